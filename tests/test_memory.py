"""kNN-memory attention against a float64 NumPy stream simulation (brute-force retrieval, Python-list FIFO)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tolerance

from lconv.nn import mixers
from lconv.nn.knn_memory import KNNMemoryAttention, reset_memory, retrieve_top_k

B, T, C, H = 2, 13, 12, 3
D = C // H
M, K = 20, 4  # memory_size (so the third window evicts), neighbours
WINDOWS = [np.asarray(jax.random.normal(jax.random.PRNGKey(w), (B, T, C)), np.float32) for w in range(3)]
ONES = np.ones((B, T), np.int32)
PRECISION = "highest"  # exact float32 on every backend, so float32's tolerances hold on all of them
MODEL = KNNMemoryAttention(num_heads=H, memory_size=M, num_neighbors=K, matmul_precision=PRECISION)
VARS = jax.jit(MODEL.init)(jax.random.PRNGKey(1), jnp.asarray(WINDOWS[0]))
PARAMS = dict(nn.meta.unbox(VARS["params"]), gate=jnp.array([-1.0, 0.5, 2.0]))  # distinct per-head gates
EMPTY = VARS["memory"]


def _tol(atol, rtol=1e-7, dtype=np.float32):
    return tolerance(dtype, PRECISION, atol=atol, rtol=rtol)


@functools.partial(jax.jit, static_argnums=0)
def step(m, params, mem, x, seg, reset):
    """One window of the stream loop: rows flagged in ``reset`` start a new document, then the layer runs."""
    mem = reset_memory(mem, reset)
    return m.apply({"params": params, "memory": mem}, x, segment_ids=seg, mutable=["memory"])


def run_stream(windows, segs=None, resets=None, m=MODEL):
    mem, ys = EMPTY, []
    for i, x in enumerate(windows):
        reset = np.zeros(B, bool) if resets is None else resets[i]
        y, upd = step(m, PARAMS, mem, jnp.asarray(x), ONES if segs is None else segs[i], reset)
        mem = upd["memory"]
        ys.append(np.asarray(y, np.float32))
    return ys, mem


# ---------------------------------------------------------------- float64 NumPy reference


def np_dense(p, x):
    return np.asarray(x, np.float64) @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)


def np_unit(a):
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def np_softmax_sum(scores, vals):
    p = np.exp(scores - scores.max())
    return (p / p.sum()) @ np.asarray(vals)


def np_stream(windows, resets=None):
    """Per row: a Python list FIFO of (k̂ [H, D], v [H, D]); read the top-K by brute-force sorting, then append."""
    P = {k: np.asarray(v, np.float64) if not isinstance(v, dict) else v for k, v in PARAMS.items()}
    tau, g = np.exp(P["log_scale"]), 1 / (1 + np.exp(-P["gate"]))
    memory, ys = [[] for _ in range(B)], []
    for i, x in enumerate(windows):
        q = np_unit(np_dense(P["query"], x).reshape(B, T, H, D)) * tau[:, None]
        k = np_unit(np_dense(P["key"], x).reshape(B, T, H, D))
        v = np_dense(P["value"], x).reshape(B, T, H, D)
        out = np.zeros((B, T, H, D))
        for b in range(B):
            if resets is not None and resets[i][b]:
                memory[b] = []
            for h in range(H):
                for t in range(T):
                    local = np_softmax_sum(np.array([q[b, t, h] @ k[b, s, h] for s in range(t + 1)]), v[b, :t + 1, h])
                    if not memory[b]:
                        out[b, t, h] = local
                        continue
                    scores = np.array([q[b, t, h] @ mk[h] for mk, _ in memory[b]])
                    top = np.argsort(-scores, kind="stable")[:K]
                    mem = np_softmax_sum(scores[top], np.array([memory[b][j][1][h] for j in top]))
                    out[b, t, h] = g[h] * mem + (1 - g[h]) * local
            memory[b] = (memory[b] + [(k[b, t], v[b, t]) for t in range(T)])[-M:]
        ys.append(np_dense(P["out"], out.reshape(B, T, C)))
    return ys, memory


# ---------------------------------------------------------------- tests


def test_stream_matches_numpy_reference_and_fifo_eviction():
    ys, mem = run_stream(WINDOWS)
    ref_ys, ref_mem = np_stream(WINDOWS)
    for y, ref in zip(ys, ref_ys):
        np.testing.assert_allclose(y, ref, **_tol(2e-5, 1e-4))
    # After 3 windows of 13 tokens, the FIFO of 20 holds the last 7 of window 2 and all of window 3, in order.
    assert np.all(np.asarray(mem["valid"]))
    for b in range(B):
        for name, i in (("keys", 0), ("values", 1)):
            np.testing.assert_allclose(np.asarray(mem[name][b]), np.stack([e[i] for e in ref_mem[b]]), **_tol(1e-5))


def test_retrieval_equals_brute_force_top_k():
    kq = jax.random.split(jax.random.PRNGKey(7), 3)
    q, keys = jax.random.normal(kq[0], (B, T, H, D)), jax.random.normal(kq[1], (B, M, H, D))
    valid = np.asarray(jax.random.bernoulli(kq[2], 0.7, (B, M)))
    scores, idx = (np.asarray(a) for a in retrieve_top_k(q, keys, jnp.asarray(valid), K))
    s = np.einsum("bthd,bmhd->bhtm", np.asarray(q, np.float64), np.asarray(keys, np.float64))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                cand = [m for m in range(M) if valid[b, m]]
                best = sorted(cand, key=lambda m: -s[b, h, t, m])[:K]
                assert set(idx[b, h, t]) == set(best)
                np.testing.assert_allclose(scores[b, h, t], s[b, h, t, best], **_tol(1e-5))


def test_memory_holds_only_past_windows():
    ys, mem = run_stream(WINDOWS[:1])
    # Window 1 reads an empty memory: its output is local attention alone, and it is written afterwards.
    no_mem = PARAMS | {"gate": jnp.full((H,), -50.0)}  # gate ≈ 0: local only
    y_local, _ = MODEL.apply({"params": no_mem, "memory": EMPTY}, WINDOWS[0], mutable=["memory"])
    np.testing.assert_allclose(ys[0], np.asarray(y_local), **_tol(1e-5))
    assert int(np.asarray(mem["valid"]).sum()) == B * T
    # Window 2's output does not depend on what window 2 itself writes: same output with a read-only memory.
    y2_ro = MODEL.apply({"params": PARAMS, "memory": mem}, WINDOWS[1], segment_ids=ONES)
    np.testing.assert_allclose(run_stream(WINDOWS[:2])[0][1], np.asarray(y2_ro), **_tol(1e-5))


def test_no_causal_leak_within_window():
    _, mem = run_stream(WINDOWS[:1])
    x2 = WINDOWS[1].copy()
    x2[:, 6:] += 3.0
    y1, y2 = (np.asarray(step(MODEL, PARAMS, mem, x, ONES, np.zeros(B, bool))[0]) for x in (WINDOWS[1], x2))
    np.testing.assert_allclose(y1[:, :6], y2[:, :6], **_tol(1e-6))
    assert np.abs(y1[:, 6:] - y2[:, 6:]).max() > 1e-3


def test_reset_memory_clears_only_the_flagged_rows():
    resets = [np.zeros(B, bool), np.array([True, False]), np.zeros(B, bool)]
    ys, _ = run_stream(WINDOWS[:2], resets=resets)
    ref_ys, _ = np_stream(WINDOWS[:2], resets=resets)
    np.testing.assert_allclose(ys[1], ref_ys[1], **_tol(2e-5, 1e-4))
    fresh = np_stream([WINDOWS[1]])[0][0]
    np.testing.assert_allclose(ys[1][0], fresh[0], **_tol(2e-5, 1e-4))  # row 0 forgot window 1
    assert np.abs(ys[1][1] - fresh[1]).max() > 1e-3  # row 1 remembered it
    # reset_memory is the only reset: positions restarting at 0 do not clear anything.
    _, mem = run_stream(WINDOWS[:1])
    pos = np.stack([np.arange(T), np.arange(T) + T]).astype(np.int32)
    y, upd = MODEL.apply({"params": PARAMS, "memory": mem}, WINDOWS[1], positions=pos, mutable=["memory"])
    np.testing.assert_allclose(np.asarray(y), run_stream(WINDOWS[:2])[0][1], **_tol(1e-5))
    assert list(np.asarray(upd["memory"]["valid"]).sum(-1)) == [M, M]
    # It works on a nested collection (a model's) and leaves the kept rows bit-identical.
    nested = {"decoder": {"layer_0": {"mixer": mem}, "layer_3": {"mixer": mem}}}
    cleared = reset_memory(nested, np.array([False, True]))
    for layer in ("layer_0", "layer_3"):
        got = cleared["decoder"][layer]["mixer"]
        for name in ("keys", "values", "valid"):
            np.testing.assert_array_equal(np.asarray(got[name][0]), np.asarray(mem[name][0]))
            assert not np.asarray(got[name][1]).any()


def test_no_memory_collection_means_no_past_windows():
    """A plain ``apply`` without the collection (sentence-level training) is the layer on an empty memory."""
    y_plain = MODEL.apply({"params": PARAMS}, WINDOWS[1])
    y_empty = MODEL.apply({"params": PARAMS, "memory": EMPTY}, WINDOWS[1])
    np.testing.assert_array_equal(np.asarray(y_plain), np.asarray(y_empty))
    _, mem = run_stream(WINDOWS[:1])
    assert np.abs(np.asarray(MODEL.apply({"params": PARAMS, "memory": mem}, WINDOWS[1])) - y_plain).max() > 1e-3


def test_packed_window_new_document_neither_reads_nor_keeps_old_memory():
    _, mem = run_stream(WINDOWS[:1])
    seg = np.array([[1] * 6 + [2] * 7, [1] * 10 + [0] * 3], np.int32)
    y, upd = step(MODEL, PARAMS, mem, jnp.asarray(WINDOWS[1]), seg, np.zeros(B, bool))
    # Row 0: segment 2 is a new document: it sees only itself, like a fresh window holding just those tokens.
    alone = np.zeros_like(WINDOWS[1])
    alone[0, :7] = WINDOWS[1][0, 6:]
    seg_alone = np.array([[1] * 7 + [0] * 6, [0] * T], np.int32)
    y_alone = np.asarray(step(MODEL, PARAMS, EMPTY, jnp.asarray(alone), seg_alone, np.zeros(B, bool))[0])
    np.testing.assert_allclose(np.asarray(y)[0, 6:], y_alone[0, :7], **_tol(1e-5))
    # The memory after the window: row 0 only segment 2 (7 entries), row 1 its 13 old + 10 real new (padding
    # is never written).
    assert list(np.asarray(upd["memory"]["valid"]).sum(-1)) == [7, 20]
    # A window that is all padding for a row neither reads nor changes that row's memory.
    seg_pad = np.array([[1] * T, [0] * T], np.int32)
    _, upd2 = step(MODEL, PARAMS, upd["memory"], jnp.asarray(WINDOWS[2]), seg_pad, np.zeros(B, bool))
    for name in ("keys", "values", "valid"):
        np.testing.assert_array_equal(np.asarray(upd2["memory"][name][1]), np.asarray(upd["memory"][name][1]))


def test_incremental_decoding_equals_full_pass_with_memory():
    _, mem = run_stream(WINDOWS[:1])
    full = np.asarray(MODEL.apply({"params": PARAMS, "memory": mem}, WINDOWS[1]))
    cache = MODEL.init(jax.random.PRNGKey(1), jnp.asarray(WINDOWS[1]), decode=True)["cache"]
    decode = jax.jit(lambda cache, x: MODEL.apply({"params": PARAMS, "memory": mem, "cache": cache}, x,
                                                  decode=True, mutable=["cache"]))
    outs = []
    for lo, hi in [(0, 1), (1, 2), (2, 7), (7, 8), (8, 13)]:
        y, upd = decode(cache, jnp.asarray(WINDOWS[1][:, lo:hi]))
        cache = upd["cache"]
        outs.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, **_tol(1e-5))


def test_bfloat16_close_to_float32():
    # Retrieve every stored entry: a discrete top-k may legitimately pick a different near-tie in bfloat16.
    m32, m16 = MODEL.clone(num_neighbors=M), MODEL.clone(num_neighbors=M, dtype=jnp.bfloat16)
    ys, _ = run_stream(WINDOWS[:2], m=m32)
    mem16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, EMPTY)
    for x in WINDOWS[:2]:
        y, upd = step(m16, PARAMS, mem16, jnp.asarray(x, jnp.bfloat16), ONES, np.zeros(B, bool))
        mem16 = upd["memory"]
    assert y.dtype == jnp.bfloat16 and mem16["keys"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), ys[1], **_tol(0.1, 0.05, jnp.bfloat16))


def test_registry_builds_knn_memory():
    m = mixers.make_mixer("knn_memory", num_heads=H, causal=True, dtype=jnp.float32, param_dtype=jnp.float32,
                          memory_size=M, num_neighbors=K)
    assert isinstance(m, KNNMemoryAttention)
    y, v = m.init_with_output(jax.random.PRNGKey(0), jnp.asarray(WINDOWS[0]))
    assert y.shape == (B, T, C) and v["memory"]["keys"].shape == (B, M, H, D)


@pytest.mark.parametrize("kw, field", [
    (dict(num_heads=5), "qkv_features"),
    (dict(memory_size=0), "memory_size"),
    (dict(num_neighbors=M + 1), "num_neighbors"),
    (dict(num_neighbors=0), "num_neighbors"),
    (dict(attention_dropout=-0.5), "attention_dropout"),
])
def test_bad_config_raises(kw, field):
    with pytest.raises(ValueError, match=field):
        KNNMemoryAttention(**(dict(num_heads=H, memory_size=M, num_neighbors=K) | kw)).init(
            jax.random.PRNGKey(0), jnp.asarray(WINDOWS[0]))


def test_bad_call_raises():
    with pytest.raises(ValueError, match="reset_B has batch"):
        reset_memory(EMPTY, jnp.zeros((B + 1,), bool))
    with pytest.raises(ValueError, match="reset_B must be"):
        reset_memory(EMPTY, jnp.zeros((B, 1), bool))
    with pytest.raises(ValueError, match="memory_size and the batch size"):
        MODEL.apply({"params": PARAMS, "memory": EMPTY}, WINDOWS[0][:1])
    with pytest.raises(ValueError, match="causal"):
        MODEL.clone(causal=False).init(jax.random.PRNGKey(0), jnp.asarray(WINDOWS[0]), decode=True)
