"""Multi-head dot-product attention: the Transformer baseline mixer and encoder-decoder attention.

``SelfAttention`` is a token mixer (``lconv.mixers``): causal and padding masks, packed ``segment_ids``
(attend only inside the same non-zero segment), and a KV cache for decoding that takes chunks of one or more
tokens. ``CrossAttention`` attends from the decoder to the encoder output. Projections are fairseq's:
xavier-uniform kernels, zero biases. Logits, softmax and the weighted sum accumulate in float32.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv.layers import EMBED, HEADS, xavier_dense

Dtype = Any
KV = "kv"
NEG_INF = -1e9  # finite, so fully masked rows (padding queries) give a uniform softmax instead of NaN


class SelfAttention(nn.Module):
    """Scaled dot-product self-attention; ``decode=True`` (causal) caches keys/values ``[B, max_len, H, D]``."""

    num_heads: int
    causal: bool = False
    attention_dropout: float = 0.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False):
        del positions  # content-based: positions enter through the embeddings
        B, T, C = x_BTC.shape
        H = self.num_heads
        D = _head_dim(C, H)
        q_BTHD, k_BTHD, v_BTHD = (
            _project_in(self, x_BTC, H, D, name)(x_BTC) for name in ("query", "key", "value"))
        if decode:
            if not self.causal:
                raise ValueError("decode=True needs causal self-attention (causal=True)")
            initialised = self.has_variable("cache", "cached_key")
            cached_k = self.variable("cache", "cached_key", jnp.zeros, k_BTHD.shape, k_BTHD.dtype)
            cached_v = self.variable("cache", "cached_value", jnp.zeros, v_BTHD.shape, v_BTHD.dtype)
            index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
            if initialised:  # write this chunk at the cache index; attend to everything written so far
                start = index.value
                cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k_BTHD, (0, start, 0, 0))
                cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v_BTHD, (0, start, 0, 0))
                index.value = start + T
                k_BTHD, v_BTHD = cached_k.value, cached_v.value
                S = k_BTHD.shape[1]
                query_pos = start + jnp.arange(T)
                mask_BTS = jnp.broadcast_to(jnp.arange(S)[None, :] <= query_pos[:, None], (B, T, S))
                y = dot_product_attention(q_BTHD, k_BTHD, v_BTHD, mask_BTS[:, None])
                return _project_out(self, y, C)
        mask = attention_mask(segment_ids, segment_ids, B, T, T, causal=self.causal)
        dropout_rng = None if deterministic or not self.attention_dropout else self.make_rng("dropout")
        y = dot_product_attention(q_BTHD, k_BTHD, v_BTHD, mask, dropout_rate=self.attention_dropout,
                                  dropout_rng=dropout_rng)
        return _project_out(self, y, C)


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention: queries from ``x_BTC``, keys/values from ``memory_BSC``."""

    num_heads: int
    attention_dropout: float = 0.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTC, memory_BSC, *, query_segment_ids=None, memory_segment_ids=None,
                 deterministic=True, decode=False):
        del decode  # keys/values are recomputed from the (fixed) encoder output each step
        B, T, C = x_BTC.shape
        S = memory_BSC.shape[1]
        H = self.num_heads
        D = _head_dim(C, H)
        q_BTHD = _project_in(self, x_BTC, H, D, "query")(x_BTC)
        k_BSHD = _project_in(self, memory_BSC, H, D, "key")(memory_BSC)
        v_BSHD = _project_in(self, memory_BSC, H, D, "value")(memory_BSC)
        if query_segment_ids is None and memory_segment_ids is not None:
            # Unpacked decoding: every query may read every non-padding source position.
            mask = jnp.broadcast_to((memory_segment_ids != 0)[:, None, None, :], (B, 1, T, S))
        else:
            mask = attention_mask(query_segment_ids, memory_segment_ids, B, T, S, causal=False)
        dropout_rng = None if deterministic or not self.attention_dropout else self.make_rng("dropout")
        y = dot_product_attention(q_BTHD, k_BSHD, v_BSHD, mask, dropout_rate=self.attention_dropout,
                                  dropout_rng=dropout_rng)
        return _project_out(self, y, C)


# ----------------------------------------------------------------------------------------------------------------
# Pieces and pure math
# ----------------------------------------------------------------------------------------------------------------
def _head_dim(C, H):
    if H < 1 or C % H:
        raise ValueError(f"features C={C} must be divisible by num_heads={H}")
    return C // H


def _project_in(module, x, H, D, name):
    dense = xavier_dense(H * D, (EMBED, HEADS), dtype=module.dtype, param_dtype=module.param_dtype, name=name)
    return lambda x: dense(x).reshape(*x.shape[:-1], H, D)


def _project_out(module, y_BTHD, C):
    y_BTC = y_BTHD.reshape(*y_BTHD.shape[:2], C)
    return xavier_dense(C, (HEADS, EMBED), dtype=module.dtype, param_dtype=module.param_dtype, name="out")(y_BTC)


def attention_mask(query_segments_BT, key_segments_BS, B, T, S, *, causal):
    """``[B, 1, T, S]`` bool: same non-zero segment (or all, without segments), and key <= query if causal."""
    mask = jnp.ones((B, 1, T, S), bool)
    if query_segments_BT is not None and key_segments_BS is not None:
        same = query_segments_BT[:, :, None] == key_segments_BS[:, None, :]
        mask = mask & (same & (key_segments_BS[:, None, :] != 0))[:, None]
    elif key_segments_BS is not None:
        mask = mask & (key_segments_BS != 0)[:, None, None, :]
    if causal:
        mask = mask & (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None])[None, None]
    return mask


def dot_product_attention(q_BTHD, k_BSHD, v_BSHD, mask_B1TS=None, *, bias_BHTS=None, dropout_rate=0.0,
                          dropout_rng=None):
    """``softmax(q k^T / sqrt(D) + bias, masked) v`` with float32 logits, softmax and accumulation."""
    D = q_BTHD.shape[-1]
    logits_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD, preferred_element_type=jnp.float32)
    logits_BHTS = logits_BHTS / jnp.sqrt(jnp.float32(D))
    if bias_BHTS is not None:
        logits_BHTS = logits_BHTS + bias_BHTS
    if mask_B1TS is not None:
        logits_BHTS = jnp.where(mask_B1TS, logits_BHTS, NEG_INF)
    probs_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
    if dropout_rng is not None and dropout_rate > 0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BHTS.shape)
        probs_BHTS = jnp.where(keep, probs_BHTS / (1.0 - dropout_rate), 0.0)
    y_BTHD = jnp.einsum("bhts,bshd->bthd", probs_BHTS.astype(v_BSHD.dtype), v_BSHD,
                        preferred_element_type=jnp.float32)
    return y_BTHD.astype(q_BTHD.dtype)
