"""Attention mixers against float64 NumPy loop references, plus cross-attention, dropout and learning checks.

Causality, packing (packed = separate), padding and decoding = the full pass are the mixer contract, checked for
every form of these mixers by lconv.testing.check_mixer in tests/test_mixers.py."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lconv.errors import UserError
from lconv.nn import mixers
from lconv.nn.attention import CrossAttention, FixedAttention, HadamardAttention, SelfAttention

B, T, C, H = 2, 13, 12, 3
D = C // H
L = 16  # max_len of the position tables
X = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (B, T, C)), np.float32)
# Row 0: two packed examples (7 + 4 tokens) and 2 padding tokens; row 1: one example, 3 padding tokens.
SEG = np.array([[1] * 7 + [2] * 4 + [0] * 2, [1] * 10 + [0] * 3], np.int32)
POS = np.array([list(range(7)) + list(range(4)) + [0, 0], list(range(10)) + [0] * 3], np.int32)

MIXERS = {  # name -> (class, extra fields)
    "attention": (SelfAttention, {}),
    "fixed": (FixedAttention, dict(max_len=L)),
    "fixed_factorized_mix": (FixedAttention, dict(max_len=L, factorized_rank=2, mix_dot_product=True)),
    "hadamard": (HadamardAttention, dict(max_len=L)),
    "hadamard_projected": (HadamardAttention, dict(max_len=L, project_qk=True)),
}


@functools.cache
def _jitted(m, mutable, flags):
    return jax.jit(lambda v, *a, **kw: m.apply(v, *a, **kw, **dict(flags), mutable=mutable))


def run(m, variables, *args, mutable=False, **kw):
    """``m.apply`` under a cached ``jax.jit`` (eager dispatch recompiles every op per new shape: slower)."""
    flags = tuple(sorted((k, v) for k, v in kw.items() if isinstance(v, bool)))
    arrays = {k: v for k, v in kw.items() if not isinstance(v, bool)}
    mutable = tuple(mutable) if mutable else False
    return _jitted(m, mutable, flags)(variables, *args, **arrays)


@functools.cache
def _params(name):
    """Parameters do not depend on ``causal``: initialise each mixer once (eagerly) and share."""
    cls, extra = MIXERS[name]
    params = nn.meta.unbox(cls(num_heads=H, **extra).init(jax.random.PRNGKey(1), jnp.asarray(X))["params"])
    if "weight" in params:  # Hadamard's table starts at ones; make it non-trivial for the tests
        params = dict(params, weight=1 + 0.5 * jax.random.normal(jax.random.PRNGKey(2), params["weight"].shape))
    return params


def build(name, causal, **kw):
    """A mixer whose float32 dots are float32 on every backend (a GPU's default is TF32): the references are
    float64 loops. What the default precision does is tests/test_precision.py's and test_matmul_precision_*."""
    cls, extra = MIXERS[name]
    return cls(num_heads=H, causal=causal, **{"matmul_precision": "highest", **extra, **kw}), _params(name)


# ---------------------------------------------------------------- float64 NumPy references (explicit loops)


def np_dense(p, x):
    return np.asarray(x, np.float64) @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)


def np_table(params, name):
    """The [H, L, L] position table of Fixed / Hadamard attention."""
    if name.startswith("fixed") and "r1" in params:
        return np.einsum("hlr,hrm->hlm", np.asarray(params["r1"], np.float64), np.asarray(params["r2"], np.float64))
    return np.asarray(params["logits" if name.startswith("fixed") else "weight"], np.float64)


def np_mixer(name, params, x, seg, pos, causal):
    """y[b, t] = Out(sum_s softmax_s(logit(b, h, t, s) over visible s) V[b, s, h]) with loops over b, h, t."""
    x = np.asarray(x, np.float64)
    Bx, Tx, _ = x.shape
    v = np_dense(params["value"], x).reshape(Bx, Tx, H, D)
    if "query" in params:
        q = np_dense(params["query"], x).reshape(Bx, Tx, H, D)
        k = np_dense(params["key"], x).reshape(Bx, Tx, H, D)
    else:  # Hadamard, source form: Q = K = the input split into heads
        q = k = x.reshape(Bx, Tx, H, D)
    out = np.zeros((Bx, Tx, H, D))
    for b in range(Bx):
        for h in range(H):
            for t in range(Tx):
                if seg[b, t] == 0:
                    continue
                ss = [s for s in range(Tx) if seg[b, s] == seg[b, t] and (not causal or s <= t)]
                dot = np.array([q[b, t, h] @ k[b, s, h] / np.sqrt(D) for s in ss])
                if name == "attention":
                    logit = dot
                else:
                    w = np.array([np_table(params, name)[h, pos[b, t], pos[b, s]] for s in ss])
                    if name == "fixed":
                        logit = w
                    elif name == "fixed_factorized_mix":
                        a = 1 / (1 + np.exp(-np.asarray(params["mix_logit"], np.float64)[h]))
                        logit = a * w + (1 - a) * dot
                    else:
                        logit = w * dot
                p = np.exp(logit - logit.max())
                p /= p.sum()
                out[b, t, h] = sum(pi * v[b, s, h] for pi, s in zip(p, ss))
    return np_dense(params["out"], out.reshape(Bx, Tx, H * D))


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(MIXERS))
@pytest.mark.parametrize("causal", [False, True])
def test_matches_numpy_reference_with_packing_and_padding(name, causal):
    m, params = build(name, causal)
    y = run(m, {"params": params}, jnp.asarray(X), segment_ids=jnp.asarray(SEG), positions=jnp.asarray(POS))
    ref = np_mixer(name, params, X, SEG, POS, causal)
    valid = SEG > 0
    np.testing.assert_allclose(np.asarray(y)[valid], ref[valid], atol=2e-5, rtol=1e-4)


