"""Suite ``gpu``: every figure an accelerator session needs, from one command of ``--minutes`` (default 8).

Accelerator time comes in short, rare pieces, so the suite is one command whose stages cannot starve each other:
each stage runs in a process of its own under a time cap (its share of ``--minutes``), stops starting new work
when its cap nears, and writes its rows and its section of the report as each row ends; a stage that hangs or
crashes is killed at its cap, and the report says so and goes on with the next. The stages, in order:

- ``ops``: the conv ops, every impl, float32 and bfloat16, fwd+bwd at each T (and fwd alone at one T), in µs per
  token against the memory floor from the copy bandwidth measured in the same process; the Pallas rows also give
  their kernels' bytes model (``pallas_conv.pass_bytes_per_token``) over the floor, and the one-kernel backward
  (``pallas-fused``) is timed beside the default two-kernel one at the shortest and longest T;
- ``train``: the LM training step of ``lconv.bench.train`` (Transformer with attention "auto", i.e. cuDNN flash
  attention on a GPU, LightConv, DynamicConv) at T=512 and 4096 in the accelerator's compute dtype;
- ``run``: the README's default command (configs/default.py, the bundled DDTP en-de) trained for what is left of
  the stage's cap, then its test split decoded: setup seconds, updates, BLEU, sentences/s;
- ``beam``: beam search over a split shaped like the default's test split, by decoding batch size
  (``lconv.bench.beam``).

On a GPU a clone's results go to docs/bench/gpu and docs/benchmarks-gpu.md (``__main__.committed_paths``); the
machine and the GPU are named at the top of the report. ``--quick`` is the CPU smoke test of the whole path (tiny
sizes; the run stage trains tests/tiny_config.py-sized models on ``--data_dir``'s prepared corpus).
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from lconv.bench import beam, mixers, report, timing, train
from lconv.ops import pallas_conv

logger = logging.getLogger(__name__)

# Each stage's share of --minutes: (stage, share). The shares sum to 1; each includes its process's start.
# Sized from the H100's run (docs/benchmarks-gpu.md): beam needs ~35 s a batch size (two models compile), the op
# table fits its share once its programs compile in parallel
STAGES = (("ops", 0.20), ("train", 0.26), ("run", 0.32), ("beam", 0.22))
KILL_GRACE_S = 20  # past its cap a stage is killed: it stops starting work at the cap, one measurement may run on
C, H, K = mixers.C, mixers.H, mixers.K
T_FULL, T_QUICK = (256, 1024, 4096, 16384), (64, 128)
FWD_ONLY_T = 4096  # the forward alone is measured at this T (T_QUICK[-1] in a quick run)
OPS = {"light": ("band", "pallas", "pallas-fused", "conv", "shift", "unfold"),
       "dynamic": ("band", "pallas", "pallas-fused", "shift", "unfold")}
# Programs compiled at once in the op stage: on the H100's 16 cores, compiling one by one took most of its time
# (1-7 s a program, 24 of the 80 rows in 100 s); XLA compiles outside the GIL
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 1)))
FAST_IMPLS = ("band", "pallas")  # measured first; the others (baselines) after, as the stage's time allows
# Pallas backwards other than the default, measured after the fast impls at the first and last T (the Pallas
# figures are flat in T): which backward "pallas" should run is this comparison's to decide
VARIANT_IMPLS = tuple(mixers.PALLAS_VARIANTS)


# ----------------------------------------------------------------------------------------------------------------
# The parent: one process per stage, each under its cap
# ----------------------------------------------------------------------------------------------------------------
def run_suite(opts: argparse.Namespace, info: dict[str, str]) -> list[report.Row]:
    if opts.stage:
        return STAGE_FUNCTIONS[opts.stage](opts, info, time.monotonic() + opts.seconds)
    rows = []
    for stage, share in STAGES:
        cap = share * opts.minutes * 60
        command = [sys.executable, "-m", "lconv.bench", "gpu", f"--stage={stage}", f"--seconds={cap:.0f}",
                   f"--out={opts.out}", f"--doc={opts.doc}", f"--minutes={opts.minutes}"]
        command += ["--quick"] * opts.quick + [f"--data_dir={opts.data_dir}"] * bool(opts.data_dir)
        start = time.monotonic()
        try:
            code = launch_stage(command, cap + KILL_GRACE_S)
            status = "done" if code == 0 else f"failed (exit {code}; its output above says why)"
        except subprocess.TimeoutExpired:
            status = f"killed at its cap ({cap:.0f} s + {KILL_GRACE_S} s): its rows so far are kept"
        rows.append(dict(stage=stage, cap_s=cap, seconds=time.monotonic() - start, status=status))
        print(f"stage {stage}: {status} in {rows[-1]['seconds']:.0f} s (cap {cap:.0f} s)", flush=True)
        report.write_results(opts.out, "gpu", rows, _summary(rows, info, opts.command), opts.doc)
    return rows


def launch_stage(command: list[str], timeout: float) -> int:
    """Runs a stage's process; its exit code (``subprocess.TimeoutExpired`` once ``timeout`` seconds pass)."""
    return subprocess.run(command, timeout=timeout).returncode


