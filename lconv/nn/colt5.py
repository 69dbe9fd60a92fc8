"""CoLT5 conditional computation (Ainslie et al. 2023): every token takes a cheap light branch, a learned router sends
the top-k tokens also through a heavy branch, weighted by the token's soft routing score. ``CoLT5Attention`` (registry
``"colt5"``) and ``CoLT5FeedForward``; encoder only (routing ranks future tokens). The formulas: docs/models.md, "The
mixers in detail"."""
from __future__ import annotations

import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv.constants import EMBED, MASKED_LOGIT, MLP
from lconv.errors import UserError
from lconv.nn.common import (
    FROM_HEADS,
    TO_HEADS,
    check_dropout,
    check_input,
    dense,
    dropout_rng,
    head_dims,
    segments_and_positions,
)
from lconv.ops.attention import attention_mask, dot_product_attention
from lconv.ops.precision import lax_precision

Array = jax.Array
DType = Any


class _Routed(nn.Module):
    """What the routed attention and the routed FFN share: dtypes, the routing fields and the routing itself."""

    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    routed_fraction: float = 0.25  # routed capacity R = ceil(routed_fraction * T) ...
    num_routed: int = 0  # ... unless num_routed > 0 (then R = num_routed); capped at T
    router_temperature: float = 0.1  # soft top-k ε
    router_iterations: int = 32  # soft top-k coordinate-descent steps
    use_bias: bool = True
    matmul_precision: str = "default"  # of the projections (lconv.ops.precision); routing scores are HIGHEST

    def _num_routed(self, T: int) -> int:
        if self.num_routed < 0:
            raise UserError(f"num_routed must be >= 0 (0 = use routed_fraction), got {self.num_routed}")
        if self.num_routed == 0 and not 0.0 < self.routed_fraction <= 1.0:
            raise UserError(f"routed_fraction must be in (0, 1], got {self.routed_fraction}")
        if self.router_temperature <= 0:
            raise UserError(f"router_temperature must be positive, got {self.router_temperature}")
        if self.router_iterations < 1:
            raise UserError(f"router_iterations must be >= 1, got {self.router_iterations}")
        R = self.num_routed or math.ceil(self.routed_fraction * T)
        return min(R, T)

    def _route(self, x_BTC: Array, valid_BT: Array, R: int, name: str) -> tuple[Array, Array]:
        """Soft weights ``s_BT`` (float32, Σ = R) and the indices ``[B, R]`` of the hard top-R."""
        init = nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), (EMBED,))
        u_C = self.param(name, init, (x_BTC.shape[-1],), self.param_dtype)
        r_BT = router_scores(x_BTC, u_C)
        w_BT = soft_top_k(r_BT, R, valid_BT, temperature=self.router_temperature,
                          iterations=self.router_iterations)
        return w_BT, top_k_indices(r_BT, valid_BT, R)

    def _weighted_scatter(self, heavy_BRC: Array, w_BT: Array, idx_BR: Array, T: int) -> Array:
        """``s_i · Heavy_i`` placed back at the routed tokens' positions; zeros elsewhere, ``[B, T, C]``."""
        weights_BR1 = gather_tokens(w_BT, idx_BR)[:, :, None].astype(self.dtype)
        return scatter_tokens(heavy_BRC * weights_BR1, idx_BR, T)


