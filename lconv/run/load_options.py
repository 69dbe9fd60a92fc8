"""``lconv.load``'s options: changes to a stored config for one load (compute dtype, decoding batch, source limit)
and the devices its params are laid out on, each checked and named as the argument the user passed."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from lconv.errors import UserError
from lconv.fields import integer
from lconv.nn.model_config import COMPUTE_DTYPES
from lconv.run import schema


def overrides(*, dtype: str | None, decode_batch_size: int | None,
              max_input_length: int | None) -> dict[str, dict[str, Any]] | None:
    """What ``restore.load_trained`` changes in the stored config (``{section: {field: value}}``; None: nothing)."""
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise UserError(f"dtype={dtype!r}: must be one of {', '.join(COMPUTE_DTYPES)} (the compute dtype; params "
                        "stay float32)")
    if decode_batch_size is not None:
        schema.check_decode({"batch_size": decode_batch_size}, spell=lambda name: "decode_batch_size")
    if max_input_length is not None and not (integer().test(max_input_length) and max_input_length >= 2):
        raise UserError(f"max_input_length={max_input_length!r}: must be an integer >= 2 (source tokens, EOS "
                        "included: EOS and at least one token)")
    changes = {"model": {"dtype": dtype}, "decode": {"batch_size": decode_batch_size},
               "data": {"eval_max_input_length": max_input_length}}
    changes = {section: {k: v for k, v in fields.items() if v is not None} for section, fields in changes.items()}
    return {section: fields for section, fields in changes.items() if fields} or None


def checked_devices(devices: Sequence[jax.Device] | None) -> list[jax.Device] | None:
    """``devices`` as a list of JAX devices, or a one-line error naming the argument."""
    if devices is None:
        return None
    if isinstance(devices, jax.Device):
        devices = [devices]
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices \
            or not all(isinstance(d, jax.Device) for d in devices):
        raise UserError(f"devices: pass a non-empty list of JAX devices (jax.devices()[:n]); got {devices!r:.60}")
    repeated = [d for i, d in enumerate(devices) if d in devices[:i]]
    if repeated:
        raise UserError(f"devices: {repeated[0]} is listed twice; a mesh holds each device once "
                        "(jax.devices()[:n])")
    return list(devices)
