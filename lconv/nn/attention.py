"""Attention-family token mixers: dot-product self-attention, cross-attention, Fixed and Hadamard attention. All reduce
to ``softmax(logits_BHTS + mask) V``; only the logits differ. ``attention_impl`` picks the kernel (``lconv.ops.flash``).
docs/models.md has each one's math."""
from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv.constants import ACT_HEADS, HEADS, KEY_LENGTH, LENGTH
from lconv.errors import UserError
from lconv.nn.common import (
    BHDT,
    BHTD,
    BTHD,
    FROM_HEADS,
    QKV_GAIN,
    Array,
    DType,
    attention_context,
    check_dropout,
    check_input,
    check_max_len,
    check_positions,
    constrain,
    decode_positions,
    dense,
    dropout_rng,
    head_dims,
    project_heads,
    segments_and_positions,
)
from lconv.ops.attention import (
    attend,
    attention_mask,
    dot_product_attention,
    dot_product_logits,
    factorized_fixed_logits,
    fixed_logits,
    head_major_attention,
)
from lconv.ops.flash import check_impl, segment_attention
from lconv.ops.precision import lax_precision

# Modules


class AttentionFields(nn.Module):
    """The fields every attention-family token mixer shares (``lconv.nn.knn_memory`` too), and their validation."""

    # Mixer metadata (lconv.nn.mixers): the fields a model layer fills from its config, and where it may sit.
    model_fields: ClassVar[dict[str, str]] = {
        "num_heads": "num_heads", "causal": "causal", "dtype": "dtype", "attention_dropout": "attention_dropout",
        "matmul_precision": "matmul_precision"}
    sides: ClassVar[tuple[str, ...]] = ("encoder", "decoder")

    num_heads: int = 8
    causal: bool = False
    dtype: DType = jnp.float32  # computation dtype; logits, softmax and accumulation stay float32
    param_dtype: DType = jnp.float32
    qkv_features: int | None = None  # total Q/K/V width; None = the input width C
    attention_dropout: float = 0.0  # on the attention probabilities, training only
    use_bias: bool = True  # in the Q/K/V/output projections
    matmul_precision: str = "default"  # projections and attention dots: default | high | highest

    def _dims(self, x_BTC: Array) -> tuple[int, int, int, int, int]:
        """``(B, T, C, H, D)`` of a ``[B, T, C]`` input; bad shapes and fields are one-line errors."""
        B, T, C = check_input(x_BTC)
        H, D = head_dims(self.num_heads, self.qkv_features, C)
        check_dropout(self.attention_dropout)
        lax_precision(self.matmul_precision)  # a bad name fails here, before any projection
        return B, T, C, H, D

    def _precision(self) -> Any:
        return lax_precision(self.matmul_precision)

    def _attend_out(self, logits_BHTS: Array, kv: dict[str, Array], mask: Array, x_BTC: Array, det: bool) -> Array:
        """``Out(softmax(logits + mask) V)``, back to ``x``'s width and dtype."""
        B, T, C = x_BTC.shape
        out_BTHD = attend(logits_BHTS, kv["value"], mask, dropout_rate=self.attention_dropout,
                          dropout_rng=dropout_rng(self, self.attention_dropout, det), dtype=self.dtype,
                          precision=self._precision())
        return dense(C, "out", self, FROM_HEADS)(out_BTHD.reshape(B, T, -1)).astype(x_BTC.dtype)


class SelfAttention(AttentionFields):
    """Multi-head scaled dot-product self-attention (registry ``"attention"``), initialised as fairseq's."""

    model_fields: ClassVar[dict[str, str]] = {**AttentionFields.model_fields, "attention_impl": "attention_impl"}
    label: ClassVar[str] = "Transformer"  # the model every layer of which uses it
    variant: ClassVar[str] = "transformer"
    attention_impl: str = "auto"  # auto | xla | chunked | cudnn

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, positions: Array | None = None,
                 deterministic: bool = True, decode: bool = False) -> Array:
        B, T, C, H, D = self._dims(x_BTC)
        check_impl(self.attention_impl)
        seg_BT, _ = segments_and_positions(x_BTC, segment_ids, positions)
        x = x_BTC.astype(self.dtype)
        q_BTHD, k_BSHD, v_BSHD = (project_heads(self, n, x, H, D) for n in ("query", "key", "value"))
        cached = decode and self.has_variable("cache", "cache_index")  # a step against a filled cache
        kv, mask_B1TS = attention_context(self, {"key": k_BSHD, "value": v_BSHD, "segment_ids": seg_BT}, decode)
        kw = dict(dropout_rate=self.attention_dropout, dtype=self.dtype, precision=self._precision(),
                  dropout_rng=dropout_rng(self, self.attention_dropout, deterministic))
        if cached:
            out_BTHD = dot_product_attention(q_BTHD, kv["key"], kv["value"], mask_B1TS, **kw)
        else:  # no segment ids = one segment per row: cuDNN then needs no mask at all
            seg = None if segment_ids is None else seg_BT
            out_BTHD = segment_attention(q_BTHD, k_BSHD, v_BSHD, seg, seg, causal=self.causal,
                                         impl=self.attention_impl, **kw)
        out_BTHD = constrain(out_BTHD, BTHD)
        return dense(C, "out", self, FROM_HEADS)(out_BTHD.reshape(B, T, H * D)).astype(x_BTC.dtype)


