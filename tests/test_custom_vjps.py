"""The hand-written VJPs that keep the training step's memory down (issue 36): the layer norm
(``lconv.ops.layer_norm``) against a float64 NumPy reference (values, and gradients by central differences) and
against ``flax.linen.LayerNorm`` differentiated by JAX; the GLU (``lconv.ops.activations.glu``) against float64; the
ReLU whose backward pass keeps its mask as bits (``lconv.ops.activations.relu``) against ``jax.nn.relu``; the dense
layer's matmul whose weight gradient is laid out for XLA:CPU (``lconv.ops.dense``) against float64."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tolerance

from lconv.nn.common import LayerNorm
from lconv.ops import activations
from lconv.ops.dense import dense_dot_general
from lconv.ops.layer_norm import layer_norm

EPS = 1e-5
F32_EPS = float(np.finfo(np.float32).eps)
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)


def _inputs(shape, seed=0, offset=3.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, 2.0, shape).astype(np.float32)  # a mean far from 0, as a residual stream may have
    scale = rng.normal(1.0, 0.5, shape[-1]).astype(np.float32)
    bias = rng.normal(0.0, 0.5, shape[-1]).astype(np.float32)
    weights = rng.normal(0.0, 1.0, shape).astype(np.float32)  # the objective sum(weights * y)
    return x, scale, bias, weights


def np_layer_norm(x, scale, bias):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)


def np_central_differences(f, args, h=1e-6):
    """d f / d args[i] of the scalar float64 function f, every element, by central differences."""
    grads = []
    for i, a in enumerate(args):
        a = np.asarray(a, np.float64)
        g = np.zeros_like(a)
        for index in np.ndindex(a.shape):
            plus, minus = a.copy(), a.copy()
            plus[index] += h
            minus[index] -= h
            g[index] = (f(*args[:i], plus, *args[i + 1:]) - f(*args[:i], minus, *args[i + 1:])) / (2 * h)
        grads.append(g)
    return grads


def _objective(x, scale, bias, weights):
    return jnp.sum(weights * layer_norm(x, scale, bias, EPS, jnp.float32))


def test_values_and_gradients_match_float64_numpy():
    x, scale, bias, weights = _inputs((2, 3, 8))
    tol = tolerance(np.float32, rtol=64 * F32_EPS, atol=64 * F32_EPS)
    np.testing.assert_allclose(layer_norm(x, scale, bias, EPS, jnp.float32), np_layer_norm(x, scale, bias), **tol)
    grads = jax.grad(_objective, argnums=(0, 1, 2))(x, scale, bias, weights)
    reference = np_central_differences(lambda *a: np.sum(weights * np_layer_norm(*a)), [x, scale, bias])
    for name, got, want in zip(("x", "scale", "bias"), grads, reference):
        # central differences in float64 are good to ~1e-9 here; the float32 sums over C and over rows dominate
        np.testing.assert_allclose(got, want, rtol=256 * F32_EPS, atol=256 * F32_EPS, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_module_equals_flax_layer_norm_values_and_gradients(dtype):
    """Same parameters (names, shapes, initial values) as ``nn.LayerNorm``; the same output and gradients for
    x, scale and bias. bfloat16: the input and output in bfloat16, the arithmetic in float32, as flax does."""
    x, scale, bias, weights = _inputs((4, 16, 32), seed=1)
    x = jnp.asarray(x, dtype)
    ours, theirs = LayerNorm(epsilon=EPS, dtype=dtype), nn.LayerNorm(epsilon=EPS, dtype=dtype)
    params = nn.meta.unbox(ours.init(jax.random.key(0), x))["params"]
    flax_params = theirs.init(jax.random.key(0), x)["params"]
    assert jax.tree.map(np.asarray, params).keys() == flax_params.keys()
    for name in ("scale", "bias"):
        np.testing.assert_array_equal(params[name], flax_params[name])
    params = {"scale": jnp.asarray(scale), "bias": jnp.asarray(bias)}

    def loss(module, params, x):
        return jnp.sum(weights * module.apply({"params": params}, x).astype(jnp.float32))

    got = jax.value_and_grad(lambda p, x: loss(ours, p, x), argnums=(0, 1))(params, x)
    want = jax.value_and_grad(lambda p, x: loss(theirs, p, x), argnums=(0, 1))(params, x)
    # flax takes the variance as E[x^2] - E[x]^2, whose float32 cancellation at |mean| / std = 1.5 costs it tens
    # of eps (this one, two-pass, is within 64 eps of float64 above): 128 eps; bfloat16 rounds y and dx once each
    unit = 128 * F32_EPS if dtype == jnp.float32 else 2 * BF16_EPS
    np.testing.assert_allclose(ours.apply({"params": params}, x).astype(np.float32),
                               theirs.apply({"params": params}, x).astype(np.float32), rtol=unit, atol=unit)
    np.testing.assert_allclose(got[0], want[0], rtol=unit)
    for name in ("scale", "bias"):  # sums over 64 rows of float32 products
        np.testing.assert_allclose(got[1][0][name], want[1][0][name], rtol=unit, atol=unit * 64, err_msg=name)
    np.testing.assert_allclose(got[1][1].astype(np.float32), want[1][1].astype(np.float32), rtol=unit, atol=unit)
    assert got[1][1].dtype == dtype and ours.apply({"params": params}, x).dtype == dtype


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_glu_values_and_gradients_match_float64_numpy(dtype):
    """``activations.glu`` (its backward pass takes the sigmoid as (1 + tanh(b/2)) / 2) against a * sigmoid(b) and
    its textbook derivatives in float64."""
    rng = np.random.default_rng(2)
    a, b, g = (rng.normal(0.0, 3.0, (64, 48)) for _ in range(3))
    cast = [jnp.asarray(v, dtype) for v in (a, b, g)]
    a, b, g = (np.asarray(v, np.float64) for v in cast)  # the reference sees the rounded inputs
    out, vjp = jax.vjp(activations.glu, *cast[:2])
    da, db = vjp(cast[2])
    s = 1 / (1 + np.exp(-b))
    unit = 8 * (F32_EPS if dtype == jnp.float32 else BF16_EPS)  # a few roundings, then one to the dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), a * s, rtol=unit, atol=unit)
    np.testing.assert_allclose(np.asarray(da, np.float64), g * s, rtol=unit, atol=unit)
    np.testing.assert_allclose(np.asarray(db, np.float64), g * a * s * (1 - s), rtol=unit, atol=unit * 4)
    assert out.dtype == da.dtype == db.dtype == dtype


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["relu", "relu_squared"])
def test_relu_keeping_its_mask_as_bits_equals_jax_relu_exactly(dtype, name):
    """``activations.relu`` (the backward pass reads the mask ``x > 0`` packed 8 to a byte) gives jax.nn.relu's
    values and gradients bit for bit, zeros (derivative 0 at 0) and a last axis that is no multiple of 8
    included; so does relu_squared, which uses it."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 7, 37))
    x[0, 0, :5] = 0.0
    x, g = jnp.asarray(x, dtype), jnp.asarray(rng.normal(size=(5, 7, 37)), dtype)
    reference = {"relu": jax.nn.relu, "relu_squared": lambda v: jnp.square(jax.nn.relu(v))}[name]
    out, vjp = jax.vjp(lambda v: activations.activation(name, v), x)
    want_out, want_vjp = jax.vjp(lambda v: reference(v.astype(jnp.float32)).astype(dtype), x)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(vjp(g)[0], np.float32), np.asarray(want_vjp(g)[0], np.float32))
    assert out.dtype == dtype


