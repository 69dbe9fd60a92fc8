"""Layer normalisation over the last axis with a hand-written VJP that keeps only the input and two floats a row:
``flax.linen.LayerNorm``'s values to float32 rounding, without autodiff's three kept ``[N, C]`` float32 arrays. Details:
docs/kernels.md, "Layer norm"."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x: Array, scale: Array, bias: Array, eps: float, out_dtype: jnp.dtype) -> Array:
    """Normalises ``x [..., C]`` over ``C``; ``scale`` and ``bias`` are ``[C]``. Returns ``out_dtype``."""
    return _forward(x, scale, bias, eps, out_dtype)[0]


def _row_mean(a: Array, weights: Array) -> Array:
    """``a [..., C] @ weights [C]`` in exact float32, ``[..., 1]``: a row reduction as a product with a vector."""
    return jnp.matmul(a, weights, precision=jax.lax.Precision.HIGHEST)[..., None]


def _forward(x, scale, bias, eps, out_dtype):
    x32 = x.astype(jnp.float32)
    C = x.shape[-1]
    uniform = jnp.full((C,), 1.0 / C, jnp.float32)
    mean = _row_mean(x32, uniform)
    rstd = jax.lax.rsqrt(_row_mean(jnp.square(x32 - mean), uniform) + eps)
    y = (x32 - mean) * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype), (x, mean, rstd, scale, bias)


def _backward(eps, out_dtype, residuals, g):
    del eps, out_dtype
    x, mean, rstd, scale, bias = residuals
    x_hat = (x.astype(jnp.float32) - mean) * rstd
    g32 = g.astype(jnp.float32)
    scale32 = scale.astype(jnp.float32) / x.shape[-1]
    # rstd * (g_hat - mean(g_hat) - x_hat * mean(g_hat * x_hat)), g_hat = g * scale
    dx = rstd * (g32 * scale.astype(jnp.float32) - _row_mean(g32, scale32) - x_hat * _row_mean(g32 * x_hat, scale32))
    batch_axes = tuple(range(x.ndim - 1))
    d_scale = jnp.sum(g32 * x_hat, axis=batch_axes)
    d_bias = jnp.sum(g32, axis=batch_axes)
    return dx.astype(x.dtype), d_scale.astype(scale.dtype), d_bias.astype(bias.dtype)


layer_norm.defvjp(_forward, _backward)
