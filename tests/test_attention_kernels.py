"""The attention kernels of lconv.ops.flash: the blockwise kernel against float64 NumPy loops and against the
materialised path's gradients, the per-platform dispatch as lowered, and cuDNN on a GPU when there is one."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lconv.errors import UserError
from lconv.ops import flash
from lconv.ops.attention import attention_mask, dot_product_attention
from lconv.ops.flash import chunked_attention, segment_attention

B, T, S, H, D = 2, 13, 7, 2, 4
HIGHEST = jax.lax.Precision.HIGHEST  # float32 dots on every backend (a GPU's default is TF32): float64 references
# Row 0: two packed examples (7 + 4 tokens) and 2 padding tokens; row 1: one example, 3 padding tokens.
SEG = np.array([[1] * 7 + [2] * 4 + [0] * 2, [1] * 10 + [0] * 3], np.int32)
# Encoder side of the cross cases: row 0 has no segment 2 (its second query example sees nothing: zeros).
KSEG = np.array([[1] * 5 + [0] * 2, [1] * 7], np.int32)


def _out_and_grads(f, q, k, v, g):
    """``f(q, k, v)`` and the gradients of ``sum(f * g)``, from one compiled program."""
    def run(q, k, v):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(g)
    return jax.jit(run)(q, k, v)


def _qkv(t, s, seed=0, dtype=jnp.float32):
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, g = (jax.random.normal(k, (B, t, H, D)).astype(dtype) for k in (k1, k4))
    k, v = (jax.random.normal(kk, (B, s, H, D)).astype(dtype) for kk in (k2, k3))
    return q, k, v, g


def np_attention(q, k, v, qseg, kseg, causal, radius, keep=None, rate=0.0):
    """float64 loops: softmax over the visible keys (same non-zero segment, causal, within radius); dropout's
    keep mask ``[B, H, T, S]`` (when given) applied to the normalised probabilities."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        for h in range(H):
            for t in range(q.shape[1]):
                ss = [s for s in range(k.shape[1]) if qseg[b, t] and kseg[b, s] == qseg[b, t]
                      and (not causal or s <= t) and (radius is None or abs(s - t) <= radius)]
                if not ss:
                    continue
                lg = np.array([q[b, t, h] @ k[b, s, h] for s in ss]) / np.sqrt(D)
                p = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum()
                if keep is not None:
                    p = p * np.array([keep[b, h, t, s] for s in ss]) / (1 - rate)
                out[b, t, h] = sum(pi * v[b, s, h] for pi, s in zip(p, ss))
    return out