@pytest.mark.parametrize("precision,features", [("default", (8, 6)), ("highest", (8, 6)), ("default", (6, 8))])
def test_the_dense_matmul_and_its_gradients_are_float64s(precision, features):
    """``dense_dot_general`` as ``flax.linen.Dense`` calls it (``[B, T, I] @ [I, O]``): the product, ``dx`` and the
    weight gradient (on CPU made from a written-out ``dy^T`` where I > O, ``x^T`` where I < O) equal float64
    NumPy's within float32 rounding."""
    rng = np.random.default_rng(4)
    I, O = features
    x, w, cotangent = (rng.normal(0, 1, shape).astype(np.float32) for shape in [(3, 5, I), (I, O), (3, 5, O)])
    lax_precision = jax.lax.Precision.HIGHEST if precision == "highest" else None
    dn = (((2,), (0,)), ((), ()))
    f = lambda x, w: jnp.sum(dense_dot_general(x, w, dn, precision=lax_precision) * cotangent)  # noqa: E731
    y = jax.jit(lambda x, w: dense_dot_general(x, w, dn, precision=lax_precision))(x, w)
    dx, dw = jax.jit(jax.grad(f, (0, 1)))(x, w)
    x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, cotangent))
    tol = tolerance(np.float32, precision, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, x64 @ w64, **tol)
    np.testing.assert_allclose(dx, c64 @ w64.T, **tol)
    np.testing.assert_allclose(dw, np.einsum("bti,bto->io", x64, c64), **tol)


def test_a_contraction_other_than_a_dense_layers_is_plain_dot_general():
    """Batch axes, or a contraction not over ``x``'s last axis, fall back to ``lax.dot_general`` unchanged."""
    rng = np.random.default_rng(5)
    a, b = rng.normal(0, 1, (2, 4, 3)).astype(np.float32), rng.normal(0, 1, (2, 3, 5)).astype(np.float32)
    dn = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(dense_dot_general(a, b, dn), jax.lax.dot_general(a, b, dn))


@pytest.mark.parametrize("I,O", [(8, 4), (4, 8)])
def test_on_cpu_the_weight_gradient_is_a_dot_over_a_written_out_transpose(I, O):
    """What makes it fast on CPU, read from the compiled program: no dot contracts its left operand's leading
    (token) axis, the layout XLA:CPU's matmul library does not take (autodiff's own gradient has one)."""
    cpu = jax.devices("cpu")[0]  # the CPU's program, whatever the default backend
    x, w = jax.device_put(jnp.ones((2, 16, I)), cpu), jax.device_put(jnp.ones((I, O)), cpu)
    dn = (((2,), (0,)), ((), ()))

    def dots(dot_general):
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(dot_general(x, w, dn))), (0, 1)))
        text = grad.lower(x, w).compile().as_text()
        return [line for line in text.splitlines() if " dot(" in line]

    assert any("lhs_contracting_dims={0}" in line for line in dots(jax.lax.dot_general))
    assert dots(dense_dot_general) and not any("lhs_contracting_dims={0}" in line for line in dots(dense_dot_general))
