"""CoLT5 routed attention / FFN against float64 NumPy references (bisection soft top-k, brute-force routing)."""
import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tolerance

from lconv.nn import mixers
from lconv.nn.colt5 import CoLT5Attention, CoLT5FeedForward, local_attention, soft_top_k

B, T, C, H = 2, 13, 12, 3
D = C // H
RADIUS, EPS = 2, 0.1
X = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (B, T, C)), np.float32)
SEG = np.array([[1] * 7 + [2] * 4 + [0] * 2, [1] * 10 + [0] * 3], np.int32)


# ---------------------------------------------------------------- float64 NumPy references


def np_soft_top_k(r, k, valid, eps=EPS):
    """The exact optimum of max r·λ + ε H(λ), Σλ = k, 0 ≤ λ ≤ 1: λ = min(1, exp((r + a)/ε)), a by bisection."""
    out = np.zeros(r.shape)
    for b in range(r.shape[0]):
        rv = np.asarray(r[b][valid[b]], np.float64)
        kb = min(k, len(rv))
        lo, hi = -rv.max() - 50 * eps, -rv.min() + 50 * eps
        for _ in range(200):
            a = (lo + hi) / 2
            lo, hi = (a, hi) if np.minimum(1, np.exp((rv + a) / eps)).sum() < kb else (lo, a)
        out[b, valid[b]] = np.minimum(1, np.exp((rv + a) / eps))
    return out


def np_dense(p, x):
    return np.asarray(x, np.float64) @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)


def np_route(params, name, x, seg, k):
    u = np.asarray(params[name], np.float64)
    r = np.asarray(x, np.float64) @ (u / np.linalg.norm(u))  # [B, T]
    w = np_soft_top_k(r, k, seg > 0)
    routed = [set(sorted([t for t in range(x.shape[1]) if seg[b, t]], key=lambda t: -r[b, t])[:k])
              for b in range(x.shape[0])]
    return w, routed


def np_attend(q, k, v, ts, ss_of_t, out):
    for t in ts:
        ss = ss_of_t(t)
        if not ss:
            continue
        lg = np.array([q[t] @ k[s] for s in ss]) / np.sqrt(q.shape[-1])
        p = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum()
        out[t] = sum(pi * v[s] for pi, s in zip(p, ss))


def np_colt5_attention(params, x, seg, k, light_heads):
    x = np.asarray(x, np.float64)
    Bx, Tx, _ = x.shape
    wq, rq = np_route(params, "router_q", x, seg, k)
    wkv, rkv = np_route(params, "router_kv", x, seg, k)
    proj = lambda n, h: np_dense(params[n], x).reshape(Bx, Tx, h, D)  # noqa: E731
    ql, kl, vl = (proj(f"light_{n}", light_heads) for n in ("query", "key", "value"))
    qh, kh, vh = (proj(f"heavy_{n}", H) for n in ("query", "key", "value"))
    light, heavy = np.zeros((Bx, Tx, light_heads, D)), np.zeros((Bx, Tx, H, D))
    for b in range(Bx):
        same = lambda t, s: seg[b, s] == seg[b, t] and seg[b, t] > 0  # noqa: E731
        for h in range(light_heads):
            np_attend(ql[b, :, h], kl[b, :, h], vl[b, :, h], range(Tx),
                      lambda t: [s for s in range(Tx) if same(t, s) and abs(s - t) <= RADIUS], light[b, :, h])
        for h in range(H):
            np_attend(qh[b, :, h], kh[b, :, h], vh[b, :, h] * wkv[b][:, None], sorted(rq[b]),
                      lambda t: [s for s in sorted(rkv[b]) if same(t, s)], heavy[b, :, h])
    y_heavy = np_dense(params["heavy_out"], heavy.reshape(Bx, Tx, H * D)) * wq[..., None]
    y_heavy *= np.array([[t in rq[b] for t in range(Tx)] for b in range(Bx)])[..., None]  # un-routed: 0
    return np_dense(params["light_out"], light.reshape(Bx, Tx, light_heads * D)) + y_heavy


def np_colt5_ffn(params, x, seg, k):
    x = np.asarray(x, np.float64)
    w, routed = np_route(params, "router", x, seg, k)
    ffn = lambda n: np_dense(params[n + "_out"], np.maximum(np_dense(params[n + "_in"], x), 0))  # noqa: E731
    on = np.array([[t in routed[b] for t in range(x.shape[1])] for b in range(x.shape[0])])
    return ffn("light") + ffn("heavy") * (w * on)[..., None]


