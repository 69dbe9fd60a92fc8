"""lconv.nn.conv: fairseq's parameterisation, DropConnect, the GLU block, decoding, and errors, against NumPy."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import conv_reference, sigmoid, softmax, tolerance

from lconv.nn import conv as layers
from lconv.nn import mixers

B, T, C, H = 2, 11, 12, 3
SEG = np.array([[1] * 6 + [2] * 3 + [0] * 2, [1] * 11], np.int32)
# Modules compared with float64 references run their projections at "highest": exact float32 on every backend, so the
# tolerances are those of float32 everywhere (the conv itself is always exact; lconv.ops.precision).
EXACT = tolerance(np.float32, "highest", atol=1e-5)


def _x(seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, T, C)).astype(np.float32))


def _params(variables):
    return nn.meta.unbox(variables)["params"]


@pytest.mark.parametrize("causal,K", [(False, 5), (True, 4)])
def test_lightweight_conv_is_softmaxed_kernel_plus_bias(causal, K):
    m = layers.LightweightConv1d(num_heads=H, kernel_size=K, causal=causal, use_bias=True)
    x = _x()
    v = m.init(jax.random.key(0), x)
    p = _params(v)
    bound = (6.0 / (K + H * K)) ** 0.5  # xavier-uniform of fairseq's [H, 1, K] weight
    assert p["weight"].shape == (H, K) and np.abs(p["weight"]).max() <= bound
    assert np.abs(p["weight"]).max() > 0.5 * bound
    p["bias"] = jnp.arange(C, dtype=jnp.float32) / 10
    y = m.apply({"params": p}, x, segment_ids=jnp.asarray(SEG))
    P = K - 1 if causal else K // 2
    want = conv_reference(x, softmax(p["weight"]), P, SEG) + np.asarray(p["bias"])
    np.testing.assert_allclose(y, want, **EXACT)


def test_weight_softmax_off_uses_raw_kernel():
    m = layers.LightweightConv1d(num_heads=H, kernel_size=3, weight_softmax=False)
    x = _x()
    v = m.init(jax.random.key(0), x)
    np.testing.assert_allclose(m.apply(v, x), conv_reference(x, _params(v)["weight"], 1), **EXACT)


def test_dynamic_conv_predicts_head_major_kernels_from_its_input():
    K = 5
    m = layers.DynamicConv1d(num_heads=H, kernel_size=K, causal=True, matmul_precision="highest")
    x = _x()
    v = m.init(jax.random.key(0), x)
    kernel = np.asarray(_params(v)["weight_linear"]["kernel"])
    assert kernel.shape == (C, H * K) and np.abs(kernel).max() <= 1 / np.sqrt(C)  # PyTorch Linear default init
    logits = np.asarray(x, np.float64) @ kernel  # [B, T, H*K], feature h*K + k
    want = conv_reference(x, softmax(logits.reshape(B, T, H, K)), K - 1, SEG)
    np.testing.assert_allclose(m.apply(v, x, segment_ids=jnp.asarray(SEG)), want, **EXACT)


@pytest.mark.parametrize("cls", [layers.LightweightConv1d, layers.DynamicConv1d])
def test_dropconnect_drops_and_rescales_the_normalised_kernel(cls):
    """An impulse input reads the effective kernel back; DropConnect entries are 0 or w / (1 - p)."""
    K, p_drop, t0 = 7, 0.4, 8
    m = cls(num_heads=H, kernel_size=K, causal=True, weight_dropout=p_drop)
    x = np.zeros((B, T, C), np.float32)
    x[:, t0] = 1.0
    x = jnp.asarray(x)
    v = m.init(jax.random.key(0), x)
    y_eval = np.asarray(m.apply(v, x))
    y_train = np.asarray(m.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(3)}))
    window = slice(t0, t0 + K)  # outputs t0..t0+K-1 read the impulse through taps K-1..0
    kept = np.isclose(y_train[:, window], y_eval[:, window] / (1 - p_drop), rtol=1e-5)
    dropped = y_train[:, window] == 0
    assert np.all(kept | dropped) and dropped.any() and kept.any()
    np.testing.assert_array_equal(y_train[:, :t0], 0.0)  # causal: nothing before the impulse


def _block_reference(x, p, K, P, use_glu, seg, conv_type):
    """NumPy version of fairseq's block: linear1 (+GLU), zero padding, conv, linear2."""
    x = np.asarray(x, np.float64)
    h = x @ p["linear1"]["kernel"] + p["linear1"]["bias"]
    if use_glu:
        d = h.shape[-1] // 2
        h = h[..., :d] * sigmoid(h[..., d:])
    h = h * (seg != 0)[..., None]
    if conv_type == "lightweight":
        w = softmax(p["conv"]["weight"])
    else:
        w = softmax((h @ p["conv"]["weight_linear"]["kernel"]).reshape(B, T, H, K))
    h = conv_reference(h, w, P, seg)
    return h @ p["linear2"]["kernel"] + p["linear2"]["bias"]


