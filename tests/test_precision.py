"""The precision policy (issue 15): the conv ops' dots and the top-k scores are exact float32 on every backend
(HIGHEST), ``model.matmul_precision`` reaches the model's other dots, ``impl="auto"`` is decided for the platform a
program is lowered for, and the tolerances the numeric tests take from the dtype and precision under test.

Everything here traces or lowers, so it checks on a CPU host what a GPU or TPU would run: a jaxpr carries each
dot's precision, and a program lowered for cuda shows which conv implementation it carries.
"""
import collections

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from reference import conv_reference, tolerance

from lconv import ops
from lconv.constants import MATMUL_PRECISIONS
from lconv.nn import models
from lconv.nn.colt5 import CoLT5FeedForward, router_scores
from lconv.nn.conv import LightConvBlock
from lconv.nn.knn_memory import retrieve_top_k

B, T, C, H, K = 2, 13, 12, 3, 5
SEG = jnp.asarray(np.array([[1] * 6 + [2] * 5 + [0] * 2, [1] * 13], np.int32))
DOTS = ("dot_general", "conv_general_dilated")


def _dots(jaxpr):
    """``(precision name, preferred dtype)`` of every dot and conv in a jaxpr, sub-jaxprs (cond branches of
    ``impl="auto"``, loops, custom VJPs) included. An unset precision is the backend's default."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in DOTS:
            precision = eqn.params.get("precision")
            precision = precision[0] if isinstance(precision, tuple) else precision
            name = "default" if precision is None else precision.name.lower()
            yield name, eqn.params.get("preferred_element_type")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _dots(sub)


def _precisions(fn, *args):
    return collections.Counter(name for name, _ in _dots(jax.make_jaxpr(fn)(*args).jaxpr))


def _inputs(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
    return x, jnp.asarray(rng.normal(size=(H, K)), jnp.float32), jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# The conv ops and the top-k scores: HIGHEST whatever the model's setting
# ----------------------------------------------------------------------------------------------------------------
OP_IMPLS = [("light", i) for i in ops.LIGHT_IMPLS] + [("dynamic", i) for i in ops.DYNAMIC_IMPLS]


@pytest.mark.parametrize("op,impl", OP_IMPLS)
def test_every_dot_of_the_conv_ops_is_highest_forward_and_backward(op, impl):
    """Forward and gradient, with and without segments, float32 and bfloat16: each dot or conv is HIGHEST and
    accumulates in float32. Every impl but pallas has at least one (shift's is its kernel gradient), so the check
    bites; the Pallas kernel multiplies and adds in float32 without a dot."""
    for dtype in (jnp.float32, jnp.bfloat16):
        x, w_light, w_dynamic = _inputs(dtype)
        conv, w = (ops.light_conv, w_light) if op == "light" else (ops.dynamic_conv, w_dynamic)
        for seg in (None, SEG):
            loss = lambda x, w, seg=seg: conv(x, w, 2, impl=impl, segment_ids=seg).astype(jnp.float32).sum()
            dots = list(_dots(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr))
            assert dots or impl == "pallas", (impl, dtype, seg)  # pallas: float32 multiply-adds, no dot to round
            assert all(name == "highest" for name, _ in dots), (impl, dtype, dots)
            assert all(out == jnp.float32 for _, out in dots), (impl, dtype, dots)


def test_decode_steps_multiply_and_add_in_float32():
    """A decode step (one new position, a search's step, or a chunk, a forced prefix) is elementwise multiply-adds,
    in float32 for bfloat16 inputs too: no dot for a backend to round."""
    x, w_light, w_dynamic = _inputs(jnp.float32)
    state = ops.init_conv_state(B, K, C)
    for dtype in (jnp.float32, jnp.bfloat16):
        x, state = x.astype(dtype), state.astype(dtype)
        for new in (1, 3):
            for step, w in ((ops.light_conv_step, w_light), (ops.dynamic_conv_step, w_dynamic[:, :new])):
                jaxpr = jax.make_jaxpr(step)(x[:, :new], state, w).jaxpr
                assert not list(_dots(jaxpr)), (step.__name__, dtype, new)
                arithmetic = {e.outvars[0].aval.dtype for e in jaxpr.eqns if e.primitive.name in ("mul", "add")}
                assert arithmetic == {jnp.dtype(jnp.float32)}, (step.__name__, dtype, new, arithmetic)


def test_knn_retrieval_and_colt5_routing_scores_are_highest():
    """A top-k choice must not flip because TF32 rounded the scores it ranks."""
    q, keys = jnp.ones((B, T, H, 4)), jnp.ones((B, 7, H, 4))
    assert _precisions(lambda q, k: retrieve_top_k(q, k, jnp.ones((B, 7), bool), 3), q, keys) == {"highest": 1}
    assert _precisions(router_scores, jnp.ones((B, T, C), jnp.bfloat16), jnp.ones((C,))) == {"highest": 1}


def test_the_dot_finder_sees_a_default_dot():
    """The checks above can fail: a dot without a precision is reported as the backend's default."""
    assert _precisions(lambda a: a @ a, jnp.ones((3, 3))) == {"default": 1}


# ----------------------------------------------------------------------------------------------------------------
# model.matmul_precision
# ----------------------------------------------------------------------------------------------------------------
LM = dict(vocab_size=37, d_model=12, ffn_dim=16, num_heads=3, decoder_layers=2, decoder_mixer="lightconv,dynamicconv",
          decoder_kernel_sizes=(3, 4), dropout=0.0)
# The model's own dots per forward pass: GLU, linear2, fc1, fc2 per layer, the dynamic conv's kernel projection, and
# the output layer (tied: the embedding's attend; adaptive with one cutoff: head, tail projection, tail).
OUTPUTS = {"tied": ({}, 1), "adaptive": (dict(share_embeddings=False, adaptive_softmax_cutoffs=(16,)), 3)}


@pytest.mark.parametrize("precision", MATMUL_PRECISIONS)
@pytest.mark.parametrize("output", sorted(OUTPUTS))
def test_matmul_precision_reaches_every_dot_of_a_model(precision, output):
    """Forward: exactly the model's dots run at the configured precision, the conv's at HIGHEST, none at another;
    the gradient's dots too (their transposes keep the precision)."""
    fields, output_dots = OUTPUTS[output]
    m = models.DecoderOnlyLM(models.ModelConfig(**LM, **fields, matmul_precision=precision))
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, 37, (B, 6)), jnp.int32)
    variables = jax.eval_shape(m.init, jax.random.key(0), tokens)
    forward = _precisions(m.apply, variables, tokens)
    assert set(forward) <= {precision, "highest"}, forward
    if precision != "highest":
        assert forward[precision] == 4 + 5 + output_dots, forward
    assert forward["highest"] >= 2  # the convs' (one per layer at least)
    loss = lambda v: m.apply(v, tokens).sum()
    assert set(_precisions(jax.grad(loss), variables)) <= {precision, "highest"}


