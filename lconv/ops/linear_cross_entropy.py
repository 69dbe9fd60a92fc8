"""The output layer and the label-smoothed cross-entropy in one pass, without the ``[B, T, V]`` logits.

``cross_entropy_sums`` makes the logits one chunk of the length axis at a time, with the gradient in the same pass (a
``custom_vjp``); matmuls in ``dtype``, sums and gradients in float32. Plain jnp, so every backend and mesh runs it
(docs/kernels.md).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

Array = jax.Array

CHUNK_LOGITS = 2**23  # float32 logits a chunk may hold (per device): 32 MiB, e.g. 1,024 tokens x 8,192 ids
VOCAB_SLICE = 2048  # ids per slice of a chunk's backward matmuls (at most; the slices of V are even)


def logits(x_BTC: Array, table_VC: Array, valid_vocab: int, dtype: jnp.dtype,
           precision: jax.lax.Precision) -> Array:
    """Float32 logits ``[B, T, V]`` of ``x`` against the table, ids from ``valid_vocab`` on at -inf."""
    z_BTV = jnp.einsum("btc,vc->btv", x_BTC.astype(dtype), table_VC.astype(dtype), precision=precision,
                       preferred_element_type=jnp.float32)
    V = z_BTV.shape[-1]
    return z_BTV if valid_vocab >= V else jnp.where(jnp.arange(V) < valid_vocab, z_BTV, -jnp.inf)


def chunk_length(rows: int, length: int, vocab: int, budget: int = CHUNK_LOGITS) -> int:
    """The longest chunk keeping ``rows x L x vocab`` logits within ``budget``, a divisor of ``length`` if it can."""
    longest = max(1, min(length, budget // max(rows * vocab, 1)))
    divisor = next(d for d in range(longest, 0, -1) if length % d == 0)
    return divisor if 2 * divisor >= longest else longest


def cross_entropy_sums(x_BTC: Array, table_VC: Array, targets_BT: Array, weights_BT: Array, *,
                       label_smoothing: float = 0.0, valid_vocab: int | None = None, chunk: int | None = None,
                       dtype: jnp.dtype = jnp.float32, precision: jax.lax.Precision = jax.lax.Precision.DEFAULT,
                       rows_per_device: int | None = None, vocab_slice: int = VOCAB_SLICE) -> dict[str, Array]:
    """``{loss, nll, correct}``, float32 sums weighted by ``weights_BT`` (only ``loss`` differentiable); ``chunk``: None
    sizes it by ``rows_per_device``; ``vocab_slice``: the most ids one backward slice takes."""
    B, T, _ = x_BTC.shape
    V = table_VC.shape[0]
    valid_vocab = V if valid_vocab is None else int(valid_vocab)
    if not 0 < valid_vocab <= V:
        raise ValueError(f"valid_vocab={valid_vocab}: must be in [1, {V}]")
    L = chunk or chunk_length(rows_per_device or B, T, V)
    padded = math.ceil(T / L) * L
    if padded != T:  # a ragged last chunk: its padding weighs zero
        pad = ((0, 0), (0, padded - T))
        x_BTC, targets_BT, weights_BT = (jnp.pad(x_BTC, pad + ((0, 0),)), jnp.pad(targets_BT, pad),
                                         jnp.pad(weights_BT, pad))
    settings = (L, vocab_slice, valid_vocab, float(label_smoothing), jnp.dtype(dtype), precision)  # static
    loss, nll, correct = _sums(x_BTC, table_VC, targets_BT.astype(jnp.int32), weights_BT.astype(jnp.float32),
                               settings)
    return {"loss": loss, "nll": jax.lax.stop_gradient(nll), "correct": jax.lax.stop_gradient(correct)}


def _chunk_sums(x_BLC, table_VC, t_BL, w_BL, settings, dtable_VC):
    """One chunk's ``(loss, nll, correct)`` sums and, given the accumulator ``dtable_VC``, ``(dx_BLC, dtable_VC)``."""
    _, _, valid_vocab, eps, dtype, precision = settings
    V = table_VC.shape[0]
    table_VC = table_VC.astype(dtype)
    z_BLV = logits(x_BLC, table_VC, valid_vocab, dtype, precision)
    max_BL = jnp.max(z_BLV, axis=-1)
    sum_BL = jnp.sum(jnp.exp(z_BLV - max_BL[..., None]), axis=-1)
    lse_BL = max_BL + jnp.log(sum_BL)
    # A gather of the predicted ids' logits, not sums of where(...): XLA:CPU materialises each reduction's operand.
    in_range_BL = (t_BL >= 0) & (t_BL < V)
    target_BL = jnp.take_along_axis(z_BLV, jnp.clip(t_BL, 0, V - 1)[..., None], axis=-1, mode="clip")[..., 0]
    nll_BL = lse_BL - jnp.where(in_range_BL, target_BL, 0.0)
    smooth_BL = lse_BL - jnp.sum(z_BLV[..., :valid_vocab], axis=-1) / valid_vocab
    loss_BL = nll_BL if eps == 0 else (1.0 - eps) * nll_BL + eps * smooth_BL
    correct_BL = jnp.argmax(z_BLV, axis=-1) == t_BL
    sums = tuple(jnp.sum(v * w_BL) for v in (loss_BL, nll_BL, correct_BL.astype(jnp.float32)))
    if dtable_VC is None:
        return sums, None
    return sums, _chunk_grads(x_BLC, table_VC, z_BLV, (max_BL, sum_BL), t_BL, w_BL, settings, dtable_VC)