CASES = {  # name -> (key length, query segments, key segments, causal, radius)
    "self_packed": (T, SEG, SEG, False, None),
    "self_packed_causal": (T, SEG, SEG, True, None),
    "self_local": (T, SEG, SEG, False, 2),
    "self_local_causal": (T, SEG, SEG, True, 3),
    "cross_padded": (S, SEG, KSEG, False, None),
    "unsegmented_causal": (T, None, None, True, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_numpy_and_plain_gradients(case):
    s, qseg, kseg, causal, radius = CASES[case]
    q, k, v, g = _qkv(T, s)
    qs, ks = (None, None) if qseg is None else (jnp.asarray(qseg), jnp.asarray(kseg))
    ones_q, ones_k = np.ones((B, T), np.int32), np.ones((B, s), np.int32)
    # blocks 4 x 3: lengths 13 and 7 divide neither; several blocks fall outside the causal / local band
    chunked = functools.partial(chunked_attention, q_seg_BT=qs, k_seg_BS=ks, causal=causal, radius=radius,
                                block_q=4, block_k=3, precision=HIGHEST)
    mask = attention_mask(jnp.asarray(ones_q if qseg is None else qseg), jnp.asarray(ones_k if kseg is None else kseg),
                          causal=causal, radius=radius)
    plain = functools.partial(dot_product_attention, mask_BHTS=mask, precision=HIGHEST)

    (out, grads), (_, ref_grads) = _out_and_grads(chunked, q, k, v, g), _out_and_grads(plain, q, k, v, g)
    ref = np_attention(q, k, v, ones_q if qseg is None else qseg, ones_k if kseg is None else kseg, causal, radius)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5, err_msg=f"d{name}")


def test_chunked_dropout_matches_numpy_with_its_keep_mask_and_autodiff():
    """Dropout draws one keep mask per block; the backward redraws the same: the forward equals the reference
    under that mask (assembled block by block), and the gradients equal autodiff of the materialised path."""
    q, k, v, g = _qkv(T, T, seed=1)
    rate, rng, bq, bk = 0.3, jax.random.PRNGKey(5), 4, 3
    f = functools.partial(chunked_attention, q_seg_BT=jnp.asarray(SEG), k_seg_BS=jnp.asarray(SEG), causal=True,
                          dropout_rate=rate, dropout_rng=rng, block_q=bq, block_k=bk, precision=HIGHEST)
    nq, nk = -(-T // bq), -(-T // bk)
    block_keep = jax.jit(lambda i, j: flash._keep(rng, i, j, (B, H, bq, bk), rate))  # compiled once
    keep = np.concatenate([np.concatenate([np.asarray(block_keep(i, j))
                                           for j in range(nk)], axis=3) for i in range(nq)], axis=2)[:, :, :T, :T]
    assert 0.5 < keep.mean() < 0.9  # ~ 1 - rate
    out, grads = _out_and_grads(f, q, k, v, g)
    ref = np_attention(q, k, v, SEG, SEG, True, None, keep, rate)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)

    def reference(q, k, v):  # the materialised softmax with the same keep mask
        mask = attention_mask(jnp.asarray(SEG), jnp.asarray(SEG), causal=True)
        logits = jnp.where(mask, jnp.einsum("bthd,bshd->bhts", q, k, precision=HIGHEST) / np.sqrt(D), -1e30)
        probs = jnp.where(mask, jax.nn.softmax(logits, -1), 0.0) * keep / (1 - rate)
        return jnp.einsum("bhts,bshd->bthd", probs, v, precision=HIGHEST)

    ref_grads = _out_and_grads(reference, q, k, v, g)[1]
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5, err_msg=f"d{name}")


def _lowered(f, platform, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_auto_picks_per_lowering_platform():
    """"auto" below cuDNN: chunked (a while loop) on CPU from 128² pairs, the materialised path elsewhere below
    1024² pairs; the choice is the lowering platform's, whatever the host."""
    n = 160  # 160² pairs: between the two thresholds
    q = jnp.zeros((1, n, H, D))
    seg = jnp.ones((1, n), jnp.int32)
    f = functools.partial(segment_attention, q_seg_BT=seg, k_seg_BS=seg, causal=True)
    assert "stablehlo.while" in _lowered(lambda q: f(q, q, q), "cpu", q)
    assert "stablehlo.while" not in _lowered(lambda q: f(q, q, q), "cuda", q)
    assert "stablehlo.while" not in _lowered(lambda q: f(q, q, q, impl="xla"), "cpu", q)
    assert "stablehlo.while" in _lowered(lambda q: f(q, q, q, impl="chunked"), "cuda", q)
    # auto_impl, the report's name for the same decision
    shape = (1, n, H, D)
    assert flash.auto_impl("cpu", shape, shape, jnp.float32, segmented=True, causal=True) == "chunked"
    assert flash.auto_impl("cuda", shape, shape, jnp.float32, segmented=True, causal=True) == "xla"
    assert flash.auto_impl("tpu", (1, 1024, H, D), (1, 1024, H, D), jnp.float32, segmented=True) == "chunked"


def test_cudnn_branch_is_lowered_for_cuda_only(monkeypatch):
    """The cuDNN branch sits under platform_dependent. This host may lack cuDNN's library (then jax cannot trace
    the cuDNN call at all), so the cuDNN call is replaced by a marked stand-in: the dispatch must put it in the
    program lowered for CUDA and leave it out of the CPU one. (The real call: test_cudnn_on_gpu.)"""
    monkeypatch.setattr(flash, "_cudnn_probe", lambda *a: None)
    monkeypatch.setattr(flash, "_cudnn_attention", lambda q, k, v, *a: jnp.cos(q))  # the marker: a cosine
    q = jnp.zeros((B, T + 1, H, 8), jnp.bfloat16)
    f = functools.partial(segment_attention, causal=True)
    assert "stablehlo.cosine" in _lowered(lambda q: f(q, q, q), "cuda", q)
    assert "stablehlo.cosine" not in _lowered(lambda q: f(q, q, q), "cpu", q)
    # where cuDNN cannot apply (float32, dropout, a two-sided window), CUDA gets the XLA path
    q32 = q.astype(jnp.float32)
    assert "stablehlo.cosine" not in _lowered(lambda q: f(q, q, q), "cuda", q32)
    drop = functools.partial(f, dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0))
    assert "stablehlo.cosine" not in _lowered(lambda q: drop(q, q, q), "cuda", q)
    assert "stablehlo.cosine" not in _lowered(lambda q: segment_attention(q, q, q, radius=2), "cuda", q)
    shape = q.shape
    assert flash.auto_impl("cuda", shape, shape, jnp.bfloat16, segmented=False, causal=True) == "cudnn"
    assert flash.auto_impl("cuda", shape, shape, jnp.float32, segmented=False, causal=True) == "xla"
    assert flash.auto_impl("cuda", shape, shape, jnp.bfloat16, segmented=False, causal=True, dropout=True) == "xla"
    assert flash.auto_impl("cpu", shape, shape, jnp.bfloat16, segmented=False, causal=True) == "xla"


