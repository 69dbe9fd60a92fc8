"""The Pallas conv kernels (``lconv.ops.pallas_conv``) in interpret mode against float64 NumPy loops: forward, dx
and dweight, light and dynamic, both backwards (``split``: dx and dw kernels; ``fused``: one), every padding of
K = 3 and 4 and one K = 31 case, packed segments with padding, float32 and bfloat16; and the bytes model against
the kernels' own operands.

Shapes are tiny and tiles short (``block_t`` 2..16 over T = 13 / 16 / 40) so tiles, halos across several tiles and
the partial last tile all occur; interpret mode compiles each kernel as an XLA loop, about a second per case.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from reference import conv_reference

from lconv.errors import UserError
from lconv.ops import pallas_conv
from lconv.ops.pallas_conv import dynamic_conv_pallas, light_conv_pallas

B, C, H = 2, 8, 2


def _segments(T):
    """Row 0: three segments then padding; row 1: a segment, padding mid-row, a segment to the end."""
    rows = {13: [[1] * 4 + [2] * 5 + [3] * 2 + [0] * 2, [1] * 5 + [0] * 2 + [2] * 6],
            16: [[1] * 6 + [2] * 7 + [0] * 3, [1] * 3 + [0] * 2 + [2] * 4 + [3] * 7],
            40: [[1] * 20 + [2] * 15 + [0] * 5, [1] * 3 + [0] * 2 + [2] * 35]}  # segments longer than K=31
    return np.array(rows[T], np.int32)


def _inputs(T, K, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, C)).astype(np.float32)
    w_light = rng.normal(size=(H, K)).astype(np.float32)
    w_dynamic = rng.normal(size=(B, T, H, K)).astype(np.float32)
    dy = rng.normal(size=(B, T, C)).astype(np.float32)
    return x, w_light, w_dynamic, dy


def _grad_reference(x, weight, dy, padding_left, segment_ids=None):
    """float64 loops: ``dx[s] = sum over (t, k) with t + k - P = s of w[t, k] dy[t]``, ``dw[t, h, k] = sum over
    the head's channels of x[t + k - P] dy[t]``, over the live taps only; a light weight's ``dw`` summed over B, T."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    T = x.shape[1]
    w = np.asarray(weight, np.float64)
    w_BTHK = np.broadcast_to(w, (B, T) + w.shape[-2:]) if w.ndim == 2 else w
    K = w_BTHK.shape[-1]
    D = C // H
    dx, dw = np.zeros_like(x), np.zeros(w_BTHK.shape)
    for b in range(B):
        for t in range(T):
            for k in range(K):
                s = t + k - padding_left
                if not 0 <= s < T:
                    continue
                if segment_ids is not None and (segment_ids[b, t] == 0 or segment_ids[b, s] != segment_ids[b, t]):
                    continue
                for h in range(H):
                    ch = slice(h * D, (h + 1) * D)
                    dx[b, s, ch] += w_BTHK[b, t, h, k] * dy[b, t, ch]
                    dw[b, t, h, k] += x[b, s, ch] @ dy[b, t, ch]
    return dx, (dw.sum((0, 1)) if w.ndim == 2 else dw)


def _run(op, x, w, dy, P, seg, block_t, backward):
    """``y`` and the VJP's ``(dx, dw)`` at ``dy``, jitted (interpret=None: decided by the CPU lowering)."""
    conv = light_conv_pallas if op == "light" else dynamic_conv_pallas
    seg = None if seg is None else jnp.asarray(seg)

    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: conv(x, w, P, seg, block_t=block_t, backward=backward), x, w)
        return y, *vjp(dy)

    return run(x, w, dy)


# (T, K, padding_left, segments, block_t): every padding of an odd and an even K with segments and a partial last
# tile (13 = 3 x 4 + 1); tiles shorter than the halo (block_t=2 < K-1=3); no segments; one tile longer than T
# (16 > 13); T a multiple of the tile; the paper's K = 31, centred, over three tiles (the last partial), with
# dw's [L, Kp] tile masked to 31 of its 32 columns (K = 3 masks 3 of 4 too).
CASES = [(13, K, P, True, 4) for K in (3, 4) for P in range(K)] + [
    (13, 4, 1, True, 2),
    (13, 4, 3, False, 4),
    (16, 3, 1, False, 16),
    (16, 4, 2, True, 4),
    (40, 31, 15, True, 16),
]


