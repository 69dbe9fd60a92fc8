"""The matmul of a dense layer, ``x[..., I] @ w[I, O]``, whose weight gradient XLA:CPU runs at full speed: on CPU the
VJP writes the narrower operand out transposed first, into the layout XLA:CPU's matmul library takes; elsewhere it is
autodiff's dot. Why and how: docs/kernels.md, "The dense layers' weight gradient"."""
from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax

Array = jax.Array


def dense_dot_general(lhs: Array, rhs: Array, dimension_numbers: Any, precision: Any = None,
                      preferred_element_type: Any = None) -> Array:
    """``lax.dot_general``, with a dense layer's contraction (no batch axes, 2-D ``rhs``) through ``_dense``'s VJP."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if (rhs.ndim == 2 and tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,)
            and not lhs_batch and not rhs_batch):
        return _dense(lhs, rhs, _hashable(precision), preferred_element_type)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)


def _hashable(precision: Any) -> Any:
    return tuple(precision) if isinstance(precision, list) else precision


def _matmul(x_NI: Array, w_IO: Array, precision: Any, out_dtype: Any) -> Array:
    return lax.dot_general(x_NI, w_IO, (((x_NI.ndim - 1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x: Array, w_IO: Array, precision: Any, out_dtype: Any) -> Array:
    return _matmul(x, w_IO, precision, out_dtype)


def _dense_fwd(x, w_IO, precision, out_dtype):
    return _matmul(x, w_IO, precision, out_dtype), (x, w_IO)


def _dense_bwd(precision, out_dtype, residuals, dy):
    x, w_IO = residuals
    dx = lax.dot_general(dy, w_IO, (((dy.ndim - 1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=out_dtype)
    x_NI, dy_NO = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])

    def cpu(x_NI, dy_NO):  # the narrower of x and dy written out transposed: the library's layout
        if x_NI.shape[1] <= dy_NO.shape[1]:
            return lax.dot_general(lax.optimization_barrier(x_NI.T), dy_NO, (((1,), (0,)), ((), ())),
                                   precision=precision, preferred_element_type=out_dtype)  # [I, N] @ [N, O]
        dw_OI = lax.dot_general(lax.optimization_barrier(dy_NO.T), x_NI, (((1,), (0,)), ((), ())),
                                precision=precision, preferred_element_type=out_dtype)  # [O, N] @ [N, I]
        return lax.optimization_barrier(dw_OI).T  # the barrier: XLA would fold this transpose into the dot too

    def default(x_NI, dy_NO):  # autodiff's own contraction over the tokens
        return lax.dot_general(x_NI, dy_NO, (((0,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=out_dtype)

    dw_IO = lax.platform_dependent(x_NI, dy_NO, cpu=cpu, default=default)
    return dx.astype(x.dtype), dw_IO.astype(w_IO.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)
