"""Dropout's keep mask from 16 random bits an element, half the random words (and memory) of ``nn.Dropout``'s.

The drop probability is the rate rounded to a multiple of ``2**-16``; kept values are scaled by ``1 / (1 - rate)``; the
backward reads the mask packed 8 to a byte. Details: docs/kernels.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
LEVELS = 2 ** 16


def keep_mask(key: Array, rate: float, shape: tuple[int, ...]) -> Array:
    """``keep [shape] bool``: each element kept with probability ``1 - rate`` (rounded to ``2**-16``)."""
    drop_levels = round(rate * LEVELS)
    if drop_levels >= LEVELS:
        raise ValueError(f"dropout rate {rate} rounds to 1 at 16 bits; a rate of 1 drops everything")
    lead, last = tuple(shape[:-1]), (shape[-1] if shape else 1)
    words = jax.random.bits(key, (*lead, (last + 1) // 2), jnp.uint32)
    halves = lax.bitcast_convert_type(words, jnp.uint16).reshape(*lead, -1)[..., :last]  # [..., 2 * words]
    return halves.reshape(shape) >= drop_levels


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _keep_and_scale(x: Array, keep: Array, scale: float) -> Array:
    return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))


def _keep_and_scale_forward(x, keep, scale):
    return _keep_and_scale(x, keep, scale), jnp.packbits(keep, axis=-1)


def _keep_and_scale_backward(scale, bits, g):
    keep = jnp.unpackbits(bits, axis=-1, count=g.shape[-1]).astype(bool)
    return _keep_and_scale(g, keep, scale), None


_keep_and_scale.defvjp(_keep_and_scale_forward, _keep_and_scale_backward)


def dropout(key: Array, rate: float, x: Array) -> Array:
    """``x`` with each element zeroed at ``rate`` (rounded to 16 bits) and the rest divided by ``1 - rate``."""
    if rate == 0.0:
        return x
    if rate >= 1.0:
        return jnp.zeros_like(x)
    return _keep_and_scale(x, keep_mask(key, rate, x.shape), 1.0 / (1.0 - rate))
