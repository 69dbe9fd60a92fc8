"""The gpu command's ``ops`` stage: the conv ops against the memory floor, rows in order of value, fitted to its cap.
The order, what each row reports and how groups compile: docs/benchmarks.md, "The ops stage"."""
from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from lconv.bench import gpu_plan, mixers, report, timing
from lconv.ops import pallas_conv

logger = logging.getLogger(__name__)

C, H, K = mixers.C, mixers.H, mixers.K
T_FULL, T_QUICK = (512, 4096, 16384), (64, 128)
DTYPES = ("bfloat16", "float32")  # bfloat16 first: what users train in
FWD_ONLY_T = BASELINE_T = 4096  # the forward alone and the baselines are measured at this T only
OPS = ("light", "dynamic")
MAIN_IMPLS = ("band",) + ("pallas",) + tuple(mixers.PALLAS_VARIANTS)  # band, split and fused Pallas backwards
FWD_IMPLS = ("band", "pallas")
BASELINES = {"light": ("conv", "shift", "unfold"), "dynamic": ("shift", "unfold")}
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 1)))  # programs compiled at once (outside the GIL)
PALLAS_SKIPPED = "skipped: the Pallas kernel compiles on a GPU only (interpret mode here)"
PlanItem = tuple[str, str, str, int, str]  # (op, impl, dtype, T, passes)


def floor_bytes_per_token(op: str, dtype: str, passes: str) -> int:
    """The op's floor at C, H, K in ``dtype``: ``timing.conv_bytes_per_token`` of one program."""
    return timing.conv_bytes_per_token(C, H, K, dynamic=op == "dynamic", backward=passes != "fwd", one_program=True,
                                       itemsize=jnp.dtype(dtype).itemsize)


def model_bytes_per_token(op: str, impl: str, dtype: str, passes: str) -> float | None:
    """A Pallas row's bytes model (its kernels' DRAM bytes, ``pallas_conv.pass_bytes_per_token``); None for XLA's."""
    if not impl.startswith("pallas"):
        return None
    backward = mixers.PALLAS_VARIANTS.get(impl, pallas_conv.BACKWARD)
    return pallas_conv.pass_bytes_per_token(passes, backward, C, H, K, dynamic=op == "dynamic",
                                            itemsize=jnp.dtype(dtype).itemsize)


def op_plan(quick: bool) -> list[PlanItem]:
    """``(op, impl, dtype, T, passes)`` in order of value; a quick run has each kind of row once, in the same order."""
    if quick:
        short, long = T_QUICK
        return [("light", "band", "bfloat16", short, "fwd+bwd"), ("dynamic", "pallas", "bfloat16", short, "fwd+bwd"),
                ("light", "pallas-fused", "bfloat16", short, "fwd+bwd"),
                ("dynamic", "band", "float32", long, "fwd+bwd"), ("light", "band", "float32", long, "fwd"),
                ("light", "shift", "float32", short, "fwd+bwd")]
    main = [(op, impl, dtype, T, "fwd+bwd") for dtype in DTYPES for T in T_FULL for op in OPS for impl in MAIN_IMPLS]
    forward = [(op, impl, dtype, FWD_ONLY_T, "fwd") for dtype in DTYPES for op in OPS for impl in FWD_IMPLS]
    baselines = [(op, impl, dtype, BASELINE_T, "fwd+bwd") for dtype in DTYPES for op, impls in BASELINES.items()
                 for impl in impls]
    return main + forward + baselines


