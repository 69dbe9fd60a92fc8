"""The fused Pallas conv (``lconv.ops.pallas_conv``) in interpret mode against float64 NumPy loops: forward, dx and
dweight, light and dynamic, both paddings and any other, packed segments with padding, float32 and bfloat16.

Shapes are tiny and tiles short (``block_t`` 2..16 over T = 13 / 16) so tiles, halos across several tiles and the
partial last tile all occur; interpret mode compiles each kernel as an XLA loop, a few seconds per case.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from reference import conv_reference

from lconv.errors import UserError
from lconv.ops.pallas_conv import dynamic_conv_pallas, light_conv_pallas

B, C, H = 2, 8, 2


def _segments(T):
    """Row 0: three segments then padding; row 1: a segment, padding mid-row, a segment to the end."""
    rows = {13: [[1] * 4 + [2] * 5 + [3] * 2 + [0] * 2, [1] * 5 + [0] * 2 + [2] * 6],
            16: [[1] * 6 + [2] * 7 + [0] * 3, [1] * 3 + [0] * 2 + [2] * 4 + [3] * 7]}
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


def _run(op, x, w, dy, P, seg, block_t):
    """``y`` and the VJP's ``(dx, dw)`` at ``dy``, jitted (interpret=None: decided by the CPU lowering)."""
    conv = light_conv_pallas if op == "light" else dynamic_conv_pallas
    seg = None if seg is None else jnp.asarray(seg)

    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: conv(x, w, P, seg, block_t=block_t), x, w)
        return y, *vjp(dy)

    return run(x, w, dy)


# (T, K, padding_left, segments, block_t): centred and causal, odd and even K, a padding that is neither (K=4, P=1),
# tiles shorter than the halo (block_t=2 < K-1=3), one tile longer than T (16 > 13), partial last tiles.
CASES = [
    (13, 3, 1, True, 4),
    (16, 4, 3, True, 4),
    (13, 4, 1, True, 2),
    (13, 4, 3, False, 4),
    (16, 3, 1, False, 16),
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


@pytest.mark.parametrize("op", ["light", "dynamic"])
@pytest.mark.parametrize("T,K,P,segmented,block_t", CASES)
def test_float32_forward_and_gradients_match_reference(op, T, K, P, segmented, block_t):
    x, w_light, w_dynamic, dy = _inputs(T, K)
    w = w_light if op == "light" else w_dynamic
    seg = _segments(T) if segmented else None
    y, dx, dw = _run(op, jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), P, seg, block_t)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32 and dw.shape == w.shape
    want_dx, want_dw = _grad_reference(x, w, dy, P, seg)
    np.testing.assert_allclose(y, conv_reference(x, w, P, seg), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dw, want_dw, atol=1e-5, rtol=1e-5)
    if segmented:  # padding outputs zero and receives no gradient
        pad = seg == 0
        np.testing.assert_array_equal(np.asarray(y)[pad], 0.0)
        np.testing.assert_array_equal(np.asarray(dx)[pad], 0.0)


@pytest.mark.parametrize("op", ["light", "dynamic"])
def test_bfloat16_accumulates_in_float32(op):
    """bfloat16 in and out, float32 inside: within bfloat16 rounding of the float64 result on the rounded inputs."""
    T, K, P = 16, 4, 3
    x, w_light, w_dynamic, dy = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(T, K, seed=1))
    w = w_light if op == "light" else w_dynamic
    seg = _segments(T)
    y, dx, dw = _run(op, x, w, dy, P, seg, 4)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
    want_dx, want_dw = _grad_reference(x, w, dy, P, seg)
    for got, want in [(y, conv_reference(x, w, P, seg)), (dx, want_dx), (dw, want_dw)]:
        # One bfloat16 rounding of the output (2^-8 relative); a bfloat16 accumulator would be off by ~K*D times that.
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=8e-3, atol=8e-3 * np.abs(want).max())


def test_lowers_to_triton_for_cuda():
    """The compiled branch lowers through Pallas' Triton backend on this CPU: forward and the fused backward.

    Lowering legality only (power-of-two loads, supported primitives); Triton's own compile needs a GPU.
    """
    T, K, P = 13, 4, 3
    x, w_light, w_dynamic, dy = _inputs(T, K)
    seg = jnp.asarray(_segments(T))

    def both(x, w_light, w_dynamic):
        y1, vjp1 = jax.vjp(lambda x, w: light_conv_pallas(x, w, P, seg, block_t=4), x, w_light)
        y2, vjp2 = jax.vjp(lambda x, w: dynamic_conv_pallas(x, w, P, seg, block_t=4), x, w_dynamic)
        return vjp1(y1), vjp2(y2)

    triton = "__gpu$xla.gpu.triton"
    exported = export.export(jax.jit(both), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(x, w_light, w_dynamic)
    assert exported.mlir_module().count(f"@{triton}(") == 4  # two forward kernels, two fused backward kernels


@pytest.mark.parametrize("call,match", [
    (lambda x, w, wd: light_conv_pallas(x[0], w, 1), "x must be"),
    (lambda x, w, wd: light_conv_pallas(x, wd, 1), "weight must be"),
    (lambda x, w, wd: dynamic_conv_pallas(x, wd[:, :5], 1), "weight must be"),
    (lambda x, w, wd: light_conv_pallas(x, w[:, :0], 0), "K >= 1"),
    (lambda x, w, wd: light_conv_pallas(x, w, 3), "padding_left"),
    (lambda x, w, wd: light_conv_pallas(x, w, 1, jnp.ones((B, 5), jnp.int32)), "segment_ids"),
    (lambda x, w, wd: dynamic_conv_pallas(x, wd, 1, block_t=6), "block_t"),
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
