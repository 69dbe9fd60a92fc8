"""Suite ``gpu``: every figure an accelerator session needs, from one command of ``--minutes`` (default 8).

Each stage (``ops``, ``train``, ``profile``, ``run``, ``beam``) runs in a process of its own under a time cap
(``gpu_plan.stage_caps``), so short, rare accelerator time is never starved by one stage; they share one compilation
cache. What each measures: docs/benchmarks.md, "The accelerator suite".
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import ml_collections

from lconv import shared_folders
from lconv.bench import beam, gpu_ops, gpu_plan, profile, report, timing, train
from lconv.run import compilation_cache

logger = logging.getLogger(__name__)

KILL_GRACE_S = 20  # past its cap a stage is killed: it stops starting work at the cap, one measurement may run on
PROFILE_T, PROFILE_STEPS = 512, 3
QUICK_BEAM_SENTENCES = 24  # a quick run's trained beam decodes this many test sentences


# The parent: one process per stage, each under its cap
def run_suite(opts: argparse.Namespace, info: dict[str, str]) -> list[report.Row]:
    if opts.stage:
        use_compilation_cache(opts.compilation_cache)
        started_s_ago = time.time() - opts.started if getattr(opts, "started", None) else 0.0  # the process's start
        return STAGE_FUNCTIONS[opts.stage](opts, info, time.monotonic() + opts.seconds - max(started_s_ago, 0.0))
    scratch = tempfile.mkdtemp(prefix="lconv_gpu_")  # the run's workdir (the beam stage reads it) and the cuts
    cache = opts.compilation_cache or (os.path.join(scratch, "compilation_cache") if opts.quick else shared_cache())
    planned = gpu_plan.stage_caps(opts.minutes, opts.profile)
    try:
        return _run_stages(opts, info, planned, scratch, cache)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_stages(opts: argparse.Namespace, info: dict[str, str], planned: list[tuple[str, float]], scratch: str,
                cache: str) -> list[report.Row]:
    """Each planned stage in a process of its own, under its cap (less what the earlier stages overran)."""
    end, rows = time.monotonic() + opts.minutes * 60, []
    for k, (stage, planned_cap) in enumerate(planned):
        cap = gpu_plan.stage_cap(planned_cap, sum(c for _, c in planned[k + 1:]), end - time.monotonic())
        command = [sys.executable, "-P", "-m", "lconv.bench", "gpu", f"--stage={stage}", f"--seconds={cap:.0f}",
                   f"--out={opts.out}", f"--doc={opts.doc}", f"--minutes={opts.minutes}", f"--scratch={scratch}",
                   f"--compilation_cache={cache}", f"--started={time.time():.3f}"]
        command += ["--quick"] * opts.quick + ["--profile"] * opts.profile
        command += [f"--data_dir={opts.data_dir}"] * bool(opts.data_dir)
        start = time.monotonic()
        try:
            code = launch_stage(command, cap + KILL_GRACE_S)
            status = "done" if code == 0 else f"failed (exit {code}; its output above says why)"
        except subprocess.TimeoutExpired:
            status = f"killed at its cap ({cap:.0f} s + {KILL_GRACE_S} s): its rows so far are kept"
        rows.append(dict(stage=stage, cap_s=cap, seconds=time.monotonic() - start, status=status,
                         cut="; ".join(read_cuts(scratch, stage)) or "-"))
        print(f"stage {stage}: {status} in {rows[-1]['seconds']:.0f} s (cap {cap:.0f} s)", flush=True)
        report.write_results(opts.out, "gpu", rows, _summary(rows, info, opts.command, cache), opts.doc)
    return rows


def launch_stage(command: list[str], timeout: float) -> int:
    """Runs a stage's process; its exit code (``subprocess.TimeoutExpired`` once ``timeout`` seconds pass). It
    imports this lconv by PYTHONPATH (``-P``: never a planted lconv/ in the working folder)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run(command, timeout=timeout, env=shared_folders.child_environment(package_root)).returncode


def shared_cache() -> str:
    """A full run's cache: this user's folder, never a world-shared one; ``"none"`` when it cannot be private."""
    folder = compilation_cache.user_folder()
    problem = compilation_cache.make_private(folder) or compilation_cache.shared(folder)
    if problem:
        logger.warning(f"compiled programs are not kept: {folder} {problem}; --compilation_cache=DIR names another")
        return "none"
    return folder


def use_compilation_cache(folder: str | None) -> None:
    """Keeps (and reads back) compiled programs in ``folder``, shared by every stage; ``"none"`` or None: afresh."""
    if folder and folder.lower() != "none":
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(folder))
        if compilation_cache.check_chosen():  # an entry is code: never from a folder another user could fill
            compilation_cache.report_cache_errors(folder)


