"""Names of matmul precisions (``config.model.matmul_precision``) -> ``jax.lax.Precision``. ``"highest"`` is float32 on
every backend, ``"default"`` the backend's fast path (TF32 on GPU); the conv ops always use ``CONV_PRECISION``."""
from __future__ import annotations

import jax

from lconv.constants import MATMUL_PRECISIONS
from lconv.errors import UserError

_BY_NAME = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH,
            "highest": jax.lax.Precision.HIGHEST}
assert set(_BY_NAME) == set(MATMUL_PRECISIONS)

CONV_PRECISION = jax.lax.Precision.HIGHEST  # the conv ops are exact in float32 on every backend


def lax_precision(name: str) -> jax.lax.Precision:
    """``"default" | "high" | "highest"`` -> ``jax.lax.Precision``; anything else is a one-line error."""
    if name not in _BY_NAME:
        raise UserError(f"matmul precision {name!r}: must be one of {', '.join(MATMUL_PRECISIONS)}")
    return _BY_NAME[name]
