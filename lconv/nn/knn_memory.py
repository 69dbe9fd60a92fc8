"""Memorizing Transformer kNN-memory attention (Wu et al. 2022, "Memorizing Transformers").

A document is fed window by window. Each layer attends locally (causal, inside the window) and over the
top-``num_neighbors`` (key, value) pairs retrieved by exact inner product from a FIFO memory of the document's past
windows, gated per head: ``y = Out(g_h · mem + (1 - g_h) · local)``. The memory is the mixer's carried state (the
``'memory'`` collection, ``lconv.nn.mixer_state``); its layout, reset and packing rules: docs/models.md, "The mixers in
detail".
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from lconv.constants import HEADS, MASKED_LOGIT
from lconv.errors import UserError
from lconv.nn import mixers
from lconv.nn.attention import AttentionFields
from lconv.nn.common import (
    FROM_HEADS,
    attention_context,
    dense,
    dropout_rng,
    project_heads,
    segments_and_positions,
)
from lconv.ops.attention import attend
from lconv.ops.top_k import rowwise_top_k

Array = jax.Array
DType = Any
PyTree = Any


class KNNMemoryAttention(AttentionFields):
    """Local attention + top-k retrieval from a FIFO memory of past windows (registry ``"knn_memory"``); ``memory_size``
    entries per row, ``num_neighbors`` retrieved per query and head."""

    # Decoder only: the memory is carried across a document's windows, which only a decoder-only LM reads.
    sides: ClassVar[tuple[str, ...]] = ("decoder",)
    side_reason: ClassVar[str] = "its memory is carried across the windows of a decoder's document stream"
    label: ClassVar[str] = "kNN memory"
    variant: ClassVar[str] = "knn"
    example_fields: ClassVar[dict[str, Any]] = {"memory_size": 8, "num_neighbors": 2}
    state: ClassVar[tuple[str, ...]] = ("memory",)  # past windows' keys and values, threaded by the caller
    reset_state = staticmethod(mixers.zero_rows)  # at a document start the row's memory empties (init's zeros)
    layout: ClassVar[tuple[int, ...]] = (-2,)  # the paper's layout: one kNN layer, second to last ...
    layout_others: ClassVar[str] = "attention"  # ... among local-attention layers

    causal: bool = True  # the Memorizing Transformer is a decoder; False gives bidirectional local attention
    memory_size: int = 1024
    num_neighbors: int = 32

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, positions: Array | None = None,
                 deterministic: bool = True, decode: bool = False) -> Array:
        B, T, C, H, D = self._dims(x_BTC)
        if self.memory_size < 1:
            raise UserError(f"memory_size must be >= 1, got {self.memory_size}")
        if not 1 <= self.num_neighbors <= self.memory_size:
            raise UserError(f"num_neighbors must be in [1, memory_size={self.memory_size}], got {self.num_neighbors}")
        seg_BT, _ = segments_and_positions(x_BTC, segment_ids, positions)
        x = x_BTC.astype(self.dtype)
        q_BTHD = l2_normalize(project_heads(self, "query", x, H, D))
        k_BTHD = l2_normalize(project_heads(self, "key", x, H, D)).astype(self.dtype)
        v_BTHD = project_heads(self, "value", x, H, D)
        log_scale_H = self.param("log_scale", per_head(nn.initializers.constant(math.log(math.sqrt(D)))), (H,),
                                 self.param_dtype)
        q_BTHD = (q_BTHD * jnp.exp(log_scale_H.astype(jnp.float32))[:, None]).astype(self.dtype)  # τ_h q̂

        kv, mask = attention_context(self, {"key": k_BTHD, "value": v_BTHD, "segment_ids": seg_BT}, decode)
        precision = self._precision()  # matmul_precision: projections and attention; retrieval is always HIGHEST
        logits_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, kv["key"], precision=precision,
                                 preferred_element_type=jnp.float32)
        local_BTHD = attend(logits_BHTS, kv["value"], mask, dropout_rate=self.attention_dropout,
                            dropout_rng=dropout_rng(self, self.attention_dropout, deterministic),
                            dtype=jnp.float32, precision=precision)

        gate_H = jax.nn.sigmoid(self.param("gate", per_head(nn.initializers.zeros), (H,), self.param_dtype))
        out_BTHD = local_BTHD
        if self.has_variable("memory", "keys") or self.is_mutable_collection("memory"):
            out_BTHD = self._read_then_write(q_BTHD, k_BTHD, v_BTHD, local_BTHD, gate_H, seg_BT, decode, precision)
        out_BTC = dense(C, "out", self, FROM_HEADS)(out_BTHD.astype(self.dtype).reshape(B, T, H * D))
        return out_BTC.astype(x_BTC.dtype)

    def _read_then_write(self, q_BTHD: Array, k_BTHD: Array, v_BTHD: Array, local_BTHD: Array, gate_H: Array,
                         seg_BT: Array, decode: bool, precision: jax.lax.Precision) -> Array:
        """Mixes retrieval from the memory into the local result; appends this window when it may write."""
        B, M, (H, D) = q_BTHD.shape[0], self.memory_size, q_BTHD.shape[2:]
        mem_k = self.variable("memory", "keys", jnp.zeros, (B, M, H, D), self.dtype)
        mem_v = self.variable("memory", "values", jnp.zeros, (B, M, H, D), self.dtype)
        mem_valid = self.variable("memory", "valid", jnp.zeros, (B, M), bool)
        if mem_k.value.shape != (B, M, H, D):
            raise UserError(f"memory/keys has shape {mem_k.value.shape} but this call needs {(B, M, H, D)}; "
                             "memory_size and the batch size must match the init call")
        first_B1 = jnp.where(seg_BT > 0, seg_BT, jnp.iinfo(jnp.int32).max).min(-1, keepdims=True)
        last_B1 = seg_BT.max(-1, keepdims=True)
        read_BT = (seg_BT == first_B1) & (seg_BT > 0)
        mem_BTHD, found_BTH = memory_attention(q_BTHD, jax.lax.stop_gradient(mem_k.value),
                                               jax.lax.stop_gradient(mem_v.value), mem_valid.value,
                                               self.num_neighbors, precision=precision)
        found_BTH &= read_BT[:, :, None]
        g = gate_H.astype(jnp.float32)[:, None]
        out_BTHD = jnp.where(found_BTH[..., None], g * mem_BTHD + (1 - g) * local_BTHD, local_BTHD)

        if self.is_mutable_collection("memory") and not decode and not self.is_initializing():
            write_BT = (seg_BT == last_B1) & (seg_BT > 0)
            keep_B1 = (last_B1 == first_B1) | (last_B1 == 0)  # an all-padding window keeps the memory
            mem_k.value, mem_v.value, mem_valid.value = fifo_append(
                mem_k.value, mem_v.value, mem_valid.value & keep_B1, jax.lax.stop_gradient(k_BTHD),
                jax.lax.stop_gradient(v_BTHD), write_BT)
        return out_BTHD


def per_head(init: nn.initializers.Initializer) -> nn.initializers.Initializer:
    """An ``[H]`` parameter's initializer, named by ``HEADS``."""
    return nn.with_logical_partitioning(init, (HEADS,))


