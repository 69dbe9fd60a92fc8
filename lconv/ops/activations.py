"""The FFN's activation functions by name (``config.model.activation``; fairseq's ``--activation-fn``): ``gelu`` the
exact erf form, ``gelu_accurate`` the tanh approximation. Each is computed in float32 and cast back, as fairseq's
``gelu`` is, so a bfloat16 activation is rounded once."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.custom_vjp
def relu(x: Array) -> Array:
    """``max(x, 0)`` with its backward mask packed 8 to a byte (docs/kernels.md)."""
    return jnp.maximum(x, 0)


def _relu_forward(x):
    return relu(x), jnp.packbits(x > 0, axis=-1)


def _relu_backward(bits, g):
    keep = jnp.unpackbits(bits, axis=-1, count=g.shape[-1]).astype(bool)
    return (jnp.where(keep, g, jnp.zeros((), g.dtype)),)


relu.defvjp(_relu_forward, _relu_backward)


def _relu_squared(x: Array) -> Array:
    return jnp.square(jax.nn.relu(x))


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_accurate": lambda x: jax.nn.gelu(x, approximate=True),
    "relu_squared": _relu_squared,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
}


def activation(name: str, x: Array) -> Array:
    """``ACTIVATIONS[name](x)`` in float32, returned in ``x``'s dtype (ReLU, exact in every dtype, in ``x``'s)."""
    if name == "relu":
        return relu(x)
    return ACTIVATIONS[name](x.astype(jnp.float32)).astype(x.dtype)


@jax.custom_vjp
def glu(a: Array, b: Array) -> Array:
    """``a * sigmoid(b)`` (fairseq's GLU halves), whose backward pass recomputes the sigmoid from ``b``."""
    return a * jax.nn.sigmoid(b)


def _glu_forward(a, b):
    return glu(a, b), (a, b)


def _glu_backward(residuals, g):
    a, b = residuals
    # sigmoid(b) via tanh: another op than the forward's logistic, which XLA would merge with it and keep
    t = jnp.tanh(b * 0.5)
    return g * (0.5 + 0.5 * t), g * a * (0.25 * (1 - t * t))


glu.defvjp(_glu_forward, _glu_backward)