class CoLT5Attention(_Routed):
    """CoLT5 routed attention, ``Light(X) + s^q ⊙ Heavy(X)`` (docs/models.md): ``light_num_heads`` local heads (0: half
    of ``num_heads``) within ``local_radius``, ``num_routed`` tokens (0: ``routed_fraction`` of T) routed."""

    # Mixer metadata (lconv.nn.mixers). Encoder only: the routing ranks future tokens too.
    model_fields: ClassVar[dict[str, str]] = {
        "num_heads": "num_heads", "causal": "causal", "dtype": "dtype", "attention_dropout": "attention_dropout",
        "matmul_precision": "matmul_precision"}
    sides: ClassVar[tuple[str, ...]] = ("encoder",)
    side_reason: ClassVar[str] = "its routing ranks future tokens"
    label: ClassVar[str] = "CoLT5"
    # Every token of a short test sequence routed: a capacity below the tokens makes segments compete for it.
    example_fields: ClassVar[dict[str, Any]] = {"local_radius": 2, "num_routed": 64}

    num_heads: int = 8
    causal: bool = False
    light_num_heads: int = 0
    local_radius: int = 16
    attention_dropout: float = 0.0

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, positions: Array | None = None,
                 deterministic: bool = True, decode: bool = False) -> Array:
        if self.causal or decode:
            raise UserError("CoLT5Attention is an encoder mixer: causal=True / decode=True are not supported "
                             "(routing ranks future tokens); use 'attention' or a conv mixer in the decoder")
        B, T, C = check_input(x_BTC)
        H, D = head_dims(self.num_heads, None, C)
        Hl = self.light_num_heads or max(1, H // 2)
        if Hl < 0 or Hl > H:
            raise UserError(f"light_num_heads must be in [0, num_heads={H}], got {self.light_num_heads}")
        if self.local_radius < 0:
            raise UserError(f"local_radius must be >= 0, got {self.local_radius}")
        check_dropout(self.attention_dropout)
        R = self._num_routed(T)
        seg_BT, _ = segments_and_positions(x_BTC, segment_ids, positions)  # positions unused: content routing,
        valid_BT = seg_BT != 0  # and the local window goes by token index
        x = x_BTC.astype(self.dtype)
        rng = dropout_rng(self, self.attention_dropout, deterministic)
        rngs = (None, None) if rng is None else tuple(jax.random.split(rng))

        # Light branch: local attention, every token.
        ql_BTHD, kl_BTHD, vl_BTHD = (dense(Hl * D, f"light_{n}", self, TO_HEADS)(x).reshape(B, T, Hl, D)
                                     for n in ("query", "key", "value"))
        precision = lax_precision(self.matmul_precision)
        light_BTHD = local_attention(ql_BTHD, kl_BTHD, vl_BTHD, seg_BT, self.local_radius,
                                     dropout_rate=self.attention_dropout, dropout_rng=rngs[0], dtype=self.dtype,
                                     precision=precision)
        light_BTC = dense(C, "light_out", self, FROM_HEADS)(light_BTHD.reshape(B, T, Hl * D))

        # Heavy branch: full attention among routed queries over routed keys/values.
        wq_BT, iq_BR = self._route(x, valid_BT, R, "router_q")
        wkv_BT, ikv_BR = self._route(x, valid_BT, R, "router_kv")
        xq_BRC, xkv_BRC = gather_tokens(x, iq_BR), gather_tokens(x, ikv_BR)
        seg_q_BR, seg_kv_BR = gather_tokens(seg_BT, iq_BR), gather_tokens(seg_BT, ikv_BR)
        q_BRHD = dense(H * D, "heavy_query", self, TO_HEADS)(xq_BRC).reshape(B, R, H, D)
        k_BRHD = dense(H * D, "heavy_key", self, TO_HEADS)(xkv_BRC).reshape(B, R, H, D)
        v_BRHD = dense(H * D, "heavy_value", self, TO_HEADS)(xkv_BRC).reshape(B, R, H, D)
        v_BRHD = v_BRHD * gather_tokens(wkv_BT, ikv_BR)[:, :, None, None].astype(self.dtype)
        heavy_BRHD = dot_product_attention(q_BRHD, k_BRHD, v_BRHD, attention_mask(seg_q_BR, seg_kv_BR),
                                           dropout_rate=self.attention_dropout, dropout_rng=rngs[1],
                                           dtype=self.dtype, precision=precision)
        heavy_BRC = dense(C, "heavy_out", self, FROM_HEADS)(heavy_BRHD.reshape(B, R, H * D))
        return (light_BTC + self._weighted_scatter(heavy_BRC, wq_BT, iq_BR, T)).astype(x_BTC.dtype)


class CoLT5FeedForward(_Routed):
    """CoLT5 routed FFN, ``FFN_light(X) + s ⊙ FFN_heavy(X_routed)`` (hidden C/2 and 4C by default), ReLU."""

    # Feed-forward metadata (lconv.nn.mixers.ffn_class); encoder layers only, as the attention.
    model_fields: ClassVar[dict[str, str]] = {"dtype": "dtype", "matmul_precision": "matmul_precision"}
    sides: ClassVar[tuple[str, ...]] = ("encoder",)

    light_hidden_dim: int = 0
    heavy_hidden_dim: int = 0
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, deterministic: bool = True) -> Array:
        B, T, C = check_input(x_BTC)
        hl, hh = self.light_hidden_dim or max(1, C // 2), self.heavy_hidden_dim or 4 * C
        if hl < 0 or hh < 0:
            raise UserError(f"light_hidden_dim / heavy_hidden_dim must be >= 0, got {hl}, {hh}")
        check_dropout(self.dropout_rate, "dropout_rate")
        R = self._num_routed(T)
        seg_BT, _ = segments_and_positions(x_BTC, segment_ids, None)
        x = x_BTC.astype(self.dtype)
        drop = nn.Dropout(self.dropout_rate, deterministic=deterministic)
        light_in, light_out = dense(hl, "light_in", self, (EMBED, MLP)), dense(C, "light_out", self, (MLP, EMBED))
        light_BTC = light_out(drop(jax.nn.relu(light_in(x))))
        w_BT, idx_BR = self._route(x, seg_BT != 0, R, "router")
        xr_BRC = gather_tokens(x, idx_BR)
        heavy_in, heavy_out = dense(hh, "heavy_in", self, (EMBED, MLP)), dense(C, "heavy_out", self, (MLP, EMBED))
        heavy_BRC = heavy_out(drop(jax.nn.relu(heavy_in(xr_BRC))))
        return (light_BTC + self._weighted_scatter(heavy_BRC, w_BT, idx_BR, T)).astype(x_BTC.dtype)


# Pure math


def local_attention(q_BTHD: Array, k_BTHD: Array, v_BTHD: Array, seg_BT: Array, radius: int, *,
                    dropout_rate: float = 0.0, dropout_rng: Array | None = None, dtype: DType | None = None,
                    precision: jax.lax.Precision | None = None) -> Array:
    """Each query attends the same-segment keys within ``radius`` of it, ``[B, T, H, D]``, in ``O(T · radius)``: exactly
    ``dot_product_attention`` under ``attention_mask(seg, seg, radius=radius)``, in blocks of ``clip(radius, 1, T)``."""
    B, T, H, D = q_BTHD.shape
    W = max(1, min(radius, T))
    G = -(-T // W)
    tail = G * W - T

    def key_blocks(a_BT_):  # [B, T, ...] -> [B, G, 3W, ...]: blocks n-1, n, n+1 side by side (zeros outside)
        pad = [(0, 0), (W, W + tail)] + [(0, 0)] * (a_BT_.ndim - 2)
        a = jnp.pad(a_BT_, pad).reshape((B, G + 2, W) + a_BT_.shape[2:])
        return jnp.concatenate([a[:, :-2], a[:, 1:-1], a[:, 2:]], axis=2)

    def query_blocks(a_BT_):  # [B, T, ...] -> [B, G, W, ...]
        pad = [(0, 0), (0, tail)] + [(0, 0)] * (a_BT_.ndim - 2)
        return jnp.pad(a_BT_, pad).reshape((B, G, W) + a_BT_.shape[2:])

    q_seg_BGW, k_seg_BGS = query_blocks(seg_BT), key_blocks(seg_BT)  # S = 3W; padding is segment 0
    q_idx_GW = jnp.arange(G * W).reshape(G, W)
    k_idx_GS = q_idx_GW[:, :1] - W + jnp.arange(3 * W)  # absolute index of each key slot
    near_GWS = jnp.abs(k_idx_GS[:, None, :] - q_idx_GW[:, :, None]) <= radius
    mask_BGWS = (q_seg_BGW[..., :, None] == k_seg_BGS[..., None, :]) & (q_seg_BGW != 0)[..., None] & near_GWS

    fold = lambda a: a.reshape((B * G,) + a.shape[2:])  # blocks into the batch
    out_XWHD = dot_product_attention(
        fold(query_blocks(q_BTHD)), fold(key_blocks(k_BTHD)), fold(key_blocks(v_BTHD)),
        fold(mask_BGWS)[:, None], dropout_rate=dropout_rate, dropout_rng=dropout_rng, dtype=dtype,
        precision=precision)
    return out_XWHD.reshape(B, G * W, H, -1)[:, :T]


def router_scores(x_BTC: Array, u_C: Array) -> Array:
    """Routing scores ``X u / |u|`` in float32 at HIGHEST precision (TF32 could flip the routing), ``[B, T]``."""
    u = u_C.astype(jnp.float32)
    return jnp.einsum("btc,c->bt", x_BTC, u / jnp.linalg.norm(u), precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


def soft_top_k(scores_BT: Array, k: int, valid_BT: Array | None = None, *, temperature: float = 0.1,
               iterations: int = 32) -> Array:
    """Differentiable top-k weights ``λ_BT``, ``Σ_t λ = min(k, #valid)``, ``λ`` in ``[0, 1]``, 0 at invalid positions;
    coordinate descent on the entropy-regularised dual (docs/models.md), in float32."""
    r = scores_BT.astype(jnp.float32)
    valid = jnp.ones(r.shape, bool) if valid_BT is None else valid_BT
    r = jnp.where(valid, r, MASKED_LOGIT)
    k_B1 = jnp.clip(jnp.minimum(k, valid.sum(-1, keepdims=True)), 1, None).astype(jnp.float32)
    eps = temperature

    def a_update(b_BT):  # the sum constraint: Σ exp((r + a + b) / ε) = k
        return eps * (jnp.log(k_B1) - jax.nn.logsumexp((r + b_BT) / eps, axis=-1, keepdims=True))

    def body(_, ab):
        a_B1, _ = ab
        b_BT = -jax.nn.relu(r + a_B1)  # the caps λ_i <= 1
        return a_update(b_BT), b_BT

    # Warm start at the hard top-k: far fewer steps than b = 0 when ε is small.
    k_int_B1 = k_B1.astype(jnp.int32)
    kth_B1 = jnp.take_along_axis(jax.lax.top_k(r, min(k, r.shape[-1]))[0], k_int_B1 - 1, axis=-1)
    b0 = -jax.nn.relu(r - jax.lax.stop_gradient(kth_B1))
    a_B1, b_BT = jax.lax.fori_loop(0, iterations, body, (a_update(b0), b0))
    return jnp.where(valid, jnp.exp((r + a_B1 + b_BT) / eps), 0.0)


def top_k_indices(scores_BT: Array, valid_BT: Array, k: int) -> Array:
    """Indices ``[B, k]`` of the k highest scores, valid tokens first (padding only fills what is left)."""
    return jax.lax.top_k(jnp.where(valid_BT, scores_BT.astype(jnp.float32), -jnp.inf), k)[1]


def gather_tokens(x_BT_: Array, idx_BR: Array) -> Array:
    """``x[b, idx[b, j]]`` for ``[B, T, ...]`` inputs, ``[B, R, ...]``."""
    idx = idx_BR.reshape(idx_BR.shape + (1,) * (x_BT_.ndim - 2))
    return jnp.take_along_axis(x_BT_, idx, axis=1)


def scatter_tokens(y_BRC: Array, idx_BR: Array, T: int) -> Array:
    """Adds the rows of ``y_BRC`` at token indices ``idx_BR`` into zeros ``[B, T, C]`` (indices are unique)."""
    B = y_BRC.shape[0]
    return jnp.zeros((B, T) + y_BRC.shape[2:], y_BRC.dtype).at[jnp.arange(B)[:, None], idx_BR].add(y_BRC)