def _row(item: PlanItem, tokens: int, bandwidth: float) -> report.Row:
    op, impl, dtype, T, passes = item
    floor_bytes, model_bytes = floor_bytes_per_token(op, dtype, passes), model_bytes_per_token(op, impl, dtype, passes)
    return dict(op=op, impl=impl, dtype=dtype, T=T, B=max(tokens // T, 1), passes=passes,
                floor_us_per_token=floor_bytes / bandwidth * 1e6, copy_bytes_per_s=bandwidth,
                model_bytes_per_token=model_bytes,
                model_x_floor=None if model_bytes is None else model_bytes / floor_bytes)


def ops_stage(quick: bool, out: str, doc: str, info: dict[str, str], deadline: float, *,
              clock: Callable[[], float] = time.monotonic, overlap: bool | None = None) -> list[report.Row]:
    """Times ``op_plan``'s rows that fit before ``deadline``, writing the report as each group of rows ends."""
    tokens = 1024 if quick else (65_536 if jax.default_backend() != "cpu" else 4096)
    bandwidth = timing.copy_bytes_per_s(64 if quick else 1024, repeats=5)["copy_bytes_per_s"]
    logger.info(f"  copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows = [_row(item, tokens, bandwidth) for item in op_plan(quick)]
    runnable = []
    for row in rows:
        if row["impl"].startswith("pallas") and not mixers.pallas_backend():
            row["status"] = PALLAS_SKIPPED
        else:
            runnable.append(row)
    cap = deadline - clock()
    fitted = gpu_plan.fit(runnable, lambda r: gpu_plan.op_row_seconds(r["impl"], COMPILE_THREADS), cap)
    for row in fitted.cut:
        row["status"] = gpu_plan.cut_reason(fitted.seconds, cap)
    groups = [fitted.kept[i:i + COMPILE_THREADS] for i in range(0, len(fitted.kept), COMPILE_THREADS)]
    overlap = jax.default_backend() != "cpu" if overlap is None else overlap
    for group, results in timed_groups(groups, deadline, clock, overlap):
        for row, result in zip(group, results):
            row.update(result)
            if "us_per_token" in result:
                row["x_floor"] = result["us_per_token"] / row["floor_us_per_token"]
            logger.info(f"  {row['op']:7s} {row['impl']:12s} {row['dtype']:8s} T={row['T']:5d} {row['passes']:7s} "
                        f"{row.get('us_per_token', float('nan')):.4f} us/token "
                        f"({row.get('x_floor', float('nan')):.1f}x the floor) {row['status']}")
        report.write_results(out, "gpu_ops", rows, section(rows, info), doc)
    report.write_results(out, "gpu_ops", rows, section(rows, info), doc)
    return rows


def timed_groups(groups: Sequence[Sequence[report.Row]], deadline: float, clock: Callable[[], float],
                 overlap: bool) -> Iterator[tuple[Sequence[report.Row], list[report.Row]]]:
    """``(group, its results)`` for each group started before ``deadline`` (the later groups' rows are marked cut)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        compiling = None
        for k, group in enumerate(groups):
            if clock() > deadline:
                for row in (r for later in groups[k:] for r in later):
                    row["status"] = gpu_plan.TIME_RAN_OUT
                return
            ready = compiling.result() if compiling is not None else compile_group(lower_group(group))
            compiling = None
            if overlap and k + 1 < len(groups):
                compiling = pool.submit(compile_group, lower_group(groups[k + 1]))
            yield group, measure_group(group, ready)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def lower_group(group: Sequence[report.Row]) -> list[tuple]:
    """Each row's ``(fn, args, lowered program or the exception tracing raised)``."""
    lowered = []
    for row in group:
        try:
            fn, args = op_program(row)
            lowered.append((fn, args, jax.jit(fn).lower(*args)))
        except Exception as err:  # noqa: BLE001 - one impl failing (memory, a kernel limit) is a row, not the run's end
            lowered.append((None, None, err))
    return lowered


def compile_group(lowered: Sequence[tuple]) -> list[tuple]:
    """``lower_group``'s programs compiled ``COMPILE_THREADS`` at once: ``(fn, args, program or exception, s)``."""
    good = [i for i, (*_, program) in enumerate(lowered) if not isinstance(program, Exception)]
    compiled = dict(zip(good, timing.compile_many([lowered[i][2] for i in good], COMPILE_THREADS)))
    return [(fn, args, *compiled.get(i, (program, 0.0))) for i, (fn, args, program) in enumerate(lowered)]


def measure_group(group: Sequence[report.Row], ready: Sequence[tuple]) -> list[report.Row]:
    """Each compiled row timed, one after another (timings never overlap); a failure is its row's status."""
    results = []
    for row, (fn, args, program, compile_s) in zip(group, ready):
        if isinstance(program, Exception):
            results.append(_failed(program))
            continue
        try:
            m = timing.measure_compiled(program, compile_s, fn, args, budget_s=0.5)
        except Exception as err:  # noqa: BLE001
            results.append(_failed(err))
            continue
        results.append(dict(status="ok", us_per_token=m.median_s / (row["B"] * row["T"]) * 1e6,
                            compile_s=m.compile_s, runs=m.runs))
    return results


def op_program(row: report.Row) -> tuple[Callable, tuple]:
    """``(fn, args)`` of one op row: the op alone (``fwd``), or its forward and both gradients (``fwd+bwd``)."""
    config = mixers.op_config(row["op"], row["impl"])
    if row["passes"] != "fwd":
        return mixers.fwd_bwd_program(config, row["T"], row["B"], jnp.dtype(row["dtype"]))
    fn, (x, w), _ = config.build(row["T"], row["B"])
    return fn, (x.astype(row["dtype"]), w.astype(row["dtype"]))


def _failed(err: BaseException) -> report.Row:
    return dict(status=f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}")


def cut_summary(rows: Sequence[report.Row]) -> list[str]:
    """One line per reason rows were not measured: how many, and why."""
    counts: dict[str, int] = {}
    for row in rows:
        status = row.get("status", "")
        if status.startswith(("cut", "skipped")):
            counts[status] = counts.get(status, 0) + 1
    return [f"{n} row{'s' if n != 1 else ''} {status}" for status, n in counts.items()]


def section(rows: Sequence[report.Row], info: dict[str, str]) -> str:
    T_list = sorted({r["T"] for r in rows if r["passes"] == "fwd+bwd"})
    labels = list(dict.fromkeys((r["op"], r["impl"], r["dtype"]) for r in rows))

    def cell(label, T, passes, key="us_per_token"):
        found = [r for r in rows if (r["op"], r["impl"], r["dtype"]) == label and r["T"] == T and r["passes"] == passes]
        return found[0].get(key, found[0].get("status", "planned")) if found else None

    fwd_T = next((r["T"] for r in rows if r["passes"] == "fwd"), None)
    bandwidth = rows[0]["copy_bytes_per_s"] if rows else float("nan")
    cuts = cut_summary(rows)
    return "\n\n".join([
        "### The conv ops against the memory floor\n",
        f"Machine: {timing.describe(info)}. C={C}, H={H}, K={K}, centred; {rows[0]['B'] * rows[0]['T']:,} tokens "
        f"per call; µs per token, median. Floor: read x, dy and the kernel and write y, dx and its gradient once "
        f"(fwd: read x, write y), at the copy bandwidth measured here, {bandwidth / 1e9:.0f} GB/s (read + write). "
        f"Bytes model: what the Pallas kernels move by their own count (lconv/ops/pallas_conv.py), over the floor; "
        f"pallas is the split backward (dx and dw kernels), pallas-fused the one-kernel backward. Rows in order of "
        f"value: bfloat16 first, the baselines last at one T.",
        "Not measured: " + ("; ".join(cuts) if cuts else "nothing") + ".",
        report.markdown_table(
            ["op", "impl", "dtype"] + [f"fwd+bwd T={T}" for T in T_list] + [f"x floor T={T_list[-1]}",
                                                                             "bytes model x floor",
                                                                             f"fwd T={fwd_T}", "fwd x floor"],
            [[*label, *[cell(label, T, "fwd+bwd") for T in T_list], cell(label, T_list[-1], "fwd+bwd", "x_floor"),
              cell(label, T_list[-1], "fwd+bwd", "model_x_floor"),
              cell(label, fwd_T, "fwd"), cell(label, fwd_T, "fwd", "x_floor")] for label in labels])])