def _summary(rows: Sequence[report.Row], info: dict[str, str], command: str) -> str:
    return "\n\n".join([
        f"## One command on an accelerator (`{command}`)\n",
        f"Machine: {timing.describe(info)}. Each stage is a process of its own under its cap; its section follows.",
        report.markdown_table(["stage", "status", "seconds", "cap s"],
                              [[r["stage"], r["status"], r["seconds"], r["cap_s"]] for r in rows])])


# ----------------------------------------------------------------------------------------------------------------
# Stage ops: the conv ops against the memory floor
# ----------------------------------------------------------------------------------------------------------------
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


def _op_plan(quick: bool) -> list[tuple[str, str, str, int, str]]:
    """``(op, impl, dtype, T, pass)`` in the order measured: the fast impls at every T and dtype first, then the
    other Pallas backwards, then the fast impls' forward alone, then the baselines (XLA conv, shift, unfold) at
    every T and dtype: what the stage's cap cuts is the least needed."""
    T_list = T_QUICK if quick else T_FULL
    fwd_T = T_list[-1] if quick else FWD_ONLY_T
    if quick:  # the smoke test: each kind of row once (XLA's depthwise conv alone takes a minute on CPU)
        return [("light", "band", "float32", T_list[0], "fwd+bwd"),
                ("dynamic", "pallas", "float32", T_list[0], "fwd+bwd"),
                ("light", "pallas-fused", "float32", T_list[0], "fwd+bwd"),
                ("dynamic", "band", "bfloat16", T_list[1], "fwd+bwd"),
                ("light", "band", "float32", fwd_T, "fwd"),
                ("light", "shift", "float32", T_list[1], "fwd+bwd")]
    fast = [(op, impl, dtype, T, "fwd+bwd") for dtype in ("float32", "bfloat16") for T in T_list
            for op in OPS for impl in FAST_IMPLS]
    variants = [(op, impl, dtype, T, "fwd+bwd") for dtype in ("float32", "bfloat16") for T in (T_list[0], T_list[-1])
                for op in OPS for impl in VARIANT_IMPLS]
    forward = [(op, impl, dtype, fwd_T, "fwd") for dtype in ("float32", "bfloat16") for op in OPS
               for impl in FAST_IMPLS]
    baselines = [(op, impl, dtype, T, "fwd+bwd") for dtype in ("float32", "bfloat16") for T in T_list
                 for op, impls in OPS.items() for impl in impls if impl not in FAST_IMPLS + VARIANT_IMPLS]
    return fast + variants + forward + baselines


