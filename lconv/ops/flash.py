"""Attention without ``[B, H, T, S]`` logits: a blockwise XLA kernel for every backend, cuDNN flash attention on CUDA,
and the per-platform choice between them (``segment_attention``). The mask is described (segments, ``causal``,
``radius``), not materialised; accumulation is float32. docs/kernels.md."""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from lconv.constants import ATTENTION_IMPLS, MASKED_LOGIT
from lconv.errors import UserError
from lconv.ops.attention import attention_mask, dot_product_attention

Array = jax.Array

# Per platform: (the T * S from which "auto" takes "chunked" over "xla", chunked's block); docs/kernels.md.
XLA_RULES = {"cpu": (128 * 128, 256), "default": (1024 * 1024, 512)}
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


# The blockwise kernel


class _Blocks(NamedTuple):
    """The static part of a chunked call (hashable: ``custom_vjp``'s non-differentiated argument)."""
    causal: bool
    radius: int | None
    rate: float  # attention dropout
    bq: int
    bk: int
    precision: Any
    scale: float


def _mask(qs_BQ: Array, ks_BK: Array, i: Array, j: Array, c: _Blocks) -> Array:
    """Boolean ``[B, 1, Q, K]`` of query block ``i`` against key block ``j``."""
    m_BQK = (qs_BQ[:, :, None] == ks_BK[:, None, :]) & (qs_BQ[:, :, None] != 0)
    if c.causal or c.radius is not None:
        d_QK = (j * c.bk + jnp.arange(c.bk))[None, :] - (i * c.bq + jnp.arange(c.bq))[:, None]
        if c.causal:
            m_BQK &= (d_QK <= 0)[None]
        if c.radius is not None:
            m_BQK &= (jnp.abs(d_QK) <= c.radius)[None]
    return m_BQK[:, None]