def test_bad_calls_raise_one_line_errors():
    q = jnp.zeros((B, T, H, D))
    with pytest.raises(UserError, match="bfloat16 or float16"):
        segment_attention(q, q, q, impl="cudnn")
    with pytest.raises(UserError, match="attention_impl"):
        segment_attention(q, q, q, impl="flash")
    with pytest.raises(UserError, match="both"):
        segment_attention(q, q, q, jnp.asarray(SEG))
    with pytest.raises(UserError, match="blocks"):
        chunked_attention(q, q, q, block_q=0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention runs only on a GPU")
def test_cudnn_on_gpu():
    """The one test that needs a GPU: cuDNN's output and gradients equal the materialised path's (bfloat16
    inputs, float32 reference on the same inputs), for no mask, padding only (sequence lengths), packed rows
    (the bias), and a causal local window."""
    n, d = 64, 64  # cuDNN: head width a multiple of 8
    q, k, v, g = (jax.random.normal(key, (B, n, H, d)).astype(jnp.bfloat16)
                  for key in jax.random.split(jax.random.PRNGKey(2), 4))
    padded = np.array([[1] * 50 + [0] * 14, [1] * n], np.int32)
    packed = np.array([[1] * 20 + [2] * 30 + [0] * 14, [1] * 40 + [2] * 24], np.int32)
    for seg, causal, radius in [(None, True, None), (padded, False, None), (packed, True, None), (packed, True, 5)]:
        segs = (None, None) if seg is None else (jnp.asarray(seg),) * 2
        fast = functools.partial(segment_attention, q_seg_BT=segs[0], k_seg_BS=segs[1], causal=causal, radius=radius)
        assert "__cudnn$fmha" in _lowered(fast, "cuda", q, k, v)
        seg_ = jnp.asarray(np.ones((B, n), np.int32) if seg is None else seg)
        slow = functools.partial(dot_product_attention, mask_BHTS=attention_mask(seg_, seg_, causal=causal,
                                                                                  radius=radius))
        for f_result, r_result in zip(*(jax.jit(jax.value_and_grad(
                lambda q, k, v, f=f: (f(q, k, v).astype(jnp.float32) * g).sum(), argnums=(0, 1, 2)))(q, k, v)
                for f in (fast, slow))):
            for a, b in zip(jax.tree.leaves(f_result), jax.tree.leaves(r_result)):
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max() + 1e-2, (seg, causal, radius)
