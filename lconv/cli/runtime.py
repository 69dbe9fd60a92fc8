"""Process set-up shared by the entry points: multi-host initialisation and one-line user errors."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from lconv.errors import UserError


def initialize() -> None:
    """``jax.distributed.initialize`` when launched on several processes (env vars set by the launcher/TPU)."""
    import jax

    if int(os.environ.get("LCONV_NUM_PROCESSES", "1")) > 1:
        # CPU devices of different processes talk over gloo (TPU/GPU use their own interconnect regardless).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=os.environ["LCONV_COORDINATOR"],
            num_processes=int(os.environ["LCONV_NUM_PROCESSES"]),
            process_id=int(os.environ["LCONV_PROCESS_ID"]),
        )
    elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()  # Cloud TPU pods: everything comes from the environment


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A ``UserError`` (a config field, a flag, a file, a checkpoint) ends the program with its one line and exit
    code 2; any other exception keeps its traceback, since it is a bug to report rather than an input to fix."""
    try:
        yield
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing for ``app.run(..., flags_parser=parse_flags)``, with bad flags and ``--config.*``
    overrides (unknown field, wrong type) reported in one line instead of a traceback."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as err:
        while err.args and isinstance(err.args[0], BaseException):  # ml_collections wraps its KeyError
            err = err.args[0]
        lines = str(err.args[0] if err.args else err).strip().splitlines() or [type(err).__name__]
        text = lines[0]
        if isinstance(err, (AttributeError, KeyError)):  # a --config.a.b override with no such field
            field = text.strip("'\"")
            culprit = [a for a in argv[1:] if a.startswith("--config.") and f".{field}" in a.split("=")[0]]
            text = f"{culprit[0].split('=')[0] if culprit else 'a --config override'} is not a field of the config"
            text += "".join(f"; {line.strip()}" for line in lines[1:2])  # ml_collections' "did you mean"
        print(f"error: {text}", file=sys.stderr)
        sys.exit(2)


def print_summary(result: dict[str, Any]) -> None:
    import jax

    if jax.process_index() == 0 and result:
        scalars = {k: v for k, v in result.items() if not isinstance(v, dict)}
        print(json.dumps(scalars, indent=None, default=str))
