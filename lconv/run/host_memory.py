"""Keeps the memory a CPU program frees for its next call, instead of handing it back to the OS each step.

XLA:CPU allocates a program's temporaries at each call, from its execution thread. glibc serves a block that large
from a fresh ``mmap`` and unmaps it on free, so every step faults in every page again (docs/benchmarks.md, "The
step's fresh memory"). With one malloc arena, no ``mmap`` for big blocks and no trimming, the freed block stays in
the heap and the next step reuses it; the heap grows until it holds the blocks alive at once (a step may start
before XLA has freed the last one's), then stops. What is computed is unchanged: only where the buffers live.

Call ``reuse_freed_memory`` before JAX brings up a backend (``jax.devices()``, the first array or jit): a thread
keeps the arena it first allocated from. train.py, eval.py, the study, the benchmarks and the tests do. Set
``LCONV_HOST_MALLOC=system`` to leave the allocator as it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from lconv.errors import UserError

OPT_OUT_VARIABLE = "LCONV_HOST_MALLOC"

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest threshold it accepts


def reuse_freed_memory() -> bool:
    """On glibc: one arena, big blocks from the heap, freed memory kept. Whether it was applied (False on other C
    libraries, with ``LCONV_HOST_MALLOC=system``, or where a setting was refused); idempotent."""
    choice = os.environ.get(OPT_OUT_VARIABLE, "reuse").strip().lower() or "reuse"
    if choice not in ("reuse", "system"):
        raise UserError(f"{OPT_OUT_VARIABLE}={os.environ[OPT_OUT_VARIABLE]!r}: use 'reuse' (the default: keep the "
                        "memory a CPU step frees for the next) or 'system' (the C library's own behaviour)")
    if choice == "system" or not _glibc():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    # The arena first: a thread that allocates from another arena keeps it, and those map big blocks regardless.
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)


def _glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # not a name this system knows
        return False
