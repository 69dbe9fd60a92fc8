"""``python -m lconv.bench <suite> [--quick] [--out docs/bench] [--doc docs/benchmarks.md] [--T 256,1024]``.

Suites: mixers, limits, decode, beam, train, or all of them; and gpu, one command for an accelerator session
(``lconv.bench.gpu``). A ``--quick`` run is a smoke test written to a scratch folder (``QUICK_DIR``); committed results
are the default only of a full run from the root of a clone (else ``--out`` / ``--doc`` or ``INSTALLED_DIR``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time

from lconv import console, outputs, shared_folders
from lconv.bench import gpu_plan
from lconv.data import paths
from lconv.errors import UserError
from lconv.run import host_memory

SUITES = ("mixers", "limits", "decode", "beam", "train")  # "all" runs these
ONE_COMMAND_SUITES = ("gpu",)  # each a whole session's figures by itself: not part of "all"
COMMITTED_OUT, COMMITTED_DOC = "docs/bench", "docs/benchmarks.md"
QUICK_DIR = paths.user_cache_folder("bench_quick")
INSTALLED_DIR = paths.user_cache_folder("bench")  # a full run's default outside a clone


def in_clone_root() -> bool:
    """Whether the working directory is the root of the clone lconv is imported from (docs/ is committed there)."""
    import lconv

    root = os.path.dirname(os.path.dirname(os.path.abspath(lconv.__file__)))
    return os.path.samefile(root, os.getcwd()) and os.path.isfile(COMMITTED_DOC)


def parse_T_list(text: str) -> tuple[int, ...]:
    """``"256,1024"`` -> ``(256, 1024)``; positive integers, ascending, no repeats."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"--T must be comma-separated integers, e.g. 256,1024; got {text!r}") from None
    if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise UserError(f"--T must be positive, ascending and without repeats; got {text!r}")
    return values


def committed_paths(backend: str) -> tuple[str, str]:
    """Where a clone keeps a backend's results: docs/bench (CPU) or docs/bench/<backend>, and its benchmarks page."""
    if backend == "cpu":
        return COMMITTED_OUT, COMMITTED_DOC
    return f"{COMMITTED_OUT}/{backend}", COMMITTED_DOC.replace(".md", f"-{backend}.md")


