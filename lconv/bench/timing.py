"""The bottom layer of the benchmarks: timing, memory, machine description and the cost formulas.

Everything here is small and independent of the suites. Times are wall-clock medians of several runs of an
already compiled function (compilation is timed separately), each ended by ``block_until_ready``.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lconv.nn import mixers

F32_BYTES = 4


# Pure helpers (unit-tested in tests/test_bench.py)
def summarize(times_s: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-run times; the median is what the tables report."""
    if not times_s:
        raise ValueError("summarize needs at least one time")
    return {"median_s": statistics.median(times_s), "min_s": min(times_s), "max_s": max(times_s)}


def repeats_for(estimate_s: float, budget_s: float, lo: int = 3, hi: int = 10) -> int:
    """How many timed runs fit ``budget_s`` given one run's estimate, clamped to ``[lo, hi]``."""
    if estimate_s <= 0:
        return hi
    return int(min(hi, max(lo, budget_s // estimate_s)))


def predict_seconds(measured: tuple[int, float] | None, T: int, exponent: float) -> float | None:
    """One call's time extrapolated from the last ``(T, seconds)`` as ``s * (T / T0) ** exponent``."""
    if measured is None:
        return None
    T0, seconds = measured
    return seconds * (T / T0) ** exponent


def conv_bytes_per_token(channels: int, heads: int, kernel_size: int, *, dynamic: bool, backward: bool,
                         one_program: bool = False, itemsize: int = F32_BYTES) -> int:
    """Bytes a conv must move per token (``itemsize`` bytes a number), a memory-bound kernel's floor: fwd+bwd ``5C``
    (light) or ``5C + 3HK`` (dynamic), with ``one_program`` ``4C`` or ``4C + 2HK``."""
    kernel = heads * kernel_size if dynamic else 0
    numbers = 2 * channels + kernel
    if backward:
        numbers += (2 * channels + kernel) if one_program else (3 * channels + 2 * kernel)
    return numbers * itemsize


def conv_flops_per_token(channels: int, kernel_size: int, *, backward: bool) -> int:
    """Multiply-adds x 2 of a depthwise conv per token: forward ``2KC``; the backward's dx and dw twice that."""
    return 2 * kernel_size * channels * (3 if backward else 1)


# Measuring
@dataclasses.dataclass
class Measurement:
    """One timed configuration: per-call times in seconds, compile time and the compiled program's memory."""

    median_s: float
    min_s: float
    runs: int
    compile_s: float | None  # None: not a JAX program (the PyTorch baselines)
    memory_bytes: int | None = None
    memory_source: str | None = "n/a"
    flops: float | None = None  # XLA's cost_analysis() count, when available


def compile_fn(fn: Callable, args: Sequence[Any],
               donate_argnums: int | Sequence[int] = ()) -> tuple[jax.stages.Compiled, float]:
    """``jax.jit(fn)`` lowered and compiled for ``args``; returns ``(compiled, seconds spent compiling)``."""
    start = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
    return compiled, time.perf_counter() - start


def time_calls(call: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``call()`` (its result blocked on), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times


def measure(fn: Callable, args: Sequence[Any], *, budget_s: float = 2.0) -> Measurement:
    """Compiles ``fn`` for ``args`` and times it: one warm-up call also sets the repeat count (``budget_s``)."""
    compiled, compile_s = compile_fn(fn, args)
    return measure_compiled(compiled, compile_s, fn, args, budget_s=budget_s)


def compile_many(lowered: Sequence[jax.stages.Lowered], threads: int) -> list[tuple[Any, float]]:
    """``[(compiled or its exception, seconds)]`` per lowered program, ``threads`` at once (outside the GIL)."""
    def one(program: jax.stages.Lowered) -> tuple[Any, float]:
        start = time.perf_counter()
        try:
            return program.compile(), time.perf_counter() - start
        except Exception as err:  # noqa: BLE001 - one program failing (memory, a kernel limit) is its row's
            return err, time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(max(threads, 1)) as pool:
        return list(pool.map(one, lowered))


def budgeted_runs(call: Callable[[], Any], budget_s: float) -> tuple[dict[str, float], int]:
    """``(summarize of the timed runs, their count)``: one untimed first call's time sets how many fit ``budget_s``."""
    n = repeats_for(time_calls(call, 1, warmup=0)[0], budget_s)
    return summarize(time_calls(call, n, warmup=0)), n


def alternate(calls: dict[Any, Callable[[], Any]], rounds: int) -> dict[Any, list[float]]:
    """Seconds per call of each of ``calls``, taking turns for ``rounds`` rounds after an untimed one (it compiles or
    warms up), so load drifting during the rounds hits them all alike."""
    times: dict[Any, list[float]] = {key: [] for key in calls}
    for round_ in range(rounds + 1):
        for key, call in calls.items():
            seconds = time_calls(call, 1, warmup=0)[0]
            if round_:
                times[key].append(seconds)
    return times


def measure_compiled(compiled: jax.stages.Compiled, compile_s: float, fn: Callable, args: Sequence[Any], *,
                     budget_s: float = 2.0) -> Measurement:
    """``measure`` of a program already compiled (``compile_s`` seconds) from ``fn`` for ``args``."""
    stats, n = budgeted_runs(lambda: compiled(*args), budget_s)
    memory, source = program_memory(compiled)
    if memory is None:
        memory, source = estimate_memory(args, jax.eval_shape(fn, *args)), "estimate: arguments + outputs"
    return Measurement(stats["median_s"], stats["min_s"], n, compile_s, memory, source, xla_flops(compiled))


def program_memory(compiled: jax.stages.Compiled) -> tuple[int | None, str]:
    """Peak bytes of a compiled program: arguments + outputs + XLA's temporaries (``memory_analysis()``)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        stats = None
    if stats is None:
        return None, "n/a"
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return int(total - getattr(stats, "alias_size_in_bytes", 0)), "memory_analysis"


def estimate_memory(args: Sequence[Any], out_shapes: Any) -> int:
    """Fallback when the backend has no ``memory_analysis``: arguments + outputs only (a lower bound)."""
    leaves = jax.tree.leaves(list(args)) + jax.tree.leaves(out_shapes)
    return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in leaves))


def xla_flops(compiled: jax.stages.Compiled) -> float | None:
    """XLA's FLOP count of a compiled program (``cost_analysis()``), or None where the backend has none."""
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


# Machine limits, measured in the run that uses them
def matmul_flops_per_s(n: int = 2048, repeats: int = 10) -> dict[str, float]:
    """Float32 ``[n, n] @ [n, n]``: ``2 n^3`` FLOPs per call; median rate."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    compiled, _ = compile_fn(lambda a, b: a @ b, (a, a))
    stats = summarize(time_calls(lambda: compiled(a, a), repeats))
    return {"matmul_n": n, "matmul_flops_per_s": 2 * n**3 / stats["median_s"], "matmul_s": stats["median_s"]}


def copy_bytes_per_s(megabytes: int = 256, repeats: int = 10) -> dict[str, float]:
    """Elementwise ``x + 1`` over a large float32 array; bytes = read + write. ``in_place`` donates the input (the
    bandwidth); ``fresh`` writes a new buffer each call, paying first-touch page faults."""
    n = megabytes * 2**20 // F32_BYTES
    moved = 2 * n * F32_BYTES
    x = jnp.zeros((n,), jnp.float32)
    in_place, _ = compile_fn(lambda a: a + 1.0, (x,), donate_argnums=(0,))
    state = {"x": in_place(x)}

    def step():
        state["x"] = in_place(state["x"])
        return state["x"]

    donated = summarize(time_calls(step, repeats))
    fresh_fn, _ = compile_fn(lambda a: a + 1.0, (state["x"],))
    fresh = summarize(time_calls(lambda: fresh_fn(state["x"]), repeats))
    return {"copy_mb": megabytes, "copy_bytes_per_s": moved / donated["median_s"],
            "copy_fresh_bytes_per_s": moved / fresh["median_s"]}


# The machine
def backend() -> str:
    """Where the suites run: ``jax.default_backend()`` (cpu, gpu, tpu)."""
    return jax.default_backend()


def machine_info() -> dict[str, str]:
    """CPU model and cores, JAX device kind and versions, date and load (the machine may be shared)."""
    import jaxlib

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    device = jax.devices()[0]
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "device": f"{device.platform} / {device.device_kind} x{jax.device_count()}",
        "jax": f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        "load": f"{load[0]:.1f}" if isinstance(load[0], float) else str(load[0]),
    }


def describe(info: dict[str, str]) -> str:
    return (f"{info['date']}; {info['cpu']}; {info['device']}; {info['jax']}; "
            f"1-minute load average at start {info['load']}")


def labelled(names: Sequence[str]) -> dict[str, str]:
    """``{label: registered name}`` of mixers ``names``: a row is named by its class's ``label``, as everywhere."""
    return {mixers.info(name).label: name for name in names}


REFERENCE = mixers.info("attention").label  # the baseline the suites' speed-ups are over


def random_normal(shape: Sequence[int], seed: int = 0, dtype: Any = jnp.float32) -> jax.Array:
    """Standard-normal values of ``shape`` from ``jax.random.key(seed)``."""
    return jax.random.normal(jax.random.key(seed), shape, dtype)
