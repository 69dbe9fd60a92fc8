"""``python -m lconv.bench <suite> [--quick] [--out docs/bench] [--doc docs/benchmarks.md] [--T 256,1024]``.

Suites: mixers, limits, decode, train, or all. Kept thin: argument checks here, the work in the suite modules.
"""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time

from lconv.errors import UserError

SUITES = ("mixers", "limits", "decode", "train")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like the other entry points' user errors
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_T_list(text: str) -> tuple[int, ...]:
    """``"256,1024"`` -> ``(256, 1024)``; positive integers, ascending, no repeats."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"--T must be comma-separated integers, e.g. 256,1024; got {text!r}") from None
    if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise UserError(f"--T must be positive, ascending and without repeats; got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = _Parser(prog="python -m lconv.bench", description=__doc__.splitlines()[0])
    parser.add_argument("suite", help=f"one of {', '.join(SUITES)}, all")
    parser.add_argument("--quick", action="store_true", help="short lists and fewer runs: a smoke test")
    parser.add_argument("--out", default="docs/bench", help="folder for the CSV and PNG files")
    parser.add_argument("--doc", default="docs/benchmarks.md", help="markdown file whose suite section is rewritten")
    parser.add_argument("--T", default=None, help="sequence lengths for the mixers suite, e.g. 256,1024,4096")
    opts = parser.parse_args(argv)
    if opts.suite not in SUITES + ("all",):
        parser.error(f"unknown suite {opts.suite!r}; choose one of {', '.join(SUITES)}, all")
    try:
        opts.T = parse_T_list(opts.T) if opts.T else None
    except ValueError as err:
        parser.error(str(err))
    opts.command = "python -m lconv.bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    from lconv.bench import timing  # imports jax: after the arguments are known to be good

    info = timing.machine_info()
    print(f"machine: {timing.describe(info)}", flush=True)
    for name in SUITES if opts.suite == "all" else (opts.suite,):
        start = time.perf_counter()
        print(f"suite {name}", flush=True)
        importlib.import_module(f"lconv.bench.{name}").run_suite(opts, info, log=lambda s: print(s, flush=True))
        print(f"suite {name} done in {time.perf_counter() - start:.0f} s; results in {opts.out} and {opts.doc}",
              flush=True)


if __name__ == "__main__":
    main()