def resolve_outputs(opts: argparse.Namespace, parser: argparse.ArgumentParser, backend: str = "cpu") -> None:
    """Fills ``--out``/``--doc`` for ``backend``; a ``--quick`` run writing over committed results is refused."""
    default_out, default_doc = opts.out is None, opts.doc is None
    if opts.out is not None and opts.doc is None:  # the report goes beside the figures it shows
        opts.doc = os.path.join(opts.out, "benchmarks.md")
    if not opts.quick:
        clone = in_clone_root()
        out, doc = committed_paths(backend) if clone else (INSTALLED_DIR, f"{INSTALLED_DIR}/benchmarks.md")
        opts.out, opts.doc = opts.out or out, opts.doc or doc
    else:
        opts.out, opts.doc = opts.out or QUICK_DIR, opts.doc or os.path.join(QUICK_DIR, "benchmarks.md")
        for out, doc in {committed_paths("cpu"), committed_paths(backend)}:
            for flag, path, committed in (("--out", opts.out, out), ("--doc", opts.doc, doc)):
                if os.path.abspath(path) == os.path.abspath(committed):
                    parser.error(f"{flag}={path} holds the committed results; a --quick run is a smoke test and "
                                 f"writes elsewhere (default {QUICK_DIR})")
    # Committed results are written only by the default of a full run from the clone's root (lconv.outputs).
    try:
        outputs.claim_directory(opts.out, "bench", "--out", committed_ok=opts.out if default_out else None)
        outputs.check_output_file(opts.doc, "--doc", own_kind="bench", committed_ok=opts.doc if default_doc else None)
        # Before any suite runs: a link or a pipe planted among its files is refused at the write, after the work
        outputs.check_targets(opts.out, sorted(os.listdir(os.path.expanduser(opts.out))), "--out")
        outputs.check_targets(os.path.dirname(opts.doc) or ".", [os.path.basename(opts.doc)], "--doc")
        shared_folders.check_way(os.path.dirname(opts.doc) or ".", f"--doc={opts.doc}")  # read, then rewritten
        if os.path.isfile(opts.doc):  # before any suite runs, not at the report's write
            shared_folders.check_owner(opts.doc, "the benchmarks replace no other user's file")
    except UserError as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> None:
    parser = console.OneLineParser(prog="python -m lconv.bench", description=__doc__.splitlines()[0])
    parser.add_argument("suite", help=f"one of {', '.join(SUITES + ONE_COMMAND_SUITES)}, all")
    parser.add_argument("--quick", action="store_true", help="short lists and fewer runs: a smoke test")
    parser.add_argument("--out", default=None, help=f"folder for the CSV and PNG files (default {COMMITTED_OUT} in a "
                                                    f"clone, else {INSTALLED_DIR}; with --quick {QUICK_DIR})")
    parser.add_argument("--doc", default=None, help=f"markdown file whose suite section is rewritten (default "
                                                    f"<--out>/benchmarks.md when --out is given, else "
                                                    f"{COMMITTED_DOC}; with --quick {QUICK_DIR}/benchmarks.md)")
    parser.add_argument("--T", default=None, help="sequence lengths for the mixers suite, e.g. 256,1024,4096")
    parser.add_argument("--mixers", default="", help="the mixers suite's mixer rows, instead of every registered "
                        "mixer's: names or package.module:Class, comma-separated (the conv op rows stay)")
    parser.add_argument("--minutes", type=float, default=gpu_plan.DEFAULT_MINUTES, help="gpu: the whole command's "
                        "minutes, shared by its stages")
    parser.add_argument("--profile", action="store_true", help="gpu: also trace the train step and table its time "
                        "per kernel name")
    parser.add_argument("--compilation_cache", default=None, help="gpu: the folder of compiled programs its stages "
                        "share, or none (default: a folder in the temp dir, so a second try compiles nothing)")
    parser.add_argument("--data_dir", default=None, help="gpu: the prepared corpus of its default-run stage "
                        "(default: configs/default.py's)")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # gpu: the stage a child process runs
    parser.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)  # ... and its cap
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)  # ... and the command's scratch folder
    parser.add_argument("--started", type=float, default=None, help=argparse.SUPPRESS)  # ... its launch, time.time()
    opts = parser.parse_args(argv)
    if opts.suite not in SUITES + ONE_COMMAND_SUITES + ("all",):
        parser.error(f"unknown suite {opts.suite!r}; choose one of {', '.join(SUITES + ONE_COMMAND_SUITES)}, all")
    if opts.suite != "gpu" and (opts.profile or opts.compilation_cache):
        parser.error(f"--profile and --compilation_cache are the gpu suite's; the {opts.suite} suite has neither")
    if not 0.5 <= opts.minutes <= 60:
        parser.error(f"--minutes must be between 0.5 and 60; got {opts.minutes}")
    try:
        opts.T = parse_T_list(opts.T) if opts.T is not None else None  # an empty --T= is an error, not "unset"
    except ValueError as err:
        parser.error(str(err))
    opts.mixers = [m.strip() for m in opts.mixers.split(",") if m.strip()]
    try:
        host_memory.reuse_freed_memory()  # before the backend is up: XLA:CPU's temporaries reused, not re-faulted
    except UserError as err:
        parser.error(str(err))
    from lconv.bench import timing  # imports jax: after the arguments are known to be good
    from lconv.nn import mixers
    from lconv.run import compilation_cache

    compilation_cache.check_chosen()  # $JAX_COMPILATION_CACHE_DIR: never one another user could fill with code

    if opts.mixers and opts.suite not in ("mixers", "all"):
        parser.error(f"--mixers chooses the mixers suite's rows; the {opts.suite} suite has none")
    if opts.mixers and len(set(opts.mixers)) != len(opts.mixers):
        parser.error(f"--mixers={','.join(opts.mixers)} names a mixer twice")
    for name in opts.mixers:  # a plugin that cannot be imported or run fails now, not after the other rows
        try:
            mixers.mixer_class(name)
            from lconv.bench.mixers import op_configs  # the suite is mixers or all: checked above

            op_configs([name])
        except UserError as err:
            parser.error(f"--mixers: {err}")
    console.show_log("stdout")  # each suite's progress lines, between the suite headers printed here
    if opts.stage:  # a child process of the gpu suite: one stage, into the outputs its parent checked
        from lconv.bench import gpu

        if opts.suite != "gpu" or opts.stage not in gpu.STAGE_FUNCTIONS or not opts.seconds or not opts.out:
            parser.error("--stage is the gpu suite's own: run python -m lconv.bench gpu")
        opts.command = "python -m lconv.bench gpu" + " --quick" * opts.quick + " --profile" * opts.profile
        gpu.run_suite(opts, timing.machine_info())
        return
    resolve_outputs(opts, parser, timing.backend())
    opts.command = "python -m lconv.bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    info = timing.machine_info()
    print(f"machine: {timing.describe(info)}", flush=True)
    for name in SUITES if opts.suite == "all" else (opts.suite,):
        start = time.perf_counter()
        print(f"suite {name}", flush=True)
        try:
            importlib.import_module(f"lconv.bench.{name}").run_suite(opts, info)
        except UserError as err:  # an output refused at its write (a link put there meanwhile): one line
            parser.error(str(err))
        print(f"suite {name} done in {time.perf_counter() - start:.0f} s; results in {opts.out} and {opts.doc}",
              flush=True)


if __name__ == "__main__":
    main()