# ---------------------------------------------------------------- tests


PRECISION = "highest"  # exact float32 on every backend, so float32's tolerances hold on all of them


def _tol(atol, rtol=1e-7, dtype=np.float32):
    return tolerance(dtype, PRECISION, atol=atol, rtol=rtol)


def attn(k, **kw):
    return CoLT5Attention(num_heads=H, light_num_heads=2, local_radius=RADIUS, num_routed=k,
                          router_temperature=EPS, matmul_precision=PRECISION, **kw)


# Parameter shapes do not depend on num_routed.
PARAMS = nn.meta.unbox(jax.jit(attn(T).init)(jax.random.PRNGKey(1), jnp.asarray(X))["params"])
apply = jax.jit(lambda m, p, x, seg: m.apply({"params": p}, x, segment_ids=seg), static_argnums=0)


@pytest.mark.parametrize("k", [5, T])  # routed capacity below and at T (k = T: every token routed = dense form)
def test_attention_matches_numpy_reference(k):
    y = np.asarray(apply(attn(k), PARAMS, X, SEG))
    ref = np_colt5_attention(PARAMS, X, SEG, k, light_heads=2)
    valid = SEG > 0
    np.testing.assert_allclose(y[valid], ref[valid], **_tol(2e-3, 2e-3))


def test_every_token_routed_packed_equals_separate():
    y = np.asarray(apply(attn(T), PARAMS, X, SEG))
    alone_x, alone_seg = np.zeros_like(X), np.zeros_like(SEG)
    alone_x[0, :7], alone_x[1, :4] = X[0, :7], X[0, 7:11]
    alone_seg[0, :7], alone_seg[1, :4] = 1, 1
    alone = np.asarray(apply(attn(T), PARAMS, alone_x, alone_seg))
    np.testing.assert_allclose(y[0, :7], alone[0, :7], **_tol(2e-4))
    np.testing.assert_allclose(y[0, 7:11], alone[1, :4], **_tol(2e-4))


def test_padding_is_never_routed_and_does_not_leak():
    x2 = X.copy()
    x2[SEG == 0] = 100.0  # huge padding activations would win any routing contest they were allowed into
    y1, y2 = np.asarray(apply(attn(5), PARAMS, X, SEG)), np.asarray(apply(attn(5), PARAMS, x2, SEG))
    np.testing.assert_allclose(y1[SEG > 0], y2[SEG > 0], **_tol(1e-5))


def test_soft_top_k_sums_to_k_matches_optimum_and_is_differentiable():
    r = jax.random.normal(jax.random.PRNGKey(5), (B, T))
    valid = jnp.asarray(SEG > 0)
    w = np.asarray(soft_top_k(r, 5, valid, temperature=EPS, iterations=32))
    np.testing.assert_allclose(w.sum(-1), [5, 5], **_tol(1e-4))
    assert np.all(w[SEG == 0] == 0) and w.min() >= 0 and w.max() <= 1 + 1e-3
    np.testing.assert_allclose(w, np_soft_top_k(np.asarray(r), 5, SEG > 0), **_tol(1e-3))
    # k above the number of real tokens: capped at the real count, all of them fully on.
    np.testing.assert_allclose(np.asarray(soft_top_k(r, T, valid)).sum(-1), [11, 10], **_tol(1e-3))

    def loss(p):
        return (apply(attn(5), p, X, SEG) ** 2).sum()

    g = jax.jit(jax.grad(loss))(PARAMS)
    for name in ("router_q", "router_kv"):
        gn = np.asarray(g[name])
        assert np.all(np.isfinite(gn)) and np.abs(gn).max() > 1e-4, name


@pytest.mark.parametrize("radius", [0, 4, 9, 40])  # 0, blocks of 4 (T not a multiple), of 9, radius > T
def test_blocked_local_attention_matches_numpy_over_many_blocks(radius):
    """The light branch's blocked attention at T = 37 (10 blocks of 4): every key within the radius, same
    segment, no other; packed segments and padding included."""
    Tl, Hl = 37, 2
    keys = jax.random.split(jax.random.PRNGKey(11), 3)
    q, k, v = (np.asarray(jax.random.normal(key, (B, Tl, Hl, D)), np.float32) for key in keys)
    seg = np.array([[1] * 15 + [2] * 18 + [0] * 4, [1] * 30 + [0] * 7], np.int32)
    exact = functools.partial(local_attention, precision=jax.lax.Precision.HIGHEST)  # on every backend
    y = np.asarray(jax.jit(exact, static_argnums=4)(q, k, v, seg, radius))
    ref = np.zeros((B, Tl, Hl, D))
    for b in range(B):
        for h in range(Hl):
            np_attend(q[b, :, h], k[b, :, h], v[b, :, h], [t for t in range(Tl) if seg[b, t]],
                      lambda t: [s for s in range(Tl) if seg[b, s] == seg[b, t] and abs(s - t) <= radius],
                      ref[b, :, h])
    np.testing.assert_allclose(y, ref, **_tol(1e-5, 1e-5))  # padding queries: zeros in both


