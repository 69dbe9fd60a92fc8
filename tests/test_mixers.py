"""The mixer contract (lconv/mixers.py), checked the same way for every registered mixer: float32 softmax under
bfloat16, output shape and dtype, and one-line ValueErrors that name the bad field or argument.

Everything here only traces (``jax.eval_shape`` / ``jax.make_jaxpr``): nothing is compiled or run, so the
whole file costs a few seconds. The numerics of each mixer are tested against float64 references in its
own test file.
"""
import collections

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from lconv.nn import mixers
from lconv.nn.colt5 import CoLT5FeedForward

B, T, C, H = 2, 13, 12, 3
X = jax.ShapeDtypeStruct((B, T, C), jnp.float32)
EXTRA = {  # the smallest mixer-specific fields that make each mixer valid at these shapes
    "lightconv": dict(kernel_size=3),
    "dynamicconv": dict(kernel_size=3),
    "fixed": dict(max_len=16),
    "hadamard": dict(max_len=16),
    "colt5": dict(local_radius=2, num_routed=4),
    "knn_memory": dict(memory_size=8, num_neighbors=2),
}
CAUSAL_OK = [n for n in mixers.mixer_names() if n != "colt5"]  # CoLT5 is an encoder mixer only


def make(name, **kw):
    fields = dict(num_heads=H, causal=name in CAUSAL_OK) | EXTRA.get(name, {}) | kw
    return mixers.make_mixer(name, **fields)


def trace_init(m, x=X, **call):
    return jax.eval_shape(lambda: m.init(jax.random.PRNGKey(0), jnp.zeros(x.shape, x.dtype), **call))


def _exp_input_dtypes(jaxpr):
    """The input dtype of every ``exp`` in a jaxpr, sub-jaxprs (jit, custom_jvp, loops) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "exp":
            yield eqn.invars[0].aval.dtype
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _exp_input_dtypes(sub)


def test_every_registered_mixer_is_covered():
    assert set(EXTRA) | {"attention"} == set(mixers.mixer_names())


@pytest.mark.parametrize("name", mixers.mixer_names() + ["colt5_ffn"])
def test_bfloat16_keeps_dtype_and_every_softmax_runs_in_float32(name):
    """Under ``dtype=bfloat16`` the output is bfloat16 of the input's shape, and every ``exp`` (softmax over
    attention logits or conv taps, soft top-k) takes float32: the logits are cast up before the softmax."""
    if name == "colt5_ffn":
        m = CoLT5FeedForward(num_routed=4, dtype=jnp.bfloat16)
    else:
        m = make(name, dtype=jnp.bfloat16)
    x16 = jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16)
    variables = trace_init(m, x16)
    out = jax.eval_shape(m.apply, variables, x16)
    assert out.shape == (B, T, C) and out.dtype == jnp.bfloat16
    dtypes = list(_exp_input_dtypes(jax.make_jaxpr(m.apply)(variables, x16).jaxpr))
    assert dtypes, "no softmax found: the check would be vacuous"
    assert all(d == jnp.float32 for d in dtypes), dtypes


@pytest.mark.parametrize("name", mixers.mixer_names())
@pytest.mark.parametrize("case, field", [
    ("x_not_3d", "x_BTC"),
    ("segment_ids_shape", "segment_ids"),
    ("positions_shape", "positions"),
    ("heads_do_not_divide", "num_heads"),
    ("decode_not_causal", "causal"),
])
def test_bad_shapes_and_fields_are_one_line_errors_naming_the_field(name, case, field):
    m, x, call = make(name), X, {}
    if case == "x_not_3d":
        x = jax.ShapeDtypeStruct((T, C), jnp.float32)
    elif case == "segment_ids_shape":
        call = dict(segment_ids=jnp.ones((B, T + 1), jnp.int32))
    elif case == "positions_shape":
        call = dict(positions=jnp.zeros((B, T - 1), jnp.int32))
    elif case == "heads_do_not_divide":
        m = make(name, num_heads=5)
    elif case == "decode_not_causal":
        m, call = make(name, causal=False), dict(decode=True)
    with pytest.raises(ValueError, match=field) as info:
        trace_init(m, x, **call)
    assert "\n" not in str(info.value)


def test_colt5_refuses_causal_use_with_one_line():
    with pytest.raises(ValueError, match="encoder mixer") as info:
        trace_init(make("colt5", causal=True))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["lightconv", "dynamicconv"])
def test_even_kernel_in_a_centred_conv_is_an_error(name):
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        trace_init(make(name, causal=False, kernel_size=4))
    trace_init(make(name, causal=True, kernel_size=4))  # fine when causal (taps K-1 .. 0 before t)


def test_unknown_mixer_and_unknown_field_are_named():
    with pytest.raises(ValueError, match="unknown mixer 'lightconvv'.*'attention'"):
        mixers.make_mixer("lightconvv", num_heads=H)
    with pytest.raises(ValueError, match=r"mixer 'fixed' has no field\(s\) \['kernel_size'\]"):
        mixers.make_mixer("fixed", num_heads=H, kernel_size=3)


def _dot_precisions(jaxpr):
    """The precision of every dot and conv in a jaxpr, sub-jaxprs included (unset = the backend's default)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            precision = eqn.params.get("precision")
            yield "default" if precision is None else precision[0].name.lower()
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _dot_precisions(sub)


@pytest.mark.parametrize("name", mixers.mixer_names() + ["colt5_ffn"])
def test_matmul_precision_is_a_model_field_and_reaches_every_dot(name):
    """``matmul_precision`` comes from the model (``model_fields``) and sets every dot of the mixer, projections
    and attention alike, except those that must be exact whatever it is (the conv, top-k scores: HIGHEST)."""
    if name == "colt5_ffn":
        m = CoLT5FeedForward(num_routed=4, matmul_precision="high")
    else:
        assert mixers.model_fields(name)["matmul_precision"] == "matmul_precision"
        m = make(name, matmul_precision="high")
    variables = trace_init(m)
    precisions = collections.Counter(_dot_precisions(jax.make_jaxpr(m.apply)(variables, X).jaxpr))
    assert precisions["high"] >= 2 and set(precisions) <= {"high", "highest"}, precisions


def test_exp_finder_sees_a_bfloat16_softmax():
    """The float32 check above can fail: a softmax computed in bfloat16 is caught."""
    jaxpr = jax.make_jaxpr(lambda z: jax.nn.softmax(z))(np.zeros((2, 3), jnp.bfloat16)).jaxpr
    assert list(_exp_input_dtypes(jaxpr)) == [jnp.bfloat16]
