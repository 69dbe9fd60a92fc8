"""Attention-family token mixers: dot-product self-attention, cross-attention, Fixed and Hadamard attention.

Every mixer here follows the contract in ``lconv/mixers.py``:
``y_BTC = mixer(x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False)``.
The mixer returns the update; the model owns layer norm, residual dropout and the residual add.

All of them reduce to ``softmax(logits_BHTS + mask) V`` and differ only in where the logits come from:

- ``SelfAttention``: ``Q Kᵀ / sqrt(D)`` (Vaswani et al. 2017; projections initialised as in fairseq).
- ``FixedAttention``: learned, input-independent logits ``W_h[pos_q, pos_k]`` (Synthesizer-Random,
  Tay et al. 2021), optionally factorised and optionally mixed with ``Q Kᵀ / sqrt(D)``.
- ``HadamardAttention``: ``W_h[pos_q, pos_k] ⊙ Q Kᵀ / sqrt(D)``, a learned positional re-weighting of the
  content logits.

Masks are boolean ``[B, 1|H, T, S]``: a query attends a key only if both carry the same non-zero segment id
(packed examples never mix, padding is never read) and, when causal, the key's index is not after the query's.
Logits, softmax and the probability-value accumulation run in float32 whatever the activation dtype.

Decoding (``decode=True``, causal mixers only) follows flax ``examples/wmt``: the first call, on a full
max-length dummy input under ``mutable=['cache']``, only creates a zeroed cache in the ``'cache'`` collection
(and returns the ordinary full pass of the dummy). Later calls take a chunk of ``T >= 1`` new tokens, write it
at ``cache_index`` with ``lax.dynamic_update_slice`` and attend causally to every cached position up to
their own. The cache always holds ``cached_segment_ids [B, L]`` (0 = not yet written, so unwritten slots are
masked) and ``cache_index []`` plus the per-mixer arrays listed in each class. Writing past ``L`` cannot be
detected under jit (``dynamic_update_slice`` clamps); the decoder must stop at the max length it created.

The pure math (masks, logits, masked softmax attention) is at the bottom of the file and is reused by
``lconv.colt5`` and ``lconv.memory``.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import flax.linen as nn

Array = jax.Array
DType = Any

# A large negative logit for masked entries; finite so that fully-masked rows do not produce NaNs.
NEG_INF = -1e30


# ----------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------


class AttentionFields(nn.Module):
    """The fields every attention-family token mixer shares (``lconv.memory`` too), and their validation."""

    num_heads: int = 8
    causal: bool = False
    dtype: DType = jnp.float32  # computation dtype; logits, softmax and accumulation stay float32
    param_dtype: DType = jnp.float32
    qkv_features: int | None = None  # total Q/K/V width; None = the input width C
    attention_dropout: float = 0.0  # on the attention probabilities, training only
    use_bias: bool = True  # in the Q/K/V/output projections

    def _dims(self, x_BTC) -> tuple[int, int, int, int, int]:
        """``(B, T, C, H, D)`` of a ``[B, T, C]`` input; bad shapes and fields are one-line errors."""
        B, T, C = check_input(x_BTC)
        H, D = head_dims(self.num_heads, self.qkv_features, C)
        check_dropout(self.attention_dropout)
        return B, T, C, H, D


class SelfAttention(AttentionFields):
    """Multi-head scaled dot-product self-attention (registry name ``"attention"``).

    ``y = Out(softmax(Q Kᵀ / sqrt(D) + mask) V)`` with ``Q, K, V = x W_q, x W_k, x W_v`` split into ``num_heads``
    contiguous heads of size ``D = qkv_features / num_heads``. Kernels are xavier-uniform with zero bias, as
    fairseq initialises its Transformer. ``attention_dropout`` drops attention probabilities in training.

    Decode cache (``'cache'`` collection): ``cached_key``, ``cached_value`` ``[B, L, H, D]``,
    ``cached_segment_ids [B, L]`` int32, ``cache_index []`` int32.
    """

    @nn.compact
    def __call__(self, x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False):
        B, T, C, H, D = self._dims(x_BTC)
        seg_BT, _ = segments_and_positions(x_BTC, segment_ids, positions)
        x = x_BTC.astype(self.dtype)
        q_BTHD = dense(H * D, "query", self)(x).reshape(B, T, H, D)
        k_BSHD = dense(H * D, "key", self)(x).reshape(B, T, H, D)
        v_BSHD = dense(H * D, "value", self)(x).reshape(B, T, H, D)
        kv, mask_B1TS = attention_context(self, {"key": k_BSHD, "value": v_BSHD, "segment_ids": seg_BT}, decode)
        out_BTHD = dot_product_attention(
            q_BTHD, kv["key"], kv["value"], mask_B1TS, dropout_rate=self.attention_dropout,
            dropout_rng=dropout_rng(self, self.attention_dropout, deterministic), dtype=self.dtype)
        return dense(C, "out", self)(out_BTHD.reshape(B, T, H * D)).astype(x_BTC.dtype)


class CrossAttention(nn.Module):
    """Encoder-decoder attention: decoder queries attend the encoder output ``memory_BSC``.

    Same math and initialisation as ``SelfAttention``; the mask pairs ``query_segment_ids`` with
    ``memory_segment_ids`` (packed examples only see their own source; padding keys are never read).
    Not a token mixer (so not in the registry). With ``decode=True`` the projected encoder keys and values
    ``[B, S, H, D]`` are computed once, on the cache-creating call, and read back from the ``'cache'``
    collection on every later step (``memory_BSC`` is then only checked for shape): recomputing them each step
    cost two ``S x C x C`` projections per token. They are named ``beam_invariant_*``, so beam search neither
    tiles nor reorders them (``lconv.decode``); the beams' queries share their row's memory.
    """

    num_heads: int = 8
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    qkv_features: int | None = None
    attention_dropout: float = 0.0
    use_bias: bool = True

    @nn.compact
    def __call__(self, x_BTC, memory_BSC, *, query_segment_ids=None, memory_segment_ids=None,
                 deterministic=True, decode=False):
        B, T, C = check_input(x_BTC)
        _, S, _ = check_input(memory_BSC, "memory_BSC")
        if memory_BSC.shape[0] != B:
            raise ValueError(f"memory_BSC batch {memory_BSC.shape[0]} != x_BTC batch {B}")
        H, D = head_dims(self.num_heads, self.qkv_features, C)
        check_dropout(self.attention_dropout)
        q_seg_BT, _ = segments_and_positions(x_BTC, query_segment_ids, None, "query_segment_ids")
        k_seg_BS, _ = segments_and_positions(memory_BSC, memory_segment_ids, None, "memory_segment_ids")
        q_BTHD = dense(H * D, "query", self)(x_BTC.astype(self.dtype)).reshape(B, T, H, D)
        if decode and self.has_variable("cache", "beam_invariant_key"):
            out_BTHD = self._attend_cached(q_BTHD, q_seg_BT)
        else:
            m = memory_BSC.astype(self.dtype)
            k_BSHD = dense(H * D, "key", self)(m).reshape(B, S, H, D)
            v_BSHD = dense(H * D, "value", self)(m).reshape(B, S, H, D)
            if decode:
                self.put_variable("cache", "beam_invariant_key", k_BSHD)
                self.put_variable("cache", "beam_invariant_value", v_BSHD)
                self.put_variable("cache", "beam_invariant_segment_ids", k_seg_BS)
            out_BTHD = dot_product_attention(
                q_BTHD, k_BSHD, v_BSHD, attention_mask(q_seg_BT, k_seg_BS), dropout_rate=self.attention_dropout,
                dropout_rng=dropout_rng(self, self.attention_dropout, deterministic), dtype=self.dtype)
        return dense(C, "out", self)(out_BTHD.reshape(B, T, H * D)).astype(x_BTC.dtype)

    def _attend_cached(self, q_BTHD, q_seg_BT):
        """Queries of ``B = R * b`` rows against the cached ``[b, S, H, D]`` memory, ``R`` consecutive rows per
        memory row (the beams of ``lconv.decode.tile_cache``, which leaves ``beam_invariant_*`` untiled): the
        beams of a row are folded into its query axis, so the memory is read once per row, not once per beam."""
        k_bSHD = self.get_variable("cache", "beam_invariant_key")
        v_bSHD = self.get_variable("cache", "beam_invariant_value")
        k_seg_bS = self.get_variable("cache", "beam_invariant_segment_ids")
        (B, T, H, D), b = q_BTHD.shape, k_bSHD.shape[0]
        if B % b:
            raise ValueError(f"x_BTC batch {B} is not a multiple of the cached memory batch {b}")
        q_bQHD = q_BTHD.reshape(b, (B // b) * T, H, D)  # Q = beams * T
        mask_b1QS = attention_mask(q_seg_BT.reshape(b, -1), k_seg_bS)
        return dot_product_attention(q_bQHD, k_bSHD, v_bSHD, mask_b1QS, dtype=self.dtype).reshape(B, T, H, D)


class FixedAttention(AttentionFields):
    """Synthesizer-Random attention (registry name ``"fixed"``): ``Out(softmax(W_h[pos_q, pos_k] + mask) V)``.

    The logits are learned parameters that do not look at the input: head ``h`` owns a
    ``[max_len, max_len]`` table indexed by the tokens' within-segment ``positions``, so packed examples see the
    same table as unpacked ones. Only V and the output are projected.

    - ``factorized_rank > 0``: ``W_h = R1_h @ R2_h`` with ``R1 [H, max_len, r]``, ``R2 [H, r, max_len]``
      (Synthesizer's factorised random variant; ``2 r max_len`` instead of ``max_len²`` parameters per head).
    - ``mix_dot_product``: logits ``α_h W_h + (1 - α_h) Q Kᵀ/sqrt(D)`` with a learned per-head mixing weight
      ``α_h = sigmoid(a_h)``, ``a_h`` initialised to 0 (an even mix); adds Q/K projections (Synthesizer's
      "Random + Dot Product" mixture, whose weights are trainable and sum to one).
    - ``causal``: the future is masked (index-based, so packed and cached decoding agree).

    A sequence longer than ``max_len`` or positions outside ``[0, max_len)`` raise ``ValueError`` (positions
    can only be checked when concrete, i.e. outside jit). Decode cache: ``cached_value [B, L, H, D]``,
    ``cached_positions [B, L]``, ``cached_segment_ids [B, L]``, ``cache_index []`` (+ ``cached_key`` when
    ``mix_dot_product``); ``L <= max_len`` is enforced when the cache is created.
    """

    max_len: int = 512
    factorized_rank: int = 0  # 0 = a full [max_len, max_len] table per head
    mix_dot_product: bool = False

    @nn.compact
    def __call__(self, x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False):
        B, T, C, H, D = self._dims(x_BTC)
        check_max_len(self.max_len, T)
        if self.factorized_rank < 0:
            raise ValueError(f"factorized_rank must be >= 0 (0 = full table), got {self.factorized_rank}")
        seg_BT, pos_BT = segments_and_positions(x_BTC, segment_ids, positions)
        x = x_BTC.astype(self.dtype)
        new = {"value": dense(H * D, "value", self)(x).reshape(B, T, H, D), "segment_ids": seg_BT}
        if self.mix_dot_product:
            q_BTHD = dense(H * D, "query", self)(x).reshape(B, T, H, D)
            new["key"] = dense(H * D, "key", self)(x).reshape(B, T, H, D)
        if decode:
            pos_BT = decode_positions(self, pos_BT, positions is None)
        kv, mask = attention_context(self, {**new, "positions": pos_BT}, decode)
        check_positions(pos_BT, self.max_len)
        L, r = self.max_len, self.factorized_rank
        if r:
            init = nn.initializers.normal(stddev=(0.01 / r) ** 0.25)  # entries of R1 @ R2 have std 0.1
            r1_HLR = self.param("r1", init, (H, L, r), self.param_dtype)
            r2_HRL = self.param("r2", init, (H, r, L), self.param_dtype)
            logits_BHTS = factorized_fixed_logits(r1_HLR, r2_HRL, pos_BT, kv["positions"])
        else:
            w_HLL = self.param("logits", nn.initializers.normal(stddev=0.1), (H, L, L), self.param_dtype)
            logits_BHTS = fixed_logits(w_HLL, pos_BT, kv["positions"])
        if self.mix_dot_product:
            alpha_H = jax.nn.sigmoid(self.param("mix_logit", nn.initializers.zeros, (H,), self.param_dtype))
            alpha = alpha_H.astype(jnp.float32)[None, :, None, None]
            logits_BHTS = alpha * logits_BHTS + (1 - alpha) * dot_product_logits(q_BTHD, kv["key"])
        out_BTHD = attend(logits_BHTS, kv["value"], mask, dropout_rate=self.attention_dropout,
                          dropout_rng=dropout_rng(self, self.attention_dropout, deterministic), dtype=self.dtype)
        return dense(C, "out", self)(out_BTHD.reshape(B, T, H * D)).astype(x_BTC.dtype)


class HadamardAttention(AttentionFields):
    """Hadamard attention (registry name ``"hadamard"``): ``Out(softmax(W_h ⊙ Q Kᵀ/sqrt(D) + mask) V)``.

    ``W_h[pos_q, pos_k]`` is a learned per-head ``[max_len, max_len]`` table (initialised to ones, so training
    starts from plain dot-product attention) multiplied element-wise with the content logits; the mask is added
    AFTER the product, so a learned weight can never un-mask a key.

    - ``project_qk=False`` (the source's form): Q = K = the input itself, split into ``num_heads`` contiguous
      heads of size ``C / num_heads``; only V and the output are projected. Positional structure then lives
      entirely in ``W``.
    - ``project_qk=True``: Q and K are learned projections of width ``qkv_features`` as in ``SelfAttention``.

    Decode cache: ``cached_key``, ``cached_value [B, L, H, D]``, ``cached_positions [B, L]``,
    ``cached_segment_ids [B, L]``, ``cache_index []``; ``L <= max_len``.
    """

    max_len: int = 512
    project_qk: bool = False

    @nn.compact
    def __call__(self, x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False):
        B, T, C, H, D = self._dims(x_BTC)
        if not self.project_qk and C % H:
            raise ValueError(f"num_heads={H} must divide the input width C={C} (Q = K = the input heads when "
                             "project_qk=False)")
        check_max_len(self.max_len, T)
        seg_BT, pos_BT = segments_and_positions(x_BTC, segment_ids, positions)
        x = x_BTC.astype(self.dtype)
        if self.project_qk:
            q_BTHD = dense(H * D, "query", self)(x).reshape(B, T, H, D)
            k_BSHD = dense(H * D, "key", self)(x).reshape(B, T, H, D)
        else:
            q_BTHD = k_BSHD = x.reshape(B, T, H, C // H)
        new = {"key": k_BSHD, "value": dense(H * D, "value", self)(x).reshape(B, T, H, D), "segment_ids": seg_BT}
        if decode:
            pos_BT = decode_positions(self, pos_BT, positions is None)
        kv, mask = attention_context(self, {**new, "positions": pos_BT}, decode)
        check_positions(pos_BT, self.max_len)
        w_HLL = self.param("weight", nn.initializers.ones, (H, self.max_len, self.max_len), self.param_dtype)
        logits_BHTS = fixed_logits(w_HLL, pos_BT, kv["positions"]) * dot_product_logits(q_BTHD, kv["key"])
        out_BTHD = attend(logits_BHTS, kv["value"], mask, dropout_rate=self.attention_dropout,
                          dropout_rng=dropout_rng(self, self.attention_dropout, deterministic), dtype=self.dtype)
        return dense(C, "out", self)(out_BTHD.reshape(B, T, H * D)).astype(x_BTC.dtype)


# ----------------------------------------------------------------------------------------------------------
# Module helpers (shared with lconv.colt5 and lconv.memory)
# ----------------------------------------------------------------------------------------------------------


def dense(features: int, name: str, mdl: nn.Module, use_bias: bool | None = None) -> nn.Dense:
    """A fairseq-style projection: xavier-uniform kernel, zero bias, the module's dtypes."""
    return nn.Dense(features, use_bias=getattr(mdl, "use_bias", True) if use_bias is None else use_bias,
                    kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.zeros,
                    dtype=mdl.dtype, param_dtype=mdl.param_dtype, name=name)


def dropout_rng(mdl: nn.Module, rate: float, deterministic: bool) -> Array | None:
    return None if deterministic or rate == 0.0 else mdl.make_rng("dropout")


def decode_cache_update(mdl: nn.Module, new: dict[str, Array]) -> tuple[dict[str, Array] | None, Array | None]:
    """Writes a chunk into the ``'cache'`` collection; returns ``(full cached arrays, chunk start index)``.

    ``new`` maps names to ``[B, T, ...]`` chunks, stored as ``cached_<name>``. On the first call (no cache yet)
    the variables are created zeroed with the chunk's shape (the max length) and ``(None, None)`` is returned:
    the caller then does its ordinary full pass. Later calls write at ``cache_index`` and advance it by ``T``.
    """
    initialized = mdl.has_variable("cache", "cache_index")
    cached = {n: mdl.variable("cache", "cached_" + n, jnp.zeros, a.shape, a.dtype) for n, a in new.items()}
    cache_index = mdl.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:
        return None, None
    i = cache_index.value
    for n, a in new.items():
        cached[n].value = lax.dynamic_update_slice(cached[n].value, a.astype(cached[n].value.dtype),
                                                   (0, i) + (0,) * (a.ndim - 2))
    cache_index.value = i + next(iter(new.values())).shape[1]
    return {n: v.value for n, v in cached.items()}, i


def attention_context(mdl: nn.Module, new: dict[str, Array], decode: bool) -> tuple[dict[str, Array], Array]:
    """What a chunk attends to: ``(arrays, mask [B, 1, T, S])`` for a self-attention-like mixer.

    ``new`` holds this chunk's ``[B, T, ...]`` key-side arrays and its ``segment_ids``. In a full pass (and
    on the cache-creating call) that is ``new`` itself under the segment mask, causal if ``mdl.causal``;
    while decoding it is the whole cache after ``new`` is written into it (``decode_cache_update``), under
    the mask of the chunk's queries against every cached position up to their own.
    """
    seg_BT = new["segment_ids"]
    mask_B1TS = attention_mask(seg_BT, seg_BT, causal=mdl.causal)
    if not decode:
        return new, mask_B1TS
    check_decode(mdl.causal, type(mdl).__name__)
    cache, index = decode_cache_update(mdl, new)
    if cache is None:
        return new, mask_B1TS
    return cache, decode_mask(seg_BT, cache["segment_ids"], index)


def decode_positions(mdl: nn.Module, pos_BT, default: bool):
    """While decoding, default positions continue from the cache: ``cache_index + arange(T)``."""
    if default and mdl.has_variable("cache", "cache_index"):
        return mdl.get_variable("cache", "cache_index") + pos_BT
    return pos_BT


def check_input(x_BTC, name: str = "x_BTC") -> tuple[int, int, int]:
    if x_BTC.ndim != 3:
        raise ValueError(f"{name} must be [batch, time, features], got shape {x_BTC.shape}")
    return x_BTC.shape


def head_dims(num_heads: int, qkv_features: int | None, C: int) -> tuple[int, int]:
    """``(H, D)``: ``num_heads`` heads of ``D = width / H`` over ``qkv_features`` (None = the input width C)."""
    if num_heads <= 0:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    width = qkv_features or C
    if width <= 0 or width % num_heads:
        what = f"qkv_features={qkv_features}" if qkv_features else f"the input width C={C} (qkv_features unset)"
        raise ValueError(f"{what} must be a positive multiple of num_heads={num_heads}")
    return num_heads, width // num_heads


def check_dropout(rate: float, field: str = "attention_dropout") -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{field} must be in [0, 1), got {rate}")


def check_decode(causal: bool, mixer: str) -> None:
    if not causal:
        raise ValueError(f"{mixer}: decode=True needs causal=True (a non-causal mixer cannot decode)")


def check_max_len(max_len: int, T: int) -> None:
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if T > max_len:
        raise ValueError(f"sequence length {T} exceeds max_len={max_len}; raise max_len in the config")


def check_positions(pos_BT, max_len: int) -> None:
    """Positions outside ``[0, max_len)`` are an error when they are concrete (under jit they cannot be seen)."""
    try:
        p = np.asarray(pos_BT)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if p.size and (p.min() < 0 or p.max() >= max_len):
        raise ValueError(f"positions must lie in [0, max_len={max_len}), got [{p.min()}, {p.max()}]; "
                         "raise max_len")


def segments_and_positions(x_BTC, segment_ids, positions, seg_name: str = "segment_ids"):
    """Defaults: one segment everywhere (ids 1), positions ``arange(T)``; checks both are ``[B, T]``."""
    B, T = x_BTC.shape[:2]
    if segment_ids is None:
        segment_ids = jnp.ones((B, T), jnp.int32)
    elif segment_ids.shape != (B, T):
        raise ValueError(f"{seg_name} must be [batch, time] = {(B, T)}, got {segment_ids.shape}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    elif positions.shape != (B, T):
        raise ValueError(f"positions must be [batch, time] = {(B, T)}, got {positions.shape}")
    return jnp.asarray(segment_ids, jnp.int32), jnp.asarray(positions, jnp.int32)


def decode_mask(seg_BT, cached_seg_BL, index) -> Array:
    """Mask of a decoded chunk (queries at ``index + t``) against the whole cache, causal by index."""
    T, L = seg_BT.shape[1], cached_seg_BL.shape[1]
    return attention_mask(seg_BT, cached_seg_BL, index + jnp.arange(T), jnp.arange(L), causal=True)


# ----------------------------------------------------------------------------------------------------------
# Pure math
# ----------------------------------------------------------------------------------------------------------


def attention_mask(q_seg_BT, k_seg_BS, q_idx_T=None, k_idx_S=None, *, causal=False, radius=None) -> Array:
    """Boolean ``[B, 1, T, S]``: same non-zero segment; if ``causal`` key index <= query index; if ``radius``
    is given, ``|key index - query index| <= radius`` (local attention)."""
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


def dot_product_logits(q_BTHD, k_BSHD) -> Array:
    """``Q Kᵀ / sqrt(D)`` accumulated and returned in float32, ``[B, H, T, S]``."""
    logits_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BSHD, preferred_element_type=jnp.float32)
    return logits_BHTS / math.sqrt(q_BTHD.shape[-1])


def attend(logits_BHTS, v_BSHD, mask_BHTS, *, dropout_rate=0.0, dropout_rng=None, dtype=None) -> Array:
    """``softmax(logits + mask) V`` in float32; queries with no visible key (padding) get zeros.

    ``mask_BHTS`` is boolean and broadcasts against the logits (``[B, 1, T, S]`` is usual). Dropout on the
    probabilities (scaled by ``1/(1-rate)``) when ``dropout_rng`` is given. Returns ``[B, T, H, D]`` in ``dtype``
    (default ``v``'s).
    """
    logits = jnp.where(mask_BHTS, logits_BHTS.astype(jnp.float32), NEG_INF)
    probs_BHTS = jnp.where(mask_BHTS, jax.nn.softmax(logits, axis=-1), 0.0)
    if dropout_rng is not None and dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BHTS.shape)
        probs_BHTS = jnp.where(keep, probs_BHTS / (1.0 - dropout_rate), 0.0)
    out_BTHD = jnp.einsum("bhts,bshd->bthd", probs_BHTS.astype(v_BSHD.dtype), v_BSHD,
                          preferred_element_type=jnp.float32)
    return out_BTHD.astype(dtype or v_BSHD.dtype)


def dot_product_attention(q_BTHD, k_BSHD, v_BSHD, mask_BHTS, *, bias_BHTS=None, dropout_rate=0.0,
                          dropout_rng=None, dtype=None) -> Array:
    """Masked scaled dot-product attention, ``[B, T, H, D]``; ``bias_BHTS`` is added to the logits."""
    logits_BHTS = dot_product_logits(q_BTHD, k_BSHD)
    if bias_BHTS is not None:
        logits_BHTS = logits_BHTS + bias_BHTS
    return attend(logits_BHTS, v_BSHD, mask_BHTS, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                  dtype=dtype)


def fixed_logits(w_HLL, q_pos_BT, k_pos_BS) -> Array:
    """Gathers ``W[h, q_pos[b, t], k_pos[b, s]]`` into float32 ``[B, H, T, S]``."""
    rows_BHTL = jnp.transpose(w_HLL[:, q_pos_BT, :], (1, 0, 2, 3)).astype(jnp.float32)  # [B, H, T, L]
    B, H, T, _ = rows_BHTL.shape
    idx_BHTS = jnp.broadcast_to(k_pos_BS[:, None, None, :], (B, H, T, k_pos_BS.shape[1]))
    return jnp.take_along_axis(rows_BHTL, idx_BHTS, axis=-1)


def factorized_fixed_logits(r1_HLR, r2_HRL, q_pos_BT, k_pos_BS) -> Array:
    """``(R1 @ R2)[h, q_pos, k_pos]`` without forming the ``[L, L]`` table, float32 ``[B, H, T, S]``."""
    a_HBTR = r1_HLR[:, q_pos_BT, :].astype(jnp.float32)  # [H, B, T, r]
    b_HRBS = r2_HRL[:, :, k_pos_BS].astype(jnp.float32)  # [H, r, B, S]
    return jnp.einsum("hbtr,hrbs->bhts", a_HBTR, b_HRBS)