def test_light_branch_memory_is_linear_in_length():
    """No array in the traced mixer has T² elements at T = 1024 (the dense band mask had B·T² of them)."""
    Tl, Cl = 1024, 8
    m = CoLT5Attention(num_heads=2, light_num_heads=1, local_radius=4, routed_fraction=0.125)
    x = jax.ShapeDtypeStruct((1, Tl, Cl), jnp.float32)
    params = jax.eval_shape(m.init, jax.random.PRNGKey(0), x)
    jaxpr = jax.make_jaxpr(m.apply)(params, x)

    def sizes(jx):
        for eqn in jx.eqns:
            yield from (int(np.prod(v.aval.shape)) for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from sizes(sub)

    biggest = max(sizes(jaxpr.jaxpr))
    assert biggest < Tl * Tl // 4, biggest  # heavy logits: 2 heads x 128²; light: 256 blocks x 4 x 12


def test_bfloat16_close_to_float32():
    y32 = np.asarray(apply(attn(5), PARAMS, X, SEG))
    y16 = apply(attn(5, dtype=jnp.bfloat16), PARAMS, jnp.asarray(X, jnp.bfloat16), SEG)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32)[SEG > 0], y32[SEG > 0],
                               **_tol(0.1, 0.05, jnp.bfloat16))


@pytest.mark.parametrize("k", [4, T])
def test_feedforward_matches_numpy_reference(k):
    f = CoLT5FeedForward(light_hidden_dim=5, heavy_hidden_dim=17, num_routed=k, router_temperature=EPS,
                         matmul_precision=PRECISION)
    p = nn.meta.unbox(f.init(jax.random.PRNGKey(2), jnp.asarray(X))["params"])
    y = np.asarray(jax.jit(lambda p: f.apply({"params": p}, X, segment_ids=SEG))(p))
    valid = SEG > 0
    np.testing.assert_allclose(y[valid], np_colt5_ffn(p, X, SEG, k)[valid], **_tol(2e-3, 2e-3))


def test_registry_builds_colt5():
    m = mixers.make_mixer("colt5", num_heads=H, causal=False, dtype=jnp.float32, param_dtype=jnp.float32,
                          local_radius=RADIUS, routed_fraction=0.3)
    assert isinstance(m, CoLT5Attention)
    y, _ = m.init_with_output(jax.random.PRNGKey(0), jnp.asarray(X))
    assert y.shape == X.shape


@pytest.mark.parametrize("kw, field", [
    (dict(causal=True), "causal"),
    (dict(num_heads=5), "num_heads"),
    (dict(light_num_heads=4), "light_num_heads"),
    (dict(local_radius=-1), "local_radius"),
    (dict(num_routed=-1), "num_routed"),
    (dict(routed_fraction=0.0), "routed_fraction"),
    (dict(router_temperature=0.0), "router_temperature"),
    (dict(router_iterations=0), "router_iterations"),
    (dict(attention_dropout=1.5), "attention_dropout"),
])
def test_bad_config_raises(kw, field):
    fields = dict(num_heads=H, num_routed=0) | kw
    with pytest.raises(ValueError, match=field):
        CoLT5Attention(**fields).init(jax.random.PRNGKey(0), jnp.asarray(X))


def test_bad_call_raises():
    with pytest.raises(ValueError, match="decode"):
        attn(5).init(jax.random.PRNGKey(0), jnp.asarray(X), decode=True)
    with pytest.raises(ValueError, match="segment_ids"):
        attn(5).init(jax.random.PRNGKey(0), jnp.asarray(X), segment_ids=jnp.ones((B, T - 1), jnp.int32))
    with pytest.raises(ValueError, match="heavy_hidden_dim"):
        CoLT5FeedForward(heavy_hidden_dim=-2).init(jax.random.PRNGKey(0), jnp.asarray(X))
    with pytest.raises(ValueError, match="dropout_rate"):
        CoLT5FeedForward(dropout_rate=-0.1).init(jax.random.PRNGKey(0), jnp.asarray(X))
