"""A CPU program's freed temporaries are reused at its next call, not faulted in again (``lconv.run.host_memory``).

conftest.py applies the setting before the backend is up, as train.py does; this checks what it is for.
"""
import os
import resource

import jax
import numpy as np
import pytest

from lconv.errors import UserError
from lconv.run import host_memory

PAGE = os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_programs_temporaries_are_not_faulted_in_at_each_call():
    applied = host_memory.reuse_freed_memory()  # idempotent: conftest.py ran it first
    assert applied == host_memory._glibc()  # other C libraries: nothing to change, and it says so

    @jax.jit
    def transposed_product(x_NN, w_NK):  # (2x)^T is written out: an [N, N] temporary at each call
        return ((x_NN * 2.0).T @ w_NK).sum()  # 2^28: exact in float32 in any order of summation

    cpu = jax.devices("cpu")[0]
    x_NN = jax.device_put(np.ones((4096, 4096), np.float32), cpu)  # 64 MiB: past any mmap threshold of glibc's
    w_NK = jax.device_put(np.ones((4096, 8), np.float32), cpu)
    compiled = transposed_product.lower(x_NN, w_NK).compile()
    temporary_pages = compiled.memory_analysis().temp_size_in_bytes / PAGE
    assert temporary_pages * PAGE >= 64 * 2**20
    for _ in range(10):  # the heap grows until it holds the temporaries freed while the next call runs
        compiled(x_NN, w_NK).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    calls = 8
    for _ in range(calls):
        assert float(compiled(x_NN, w_NK)) == 2.0 * 4096 * 4096 * 8
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if applied:  # without the setting every call faults in every page (~16k each); with it the odd call may still
        # extend the heap, where smaller blocks took part of the freed one since
        assert faults < 0.3 * temporary_pages * calls, (faults, temporary_pages)


def test_the_opt_out_and_a_bad_value(monkeypatch):
    monkeypatch.setenv(host_memory.OPT_OUT_VARIABLE, "system")
    assert host_memory.reuse_freed_memory() is False
    monkeypatch.setenv(host_memory.OPT_OUT_VARIABLE, "sytem")
    with pytest.raises(UserError, match=r"^LCONV_HOST_MALLOC='sytem': use 'reuse'"):
        host_memory.reuse_freed_memory()
