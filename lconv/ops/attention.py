"""The math of attention, pure ``jnp``: masks, logits, the masked softmax and its weighted sum, shared by every
attention-family module. Masks are boolean ``[B, 1|H, T, S]``; logits, softmax and accumulation run in float32."""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from lconv.constants import MASKED_LOGIT

Array = jax.Array


def attention_mask(q_seg_BT: Array, k_seg_BS: Array, q_idx_T: Array | None = None, k_idx_S: Array | None = None,
                   *, causal: bool = False, radius: int | None = None) -> Array:
    """Boolean ``[B, 1, T, S]``: same non-zero segment, and key <= query if ``causal``, within ``radius`` if given."""
    m_BTS = (q_seg_BT[:, :, None] == k_seg_BS[:, None, :]) & (q_seg_BT[:, :, None] != 0)
    if causal or radius is not None:
        q_idx_T = jnp.arange(q_seg_BT.shape[1]) if q_idx_T is None else q_idx_T
        k_idx_S = jnp.arange(k_seg_BS.shape[1]) if k_idx_S is None else k_idx_S
        d_TS = k_idx_S[None, :] - q_idx_T[:, None]  # key index - query index
        if causal:
            m_BTS &= (d_TS <= 0)[None]
        if radius is not None:
            m_BTS &= (jnp.abs(d_TS) <= radius)[None]
    return m_BTS[:, None]


def dot_product_logits(q_BTHD: Array, k_BSHD: Array, *, precision: Any = None) -> Array:
    """``Q Kᵀ / sqrt(D)``, ``[B, H, T, S]``, accumulated and returned in float32."""
    logits_BHTS = jnp.einsum("bthd,bhsd->bhts", q_BTHD, _head_major(k_BSHD), precision=precision,
                             preferred_element_type=jnp.float32)
    return logits_BHTS / math.sqrt(q_BTHD.shape[-1])


def _head_major(k_BSHD: Array) -> Array:
    """``[B, H, S, D]``, on CPU written out once behind an optimisation barrier (not twice)."""
    return jax.lax.platform_dependent(k_BSHD, cpu=lambda k: jax.lax.optimization_barrier(k.transpose(0, 2, 1, 3)),
                                      default=lambda k: k.transpose(0, 2, 1, 3))


def masked_softmax(logits_BHTS: Array, mask_BHTS: Array) -> Array:
    """Float32 ``softmax(logits)`` over the keys ``mask`` lets through; 0 elsewhere, and for a query with none."""
    logits = jnp.where(mask_BHTS, logits_BHTS.astype(jnp.float32), MASKED_LOGIT)
    return jnp.where(mask_BHTS, jax.nn.softmax(logits, axis=-1), 0.0)


def attend(logits_BHTS: Array, v_BSHD: Array, mask_BHTS: Array, *, dropout_rate: float = 0.0,
           dropout_rng: Array | None = None, dtype: Any = None, precision: Any = None) -> Array:
    """``softmax(logits + mask) V`` in float32, ``[B, T, H, D]`` in ``dtype`` (default ``v``'s); queries with no
    visible key (padding) get zeros. Dropout on the probabilities when ``dropout_rng`` is given."""
    probs_BHTS = masked_softmax(logits_BHTS, mask_BHTS)
    if dropout_rng is not None and dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BHTS.shape)
        probs_BHTS = jnp.where(keep, probs_BHTS / (1.0 - dropout_rate), 0.0)
    out_BTHD = jnp.einsum("bhts,bshd->bthd", probs_BHTS.astype(v_BSHD.dtype), v_BSHD, precision=precision,
                          preferred_element_type=jnp.float32)
    return out_BTHD.astype(dtype or v_BSHD.dtype)


def dot_product_attention(q_BTHD: Array, k_BSHD: Array, v_BSHD: Array, mask_BHTS: Array, *,
                          dropout_rate: float = 0.0, dropout_rng: Array | None = None, dtype: Any = None,
                          precision: Any = None) -> Array:
    """Masked attention on materialised ``[B, H, T, S]`` logits: the reference the kernels of ``ops.flash`` match."""
    logits_BHTS = dot_product_logits(q_BTHD, k_BSHD, precision=precision)
    return attend(logits_BHTS, v_BSHD, mask_BHTS, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                  dtype=dtype, precision=precision)


def head_major_attention(q_BHTD: Array, k_BHDS: Array, v_BHSD: Array, mask_BHTS: Array, *, dtype: Any = None,
                         precision: Any = None) -> Array:
    """``dot_product_attention`` on head-major operands, ``[B, H, T, D]`` out: a cache's layout."""
    logits_BHTS = jnp.einsum("bhtd,bhds->bhts", q_BHTD, k_BHDS, precision=precision,
                             preferred_element_type=jnp.float32) / math.sqrt(q_BHTD.shape[-1])
    probs_BHTS = masked_softmax(logits_BHTS, mask_BHTS)
    out_BHTD = jnp.einsum("bhts,bhsd->bhtd", probs_BHTS.astype(v_BHSD.dtype), v_BHSD, precision=precision,
                          preferred_element_type=jnp.float32)
    return out_BHTD.astype(dtype or v_BHSD.dtype)


def fixed_logits(w_HLL: Array, q_pos_BT: Array, k_pos_BS: Array) -> Array:
    """Gathers ``W[h, q_pos[b, t], k_pos[b, s]]`` into float32 ``[B, H, T, S]``."""
    rows_BHTL = jnp.transpose(w_HLL[:, q_pos_BT, :], (1, 0, 2, 3)).astype(jnp.float32)  # [B, H, T, L]
    B, H, T, _ = rows_BHTL.shape
    idx_BHTS = jnp.broadcast_to(k_pos_BS[:, None, None, :], (B, H, T, k_pos_BS.shape[1]))
    return jnp.take_along_axis(rows_BHTL, idx_BHTS, axis=-1)


def factorized_fixed_logits(r1_HLF: Array, r2_HFL: Array, q_pos_BT: Array, k_pos_BS: Array, *,
                            precision: Any = None) -> Array:
    """``(R1 @ R2)[h, q_pos, k_pos]`` without forming the ``[L, L]`` table, float32 ``[B, H, T, S]``."""
    a_HBTF = r1_HLF[:, q_pos_BT, :].astype(jnp.float32)  # [H, B, T, F]
    b_HFBS = r2_HFL[:, :, k_pos_BS].astype(jnp.float32)  # [H, F, B, S]
    return jnp.einsum("hbtf,hfbs->bhts", a_HBTF, b_HFBS, precision=precision)


def decode_mask(seg_BT: Array, cached_seg_BL: Array, index: int | Array) -> Array:
    """Mask of a decoded chunk (queries at ``index + t``) against the whole cache, causal by index."""
    T, L = seg_BT.shape[1], cached_seg_BL.shape[1]
    return attention_mask(seg_BT, cached_seg_BL, index + jnp.arange(T), jnp.arange(L), causal=True)
