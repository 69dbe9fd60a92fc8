"""lconv.ops against the float64 loop reference: every impl, padding, kernel size, head count, and the edge cases."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from reference import conv_reference, tolerance

from lconv import ops
from lconv.ops import shift as shift_conv

B, T, C = 2, 13, 12  # prime-ish T so tiling remainders show up
# "pallas" runs in interpret mode on CPU (slow): tests/test_pallas_conv.py covers it against the same references.
LIGHT = [i for i in ops.LIGHT_IMPLS if i not in ("auto", "pallas")]
DYNAMIC = [i for i in ops.DYNAMIC_IMPLS if i not in ("auto", "pallas")]
# The ops' dots run at lconv.ops.precision.CONV_PRECISION (HIGHEST) whatever the model's setting: float32 results
# are exact on every backend, so these tolerances hold on all of them; bfloat16 inputs get bfloat16's.
EXACT = tolerance(np.float32, "highest", atol=1e-5)
BF16 = tolerance(jnp.bfloat16, "highest", rtol=2e-2, atol=5e-2)


def _inputs(K, H, seed=0, T=T):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, C)).astype(np.float32)
    w_light = rng.normal(size=(H, K)).astype(np.float32)
    w_dyn = rng.normal(size=(B, T, H, K)).astype(np.float32)
    return x, w_light, w_dyn


def _packed_segments():
    # Row 0: three segments then padding; row 1: one segment of 5 then padding then a segment (padding mid-row).
    return np.array([[1] * 4 + [2] * 5 + [3] * 2 + [0] * 2, [1] * 5 + [0] * 2 + [2] * 6], np.int32)


# K=1 trivial; 3/7 odd; 4 even (causal or explicit padding); 31 > T exercises halos longer than the sequence.
CASES = [(K, P, H) for K in (1, 3, 4, 7, 31) for P in sorted({0, K // 2, K - 1}) for H in (1, 3, 4)]


@pytest.mark.parametrize("op", ["light", "dynamic"])
@pytest.mark.parametrize("K,P,H", CASES)
def test_conv_matches_reference(op, K, P, H):
    x, w_light, w_dynamic = _inputs(K, H)
    w, conv, impls = (w_light, ops.light_conv, LIGHT) if op == "light" else (w_dynamic, ops.dynamic_conv, DYNAMIC)
    want = conv_reference(x, w, P)
    for impl in impls:
        got = conv(jnp.asarray(x), jnp.asarray(w), P, impl=impl)
        np.testing.assert_allclose(got, want, **tolerance(np.float32, "highest", rtol=1e-5, atol=1e-5),
                                   err_msg=impl)


@pytest.mark.parametrize("block_size", [1, 4, 5, 13, 64])
def test_band_any_tile_length(block_size):
    """Tiles shorter than the halo are widened; tiles longer than T are one tile; remainders are cut."""
    K, P, H = 7, 3, 3
    x, w, wd = _inputs(K, H)
    got = ops.light_conv(jnp.asarray(x), jnp.asarray(w), P, impl="band", block_size=block_size)
    np.testing.assert_allclose(got, conv_reference(x, w, P), **EXACT)
    got = ops.dynamic_conv(jnp.asarray(x), jnp.asarray(wd), P, impl="band", block_size=block_size)
    np.testing.assert_allclose(got, conv_reference(x, wd, P), **EXACT)


@pytest.mark.parametrize("K,P", [(3, 1), (7, 6), (31, 15)])
def test_segments_match_reference_and_separate_sequences(K, P):
    H = 3
    x, w, wd = _inputs(K, H)
    seg = _packed_segments()
    for impl in LIGHT:
        got = ops.light_conv(jnp.asarray(x), jnp.asarray(w), P, impl=impl, segment_ids=jnp.asarray(seg))
        np.testing.assert_allclose(got, conv_reference(x, w, P, seg), **EXACT, err_msg=impl)
    for impl in DYNAMIC:
        got = ops.dynamic_conv(jnp.asarray(x), jnp.asarray(wd), P, impl=impl, segment_ids=jnp.asarray(seg))
        np.testing.assert_allclose(got, conv_reference(x, wd, P, seg), **EXACT, err_msg=impl)
    # Each packed segment equals the op run on that segment alone.
    packed = np.asarray(ops.dynamic_conv(jnp.asarray(x), jnp.asarray(wd), P, segment_ids=jnp.asarray(seg)))
    for b in range(B):
        for s in set(seg[b]) - {0}:
            idx = np.flatnonzero(seg[b] == s)
            alone = ops.dynamic_conv(jnp.asarray(x[b : b + 1, idx]), jnp.asarray(wd[b : b + 1, idx]), P)
            np.testing.assert_allclose(packed[b, idx], np.asarray(alone)[0], **EXACT)
        np.testing.assert_array_equal(packed[b, seg[b] == 0], 0.0)  # padding outputs zero


def test_causal_conv_never_reads_the_future():
    K, H = 7, 3
    x, w, wd = _inputs(K, H)
    rng = np.random.default_rng(1)
    for t in (0, 5, T - 2):
        x2 = x.copy()
        x2[:, t + 1 :] = rng.normal(size=x2[:, t + 1 :].shape)
        for impl in LIGHT:
            y1 = ops.light_conv(jnp.asarray(x), jnp.asarray(w), K - 1, impl=impl)
            y2 = ops.light_conv(jnp.asarray(x2), jnp.asarray(w), K - 1, impl=impl)
            np.testing.assert_array_equal(y1[:, : t + 1], y2[:, : t + 1], err_msg=impl)
        for impl in DYNAMIC:
            y1 = ops.dynamic_conv(jnp.asarray(x), jnp.asarray(wd), K - 1, impl=impl)
            y2 = ops.dynamic_conv(jnp.asarray(x2), jnp.asarray(wd), K - 1, impl=impl)
            np.testing.assert_array_equal(y1[:, : t + 1], y2[:, : t + 1], err_msg=impl)


@pytest.mark.parametrize("impl", LIGHT)
def test_light_conv_gradients(impl):
    x, w, _ = _inputs(5, 3, T=7)
    f = lambda x, w: ops.light_conv(x, w, 2, impl=impl)  # noqa: E731
    check_grads(f, (jnp.asarray(x), jnp.asarray(w)), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("impl", DYNAMIC)
def test_dynamic_conv_gradients(impl):
    x, _, w = _inputs(5, 3, T=7)
    seg = jnp.asarray(np.array([[1, 1, 1, 2, 2, 0, 0], [1] * 7], np.int32))
    f = lambda x, w: ops.dynamic_conv(x, w, 4, impl=impl, segment_ids=seg)  # noqa: E731
    check_grads(f, (jnp.asarray(x), jnp.asarray(w)), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("K", [1, 4, 7])
def test_incremental_chunks_equal_full_causal_pass(K):
    H = 3
    x, w, wd = _inputs(K, H)
    full_light = ops.light_conv(jnp.asarray(x), jnp.asarray(w), K - 1)
    full_dyn = ops.dynamic_conv(jnp.asarray(x), jnp.asarray(wd), K - 1)
    state_l = state_d = ops.init_conv_state(B, K, C)
    outs_l, outs_d = [], []
    for start, stop in [(0, 1), (1, 2), (2, 6), (6, 7), (7, 13)]:  # chunks of 1 and of several positions
        y, state_l = ops.light_conv_step(jnp.asarray(x[:, start:stop]), state_l, jnp.asarray(w))
        outs_l.append(y)
        y, state_d = ops.dynamic_conv_step(jnp.asarray(x[:, start:stop]), state_d, jnp.asarray(wd[:, start:stop]))
        outs_d.append(y)
        assert state_l.shape == (B, K - 1, C)  # the state never grows with the output length
    np.testing.assert_allclose(jnp.concatenate(outs_l, 1), full_light, **EXACT)
    np.testing.assert_allclose(jnp.concatenate(outs_d, 1), full_dyn, **EXACT)


def test_bfloat16_within_tolerance_and_keeps_dtype():
    K, P, H = 7, 3, 3
    x, w, wd = _inputs(K, H)
    w, wd = np.asarray(jax.nn.softmax(w)), np.asarray(jax.nn.softmax(wd))  # normalised kernels, as in use
    xb = jnp.asarray(x, jnp.bfloat16)
    for impl in LIGHT:
        y = ops.light_conv(xb, jnp.asarray(w), P, impl=impl)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y, np.float32), conv_reference(x, w, P), **BF16)
    for impl in DYNAMIC:
        y = ops.dynamic_conv(xb, jnp.asarray(wd), P, impl=impl)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y, np.float32), conv_reference(x, wd, P), **BF16)


def test_jit_and_vmap():
    K, P, H = 7, 3, 3
    x, w, wd = _inputs(K, H)
    want = conv_reference(x, wd, P)
    jitted = jax.jit(lambda x, w: ops.dynamic_conv(x, w, P, impl="band"))
    np.testing.assert_allclose(jitted(jnp.asarray(x), jnp.asarray(wd)), want, **EXACT)
    # vmap over a leading "model" axis: per-example calls of batch 1 stacked back.
    per_example = jax.vmap(lambda x1, w1: ops.dynamic_conv(x1[None], w1[None], P)[0])
    np.testing.assert_allclose(per_example(jnp.asarray(x), jnp.asarray(wd)), want, **EXACT)
    vmapped_light = jax.vmap(lambda x1: ops.light_conv(x1[None], jnp.asarray(w), P, impl="conv")[0])
    np.testing.assert_allclose(vmapped_light(jnp.asarray(x)), conv_reference(x, w, P), **EXACT)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x, w: ops.light_conv(x, jnp.ones((5, 3)), 1), "divisible"),  # C=12 % H=5
        (lambda x, w: ops.light_conv(x, jnp.ones((3,)), 1), "weight must be"),
        (lambda x, w: ops.light_conv(x, w, 3), "padding_left"),  # K=3: 0..2
        (lambda x, w: ops.light_conv(x, w, -1), "padding_left"),
        (lambda x, w: ops.light_conv(x[0], w, 1), "x must be"),
        (lambda x, w: ops.light_conv(x, w, 1, impl="fft"), "impl"),
        (lambda x, w: ops.dynamic_conv(x, jnp.ones((B, T, 3)), 1), "weight must be"),
        (lambda x, w: ops.dynamic_conv(x, jnp.ones((B, T + 1, 3, 3)), 1), "weight must be"),
        (lambda x, w: ops.dynamic_conv(x, jnp.ones((B, T, 3, 3)), 1, impl="conv"), "impl"),
        (lambda x, w: ops.light_conv(x, w, 1, segment_ids=jnp.ones((B, T + 1), jnp.int32)), "segment_ids"),
        (lambda x, w: ops.light_conv(x, w, 1, segment_ids=jnp.ones((B, T))), "segment_ids"),
        (lambda x, w: ops.light_conv_step(x, jnp.zeros((B, 1, C)), w), "state"),
        (lambda x, w: ops.light_conv(x, w, 1, impl="band", block_size=0), "block_size"),
    ],
)
def test_bad_input_raises_a_clear_error(call, message):
    x, w, _ = _inputs(3, 3)
    with pytest.raises(ValueError, match=message):
        call(jnp.asarray(x), jnp.asarray(w))


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
@pytest.mark.parametrize("chunk_tokens", [5, 8, 16])
def test_shift_blocks_match_reference(monkeypatch, chunk_tokens):
    """The "shift" impl loops over blocks: pieces of rows (the last one overlapping) or groups of whole rows."""
    monkeypatch.setattr(shift_conv, "CHUNK_TOKENS", chunk_tokens)
    for K, P in [(31, 15), (4, 3), (3, 0)]:
        x, w, wd = _inputs(K, 4)
        seg = jnp.asarray(_packed_segments())
        got = ops.light_conv(jnp.asarray(x), jnp.asarray(w), P, impl="shift")
        np.testing.assert_allclose(got, conv_reference(x, w, P), **EXACT)
        got = ops.dynamic_conv(jnp.asarray(x), jnp.asarray(wd), P, impl="shift", segment_ids=seg)
        np.testing.assert_allclose(got, conv_reference(x, wd, P, np.asarray(seg)), **EXACT)
        # Gradients against the unfold impl (autodiff of a plain einsum).
        ct = np.random.default_rng(K).normal(size=x.shape).astype(np.float32)
        for op, weight in [(ops.light_conv, w), (ops.dynamic_conv, wd)]:
            grads = {
                impl: jax.grad(lambda x, w, op=op, P=P, impl=impl, ct=ct: jnp.vdot(op(x, w, P, impl=impl), ct),
                               argnums=(0, 1))(jnp.asarray(x), jnp.asarray(weight))
                for impl in ("shift", "unfold")
            }
            for got, want in zip(grads["shift"], grads["unfold"]):
                np.testing.assert_allclose(got, want, **tolerance(np.float32, "highest", rtol=1e-4, atol=1e-4))
