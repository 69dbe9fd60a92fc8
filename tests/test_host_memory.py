"""A CPU program's freed temporaries are reused at its next call, not faulted in again (``lconv.run.host_memory``).

The setting is the process's allocator, taken before the backend is up: each case runs in a new process (in this
one, the heap of a long test session decides where the next block lands).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from lconv.errors import UserError
from lconv.run import host_memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
_PROGRAM = """
import json, resource
from lconv.run import host_memory
applied = host_memory.reuse_freed_memory()  # as train.py does, before the backend is up
import jax, numpy as np

@jax.jit
def transposed_product(x_NN, w_NK):  # (2x)^T is written out: an [N, N] temporary at each call
    return ((x_NN * 2.0).T @ w_NK).sum()  # 2^28: exact in float32 in any order of summation

cpu = jax.devices("cpu")[0]
x_NN = jax.device_put(np.ones((4096, 4096), np.float32), cpu)  # 64 MiB: past any mmap threshold of glibc's
w_NK = jax.device_put(np.ones((4096, 8), np.float32), cpu)
compiled = transposed_product.lower(x_NN, w_NK).compile()
for _ in range(20):  # the heap grows until it holds the temporaries freed while the next call runs
    compiled(x_NN, w_NK).block_until_ready()
values, faults = [], []
for _ in range(24):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    values.append(float(compiled(x_NN, w_NK)))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
pages = compiled.memory_analysis().temp_size_in_bytes / resource.getpagesize()
print(json.dumps(dict(applied=applied, values=values, faults=faults, pages=pages)))
"""


@pytest.mark.slow  # two processes
def test_a_cpu_programs_temporaries_are_not_faulted_in_at_each_call():
    reports = {}
    for choice in ("reuse", "system"):  # one after the other: the more loaded the host, the later XLA's frees
        environment = {**os.environ, host_memory.OPT_OUT_VARIABLE: choice}
        printed = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, cwd=ROOT,
                                 env=environment, timeout=300, check=True).stdout
        reports[choice] = json.loads(printed.strip().splitlines()[-1])
    reuse, system = reports["reuse"], reports["system"]
    assert reuse["applied"] == host_memory._glibc() and system["applied"] is False
    calls = len(reuse["values"])
    assert reuse["values"] == system["values"] == [2.0 * 4096 * 4096 * 8] * calls  # where buffers live, not what
    assert reuse["pages"] * os.sysconf("SC_PAGE_SIZE") >= 64 * 2**20
    if reuse["applied"]:
        # glibc's own way: every call maps its temporaries afresh and faults in every page.
        assert all(faults > 0.7 * system["pages"] for faults in system["faults"]), system
        # Kept: a call faults in a block only where the heap grows, when the previous call's temporaries were not yet
        # freed (XLA may free them after the result is ready); the heap then holds both and stops growing.
        extended = [faults for faults in reuse["faults"] if faults > 0.05 * reuse["pages"]]
        assert len(extended) <= calls // 6, reuse


def test_the_opt_out_and_a_bad_value(monkeypatch):
    monkeypatch.setenv(host_memory.OPT_OUT_VARIABLE, "system")
    assert host_memory.reuse_freed_memory() is False
    monkeypatch.setenv(host_memory.OPT_OUT_VARIABLE, "sytem")
    with pytest.raises(UserError, match=r"^LCONV_HOST_MALLOC='sytem': use 'reuse'"):
        host_memory.reuse_freed_memory()