@pytest.mark.slow  # every mixer's model: CI runs it, the quick command skips it
def test_matmul_precision_reaches_every_dot_of_an_encoder_decoder_with_every_mixer():
    """Every mixer, cross-attention and the routed FFN: at "high" no dot is left at the backend's default."""
    every = dict(decoder_mixer="lightconv,dynamicconv,attention,fixed,hadamard,knn_memory", decoder_layers=6,
                 decoder_kernel_sizes=(4,),
                 encoder_mixer="colt5,lightconv", encoder_layers=2, encoder_kernel_sizes=(3,), ffn_type="colt5",
                 ffn_kwargs={"num_routed": 3}, max_len=16,
                 mixer_kwargs={"knn_memory": {"memory_size": 8, "num_neighbors": 2},
                               "colt5": {"local_radius": 2, "num_routed": 3}})
    cfg = models.ModelConfig(**{**LM, **every}, matmul_precision="high")
    m = models.EncoderDecoder(cfg)
    src, tgt = jnp.ones((B, 7), jnp.int32), jnp.ones((B, 6), jnp.int32)
    precisions = _precisions(m.apply, jax.eval_shape(m.init, jax.random.key(0), src, tgt), src, tgt)
    assert set(precisions) == {"high", "highest"}, precisions


@pytest.mark.parametrize("precision", ["default", "high"])
def test_colt5_ffn_takes_matmul_precision_and_routes_at_highest(precision):
    f = CoLT5FeedForward(num_routed=4, matmul_precision=precision)
    x = jax.ShapeDtypeStruct((B, T, C), jnp.float32)
    variables = jax.eval_shape(f.init, jax.random.key(0), x)
    assert _precisions(f.apply, variables, x) == {precision: 4, "highest": 1}  # light/heavy in/out; the router


