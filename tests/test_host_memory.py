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
for _ in range(10):  # the heap grows until it holds the temporaries freed while the next call runs
    compiled(x_NN, w_NK).block_until_ready()
before, values = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
for _ in range(8):
    values.append(float(compiled(x_NN, w_NK)))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
pages = compiled.memory_analysis().temp_size_in_bytes / resource.getpagesize()
print(json.dumps(dict(applied=applied, values=values, faults=faults, pages=pages)))
"""


@pytest.mark.slow  # two processes
def test_a_cpu_programs_temporaries_are_not_faulted_in_at_each_call():
    processes = {choice: subprocess.Popen([sys.executable, "-c", _PROGRAM], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                          env={**os.environ, host_memory.OPT_OUT_VARIABLE: choice})
                 for choice in ("reuse", "system")}
    reports = {choice: json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])
               for choice, p in processes.items()}
    reuse, system = reports["reuse"], reports["system"]
    assert reuse["applied"] == host_memory._glibc() and system["applied"] is False
    assert reuse["values"] == system["values"] == [2.0 * 4096 * 4096 * 8] * 8  # where the buffers live, not what
    assert reuse["pages"] * os.sysconf("SC_PAGE_SIZE") >= 64 * 2**20
    calls = len(reuse["values"])
    if reuse["applied"]:  # glibc's own way: every call maps its temporaries afresh and faults in every page
        assert system["faults"] > 0.7 * system["pages"] * calls, system
        assert reuse["faults"] < 0.3 * reuse["pages"] * calls, reuse  # the odd call may still extend the heap


def test_the_opt_out_and_a_bad_value(monkeypatch):
    monkeypatch.setenv(host_memory.OPT_OUT_VARIABLE, "system")
    assert host_memory.reuse_freed_memory() is False
    monkeypatch.setenv(host_memory.OPT_OUT_VARIABLE, "sytem")
    with pytest.raises(UserError, match=r"^LCONV_HOST_MALLOC='sytem': use 'reuse'"):
        host_memory.reuse_freed_memory()