def note_cuts(opts: argparse.Namespace, stage: str, lines: Sequence[str]) -> None:
    """Tells the parent what ``stage`` cut and why (one line each), for the summary."""
    if getattr(opts, "scratch", None):
        with open(os.path.join(opts.scratch, f"{stage}.cuts.json"), "w") as f:
            json.dump(list(lines), f)


def read_cuts(scratch: str, stage: str) -> list[str]:
    path = os.path.join(scratch, f"{stage}.cuts.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return json.load(f)


def _summary(rows: Sequence[report.Row], info: dict[str, str], command: str, cache: str) -> str:
    return "\n\n".join([
        f"## One command on an accelerator (`{command}`)\n",
        f"Machine: {timing.describe(info)}. Each stage is a process of its own under its cap; its section follows. "
        f"The stages share one compilation cache ({cache}).",
        report.markdown_table(["stage", "status", "seconds", "cap s", "cut, and why"],
                              [[r["stage"], r["status"], r["seconds"], r["cap_s"], r.get("cut", "-")] for r in rows])])


# Stages ops, train and profile
def ops_stage(opts: argparse.Namespace, info: dict[str, str], deadline: float) -> list[report.Row]:
    rows = gpu_ops.ops_stage(opts.quick, opts.out, opts.doc, info, deadline)
    note_cuts(opts, "ops", gpu_ops.cut_summary(rows))
    return rows


def train_stage(opts: argparse.Namespace, info: dict[str, str], deadline: float) -> list[report.Row]:
    T_list = (64,) if opts.quick else train.T_FULL
    dtype = "bfloat16" if train.accelerator() else "float32"  # bf16 on CPU is emulated: slower, not faster
    cap = deadline - time.monotonic()
    fitted = gpu_plan.train_fit(T_list, cap)
    cuts = [f"T={T} {gpu_plan.cut_reason(fitted.seconds, cap)}" for T in fitted.cut]
    rows = []
    for T in fitted.kept:  # T by T, so a cut stage keeps the shorter length's rows
        if time.monotonic() > deadline:
            cuts.append(f"T={T} {gpu_plan.TIME_RAN_OUT}")
            break
        rows += train.run((T,), repeats=1 if opts.quick else 3, dtype_list=(dtype,), vocabs=(),
                          size=train.SMOKE if opts.quick else train.FULL)
        report.write_results(opts.out, "gpu_train", rows, train.section(rows, T_list, info, opts.command), opts.doc)
        train.plot(rows, f"{opts.out}/train.png")
    note_cuts(opts, "train", cuts)
    return rows


def profile_stage(opts: argparse.Namespace, info: dict[str, str], deadline: float) -> list[report.Row]:
    """A trace of the train step at ``PROFILE_T`` per model, as the cap allows, reduced to time per kernel name."""
    T, size = (64, train.SMOKE) if opts.quick else (PROFILE_T, train.FULL)
    dtype = "bfloat16" if train.accelerator() else "float32"
    cap = deadline - time.monotonic()
    fitted = gpu_plan.fit(tuple(timing.labelled(("dynamicconv", "attention"))), lambda _: gpu_plan.PROFILE_S, cap)
    cuts = [f"{label} {gpu_plan.cut_reason(fitted.seconds, cap)}" for label in fitted.cut]
    rows, sections = [], []
    for label in fitted.kept:
        if time.monotonic() > deadline:
            cuts.append(f"{label} {gpu_plan.TIME_RAN_OUT}")
            break
        step = train.trainers({label: (train.MODELS[label], T, dtype, train.VOCAB, True, size)})[label][0]
        with tempfile.TemporaryDirectory(prefix="lconv_gpu_trace_") as logdir:
            kernels = profile.kernel_times(profile.read_events(profile.trace(step, PROFILE_STEPS, logdir)),
                                           PROFILE_STEPS)
        rows += [dict(model=label, T=T, dtype=dtype, **k) for k in kernels]
        sections.append(profile.section(kernels, f"{label}, T={T}, {dtype}, {PROFILE_STEPS} steps traced"))
        report.write_results(opts.out, "gpu_profile", rows, "\n\n".join(sections), opts.doc)
    note_cuts(opts, "profile", cuts)
    return rows


# Stage run: the README's default command end to end
def run_workdir(opts: argparse.Namespace) -> str | None:
    """Where the run stage trains and the beam stage finds its checkpoint (None outside the command)."""
    return os.path.join(opts.scratch, "run") if getattr(opts, "scratch", None) else None


def run_config(opts: argparse.Namespace, seconds: float) -> ml_collections.ConfigDict:
    """configs/default.py with a ``seconds`` budget (setup and final evaluation included); quick: tiny sizes."""
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

    seconds = deadline - time.monotonic() - gpu_plan.RUN_MARGIN_S  # the run's own budget, inside the stage's cap
    cuts = [] if opts.quick or seconds >= gpu_plan.RUN_MIN_BUDGET_S else [
        f"the run's budget is {seconds:.0f} s, under {gpu_plan.RUN_MIN_BUDGET_S:.0f}: too few updates for its "
        "BLEU to mean much (raise --minutes)"]
    config = run_config(opts, seconds)
    workdir = run_workdir(opts) or tempfile.mkdtemp(prefix="lconv_gpu_run_")
    result = loop.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
    test = result.get("test", {})
    setup_parts = result.get("setup_seconds", {})
    rows = [dict(budget_s=seconds, first_update_s=result.get("first_update_seconds"), updates=result["step"],
                 setup_parts="; ".join(f"{name} {t:.1f}" for name, t in setup_parts.items()),
                 compile_and_first_update_s=result.get("first_update_seconds", 0.0) - sum(setup_parts.values()),
                 run_s=result.get("run_seconds"), final_evaluation_s=result.get("final_evaluation_seconds"),
                 bleu=test.get("bleu"), test_sentences=test.get("examples"),
                 sentences_per_s=test.get("sentences_per_s"), decode_seconds=test.get("decode_seconds"),
                 quick=opts.quick)]
    if getattr(opts, "scratch", None):  # the final evaluation's rate, for the beam stage's section
        with open(os.path.join(opts.scratch, "run.json"), "w") as f:
            json.dump({key: test.get(key) for key in ("examples", "sentences_per_s", "decode_seconds", "bleu")}, f)
    report.write_results(opts.out, "gpu_run", rows, _run_section(rows, info), opts.doc)
    note_cuts(opts, "run", cuts)
    return rows


def _run_section(rows: Sequence[report.Row], info: dict[str, str]) -> str:
    r = rows[0]
    what = "tiny sizes (a smoke test)" if r["quick"] else "configs/default.py"
    return "\n\n".join([
        "### The README's default run\n",
        f"Machine: {timing.describe(info)}. `python train.py --config=configs/default.py` ({what}) on one device, "
        f"with `train.max_minutes` the stage's {r['budget_s']:.0f} s: setup and the final evaluation count in it. "
        "Its programs come from the command's shared compilation cache when an earlier try compiled them.",
        report.markdown_table(["seconds to update 1", "of which setup, s", "then compile + update 1, s", "updates",
                               "run s", "final evaluation s", "test BLEU", "test sentences", "decode sentences/s"],
                              [[r["first_update_s"], r.get("setup_parts", "-"), r.get("compile_and_first_update_s"),
                                r["updates"], r["run_s"], r["final_evaluation_s"], r["bleu"], r["test_sentences"],
                                r["sentences_per_s"]]])])


# Stage beam: the trained run's decoding speed by batch size
def beam_stage(opts: argparse.Namespace, info: dict[str, str], deadline: float) -> list[report.Row]:
    workdir = run_workdir(opts)
    if workdir is None or not os.path.isdir(os.path.join(workdir, "checkpoints")):
        note_cuts(opts, "beam", ["the trained rows: the run stage left no checkpoint (untrained models instead)"])
        count = 16 if opts.quick else beam.sentences()
        rows = beam.run(count, (16,) if opts.quick else beam.ROWS, deadline=deadline, smoke=opts.quick)
        if rows:
            report.write_results(opts.out, "gpu_beam", rows, beam.section(rows, info, opts.command), opts.doc)
        return rows
    rows_list = (16,) if opts.quick else beam.TRAINED_ROWS
    cap = deadline - time.monotonic()
    fitted = gpu_plan.beam_fit(rows_list, cap)
    cuts = [f"{rows} rows {gpu_plan.cut_reason(fitted.seconds, cap)}" for rows in fitted.cut]
    rows = beam.run_trained(workdir, tuple(fitted.kept), limit=QUICK_BEAM_SENTENCES if opts.quick else None,
                            deadline=deadline)
    cuts += [f"{size} rows {gpu_plan.TIME_RAN_OUT}" for size in fitted.kept if size not in {r["rows"] for r in rows}
             and size <= (rows[0]["sentences"] if rows else 0)]
    final_path = os.path.join(opts.scratch, "run.json")
    final = None
    if os.path.isfile(final_path):
        with open(final_path) as f:
            final = json.load(f)
    if rows:
        report.write_results(opts.out, "gpu_beam", rows, beam.trained_section(rows, final, info, opts.command),
                             opts.doc)
    note_cuts(opts, "beam", cuts)
    return rows


STAGE_FUNCTIONS = {"ops": ops_stage, "train": train_stage, "profile": profile_stage, "run": run_stage,
                   "beam": beam_stage}
assert {s for s, _ in gpu_plan.stage_caps(1.0, profile=True)} == set(STAGE_FUNCTIONS)
