"""Names of matmul precisions (``config.model.matmul_precision``) -> ``jax.lax.Precision``.

``"highest"`` makes a float32 dot float32 on every backend (on GPU the default is TF32, on TPU one bfloat16
pass); ``"high"`` is bfloat16x3 on TPU and TF32 on GPU; ``"default"`` is the backend's fast path. The conv ops
use ``CONV_PRECISION`` for the einsums that do the convolution's own arithmetic, whatever the model's setting.
"""
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