def test_gradient_reference_is_the_adjoint():
    """The test's own gradient loops are the true gradient: <dy, conv(x, w)> = <dx, x> = <dw, w> (bilinear)."""
    T, K, P = 13, 4, 1
    x, w_light, w_dynamic, dy = _inputs(T, K)
    for w in (w_light, w_dynamic):
        for seg in (None, _segments(T)):
            inner = np.sum(dy * conv_reference(x, w, P, seg))
            dx, dw = _grad_reference(x, w, dy, P, seg)
            np.testing.assert_allclose(np.sum(dx * x), inner, rtol=1e-12)
            np.testing.assert_allclose(np.sum(dw * w), inner, rtol=1e-12)


# The fused backward (the bench's comparison, not the default) shares every tap helper with the split one: the
# even K's first padding runs in the quick tier, its other paddings and the K = 31 case in the slow tier.
_FUSED = [case for case in CASES if case[1] != 3]
# K = 31 (interpret mode's loop over 31 taps, ~14 s) runs in the slow tier for both backwards.
BACKWARD_CASES = [pytest.param(*case, "split", id=f"{'-'.join(map(str, case))}-split",
                               marks=[pytest.mark.slow] * (case[1] == 31)) for case in CASES] + [
    pytest.param(*case, "fused", id=f"{'-'.join(map(str, case))}-fused", marks=[pytest.mark.slow] * (i > 0))
    for i, case in enumerate(_FUSED)]


@pytest.mark.parametrize("op", ["light", "dynamic"])
@pytest.mark.parametrize("T,K,P,segmented,block_t,backward", BACKWARD_CASES)
def test_float32_forward_and_gradients_match_reference(op, T, K, P, segmented, block_t, backward):
    x, w_light, w_dynamic, dy = _inputs(T, K)
    w = w_light if op == "light" else w_dynamic
    seg = _segments(T) if segmented else None
    y, dx, dw = _run(op, jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), P, seg, block_t, backward)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32 and dw.shape == w.shape
    want_dx, want_dw = _grad_reference(x, w, dy, P, seg)
    np.testing.assert_allclose(y, conv_reference(x, w, P, seg), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dw, want_dw, atol=1e-5, rtol=1e-5)
    if segmented:  # padding outputs zero and receives no gradient
        pad = seg == 0
        np.testing.assert_array_equal(np.asarray(y)[pad], 0.0)
        np.testing.assert_array_equal(np.asarray(dx)[pad], 0.0)


@pytest.mark.parametrize("backward", [b if b == "split" else pytest.param(b, marks=pytest.mark.slow)
                                      for b in pallas_conv.BACKWARDS])
@pytest.mark.parametrize("op", ["light", "dynamic"])
def test_bfloat16_accumulates_in_float32(op, backward):
    """bfloat16 in and out, float32 inside: within bfloat16 rounding of the float64 result on the rounded inputs,
    T = 13 a partial last tile."""
    T, K, P = 13, 4, 3
    x, w_light, w_dynamic, dy = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(T, K, seed=1))
    w = w_light if op == "light" else w_dynamic
    seg = _segments(T)
    y, dx, dw = _run(op, x, w, dy, P, seg, 4, backward)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
    want_dx, want_dw = _grad_reference(x, w, dy, P, seg)
    # One bfloat16 rounding of the output, unit roundoff u = eps / 2 = 2^-8, and float32 sums far below it: 2u
    # relative (and 2u of the largest value near cancellations); a bfloat16 accumulator would be ~K*D u off.
    u = float(jnp.finfo(jnp.bfloat16).eps) / 2
    for got, want in [(y, conv_reference(x, w, P, seg)), (dx, want_dx), (dw, want_dw)]:
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 * u, atol=2 * u * np.abs(want).max())