@pytest.mark.parametrize("conv_type,use_glu,causal,precision", [("lightweight", True, False, "highest"),
                                                                 ("dynamic", False, True, "highest"),
                                                                 ("dynamic", True, False, "default")])
def test_block_matches_numpy_reference(conv_type, use_glu, causal, precision):
    """At "highest" exact on every backend; at "default" within the backend's rounding (exact on CPU)."""
    K = 5
    m = layers.LightConvBlock(num_heads=H, kernel_size=K, causal=causal, conv_type=conv_type, use_glu=use_glu,
                              matmul_precision=precision)
    x = _x()
    v = m.init(jax.random.key(1), x)
    p = jax.tree.map(np.asarray, _params(v))
    p["linear1"]["bias"] = np.linspace(-1, 1, p["linear1"]["bias"].size).astype(np.float32)  # exercise biases
    y = m.apply({"params": p}, x, segment_ids=jnp.asarray(SEG))
    want = _block_reference(x, p, K, K - 1 if causal else K // 2, use_glu, SEG, conv_type)
    np.testing.assert_allclose(y, want, **tolerance(np.float32, precision, atol=1e-4))


@pytest.mark.parametrize("name", ["lightconv", "dynamicconv"])
def test_block_decoding_in_chunks_equals_full_pass(name):
    m = mixers.make_mixer(name, num_heads=H, kernel_size=4, causal=True, matmul_precision="highest")
    x = _x(2)
    v = m.init(jax.random.key(0), x)
    full = m.apply(v, x)
    _, cache = m.apply(v, jnp.zeros_like(x), decode=True, mutable=["cache"])  # creates the cache
    assert cache["cache"]["conv"]["conv_state"].shape == (B, 3, C)
    outs = []
    for start, stop in [(0, 1), (1, 5), (5, 6), (6, 11)]:
        y, cache = m.apply({**v, **cache}, x[:, start:stop], decode=True, mutable=["cache"])
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **EXACT)


def test_bfloat16_block_keeps_dtype_and_stays_close():
    m32 = layers.DynamicConvBlock(num_heads=H, kernel_size=5, matmul_precision="highest")
    m16 = layers.DynamicConvBlock(num_heads=H, kernel_size=5, dtype=jnp.bfloat16)
    x = _x()
    v = m32.init(jax.random.key(0), x)
    y16 = m16.apply(v, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), m32.apply(v, x),
                               **tolerance(jnp.bfloat16, "default", rtol=0.05, atol=0.1))


@pytest.mark.parametrize(
    "kwargs,call_kwargs,message",
    [
        (dict(kernel_size=4), {}, "odd"),  # even kernel in a centred conv
        (dict(kernel_size=3, num_heads=5), {}, "divisible"),
        (dict(kernel_size=3, causal=True, padding_left=1), {}, "causal"),
        (dict(kernel_size=3), dict(decode=True), "causal"),  # decoding a centred conv
        (dict(kernel_size=3, conv_type="fft"), {}, "conv_type"),
    ],
)
def test_bad_configuration_raises_a_clear_error(kwargs, call_kwargs, message):
    m = layers.LightConvBlock(**{"num_heads": H, **kwargs})
    with pytest.raises(ValueError, match=message):
        m.init(jax.random.key(0), _x(), **call_kwargs)


def test_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown mixer 'lightconvv'"):
        mixers.make_mixer("lightconvv", num_heads=H)
    with pytest.raises(ValueError, match="kernel_sizes"):
        mixers.make_mixer("lightconv", num_heads=H, kernel_sizes=3)