def test_an_invalid_matmul_precision_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"matmul_precision='fast'.*default.*high.*highest") as info:
        models.ModelConfig.from_config({**LM, "matmul_precision": "fast"})
    assert "\n" not in str(info.value)
    block = LightConvBlock(num_heads=H, kernel_size=3, matmul_precision="TF32")
    with pytest.raises(ValueError, match=r"'TF32'.*default.*high.*highest") as info:
        jax.eval_shape(block.init, jax.random.key(0), jax.ShapeDtypeStruct((B, T, C), jnp.float32))
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------------------------
# impl="auto" per platform
# ----------------------------------------------------------------------------------------------------------------
def test_auto_impl_is_chosen_for_the_platform_the_program_is_lowered_for():
    """Lowered for cuda on any host, ``auto`` carries the band (a HIGHEST dot); for cpu, the shift (multiply-adds,
    no dot); exported for both, it carries both and runs the one of the backend it is called on."""
    x, _, w = _inputs(jnp.float32)
    f = jax.jit(lambda x, w: ops.dynamic_conv(x, w, 2))
    lowered = {p: f.trace(x, w).lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda")}
    assert "dot_general" not in lowered["cpu"]
    dots = [line for line in lowered["cuda"].splitlines() if "stablehlo.dot_general" in line]
    assert dots and all("precision = [HIGHEST, HIGHEST]" in line for line in dots), dots
    exported = jax.export.export(f, platforms=("cpu", "cuda"))(x, w)
    assert "stablehlo.case" in exported.mlir_module() and "dot_general" in exported.mlir_module()
    np.testing.assert_allclose(exported.call(x, w), conv_reference(x, w, 2), **tolerance(atol=1e-5))  # either branch
    assert (ops.choose_impl("cpu"), ops.choose_impl("cuda"), ops.choose_impl("tpu")) == ("shift", "band", "band")


# ----------------------------------------------------------------------------------------------------------------
# tests/reference.py's tolerance
# ----------------------------------------------------------------------------------------------------------------
def test_tolerance_comes_from_dtype_and_precision():
    """Exact float32 (CPU at any precision, "highest" anywhere) keeps the test's own tolerance; TF32, bfloat16
    passes and bfloat16 compute raise it to their rounding's floor."""
    own = dict(rtol=1e-7, atol=1e-5)
    for precision in MATMUL_PRECISIONS:
        assert tolerance(np.float32, precision, atol=1e-5, backend="cpu") == own
    for backend in ("cpu", "gpu", "tpu"):
        assert tolerance(np.float32, "highest", atol=1e-5, backend=backend) == own
    assert tolerance(np.float32, "default", atol=1e-5, backend="gpu") == dict(rtol=1e-2, atol=1e-2)  # TF32
    assert tolerance(np.float32, "high", atol=1e-5, backend="tpu") == dict(rtol=1e-4, atol=1e-4)  # bf16 x 3
    assert tolerance(np.float32, "default", atol=1e-5, backend="tpu") == dict(rtol=2e-2, atol=2e-2)  # one pass
    assert tolerance(jnp.bfloat16, "highest", rtol=0.05, atol=0.1, backend="cpu") == dict(rtol=0.05, atol=0.1)
    assert tolerance(jnp.bfloat16, "highest", backend="cpu") == dict(rtol=2e-2, atol=2e-2)