def test_lowers_to_triton_for_cuda():
    """The compiled branch lowers through Pallas' Triton backend on this CPU: forward, both backwards, K = 3 (not a
    power of two: dw's [L, 4] tile stored masked into a [L, 3] block).

    Lowering legality only (power-of-two loads, supported primitives); Triton's own compile needs a GPU.
    """
    T, K, P = 13, 3, 2
    x, w_light, w_dynamic, dy = _inputs(T, K)
    seg = jnp.asarray(_segments(T))

    def every_kernel(x, w_light, w_dynamic):
        grads = []
        for backward in pallas_conv.BACKWARDS:
            for conv, w in ((light_conv_pallas, w_light), (dynamic_conv_pallas, w_dynamic)):
                y, vjp = jax.vjp(lambda x, w: conv(x, w, P, seg, block_t=4, backward=backward), x, w)
                grads.append(vjp(y))
        return grads

    triton = "__gpu$xla.gpu.triton"
    exported = export.export(jax.jit(every_kernel), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(x, w_light, w_dynamic)
    # per op: split, a forward, a dx and a dw kernel; fused, a forward and one backward kernel
    assert exported.mlir_module().count(f"@{triton}(") == 2 * 3 + 2 * 2


def _pallas_calls(jaxpr):
    """The ``pallas_call`` equations of a jaxpr and of the jaxprs inside it, in program order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    found += _pallas_calls(inner)
    return found


@pytest.mark.parametrize("backward", pallas_conv.BACKWARDS)
@pytest.mark.parametrize("op,dtype", [("light", jnp.float32), ("dynamic", jnp.float32), ("dynamic", jnp.bfloat16)])
def test_bytes_model_counts_each_kernels_operands(op, dtype, backward):
    """``kernel_bytes_per_token`` equals what each kernel of a fwd+bwd takes and gives per token (its operands'
    and outputs' bytes; light's shared [H, K] weight excepted, as the model says), T a multiple of the tile."""
    T, K, P, L = 16, 3, 1, 4
    x, w_light, w_dynamic, dy = (jnp.asarray(a, dtype) for a in _inputs(T, K))
    w = w_light if op == "light" else w_dynamic
    conv = light_conv_pallas if op == "light" else dynamic_conv_pallas

    def fwd_bwd(x, w, dy):
        return jax.vjp(lambda x, w: conv(x, w, P, block_t=L, backward=backward, interpret=True), x, w)[1](dy)

    calls = _pallas_calls(jax.make_jaxpr(fwd_bwd)(x, w, dy).jaxpr)
    kernels = ["forward"] + (["dx", "dweight"] if backward == "split" else ["fused_backward"])
    assert len(calls) == len(kernels)
    for kernel, eqn in zip(kernels, calls):
        avals = [v.aval for v in eqn.invars if not (op == "light" and v.aval.shape == w.shape)] + \
            [v.aval for v in eqn.outvars]
        moved = sum(a.size * a.dtype.itemsize for a in avals) / (B * T)
        model = pallas_conv.kernel_bytes_per_token(kernel, C, H, K, dynamic=op == "dynamic",
                                                   itemsize=jnp.dtype(dtype).itemsize, block_t=L)
        assert moved == pytest.approx(model, rel=1e-12), kernel


@pytest.mark.parametrize("call,match", [
    (lambda x, w, wd: light_conv_pallas(x[0], w, 1), "x must be"),
    (lambda x, w, wd: light_conv_pallas(x, wd, 1), "weight must be"),
    (lambda x, w, wd: dynamic_conv_pallas(x, wd[:, :5], 1), "weight must be"),
    (lambda x, w, wd: light_conv_pallas(x, w[:, :0], 0), "K >= 1"),
    (lambda x, w, wd: light_conv_pallas(x, w, 3), "padding_left"),
    (lambda x, w, wd: light_conv_pallas(x, w, 1, jnp.ones((B, 5), jnp.int32)), "segment_ids"),
    (lambda x, w, wd: dynamic_conv_pallas(x, wd, 1, block_t=6), "block_t"),
    (lambda x, w, wd: light_conv_pallas(x, w, 1, num_warps=3), "num_warps"),
    (lambda x, w, wd: light_conv_pallas(x, w, 1, backward="both"), "backward"),
    (lambda x, w, wd: pallas_conv.kernel_bytes_per_token("dw", C, H, 3, dynamic=True, itemsize=4), "kernel"),
])
def test_bad_input_is_a_one_line_error(call, match):
    x, w, wd, _ = _inputs(13, 3)
    with pytest.raises(UserError, match=match) as info:
        call(jnp.asarray(x), jnp.asarray(w), jnp.asarray(wd))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("backend,C_,match", [("gpu", 6, "power-of-two head width"), ("tpu", C, "no TPU")])
def test_compiled_kernel_limits_are_one_line_errors(monkeypatch, backend, C_, match):
    """Where the compiled kernel cannot run (Triton: D = C/H a power of two; no Mosaic kernel), say so up front."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    x = jnp.zeros((B, 13, C_))
    with pytest.raises(UserError, match=match):
        light_conv_pallas(x, jnp.zeros((H, 3)), 1)
    light_conv_pallas(x, jnp.zeros((H, 3)), 1, interpret=True)  # interpret mode has neither limit