def test_cross_attention_matches_numpy_and_masks_memory_padding():
    S = 7
    mem = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (B, S, C)), np.float32)
    mseg = np.array([[1] * 5 + [0] * 2, [1] * 7], np.int32)
    m = CrossAttention(num_heads=H, matmul_precision="highest")
    params = nn.meta.unbox(m.init(jax.random.PRNGKey(1), jnp.asarray(X), jnp.asarray(mem))["params"])
    y = np.asarray(run(m, {"params": params}, jnp.asarray(X), jnp.asarray(mem),
                           encoded_segment_ids=jnp.asarray(mseg)))
    q = np_dense(params["query"], X).reshape(B, T, H, D)
    k = np_dense(params["key"], mem).reshape(B, S, H, D)
    v = np_dense(params["value"], mem).reshape(B, S, H, D)
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                ss = [s for s in range(S) if mseg[b, s]]
                lg = np.array([q[b, t, h] @ k[b, s, h] for s in ss]) / np.sqrt(D)
                p = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum()
                out[b, t, h] = sum(pi * v[b, s, h] for pi, s in zip(p, ss))
    np.testing.assert_allclose(y, np_dense(params["out"], out.reshape(B, T, C)), atol=2e-5, rtol=1e-4)

    # Decoding: the projected memory is cached by the first call and read back by later ones (a later call's
    # encoded_BSC is not projected again: garbage of the same shape gives the same output).
    kwargs = dict(encoded_segment_ids=jnp.asarray(mseg), decode=True)
    first, vars_ = m.apply({"params": params}, jnp.asarray(X), jnp.asarray(mem), mutable=["cache"], **kwargs)
    assert set(vars_["cache"]) == {"beam_invariant_key", "beam_invariant_value", "beam_invariant_segment_ids"}
    later, _ = m.apply({"params": params, **vars_}, jnp.asarray(X), jnp.full_like(jnp.asarray(mem), 1e3),
                       mutable=["cache"], **kwargs)
    np.testing.assert_allclose(np.asarray(first), y, atol=1e-6)
    np.testing.assert_allclose(np.asarray(later), y, atol=1e-6)
    # Beam search tiles the queries (3 consecutive rows per memory row) but not the cached memory.
    tiled_x = jnp.repeat(jnp.asarray(X[:, ::-1]), 3, axis=0)  # other queries than the cache's first call
    beams = m.apply({"params": params, **vars_}, tiled_x, jnp.repeat(jnp.asarray(mem), 3, axis=0),
                    encoded_segment_ids=jnp.repeat(jnp.asarray(mseg), 3, axis=0), decode=True, mutable=["cache"])[0]
    expected = run(m, {"params": params}, jnp.asarray(X[:, ::-1]), jnp.asarray(mem),
                   encoded_segment_ids=jnp.asarray(mseg))
    np.testing.assert_allclose(np.asarray(beams), np.repeat(np.asarray(expected), 3, axis=0), atol=1e-5)