def reset_memory(memory: PyTree, reset_B: ArrayLike) -> PyTree:
    """Empties rows ``reset_B`` (bool ``[B]``) of every kNN layer in a ``'memory'`` collection."""
    return mixers.zero_rows(memory, reset_B)


# Pure math


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """``x / |x|`` over the last axis, computed in float32, returned in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def retrieve_top_k(q_BTHD: Array, keys_BMHD: Array, valid_BM: Array, k: int) -> tuple[Array, Array]:
    """Exact top-k entries per query and head, ``(scores, indices) [B, H, T, k]``, invalid slots last."""
    scores_BHTM = jnp.einsum("bthd,bmhd->bhtm", q_BTHD, keys_BMHD, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    scores_BHTM = jnp.where(valid_BM[:, None, None, :], scores_BHTM, MASKED_LOGIT)
    return rowwise_top_k(scores_BHTM, k)


def memory_attention(q_BTHD: Array, keys_BMHD: Array, values_BMHD: Array, valid_BM: Array, k: int, *,
                     precision: jax.lax.Precision | None = None) -> tuple[Array, Array]:
    """Softmax attention of each query over its ``k`` retrieved entries, float32: ``(out [B, T, H, D], found [B, T,
    H])``, ``out`` 0 where nothing valid was retrieved."""
    scores_BHTJ, idx_BHTJ = retrieve_top_k(q_BTHD, keys_BMHD, valid_BM, k)
    ok_BHTJ = scores_BHTJ > MASKED_LOGIT / 2
    probs_BHTJ = jnp.where(ok_BHTJ, jax.nn.softmax(scores_BHTJ, axis=-1), 0.0)
    v_BH1MD = jnp.transpose(values_BMHD, (0, 2, 1, 3))[:, :, None].astype(jnp.float32)
    v_BHTJD = jnp.take_along_axis(v_BH1MD, idx_BHTJ[..., None], axis=3)
    out_BHTD = jnp.einsum("bhtj,bhtjd->bhtd", probs_BHTJ, v_BHTJD, precision=precision)
    return jnp.transpose(out_BHTD, (0, 2, 1, 3)), jnp.transpose(ok_BHTJ.any(-1), (0, 2, 1))


def fifo_append(keys_BMHD: Array, values_BMHD: Array, valid_BM: Array, new_k_BTHD: Array, new_v_BTHD: Array,
                new_valid_BT: Array) -> tuple[Array, Array, Array]:
    """Appends the valid new entries after the valid old ones, keeping the newest ``M`` in time order."""
    M = keys_BMHD.shape[1]
    k = jnp.concatenate([keys_BMHD, new_k_BTHD.astype(keys_BMHD.dtype)], axis=1)  # [B, M + T, H, D]
    v = jnp.concatenate([values_BMHD, new_v_BTHD.astype(values_BMHD.dtype)], axis=1)
    valid = jnp.concatenate([valid_BM, new_valid_BT], axis=1)  # [B, M + T]
    keep_BM = jnp.argsort(valid, axis=1, stable=True)[:, -M:]
    take = lambda a: jnp.take_along_axis(a, keep_BM.reshape(keep_BM.shape + (1,) * (a.ndim - 2)), axis=1)
    k, v, valid = take(k), take(v), take(valid)
    return jnp.where(valid[:, :, None, None], k, 0), jnp.where(valid[:, :, None, None], v, 0), valid
