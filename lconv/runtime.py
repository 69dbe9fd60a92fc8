"""Process set-up shared by the entry points: multi-host initialisation and one-line user errors."""
from __future__ import annotations

import contextlib
import json
import os
import sys


def initialize():
    """``jax.distributed.initialize`` when launched on several processes (env vars set by the launcher/TPU)."""
    import jax

    if int(os.environ.get("LCONV_NUM_PROCESSES", "1")) > 1:
        jax.distributed.initialize(
            coordinator_address=os.environ["LCONV_COORDINATOR"],
            num_processes=int(os.environ["LCONV_NUM_PROCESSES"]),
            process_id=int(os.environ["LCONV_PROCESS_ID"]),
        )
    elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()  # Cloud TPU pods: everything comes from the environment


@contextlib.contextmanager
def user_errors():
    """Errors a user can fix (config, data, checkpoints) end the program with one line, not a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError, FloatingPointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def print_summary(result):
    import jax

    if jax.process_index() == 0 and result:
        scalars = {k: v for k, v in result.items() if not isinstance(v, dict)}
        print(json.dumps(scalars, indent=None, default=str))