@pytest.mark.parametrize("name", ["attention", "fixed_factorized_mix", "hadamard"])
def test_bfloat16_close_to_float32(name):
    m, params = build(name, True)
    y32 = np.asarray(run(m, {"params": params}, jnp.asarray(X)))
    m16 = m.clone(dtype=jnp.bfloat16)
    y16 = run(m16, {"params": params}, jnp.asarray(X, jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.1, rtol=0.05)


def test_attention_dropout_only_in_training():
    m, params = build("attention", False, attention_dropout=0.3)
    det = run(m, {"params": params}, jnp.asarray(X))
    ref = build("attention", False)[0].apply({"params": params}, jnp.asarray(X))
    np.testing.assert_allclose(det, ref, atol=1e-6)
    y1 = run(m, {"params": params}, jnp.asarray(X), deterministic=False, rngs={"dropout": jax.random.PRNGKey(4)})
    assert np.all(np.isfinite(y1)) and np.abs(np.asarray(y1) - np.asarray(det)).max() > 1e-3


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_fixed_attention_learns_to_reverse_a_sequence():
    """A position-only task: output token t = input token T-1-t. Fixed attention must route by position."""
    V, Tr, Cr = 7, 11, 16

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tok_BT):
            x = nn.Embed(V, Cr)(tok_BT)
            x = FixedAttention(num_heads=2, max_len=Tr, factorized_rank=0)(x)
            return nn.Dense(V)(x)

    model = Model()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, Tr), jnp.int32))
    opt = optax.adam(0.05)

    def loss_fn(p, tok):
        logits = model.apply(p, tok)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, ::-1]).mean()

    @jax.jit
    def step(p, s, key):
        tok = jax.random.randint(key, (32, Tr), 0, V)
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    state = opt.init(params)
    for i in range(200):
        params, state, loss = step(params, state, jax.random.PRNGKey(i))
    tok = jax.random.randint(jax.random.PRNGKey(10_000), (64, Tr), 0, V)
    acc = float((model.apply(params, tok).argmax(-1) == tok[:, ::-1]).mean())
    assert acc > 0.98 and float(loss) < 0.1, (acc, float(loss))


def test_registry_builds_each_mixer():
    for name, cls in [("attention", SelfAttention), ("fixed", FixedAttention), ("hadamard", HadamardAttention)]:
        m = mixers.make_mixer(name, num_heads=H, causal=True, dtype=jnp.float32, param_dtype=jnp.float32)
        assert isinstance(m, cls)
        y, _ = m.init_with_output(jax.random.PRNGKey(0), jnp.asarray(X))
        assert y.shape == X.shape


@pytest.mark.parametrize("cls, kw, field", [
    (SelfAttention, dict(num_heads=5), "qkv_features"),
    (SelfAttention, dict(num_heads=0), "num_heads"),
    (SelfAttention, dict(num_heads=3, attention_dropout=1.0), "attention_dropout"),
    (SelfAttention, dict(num_heads=3, qkv_features=10), "qkv_features"),
    (FixedAttention, dict(num_heads=3, max_len=8), "max_len"),
    (FixedAttention, dict(num_heads=3, max_len=L, factorized_rank=-1), "factorized_rank"),
    (HadamardAttention, dict(num_heads=5, qkv_features=10), "num_heads"),
    (HadamardAttention, dict(num_heads=3, max_len=8), "max_len"),
])
def test_bad_config_raises(cls, kw, field):
    with pytest.raises(ValueError, match=field):
        cls(**kw).init(jax.random.PRNGKey(0), jnp.asarray(X))


@pytest.mark.parametrize("cls, kw", [(SelfAttention, {}), (FixedAttention, dict(max_len=L)),
                                     (HadamardAttention, dict(max_len=L))])
def test_bad_call_raises(cls, kw):
    m = cls(num_heads=H, **kw)
    with pytest.raises(ValueError, match="x_BTC"):
        m.init(jax.random.PRNGKey(0), jnp.asarray(X[0]))
    with pytest.raises(ValueError, match="segment_ids"):
        m.init(jax.random.PRNGKey(0), jnp.asarray(X), segment_ids=jnp.ones((B, T + 1), jnp.int32))
    with pytest.raises(ValueError, match="causal"):
        m.init(jax.random.PRNGKey(0), jnp.asarray(X), decode=True)
    if cls is not SelfAttention:
        with pytest.raises(ValueError, match="max_len"):
            m.init(jax.random.PRNGKey(0), jnp.asarray(X), positions=jnp.full((B, T), L, jnp.int32))