def _chunk_grads(x_BLC, table_VC, z_BLV, softmax_stats, t_BL, w_BL, settings, dtable_VC):
    """``dz`` one vocabulary slice at a time, meeting the table and ``x`` (the accumulator updated in place)."""
    _, vocab_slice, valid_vocab, eps, dtype, precision = settings
    max_BL, sum_BL = softmax_stats
    V, C = table_VC.shape
    count, width = _vocab_slicing(V, vocab_slice)
    x_NC = x_BLC.astype(dtype).reshape(-1, C)

    def one_slice(i, carry):
        dx_BLC, dtable_VC = carry
        # When equal slices do not tile V, the last overlaps its neighbour; its ids before `fresh_from` get no gradient.
        fresh_from = i * width
        start = jnp.minimum(fresh_from, V - width)
        ids_S = start + jnp.arange(width)
        z_BLS = jax.lax.dynamic_slice_in_dim(z_BLV, start, width, axis=2)
        p_BLS = jnp.exp(z_BLS - max_BL[..., None]) / sum_BL[..., None]
        dz_BLS = w_BL[..., None] * (p_BLS - jnp.where(ids_S == t_BL[..., None], 1.0 - eps, 0.0)
                                    - jnp.where(ids_S < valid_vocab, eps / valid_vocab, 0.0))
        if count * width != V:
            dz_BLS = jnp.where(ids_S >= fresh_from, dz_BLS, 0.0)
        dz_BLS = dz_BLS.astype(dtype)
        table_SC = jax.lax.dynamic_slice_in_dim(table_VC, start, width, axis=0)
        dx_BLC = dx_BLC + jnp.einsum("bls,sc->blc", dz_BLS, table_SC, precision=precision,
                                     preferred_element_type=jnp.float32)
        # One contracting dim of B*L tokens: XLA:CPU has no bf16 x bf16 -> f32 dot over two contracting dims.
        dtable_SC = jnp.einsum("ns,nc->sc", dz_BLS.reshape(-1, width), x_NC, precision=precision,
                               preferred_element_type=jnp.float32)
        old_SC = jax.lax.dynamic_slice_in_dim(dtable_VC, start, width, axis=0)
        return dx_BLC, jax.lax.dynamic_update_slice_in_dim(dtable_VC, old_SC + dtable_SC, start, axis=0)

    init = (jnp.zeros(x_BLC.shape, jnp.float32), dtable_VC)
    dx_BLC, dtable_VC = one_slice(0, init) if count == 1 else jax.lax.fori_loop(0, count, one_slice, init)
    return dx_BLC.astype(x_BLC.dtype), dtable_VC


def _vocab_slicing(vocab: int, most: int) -> tuple[int, int]:
    """``(count, width)``: the fewest slices of at most ``most`` ids that cover ``vocab``, as even as can be."""
    count = max(1, math.ceil(vocab / max(most, 1)))
    return count, math.ceil(vocab / count)


def _scan_chunks(x_BTC, table_VC, targets_BT, weights_BT, settings, with_grads):
    """The sums over every chunk and, ``with_grads``, ``dx_BTC`` and the float32 ``dtable_VC``; the loop slices the
    chunks (a scan would hold transposed copies)."""
    L = settings[0]
    B, T, C = x_BTC.shape

    def one_chunk(i, carry):
        sums, dx_BTC, dtable_VC = carry
        x_BLC, t_BL, w_BL = (jax.lax.dynamic_slice_in_dim(a, i * L, L, axis=1)
                             for a in (x_BTC, targets_BT, weights_BT))
        chunk_sums, grads = _chunk_sums(x_BLC, table_VC, t_BL, w_BL, settings, dtable_VC)
        sums = tuple(a + b for a, b in zip(sums, chunk_sums))
        if grads is None:
            return sums, dx_BTC, dtable_VC
        return sums, jax.lax.dynamic_update_slice_in_dim(dx_BTC, grads[0], i * L, axis=1), grads[1]

    zeros = (jnp.zeros((), jnp.float32),) * 3
    init = ((zeros, jnp.zeros((B, T, C), x_BTC.dtype), jnp.zeros(table_VC.shape, jnp.float32)) if with_grads
            else (zeros, None, None))
    n = T // L
    sums, dx_BTC, dtable_VC = one_chunk(0, init) if n == 1 else jax.lax.fori_loop(0, n, one_chunk, init)
    return sums, dx_BTC, dtable_VC


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sums(x_BTC, table_VC, targets_BT, weights_BT, settings):
    return _scan_chunks(x_BTC, table_VC, targets_BT, weights_BT, settings, with_grads=False)[0]


def _sums_forward(x_BTC, table_VC, targets_BT, weights_BT, settings):
    sums, dx_BTC, dtable_VC = _scan_chunks(x_BTC, table_VC, targets_BT, weights_BT, settings, with_grads=True)
    return sums, (dx_BTC, dtable_VC.astype(table_VC.dtype))


def _sums_backward(settings, grads, cotangents):
    """Scales the forward's gradients of ``loss`` by its cotangent (``nll`` and ``correct`` carry none)."""
    dx_BTC, dtable_VC = grads
    g_loss = cotangents[0]
    return ((g_loss * dx_BTC).astype(dx_BTC.dtype), (g_loss * dtable_VC).astype(dtable_VC.dtype), None, None)


_sums.defvjp(_sums_forward, _sums_backward)
