"""The output layer and the label-smoothed cross-entropy in one pass, without the ``[B, T, V]`` logits.

``cross_entropy_sums(x_BTC, table_VC, targets_BT, weights_BT)`` is the loss of the logits ``z = x @ table.T``:
the sums ``{loss, nll, correct}`` over weighted tokens of ``loss = (1 - eps) * nll + eps * mean_v(-log p_v)``
(the mean over the predictable ids, those below ``valid_vocab``). The logits are made one chunk of the length
axis at a time (``[B, L, V]``, every row of the batch in each chunk, so a batch split over devices stays split)
and consumed at once, so no more than one chunk's float32 logits exist. Shapes: B rows, T length, L chunk
length, C features, V vocabulary.

The gradient is made in the same pass. Only ``loss`` is differentiable (``nll`` and ``correct`` are reports), so
when the sums are differentiated (a ``custom_vjp``) each chunk's ``dz = w * (softmax(z) - (1 - eps) * onehot -
eps / V)`` is formed while its logits are at hand and meets ``x`` and the table in the two backward matmuls there;
the backward pass only scales the stored ``dx`` and ``dtable`` by the loss's cotangent. The logits are made
once, as in the unfused head, instead of once more in the backward; an evaluation (no gradient) runs the
forward alone.

The matmuls read ``x`` and the table in ``dtype`` (the model's compute dtype) and accumulate in float32
(``preferred_element_type``); the sums are float32, and so is the table's gradient, accumulated over the chunks.
In float32 at ``precision="highest"`` the sums and gradients equal a float32 log-softmax over materialised logits
to rounding (tests/test_linear_cross_entropy.py checks both against float64 NumPy).

Why a scan over chunks of plain jnp rather than a kernel library: it runs on every backend and under every mesh
the models run on, and none of the libraries keeps label smoothing, weights, the accuracy and an output
vocabulary (docs/training.md, "The output layer and the loss").
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

Array = jax.Array

CHUNK_LOGITS = 2**23  # float32 logits a chunk may hold (per device): 32 MiB, e.g. 1,024 tokens x 8,192 ids


def logits(x_BTC: Array, table_VC: Array, valid_vocab: int, dtype: jnp.dtype,
           precision: jax.lax.Precision) -> Array:
    """Float32 logits ``[B, T, V]`` of ``x`` against the table, read in ``dtype`` with float32 accumulation; the
    ids from ``valid_vocab`` on at -inf (never predicted)."""
    z_BTV = jnp.einsum("btc,vc->btv", x_BTC.astype(dtype), table_VC.astype(dtype), precision=precision,
                       preferred_element_type=jnp.float32)
    V = z_BTV.shape[-1]
    return z_BTV if valid_vocab >= V else jnp.where(jnp.arange(V) < valid_vocab, z_BTV, -jnp.inf)


def chunk_length(rows: int, length: int, vocab: int, budget: int = CHUNK_LOGITS) -> int:
    """The chunk length ``L``: the longest that keeps ``rows x L x vocab`` logits within ``budget`` (at least 1),
    lowered to divide ``length`` evenly when a divisor at least half as long exists (no padding copy)."""
    longest = max(1, min(length, budget // max(rows * vocab, 1)))
    divisor = next(d for d in range(longest, 0, -1) if length % d == 0)
    return divisor if 2 * divisor >= longest else longest


def cross_entropy_sums(x_BTC: Array, table_VC: Array, targets_BT: Array, weights_BT: Array, *,
                       label_smoothing: float = 0.0, valid_vocab: int | None = None, chunk: int | None = None,
                       dtype: jnp.dtype = jnp.float32, precision: jax.lax.Precision = jax.lax.Precision.DEFAULT,
                       rows_per_device: int | None = None) -> dict[str, Array]:
    """``{loss, nll, correct}``, float32 sums over the tokens weighted by ``weights_BT`` (see the module doc).

    ``chunk``: the chunk length ``L`` (None: ``chunk_length`` of ``rows_per_device``, the batch rows one device
    holds, default ``B``). ``loss`` is differentiable with respect to ``x`` (its gradient in ``x``'s dtype) and
    the table (in the table's dtype); ``nll`` and ``correct`` carry no gradient."""
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
    settings = (L, valid_vocab, float(label_smoothing), jnp.dtype(dtype), precision)  # static, hashable
    loss, nll, correct = _sums(x_BTC, table_VC, targets_BT.astype(jnp.int32), weights_BT.astype(jnp.float32),
                               settings)
    return {"loss": loss, "nll": jax.lax.stop_gradient(nll), "correct": jax.lax.stop_gradient(correct)}


def _chunks(a_BT: Array, L: int) -> Array:
    """``[B, T, ...] -> [T / L, B, L, ...]``: the scan's axis first, every row in every chunk."""
    B, T = a_BT.shape[:2]
    return jnp.swapaxes(a_BT.reshape(B, T // L, L, *a_BT.shape[2:]), 0, 1)


def _unchunk(a_NBL: Array) -> Array:
    """The inverse of ``_chunks``."""
    N, B, L = a_NBL.shape[:3]
    return jnp.swapaxes(a_NBL, 0, 1).reshape(B, N * L, *a_NBL.shape[3:])


def _chunk_sums(x_BLC, table_VC, t_BL, w_BL, settings, with_grads):
    """One chunk's ``(loss, nll, correct)`` sums and, ``with_grads``, ``(dx_BLC, dtable_CV)`` of its loss."""
    _, valid_vocab, eps, dtype, precision = settings
    V = table_VC.shape[0]
    table_VC = table_VC.astype(dtype)
    z_BLV = logits(x_BLC, table_VC, valid_vocab, dtype, precision)
    predicted_V = jnp.arange(V) < valid_vocab
    max_BL = jnp.max(z_BLV, axis=-1)
    exp_BLV = jnp.exp(z_BLV - max_BL[..., None])
    sum_BL = jnp.sum(exp_BLV, axis=-1)
    lse_BL = max_BL + jnp.log(sum_BL)
    target_BLV = jnp.arange(V) == t_BL[..., None]
    nll_BL = lse_BL - jnp.sum(jnp.where(target_BLV, z_BLV, 0.0), axis=-1)
    smooth_BL = lse_BL - jnp.sum(jnp.where(predicted_V, z_BLV, 0.0), axis=-1) / valid_vocab
    loss_BL = nll_BL if eps == 0 else (1.0 - eps) * nll_BL + eps * smooth_BL
    correct_BL = jnp.argmax(z_BLV, axis=-1) == t_BL
    sums = tuple(jnp.sum(v * w_BL) for v in (loss_BL, nll_BL, correct_BL.astype(jnp.float32)))
    if not with_grads:
        return sums, None
    p_BLV = exp_BLV / sum_BL[..., None]
    dz_BLV = w_BL[..., None] * (p_BLV - jnp.where(target_BLV, 1.0 - eps, 0.0)
                                - jnp.where(predicted_V, eps / valid_vocab, 0.0))
    dz_BLV = dz_BLV.astype(dtype)
    dx_BLC = jnp.einsum("blv,vc->blc", dz_BLV, table_VC, precision=precision,
                        preferred_element_type=jnp.float32).astype(x_BLC.dtype)
    # One contracting dim of B*L tokens, not two: XLA:CPU's dot runtime has no bfloat16 x bfloat16 -> float32 dot
    # over two contracting dims (UNIMPLEMENTED on one device), and on every backend it is the same matmul.
    dtable_CV = jnp.einsum("nc,nv->cv", x_BLC.astype(dtype).reshape(-1, x_BLC.shape[-1]), dz_BLV.reshape(-1, V),
                           precision=precision, preferred_element_type=jnp.float32)
    return sums, (dx_BLC, dtable_CV)


def _scan_chunks(x_BTC, table_VC, targets_BT, weights_BT, settings, with_grads):
    """The sums over every chunk and, ``with_grads``, ``dx_BTC`` and the float32 ``dtable_VC``."""
    L = settings[0]

    def one_chunk(carry, chunk):
        sums, dtable_CV = carry  # accumulated as the matmul writes it; transposed once, after the last chunk
        x_BLC, t_BL, w_BL = chunk
        chunk_sums, grads = _chunk_sums(x_BLC, table_VC, t_BL, w_BL, settings, with_grads)
        sums = tuple(a + b for a, b in zip(sums, chunk_sums))
        if not with_grads:
            return (sums, dtable_CV), None
        return (sums, dtable_CV + grads[1]), grads[0]

    zeros = (jnp.zeros((), jnp.float32),) * 3
    dtable_CV = jnp.zeros(table_VC.shape[::-1], jnp.float32) if with_grads else jnp.zeros((), jnp.float32)
    chunks = tuple(_chunks(a, L) for a in (x_BTC, targets_BT, weights_BT))
    (sums, dtable_CV), dx_NBLC = jax.lax.scan(one_chunk, (zeros, dtable_CV), chunks)
    return sums, (None if dx_NBLC is None else _unchunk(dx_NBLC)), dtable_CV.T


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sums(x_BTC, table_VC, targets_BT, weights_BT, settings):
    return _scan_chunks(x_BTC, table_VC, targets_BT, weights_BT, settings, with_grads=False)[0]


def _sums_forward(x_BTC, table_VC, targets_BT, weights_BT, settings):
    sums, dx_BTC, dtable_VC = _scan_chunks(x_BTC, table_VC, targets_BT, weights_BT, settings, with_grads=True)
    return sums, (dx_BTC, dtable_VC.astype(table_VC.dtype))


def _sums_backward(settings, grads, cotangents):
    """Scales the gradients of the loss made in the forward by its cotangent (``nll`` and ``correct`` are
    stopped in ``cross_entropy_sums``, so theirs are zero)."""
    dx_BTC, dtable_VC = grads
    g_loss = cotangents[0]
    return ((g_loss * dx_BTC).astype(dx_BTC.dtype), (g_loss * dtable_VC).astype(dtable_VC.dtype), None, None)


_sums.defvjp(_sums_forward, _sums_backward)