def test_cross_attention_gradients_match_float64_central_differences():
    """Every parameter's gradient (the Q/K/V biases' included, whose cotangent is written out once on CPU) and the
    inputs' equal central differences of a float64 NumPy forward pass."""
    S, rng = 5, np.random.default_rng(7)
    x, mem = rng.normal(size=(B, 4, C)).astype(np.float32), rng.normal(size=(B, S, C)).astype(np.float32)
    mseg, weights = np.array([[1, 1, 1, 0, 0], [1] * 5], np.int32), rng.normal(size=(B, 4, C))
    m = CrossAttention(num_heads=H, matmul_precision="highest")
    params = nn.meta.unbox(m.init(jax.random.PRNGKey(1), jnp.asarray(x), jnp.asarray(mem))["params"])
    params = jax.tree.map(lambda p: p + 0.1 * rng.normal(size=p.shape).astype(np.float32), params)  # biases != 0

    def np_loss(params, x, mem):
        q, k, v = (np_dense(params[n], a).reshape(B, -1, H, D) for n, a in [("query", x), ("key", mem),
                                                                             ("value", mem)])
        logits = np.where(mseg[:, None, None, :] > 0, np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D), -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        out = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v).reshape(B, -1, C)
        return float((np_dense(params["out"], out) * weights).sum())

    loss = lambda p, x, mem: jnp.sum(m.apply({"params": p}, x, mem, encoded_segment_ids=jnp.asarray(mseg))  # noqa: E731
                                     * weights)
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(params, jnp.asarray(x), jnp.asarray(mem))
    args64 = jax.tree.map(lambda a: np.asarray(a, np.float64), (params, x, mem))
    leaves, tree = jax.tree.flatten(args64)
    for leaf, grad in zip(leaves, jax.tree.leaves(grads)):
        numeric = np.zeros_like(leaf)
        for i in np.ndindex(leaf.shape):
            old = leaf[i]
            leaf[i] = old + 1e-6
            up = np_loss(*jax.tree.unflatten(tree, leaves))
            leaf[i] = old - 1e-6
            numeric[i] = (up - np_loss(*jax.tree.unflatten(tree, leaves))) / 2e-6
            leaf[i] = old
        np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_kernel_in_the_module_matches_numpy_reference(causal):
    """attention_impl='chunked' (lconv.ops.flash): the same numbers as the reference, packing and padding kept."""
    m, params = build("attention", causal, attention_impl="chunked")
    y = run(m, {"params": params}, jnp.asarray(X), segment_ids=jnp.asarray(SEG))
    ref = np_mixer("attention", params, X, SEG, POS, causal)
    valid = SEG > 0
    np.testing.assert_allclose(np.asarray(y)[valid], ref[valid], atol=2e-5, rtol=1e-4)


def test_cross_attention_kernels_agree():
    mem = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (B, 7, C)), np.float32)
    mseg = np.array([[1] * 5 + [0] * 2, [1] * 7], np.int32)
    m = CrossAttention(num_heads=H, attention_impl="xla", matmul_precision="highest")
    params = nn.meta.unbox(m.init(jax.random.PRNGKey(1), jnp.asarray(X), jnp.asarray(mem))["params"])
    kw = dict(query_segment_ids=jnp.asarray(SEG), encoded_segment_ids=jnp.asarray(mseg))
    ys = [run(m.clone(attention_impl=impl), {"params": params}, jnp.asarray(X), jnp.asarray(mem), **kw)
          for impl in ("xla", "chunked")]
    np.testing.assert_allclose(np.asarray(ys[1]), np.asarray(ys[0]), atol=1e-6)


def _dot_precisions(m, *args):
    """The precision attribute of every dot in ``m.apply``'s lowered program."""
    params = m.init(jax.random.PRNGKey(0), *args)["params"]
    text = jax.jit(lambda p, *a: m.apply({"params": p}, *a)).lower(params, *args).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) >= 6, len(dots)  # four projections, the logits and the value sum at least
    return {("HIGHEST" if "HIGHEST" in d else "DEFAULT" if "DEFAULT" in d or "precision" not in d else "other")
            for d in dots}


@pytest.mark.parametrize("cls, extra", [(SelfAttention, {}), (SelfAttention, dict(attention_impl="chunked")),
                                        (HadamardAttention, dict(max_len=L, project_qk=True)),
                                        (FixedAttention, dict(max_len=L, factorized_rank=2, mix_dot_product=True))])
def test_matmul_precision_reaches_every_dot(cls, extra):
    """matmul_precision (a model field) sets the projections' and the attention dots' precision, none left out."""
    assert cls.model_fields["matmul_precision"] == "matmul_precision"
    x = jnp.asarray(X)
    assert _dot_precisions(cls(num_heads=H, causal=True, matmul_precision="highest", **extra), x) == {"HIGHEST"}
    assert _dot_precisions(cls(num_heads=H, causal=True, **extra), x) == {"DEFAULT"}
    m = CrossAttention(num_heads=H, matmul_precision="highest")
    assert _dot_precisions(m, x, jnp.asarray(X[:, :5])) == {"HIGHEST"}


@pytest.mark.parametrize("cls, kw, field", [
    (SelfAttention, dict(matmul_precision="exact"), "matmul precision"),
    (SelfAttention, dict(attention_impl="flash"), "attention_impl"),
    (HadamardAttention, dict(max_len=L, matmul_precision="exact"), "matmul precision"),
])
def test_bad_kernel_fields_raise(cls, kw, field):
    with pytest.raises(UserError, match=field):
        cls(num_heads=H, **kw).init(jax.random.PRNGKey(0), jnp.asarray(X))