def _key_range(i: Array, nk: int, c: _Blocks) -> tuple[Array, Array]:
    """``[lo, hi)``: the key blocks query block ``i`` can see (the causal / local band; all without either)."""
    first, last = i * c.bq, i * c.bq + c.bq - 1
    lo, hi = jnp.int32(0), jnp.int32(nk)
    if c.radius is not None:
        lo = jnp.maximum(lo, (first - c.radius) // c.bk)
        hi = jnp.minimum(hi, (last + c.radius) // c.bk + 1)
    if c.causal:
        hi = jnp.minimum(hi, last // c.bk + 1)
    return lo, hi


def _keep(rng: Array, i: Array, j: Array, shape: tuple[int, ...], rate: float) -> Array:
    """Dropout's keep mask of block ``(i, j)``: a function of the block, so the backward redraws it exactly."""
    return jax.random.bernoulli(jax.random.fold_in(jax.random.fold_in(rng, i), j), 1.0 - rate, shape)


def _take(x: Array, start: Array, size: int) -> Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _logits(q_BQHD: Array, k_BKHD: Array, c: _Blocks) -> Array:
    s_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKHD, precision=c.precision,
                        preferred_element_type=jnp.float32)
    return s_BHQK * c.scale


def _forward(q, k, v, qs, ks, rng, c: _Blocks):
    """``(out [B, T, H, D] float32, lse [B, H, T])`` of padded inputs (``T % bq == S % bk == 0``)."""
    (B, T, H, D), nk = q.shape, k.shape[1] // c.bk

    def query_block(i):
        q_i, qs_i = _take(q, i * c.bq, c.bq), _take(qs, i * c.bq, c.bq)

        def key_block(j, carry):
            m_BHQ, l_BHQ, acc_BHQD = carry
            k_j, v_j, ks_j = _take(k, j * c.bk, c.bk), _take(v, j * c.bk, c.bk), _take(ks, j * c.bk, c.bk)
            mask = _mask(qs_i, ks_j, i, j, c)
            s = jnp.where(mask, _logits(q_i, k_j, c), MASKED_LOGIT)
            m_new = jnp.maximum(m_BHQ, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # explicit: a row masked so far stays 0
            corr = jnp.exp(m_BHQ - m_new)
            l_BHQ = l_BHQ * corr + p.sum(-1)
            if c.rate:
                p = jnp.where(_keep(rng, i, j, p.shape, c.rate), p / (1.0 - c.rate), 0.0)
            pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), v_j, precision=c.precision,
                            preferred_element_type=jnp.float32)
            return m_new, l_BHQ, acc_BHQD * corr[..., None] + pv

        acc0 = jnp.zeros_like(q_i.transpose(0, 2, 1, 3), jnp.float32)  # *_like: keeps q's sharding
        init = (jnp.full_like(acc0[..., 0], MASKED_LOGIT), jnp.zeros_like(acc0[..., 0]), acc0)
        m, l, acc = lax.fori_loop(*_key_range(i, nk, c), key_block, init)
        seen = l > 0  # queries with no visible key (padding) give zeros, as `attend` does
        out_BHQD = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        return out_BHQD.transpose(0, 2, 1, 3), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)

    out_GBQHD, lse_GBHQ = lax.map(query_block, jnp.arange(T // c.bq))
    out = out_GBQHD.transpose(1, 0, 2, 3, 4).reshape(B, T, H, D)
    return out, lse_GBHQ.transpose(1, 2, 0, 3).reshape(B, H, T)


def _backward(c: _Blocks, res, g_BTHD):
    """FlashAttention-2's backward: per block, ``P = exp(S - lse)``, ``dS = P (dP - rowsum(dO O))``."""
    q, k, v, qs, ks, rng, out, lse = res
    T, nk = q.shape[1], k.shape[1] // c.bk
    do = g_BTHD.astype(jnp.float32)
    delta_BHT = jnp.einsum("bthd,bthd->bht", do, out)

    def query_block(i, carry):
        dq, dk, dv = carry
        q_i, qs_i, do_i = _take(q, i * c.bq, c.bq), _take(qs, i * c.bq, c.bq), _take(do, i * c.bq, c.bq)
        lse_i = lax.dynamic_slice_in_dim(lse, i * c.bq, c.bq, axis=2)[..., None]
        delta_i = lax.dynamic_slice_in_dim(delta_BHT, i * c.bq, c.bq, axis=2)[..., None]

        def key_block(j, inner):
            dq_i, dk, dv = inner
            k_j, v_j, ks_j = _take(k, j * c.bk, c.bk), _take(v, j * c.bk, c.bk), _take(ks, j * c.bk, c.bk)
            p = jnp.where(_mask(qs_i, ks_j, i, j, c), jnp.exp(_logits(q_i, k_j, c) - lse_i), 0.0)
            dp = jnp.einsum("bqhd,bkhd->bhqk", do_i, v_j, precision=c.precision)
            pd = p
            if c.rate:
                keep = _keep(rng, i, j, p.shape, c.rate)
                pd = jnp.where(keep, p / (1.0 - c.rate), 0.0)
                dp = jnp.where(keep, dp / (1.0 - c.rate), 0.0)
            ds = p * (dp - delta_i) * c.scale
            dv_j = jnp.einsum("bhqk,bqhd->bkhd", pd, do_i, precision=c.precision)
            dk_j = jnp.einsum("bhqk,bqhd->bkhd", ds, q_i, precision=c.precision)
            dq_i += jnp.einsum("bhqk,bkhd->bqhd", ds, k_j, precision=c.precision)
            return dq_i, _add(dk, dk_j, j * c.bk), _add(dv, dv_j, j * c.bk)

        dq_i, dk, dv = lax.fori_loop(*_key_range(i, nk, c), key_block,
                                     (jnp.zeros_like(q_i, jnp.float32), dk, dv))
        return lax.dynamic_update_slice_in_dim(dq, dq_i, i * c.bq, axis=1), dk, dv

    zeros = functools.partial(jnp.zeros_like, dtype=jnp.float32)
    dq, dk, dv = lax.fori_loop(0, T // c.bq, query_block, (zeros(q), zeros(k), zeros(v)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


def _add(acc: Array, block: Array, start: Array) -> Array:
    return lax.dynamic_update_slice_in_dim(acc, _take(acc, start, block.shape[1]) + block, start, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunked(q, k, v, qs, ks, rng, c: _Blocks):
    return _forward(q, k, v, qs, ks, rng, c)[0]


def _chunked_fwd(q, k, v, qs, ks, rng, c: _Blocks):
    out, lse = _forward(q, k, v, qs, ks, rng, c)
    return out, (q, k, v, qs, ks, rng, out, lse)


_chunked.defvjp(_chunked_fwd, _backward)


def chunked_attention(q_BTHD: Array, k_BSHD: Array, v_BSHD: Array, q_seg_BT: Array | None = None,
                      k_seg_BS: Array | None = None, *, causal: bool = False, radius: int | None = None,
                      dropout_rate: float = 0.0, dropout_rng: Array | None = None, dtype: Any = None,
                      precision: Any = None, block_q: int = 512, block_k: int = 512) -> Array:
    """Blockwise masked attention with an online softmax, ``[B, T, H, D]`` in ``dtype`` (default ``v``'s):
    ``dot_product_attention`` to float32 rounding, gradients too; dropout redraws its mask per block."""
    (B, T, _, D), S = q_BTHD.shape, k_BSHD.shape[1]
    if block_q <= 0 or block_k <= 0:
        raise UserError(f"attention blocks must be positive, got block_q={block_q}, block_k={block_k}")
    q_seg_BT = jnp.ones((B, T), jnp.int32) if q_seg_BT is None else q_seg_BT.astype(jnp.int32)
    k_seg_BS = jnp.ones((B, S), jnp.int32) if k_seg_BS is None else k_seg_BS.astype(jnp.int32)
    bq, bk = min(block_q, T), min(block_k, S)
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk

    def pad(x, n):
        return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    rate = float(dropout_rate) if dropout_rng is not None else 0.0
    rng = dropout_rng if rate else jnp.zeros((2,), jnp.uint32)
    c = _Blocks(causal, radius, rate, bq, bk, precision, 1.0 / math.sqrt(D))
    out = _chunked(pad(q_BTHD, Tp), pad(k_BSHD, Sp), pad(v_BSHD, Sp), pad(q_seg_BT, Tp), pad(k_seg_BS, Sp), rng, c)
    return out[:, :T].astype(dtype or v_BSHD.dtype)


# cuDNN flash attention


def _rows_with_grad(ok_BT: Array, x_BTHD: Array) -> Array:
    """``x`` whose padded rows pass no gradient: cuDNN need not write rows past a sequence length."""
    return jnp.where(ok_BT[:, :, None, None], x_BTHD, lax.stop_gradient(x_BTHD))


def _single_run(seg_BT: Array) -> tuple[Array, Array]:
    """``(rows that are one segment then padding [B], non-padding length [B])``."""
    n_B = (seg_BT != 0).sum(1, dtype=jnp.int32)
    expected = jnp.where(jnp.arange(seg_BT.shape[1])[None] < n_B[:, None], seg_BT[:, :1], 0)
    return (seg_BT == expected).all(1), n_B


def _cudnn_attention(q_BTHD: Array, k_BSHD: Array, v_BSHD: Array, q_seg_BT: Array | None, k_seg_BS: Array | None,
                     causal: bool, radius: int | None) -> Array:
    """cuDNN flash attention under lconv's masks (lengths for one-segment rows, a bias for packed ones); queries that
    see no key are zeroed after."""
    window = None if radius is None else (radius, 0)  # cuDNN: a left window with causal only
    call = functools.partial(jax.nn.dot_product_attention, is_causal=causal, local_window_size=window,
                             implementation="cudnn")
    if q_seg_BT is None:
        return call(q_BTHD, k_BSHD, v_BSHD)
    mask_B1TS = attention_mask(q_seg_BT, k_seg_BS, causal=causal, radius=radius)
    q_ok, k_ok = q_seg_BT != 0, k_seg_BS != 0
    q, k, v = _rows_with_grad(q_ok, q_BTHD), _rows_with_grad(k_ok, k_BSHD), _rows_with_grad(k_ok, v_BSHD)
    (q_single, nq_B), (k_single, nk_B) = _single_run(q_seg_BT), _single_run(k_seg_BS)
    same = (q_seg_BT[:, 0] == k_seg_BS[:, 0]) | (nq_B == 0) | (nk_B == 0)

    def by_lengths():  # a length of 0 would be undefined for cuDNN: 1, and the row is zeroed below
        return call(q, k, v, query_seq_lengths=jnp.maximum(nq_B, 1), key_value_seq_lengths=jnp.maximum(nk_B, 1))

    out = lax.cond((q_single & k_single & same).all(), by_lengths, lambda: call(q, k, v, mask=mask_B1TS))
    return jnp.where(mask_B1TS.any(-1).transpose(0, 2, 1)[..., None], out, 0).astype(out.dtype)


@functools.lru_cache(maxsize=256)
def _cudnn_probe(q_shape, k_shape, dtype, segmented: bool, causal: bool, radius: int | None) -> str | None:
    """Why cuDNN cannot trace this case on this host (head width, GPU generation, no cuDNN library), or None."""
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    k = jax.ShapeDtypeStruct(k_shape, dtype)
    segs = (jax.ShapeDtypeStruct(q_shape[:2], jnp.int32), jax.ShapeDtypeStruct(k_shape[:2], jnp.int32))

    def fwd_bwd(q, k, v, *segs):
        f = lambda q, k, v: _cudnn_attention(q, k, v, *(segs or (None, None)), causal, radius)  # noqa: E731
        out, vjp = jax.vjp(f, q, k, v)
        return vjp(out)

    try:
        jax.eval_shape(fwd_bwd, q, k, k, *(segs if segmented else ()))
    except Exception as e:  # noqa: BLE001 - whatever jax's cuDNN checks raise is the reason
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def cudnn_unsupported(q_BTHD: Array, k_BSHD: Array, v_BSHD: Array, *, segmented: bool, causal: bool = False,
                      radius: int | None = None, dropout: bool = False) -> str | None:
    """Why cuDNN flash attention cannot take this call (a short reason), or None when it can."""
    T, S = q_BTHD.shape[1], k_BSHD.shape[1]
    if not (q_BTHD.dtype == k_BSHD.dtype == v_BSHD.dtype and any(q_BTHD.dtype == d for d in _CUDNN_DTYPES)):
        return f"it takes bfloat16 or float16 inputs, got {q_BTHD.dtype}"
    if dropout:
        return "jax's cuDNN call has no attention dropout"
    if radius is not None and not causal:
        return "it takes a local window only when causal"
    if (causal or radius is not None) and T != S:
        return f"causal or local masks need as many queries as keys, got T={T}, S={S}"
    if segmented and (T % 2 or S % 2):
        return f"segment masks need even lengths (a bias in training), got T={T}, S={S}"
    return _cudnn_probe(q_BTHD.shape, k_BSHD.shape, jnp.dtype(q_BTHD.dtype), segmented, causal, radius)


def auto_impl(platform: str, q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: Any, *, segmented: bool,
              causal: bool = False, radius: int | None = None, dropout: bool = False) -> str:
    """The kernel ``impl="auto"`` runs for these shapes on ``platform`` (``segment_attention``'s choice)."""
    if platform == "cuda":
        q = jax.ShapeDtypeStruct(q_shape, dtype)
        k = jax.ShapeDtypeStruct(k_shape, dtype)
        if cudnn_unsupported(q, k, k, segmented=segmented, causal=causal, radius=radius, dropout=dropout) is None:
            return "cudnn"
    min_pairs, _ = XLA_RULES.get(platform, XLA_RULES["default"])
    return "chunked" if q_shape[1] * k_shape[1] >= min_pairs else "xla"


# The dispatch


def check_impl(impl: str) -> None:
    if impl not in ATTENTION_IMPLS:
        raise UserError(f"attention_impl {impl!r}: must be one of {', '.join(ATTENTION_IMPLS)}")


def segment_attention(q_BTHD: Array, k_BSHD: Array, v_BSHD: Array, q_seg_BT: Array | None = None,
                      k_seg_BS: Array | None = None, *, causal: bool = False, radius: int | None = None,
                      impl: str = "auto", dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                      dtype: Any = None, precision: Any = None, block_q: int | None = None,
                      block_k: int | None = None) -> Array:
    """Masked scaled dot-product attention by ``impl`` (module docstring), ``[B, T, H, D]`` in ``dtype``; ``q_seg_BT`` /
    ``k_seg_BS``: both or neither. ``block_q`` / ``block_k``: the chunked kernel's (None: ``XLA_RULES``)."""
    check_impl(impl)
    if (q_seg_BT is None) != (k_seg_BS is None):
        raise UserError("segment_attention: give both query and key segment ids, or neither")
    T, S = q_BTHD.shape[1], k_BSHD.shape[1]
    dropout = dropout_rng is not None and dropout_rate > 0.0
    kw = dict(causal=causal, radius=radius, dropout_rate=dropout_rate, dropout_rng=dropout_rng, dtype=dtype,
              precision=precision)

    def xla_path(chunked: bool, block: int):
        def xla(q, k, v):
            if not chunked:
                qs = jnp.ones(q.shape[:2], jnp.int32) if q_seg_BT is None else q_seg_BT
                ks = jnp.ones(k.shape[:2], jnp.int32) if k_seg_BS is None else k_seg_BS
                return dot_product_attention(q, k, v, attention_mask(qs, ks, causal=causal, radius=radius),
                                             dropout_rate=dropout_rate, dropout_rng=dropout_rng, dtype=dtype,
                                             precision=precision)
            return chunked_attention(q, k, v, q_seg_BT, k_seg_BS, block_q=block_q or block, block_k=block_k or block,
                                     **kw)
        return xla

    def rule(min_pairs: int, block: int) -> tuple[bool, int]:
        """(chunked?, the platform's block where it matters) on one platform"""
        chunked = impl == "chunked" or (impl != "xla" and T * S >= min_pairs)
        return chunked, block if chunked and (block_q is None or block_k is None) else 0

    rules = {p: rule(*r) for p, r in XLA_RULES.items()}  # one branch where the platforms agree: traced once
    if rules["cpu"] == rules["default"]:
        branches = {"default": xla_path(*rules["default"])}
    else:
        branches = {p: xla_path(*rule) for p, rule in rules.items()}
    if impl in ("auto", "cudnn"):
        why = cudnn_unsupported(q_BTHD, k_BSHD, v_BSHD, segmented=q_seg_BT is not None, causal=causal,
                                radius=radius, dropout=dropout)
        if why is None:
            branches["cuda"] = lambda q, k, v: _cudnn_attention(q, k, v, q_seg_BT, k_seg_BS, causal, radius).astype(
                dtype or v_BSHD.dtype)
        elif impl == "cudnn":
            raise UserError(f"attention_impl='cudnn' cannot take this call: {why}; use 'auto' to fall back to XLA")
    if len(branches) == 1:
        return branches["default"](q_BTHD, k_BSHD, v_BSHD)
    return lax.platform_dependent(q_BTHD, k_BSHD, v_BSHD, **branches)