class CrossAttention(AttentionFields):
    """Encoder-decoder attention (not a token mixer, so ``causal`` is unused): ``SelfAttention``'s math over
    ``encoded_BSC``. While decoding, the projected encoder keys and values are computed once and kept as
    ``beam_invariant_*`` cache entries."""

    attention_impl: str = "auto"  # auto | xla | chunked | cudnn

    @nn.compact
    def __call__(self, x_BTC: Array, encoded_BSC: Array, *, query_segment_ids: Array | None = None,
                 encoded_segment_ids: Array | None = None, deterministic: bool = True, decode: bool = False) -> Array:
        B, T, C, H, D = self._dims(x_BTC)
        check_input(encoded_BSC, "encoded_BSC")
        if encoded_BSC.shape[0] != B:
            raise UserError(f"encoded_BSC batch {encoded_BSC.shape[0]} != x_BTC batch {B}")
        check_impl(self.attention_impl)
        precision = self._precision()
        q_seg_BT, _ = segments_and_positions(x_BTC, query_segment_ids, None, "query_segment_ids")
        k_seg_BS, _ = segments_and_positions(encoded_BSC, encoded_segment_ids, None, "encoded_segment_ids")
        # fairseq scales the Q/K/V init by QKV_GAIN only when keys and values have the queries' width.
        gain = QKV_GAIN if encoded_BSC.shape[-1] == C else 1.0
        q_BTHD = project_heads(self, "query", x_BTC.astype(self.dtype), H, D, gain)
        if decode and self.has_variable("cache", "beam_invariant_key"):
            out_BTHD = self._attend_cached(q_BTHD, q_seg_BT, precision)
        else:
            m = encoded_BSC.astype(self.dtype)
            k_BSHD, v_BSHD = project_heads(self, "key", m, H, D, gain), project_heads(self, "value", m, H, D, gain)
            if decode:  # head-major: the layout every step's dots read (``head_major_attention``)
                self.put_variable("cache", "beam_invariant_key", constrain(k_BSHD.transpose(0, 2, 3, 1), BHDT))
                self.put_variable("cache", "beam_invariant_value", constrain(v_BSHD.transpose(0, 2, 1, 3), BHTD))
                self.put_variable("cache", "beam_invariant_segment_ids", k_seg_BS)
            segmented = query_segment_ids is not None or encoded_segment_ids is not None
            out_BTHD = segment_attention(
                q_BTHD, k_BSHD, v_BSHD, q_seg_BT if segmented else None, k_seg_BS if segmented else None,
                impl=self.attention_impl, dropout_rate=self.attention_dropout, dtype=self.dtype, precision=precision,
                dropout_rng=dropout_rng(self, self.attention_dropout, deterministic))
        return dense(C, "out", self, FROM_HEADS)(out_BTHD.reshape(B, T, H * D)).astype(x_BTC.dtype)

    def _attend_cached(self, q_BTHD: Array, q_seg_BT: Array, precision: Any) -> Array:
        """Queries of ``B = N * b`` rows (beams folded into the query axis) against the cached encoder keys/values."""
        k_bHDS = self.get_variable("cache", "beam_invariant_key")
        v_bHSD = self.get_variable("cache", "beam_invariant_value")
        k_seg_bS = self.get_variable("cache", "beam_invariant_segment_ids")
        (B, T, H, D), b = q_BTHD.shape, k_bHDS.shape[0]
        if B % b:
            raise UserError(f"x_BTC batch {B} is not a multiple of the cached encoder-output batch {b}")
        q_bHQD = q_BTHD.reshape(b, (B // b) * T, H, D).transpose(0, 2, 1, 3)  # Q = beams * T
        mask_b1QS = attention_mask(q_seg_BT.reshape(b, -1), k_seg_bS)
        out_bHQD = head_major_attention(q_bHQD, k_bHDS, v_bHSD, mask_b1QS, dtype=self.dtype, precision=precision)
        return out_bHQD.transpose(0, 2, 1, 3).reshape(B, T, H, D)


class FixedAttention(AttentionFields):
    """Synthesizer-Random attention (registry ``"fixed"``): ``Out(softmax(W_h[pos_q, pos_k] + mask) V)``, ``W_h`` a
    learned ``[max_len, max_len]`` table per head (docs/models.md)."""

    model_fields: ClassVar[dict[str, str]] = {**AttentionFields.model_fields, "max_len": "max_len"}
    label: ClassVar[str] = "Fixed (Synthesizer-R)"
    example_fields: ClassVar[dict[str, Any]] = {"max_len": 16}

    max_len: int = 512
    factorized_rank: int = 0  # 0 = a full [max_len, max_len] table per head
    mix_dot_product: bool = False

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, positions: Array | None = None,
                 deterministic: bool = True, decode: bool = False) -> Array:
        B, T, C, H, D = self._dims(x_BTC)
        check_max_len(self.max_len, T)
        if self.factorized_rank < 0:
            raise UserError(f"factorized_rank must be >= 0 (0 = full table), got {self.factorized_rank}")
        seg_BT, pos_BT = segments_and_positions(x_BTC, segment_ids, positions)
        x = x_BTC.astype(self.dtype)
        new = {"value": project_heads(self, "value", x, H, D), "segment_ids": seg_BT}
        if self.mix_dot_product:
            q_BTHD = project_heads(self, "query", x, H, D)
            new["key"] = project_heads(self, "key", x, H, D)
        if decode:
            pos_BT = decode_positions(self, pos_BT, positions is None)
        kv, mask = attention_context(self, {**new, "positions": pos_BT}, decode)
        check_positions(pos_BT, self.max_len)
        L, r = self.max_len, self.factorized_rank
        if r:
            init = nn.initializers.normal(stddev=(0.01 / r) ** 0.25)  # entries of R1 @ R2 have std 0.1
            r1_HLF = self.param("r1", _named(init, (HEADS, LENGTH, None)), (H, L, r), self.param_dtype)
            r2_HFL = self.param("r2", _named(init, (HEADS, None, KEY_LENGTH)), (H, r, L), self.param_dtype)
            logits_BHTS = factorized_fixed_logits(_gathered(r1_HLF), _gathered(r2_HFL), pos_BT, kv["positions"],
                                                  precision=self._precision())
        else:
            w_HLL = self.param("logits", _named(nn.initializers.normal(stddev=0.1), (HEADS, LENGTH, KEY_LENGTH)),
                               (H, L, L), self.param_dtype)
            logits_BHTS = fixed_logits(_gathered(w_HLL), pos_BT, kv["positions"])
        if self.mix_dot_product:
            alpha_H = jax.nn.sigmoid(self.param("mix_logit", _named(nn.initializers.zeros, (HEADS,)), (H,),
                                                self.param_dtype))
            alpha = alpha_H.astype(jnp.float32)[None, :, None, None]
            content_BHTS = dot_product_logits(q_BTHD, kv["key"], precision=self._precision())
            logits_BHTS = alpha * logits_BHTS + (1 - alpha) * content_BHTS
        return self._attend_out(logits_BHTS, kv, mask, x_BTC, deterministic)


class HadamardAttention(AttentionFields):
    """Hadamard attention (registry ``"hadamard"``): ``Out(softmax(W_h ⊙ Q Kᵀ/sqrt(D) + mask) V)``, ``W_h`` a learned
    table per head, initialised to ones (docs/models.md)."""

    model_fields: ClassVar[dict[str, str]] = {**AttentionFields.model_fields, "max_len": "max_len"}
    label: ClassVar[str] = "Hadamard"
    example_fields: ClassVar[dict[str, Any]] = {"max_len": 16}

    max_len: int = 512
    project_qk: bool = False

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, positions: Array | None = None,
                 deterministic: bool = True, decode: bool = False) -> Array:
        B, T, C, H, D = self._dims(x_BTC)
        if not self.project_qk and C % H:
            raise UserError(f"num_heads={H} must divide the input width C={C} (Q = K = the input heads when "
                             "project_qk=False)")
        check_max_len(self.max_len, T)
        seg_BT, pos_BT = segments_and_positions(x_BTC, segment_ids, positions)
        x = x_BTC.astype(self.dtype)
        if self.project_qk:
            q_BTHD = project_heads(self, "query", x, H, D)
            k_BSHD = project_heads(self, "key", x, H, D)
        else:
            q_BTHD = k_BSHD = x.reshape(B, T, H, C // H)
        v_BSHD = project_heads(self, "value", x, H, D)
        new = {"key": k_BSHD, "value": v_BSHD, "segment_ids": seg_BT}
        if decode:
            pos_BT = decode_positions(self, pos_BT, positions is None)
        kv, mask = attention_context(self, {**new, "positions": pos_BT}, decode)
        check_positions(pos_BT, self.max_len)
        w_HLL = self.param("weight", _named(nn.initializers.ones, (HEADS, LENGTH, KEY_LENGTH)),
                           (H, self.max_len, self.max_len), self.param_dtype)
        content_BHTS = dot_product_logits(q_BTHD, kv["key"], precision=self._precision())
        logits_BHTS = fixed_logits(_gathered(w_HLL), pos_BT, kv["positions"]) * content_BHTS
        return self._attend_out(logits_BHTS, kv, mask, x_BTC, deterministic)


def _named(init: nn.initializers.Initializer, axes: tuple[str | None, ...]) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(init, axes)


def _gathered(table_H__: Array) -> Array:
    """A position table gathered over its positions before it is indexed, heads kept split."""
    return constrain(table_H__, (ACT_HEADS,) + (None,) * (table_H__.ndim - 1))
