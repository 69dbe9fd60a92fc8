"""The JAX backend a process was told to use (``JAX_PLATFORMS``), checked where lconv first touches a device:
train.py, eval.py, export and the importer (through ``lconv.cli.runtime``), ``lconv.load`` and
``lconv.export.load``."""
from __future__ import annotations

import os
import re

from lconv.errors import UserError


def check_backend() -> None:
    """Brings up the backends JAX is told to use (``JAX_PLATFORMS``) now: a missing one is one line, not a traceback."""
    import jax

    try:
        jax.devices()
    except (RuntimeError, AssertionError) as err:  # JAX asserts when no plugin at all serves a name (cuda on CPU)
        wanted = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
        first = (str(err).strip().splitlines() or [""])[0]
        named = re.search(r"backend '(\w+)'", first)
        reason = first.split(": ", 1)[-1].split(" (set JAX_PLATFORMS")[0][:200] or "no plugin provides it"
        raise UserError(f"JAX_PLATFORMS={wanted}: the {named.group(1) if named else wanted} backend is not available "
                        f"here ({reason}); this host has: {', '.join(_available_platforms()) or 'none'}; set "
                        "JAX_PLATFORMS to one of them, or unset it") from None


def _available_platforms() -> list[str]:
    """The platforms JAX brings up when it chooses for itself (after a failed ``JAX_PLATFORMS``)."""
    import jax
    from jax.extend import backend

    jax.config.update("jax_platforms", None)
    try:
        return sorted(backend.backends())
    except RuntimeError:
        return []