def ops_stage(opts: argparse.Namespace, info: dict[str, str], deadline: float) -> list[report.Row]:
    tokens = 1024 if opts.quick else train.tokens_per_batch()
    bandwidth = timing.copy_bytes_per_s(64 if opts.quick else 1024, repeats=5)["copy_bytes_per_s"]
    logger.info(f"  copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    plan, rows = _op_plan(opts.quick), []
    for start in range(0, len(plan), COMPILE_THREADS):  # a group compiles at once, then its rows are timed in turn
        group = []
        for op, impl, dtype, T, passes in plan[start:start + COMPILE_THREADS]:
            B = max(tokens // T, 1)
            floor_bytes, model_bytes = floor_bytes_per_token(op, dtype, passes), model_bytes_per_token(op, impl, dtype,
                                                                                                       passes)
            rows.append(dict(op=op, impl=impl, dtype=dtype, T=T, B=B, passes=passes,
                             floor_us_per_token=floor_bytes / bandwidth * 1e6, copy_bytes_per_s=bandwidth,
                             model_bytes_per_token=model_bytes,
                             model_x_floor=None if model_bytes is None else model_bytes / floor_bytes))
            if impl.startswith("pallas") and not mixers.pallas_backend():
                rows[-1]["status"] = "skipped: the Pallas kernel compiles on a GPU only (interpret mode here)"
            elif time.monotonic() > deadline:
                rows[-1]["status"] = "cut: the stage's time ran out"
            else:
                group.append(rows[-1])
        for row, result in zip(group, _time_ops(group)):
            row.update(result)
            if "us_per_token" in result:
                row["x_floor"] = result["us_per_token"] / row["floor_us_per_token"]
            logger.info(f"  {row['op']:7s} {row['impl']:6s} {row['dtype']:8s} T={row['T']:5d} {row['passes']:7s} "
                        f"{row.get('us_per_token', float('nan')):.4f} us/token "
                        f"({row.get('x_floor', float('nan')):.1f}x the floor) {row['status']}")
        report.write_results(opts.out, "gpu_ops", rows, _ops_section(rows, info), opts.doc)
    return rows


def _time_ops(group: Sequence[report.Row]) -> list[report.Row]:
    """Each row's op (``op``, ``impl``, ``dtype``, ``T``, ``B``, ``passes``) timed: the programs traced here, compiled
    ``COMPILE_THREADS`` at once, then run one after another (timings never overlap)."""
    prepared, results = [], [None] * len(group)
    for i, row in enumerate(group):
        try:
            fn, args = _op_program(row)
            prepared.append((i, fn, args, jax.jit(fn).lower(*args)))
        except Exception as err:  # noqa: BLE001 - one impl failing (memory, a kernel limit) is a row, not the run's end
            results[i] = _failed(err)
    compiled = timing.compile_many([lowered for *_, lowered in prepared], COMPILE_THREADS)
    for (i, fn, args, _), (program, compile_s) in zip(prepared, compiled):
        if isinstance(program, Exception):
            results[i] = _failed(program)
            continue
        try:
            m = timing.measure_compiled(program, compile_s, fn, args, budget_s=0.5)
        except Exception as err:  # noqa: BLE001
            results[i] = _failed(err)
            continue
        results[i] = dict(status="ok", us_per_token=m.median_s / (group[i]["B"] * group[i]["T"]) * 1e6,
                          compile_s=m.compile_s, runs=m.runs)
    return results


def _op_program(row: report.Row) -> tuple[Callable, tuple]:
    """``(fn, args)`` of one op row: the op alone (``fwd``), or its forward and both gradients (``fwd+bwd``)."""
    fn, (x, w), argnums = mixers.op_config(row["op"], row["impl"]).build(row["T"], row["B"])
    x, w = x.astype(row["dtype"]), w.astype(row["dtype"])
    if row["passes"] == "fwd":
        return fn, (x, w)
    g = timing.random_normal((row["B"], row["T"], C), 2, jnp.dtype(row["dtype"]))
    return mixers.fwd_bwd(fn, argnums), (x, w, g)


def _failed(err: BaseException) -> report.Row:
    return dict(status=f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}")


def _ops_section(rows: Sequence[report.Row], info: dict[str, str]) -> str:
    T_list = sorted({r["T"] for r in rows if r["passes"] == "fwd+bwd"})
    labels = list(dict.fromkeys((r["op"], r["impl"], r["dtype"]) for r in rows))

    def cell(label, T, passes, key="us_per_token"):
        found = [r for r in rows if (r["op"], r["impl"], r["dtype"]) == label and r["T"] == T and r["passes"] == passes]
        return found[0].get(key, found[0]["status"]) if found else None

    fwd_T = next((r["T"] for r in rows if r["passes"] == "fwd"), None)
    bandwidth = rows[0]["copy_bytes_per_s"] if rows else float("nan")
    return "\n\n".join([
        "### The conv ops against the memory floor\n",
        f"Machine: {timing.describe(info)}. C={C}, H={H}, K={K}, centred; {rows[0]['B'] * rows[0]['T']:,} tokens "
        f"per call; µs per token, median. Floor: read x, dy and the kernel and write y, dx and its gradient once "
        f"(fwd: read x, write y), at the copy bandwidth measured here, {bandwidth / 1e9:.0f} GB/s (read + write). "
        f"Bytes model: what the Pallas kernels move by their own count (lconv/ops/pallas_conv.py), over the floor; "
        f"pallas-fused is the one-kernel backward, pallas the dx + dw kernels.",
        report.markdown_table(
            ["op", "impl", "dtype"] + [f"fwd+bwd T={T}" for T in T_list] + [f"x floor T={T_list[-1]}",
                                                                             "bytes model x floor",
                                                                             f"fwd T={fwd_T}", "fwd x floor"],
            [[*label, *[cell(label, T, "fwd+bwd") for T in T_list], cell(label, T_list[-1], "fwd+bwd", "x_floor"),
              cell(label, T_list[-1], "fwd+bwd", "model_x_floor"),
              cell(label, fwd_T, "fwd"), cell(label, fwd_T, "fwd", "x_floor")] for label in labels])])


# ----------------------------------------------------------------------------------------------------------------
# Stage train: the LM step against the cuDNN-flash Transformer
# ----------------------------------------------------------------------------------------------------------------
def train_stage(opts: argparse.Namespace, info: dict[str, str], deadline: float) -> list[report.Row]:
    T_list = (64,) if opts.quick else train.T_FULL
    dtype = "bfloat16" if train.accelerator() else "float32"  # bf16 on CPU is emulated: slower, not faster
    rows = []
    for T in T_list:  # T by T, so a cut stage keeps the shorter length's rows
        if time.monotonic() > deadline:
            logger.info(f"  T={T}: cut, the stage's time ran out")
            break
        rows += train.run((T,), repeats=1 if opts.quick else 3, dtype_list=(dtype,), vocabs=(),
                          size=train.SMOKE if opts.quick else train.FULL)
        report.write_results(opts.out, "gpu_train", rows, train.section(rows, T_list, info, opts.command), opts.doc)
        train.plot(rows, f"{opts.out}/train.png")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Stage run: the README's default command end to end
# ----------------------------------------------------------------------------------------------------------------
def run_config(opts: argparse.Namespace, seconds: float) -> ml_collections.ConfigDict:
    """configs/default.py with ``train.max_minutes`` set to ``seconds`` (the budget counts setup and the final
    evaluation too); in a quick run, tests/tiny_config.py's sizes."""
    from lconv.configs import common, default

    config = default.get_config()
    config.train.max_minutes = seconds / 60
    if opts.data_dir:
        config.data.data_dir = opts.data_dir
    if opts.quick:  # a smoke test: tiny model, tokenizer and batches, a few updates, short test sources
        common.smoke_test_sizes(config)
        config.data.eval_max_input_length = config.data.eval_max_target_length = 8
        config.train.num_steps, config.train.max_minutes = 4, 0.0
    return config


def run_stage(opts: argparse.Namespace, info: dict[str, str], deadline: float) -> list[report.Row]:
    from lconv.train import loop

    seconds = deadline - time.monotonic() - 10  # the run's own budget, inside the stage's cap
    config = run_config(opts, seconds)
    with tempfile.TemporaryDirectory(prefix="lconv_gpu_run_") as workdir:
        result = loop.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
    test = result.get("test", {})
    setup_parts = result.get("setup_seconds", {})
    rows = [dict(budget_s=seconds, first_update_s=result.get("first_update_seconds"), updates=result["step"],
                 setup_parts="; ".join(f"{name} {t:.1f}" for name, t in setup_parts.items()),
                 compile_and_first_update_s=result.get("first_update_seconds", 0.0) - sum(setup_parts.values()),
                 run_s=result.get("run_seconds"), final_evaluation_s=result.get("final_evaluation_seconds"),
                 bleu=test.get("bleu"), test_sentences=test.get("examples"),
                 sentences_per_s=test.get("sentences_per_s"), quick=opts.quick)]
    report.write_results(opts.out, "gpu_run", rows, _run_section(rows, info), opts.doc)
    return rows


def _run_section(rows: Sequence[report.Row], info: dict[str, str]) -> str:
    r = rows[0]
    what = "tiny sizes (a smoke test)" if r["quick"] else "configs/default.py"
    return "\n\n".join([
        "### The README's default run\n",
        f"Machine: {timing.describe(info)}. `python train.py --config=configs/default.py` ({what}) on one device, "
        f"with `train.max_minutes` the stage's {r['budget_s']:.0f} s: setup and the final evaluation count in it.",
        report.markdown_table(["seconds to update 1", "of which setup, s", "then compile + update 1, s", "updates",
                               "run s", "final evaluation s", "test BLEU", "test sentences", "decode sentences/s"],
                              [[r["first_update_s"], r.get("setup_parts", "-"), r.get("compile_and_first_update_s"),
                                r["updates"], r["run_s"], r["final_evaluation_s"], r["bleu"], r["test_sentences"],
                                r["sentences_per_s"]]])])


# ----------------------------------------------------------------------------------------------------------------
# Stage beam: decoding speed by batch size
# ----------------------------------------------------------------------------------------------------------------
def beam_stage(opts: argparse.Namespace, info: dict[str, str], deadline: float) -> list[report.Row]:
    count = 16 if opts.quick else beam.sentences()
    rows = beam.run(count, (16,) if opts.quick else beam.ROWS, deadline=deadline, smoke=opts.quick)
    if rows:
            report.write_results(opts.out, "gpu_beam", rows, beam.section(rows, info, opts.command), opts.doc)
    return rows


STAGE_FUNCTIONS = {"ops": ops_stage, "train": train_stage, "run": run_stage, "beam": beam_stage}
assert [s for s, _ in STAGES] == list(STAGE_FUNCTIONS) and abs(sum(share for _, share in STAGES) - 1) < 1e-9
