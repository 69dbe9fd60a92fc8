"""The ``"pallas"`` implementation of ``lconv.ops.light_conv`` / ``dynamic_conv``: fused Pallas kernels.

Same semantics as ``lconv.ops.conv``. Three kernels with a custom VJP (forward, ``dx``, ``dw``; ``backward="fused"``
runs the last two as one), one program per ``(time tile, batch row, head)``, float32 FMAs throughout. GPU (Triton) and
interpret mode only. Bytes moved, grid, blocks and why these shapes: docs/kernels.md.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lconv.errors import UserError

Array = jax.Array

BLOCK_T = 64  # time tile: 64 x D float32 per operand in registers (D = 64: 32 per thread at 4 warps)
NUM_WARPS = 4
BACKWARDS = ("split", "fused")  # dx and dw as two kernels, or one
BACKWARD = "split"
KERNELS = ("forward", "dx", "dweight", "fused_backward")


def light_conv_pallas(x_BTC: Array, weight_HK: Array, padding_left: int, segment_ids_BT: Array | None = None, *,
                      block_t: int = BLOCK_T, num_warps: int = NUM_WARPS, backward: str = BACKWARD,
                      interpret: bool | None = None) -> Array:
    """Lightweight conv with a shared normalised ``[H, K]`` kernel; ``[B, T, C]`` in ``x``'s dtype."""
    settings = _Settings(padding_left, block_t, num_warps, backward, interpret)
    _check(x_BTC, weight_HK, segment_ids_BT, settings, light=True)
    return _conv(x_BTC, weight_HK, _segments(segment_ids_BT), settings)


def dynamic_conv_pallas(x_BTC: Array, weight_BTHK: Array, padding_left: int, segment_ids_BT: Array | None = None,
                        *, block_t: int = BLOCK_T, num_warps: int = NUM_WARPS, backward: str = BACKWARD,
                        interpret: bool | None = None) -> Array:
    """Dynamic conv with a normalised kernel per position, ``[B, T, H, K]``; ``[B, T, C]`` in ``x``'s dtype."""
    settings = _Settings(padding_left, block_t, num_warps, backward, interpret)
    _check(x_BTC, weight_BTHK, segment_ids_BT, settings, light=False)
    return _conv(x_BTC, weight_BTHK, _segments(segment_ids_BT), settings)


def kernel_bytes_per_token(kernel: str, channels: int, heads: int, kernel_size: int, *, dynamic: bool,
                           itemsize: int, block_t: int = BLOCK_T) -> float:
    """DRAM bytes per token one of ``KERNELS`` moves (the table in docs/kernels.md), operands and outputs once each."""
    if kernel not in KERNELS:
        raise UserError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    w = heads * kernel_size if dynamic else 0
    light_partial = 0.0 if dynamic else heads * _pow2(kernel_size) * 4 / block_t  # a float32 [Kp] per tile
    if kernel in ("forward", "dx"):
        return (2 * channels + w) * itemsize
    if kernel == "dweight":
        return (2 * channels + w) * itemsize + light_partial
    return (3 * channels + 2 * w) * itemsize + light_partial


def pass_bytes_per_token(passes: str, backward: str, channels: int, heads: int, kernel_size: int, *,
                         dynamic: bool, itemsize: int, block_t: int = BLOCK_T) -> float:
    """``kernel_bytes_per_token`` summed over the kernels of ``passes`` (``"fwd"`` or ``"fwd+bwd"``)."""
    kernels = ["forward"]
    if passes != "fwd":
        kernels += ["dx", "dweight"] if backward == "split" else ["fused_backward"]
    return sum(kernel_bytes_per_token(k, channels, heads, kernel_size, dynamic=dynamic, itemsize=itemsize,
                                      block_t=block_t) for k in kernels)


# The custom VJP
class _Settings(NamedTuple):
    """The static (hashable) arguments: padding, tile, warps, which backward, interpret mode."""
    P: int
    L: int
    num_warps: int
    backward: str
    interpret: bool | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv(x_BTC, weight, seg_BT, settings):
    return _taps(x_BTC, weight, seg_BT, settings, transposed=False)


def _conv_fwd(x_BTC, weight, seg_BT, settings):
    return _taps(x_BTC, weight, seg_BT, settings, transposed=False), (x_BTC, weight, seg_BT)


def _conv_bwd(settings, residuals, dy_BTC):
    x_BTC, weight, seg_BT = residuals
    if settings.backward == "fused":
        dx_BTC, dw = _fused_backward(x_BTC, weight, seg_BT, dy_BTC, settings)
    else:
        dx_BTC = _taps(dy_BTC, weight, seg_BT, settings, transposed=True)
        dw = _dweight(x_BTC, weight, seg_BT, dy_BTC, settings)
    return dx_BTC, dw, None  # segment ids are integers: no cotangent


_conv.defvjp(_conv_fwd, _conv_bwd)


def _taps(in_BTC, weight, seg_BT, s: _Settings, transposed):
    """The forward (``y`` from ``x``) or, ``transposed``, ``dx`` from ``dy``: ``[B, T, C]`` in ``in``'s dtype."""
    B, T, C = in_BTC.shape
    D = C // weight.shape[-2]
    return _launch(_taps_kernel, s, weight, seg_BT, (in_BTC, weight), [_row_spec(T, D), _weight_spec(weight)],
                   pl.BlockSpec((None, s.L, D), lambda g, b, h: (b, g, h)),
                   jax.ShapeDtypeStruct((B, T, C), in_BTC.dtype), transposed=transposed)


def _dweight(x_BTC, weight, seg_BT, dy_BTC, s: _Settings):
    B, T, C = x_BTC.shape
    D = C // weight.shape[-2]
    dw_spec, dw_shape = _dweight_out(weight, B, pl.cdiv(T, s.L), s.L)
    dw = _launch(_dweight_kernel, s, weight, seg_BT, (x_BTC, dy_BTC), [_row_spec(T, D), _row_spec(T, D)], dw_spec,
                 dw_shape)
    return _finish_dweight(dw, weight)


def _fused_backward(x_BTC, weight, seg_BT, dy_BTC, s: _Settings):
    B, T, C = x_BTC.shape
    D = C // weight.shape[-2]
    dw_spec, dw_shape = _dweight_out(weight, B, pl.cdiv(T, s.L), s.L)
    dx_BTC, dw = _launch(_fused_backward_kernel, s, weight, seg_BT, (x_BTC, weight, dy_BTC),
                         [_row_spec(T, D), _weight_spec(weight), _row_spec(T, D)],
                         [pl.BlockSpec((None, s.L, D), lambda g, b, h: (b, g, h)), dw_spec],
                         [jax.ShapeDtypeStruct((B, T, C), x_BTC.dtype), dw_shape])
    return dx_BTC, _finish_dweight(dw, weight)


def _launch(kernel, s: _Settings, weight, seg_BT, operands, in_specs, out_specs, out_shape, **static):
    """``kernel`` on the ``(time tile, batch row, head)`` grid over ``operands``, the segment ids appended if any."""
    B, T, _ = operands[0].shape
    H, K = weight.shape[-2:]
    segmented = seg_BT is not None
    kernel = functools.partial(kernel, T=T, K=K, P=s.P, L=s.L, light=weight.ndim == 2, segmented=segmented, **static)
    call = functools.partial(_pallas, kernel, num_warps=s.num_warps, grid=(pl.cdiv(T, s.L), B, H),
                             in_specs=in_specs + ([_segment_spec(T)] if segmented else []), out_specs=out_specs,
                             out_shape=out_shape)
    return _run(call, operands + ((seg_BT,) if segmented else ()), s.interpret)


def _dweight_out(weight, B, G, L):
    """dw's block and array: light, per-tile float32 partials ``[B, G, H, Kp]``; dynamic, ``[B, T, H, K]``."""
    H, K = weight.shape[-2:]
    if weight.ndim == 2:
        return (pl.BlockSpec((None, None, None, _pow2(K)), lambda g, b, h: (b, g, h, 0)),
                jax.ShapeDtypeStruct((B, G, H, _pow2(K)), jnp.float32))
    return pl.BlockSpec((None, L, None, K), lambda g, b, h: (b, g, h, 0)), jax.ShapeDtypeStruct(weight.shape,
                                                                                                weight.dtype)


def _finish_dweight(dw, weight):
    if weight.ndim == 2:  # the tiles' partials summed, the power-of-two padding of K dropped
        return dw.sum((0, 1))[:, :weight.shape[-1]].astype(weight.dtype)
    return dw


def _pallas(kernel, *operands, interpret, num_warps, **spec):
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps)
    return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, **spec)(*operands)


def _run(call, operands, interpret):
    """Interpret mode where the computation is lowered for CPU, compiled (Triton) elsewhere, unless forced."""
    if interpret is not None:
        return call(*operands, interpret=interpret)
    return jax.lax.platform_dependent(
        *operands, cpu=lambda *a: call(*a, interpret=True), default=lambda *a: call(*a, interpret=False)
    )


def _row_spec(T, D):
    """Batch row ``b``'s whole time axis, head ``h``'s channels: the program loads only its tile and halo."""
    return pl.BlockSpec((None, T, D), lambda g, b, h: (b, 0, h))


def _weight_spec(weight):
    if weight.ndim == 2:
        return pl.BlockSpec(weight.shape, lambda g, b, h: (0, 0))
    _, T, H, K = weight.shape
    return pl.BlockSpec((None, T, H, K), lambda g, b, h: (b, 0, 0, 0))


def _segment_spec(T):
    return pl.BlockSpec((None, T), lambda g, b, h: (b, 0))


def _pow2(n):
    return 1 << (n - 1).bit_length()


# The kernels: one program = (time tile of L steps, batch row, head)
def _taps_kernel(in_ref, w_ref, *refs, T, K, P, L, light, segmented, transposed):
    """``out[t] = sum_k in[r] w[., k]``: forward ``r = t + k - P``, weight row ``t``; transposed (dx from dy)
    ``r = t + P - k``, weight row ``r``."""
    seg_ref, out_ref = refs if segmented else (None, *refs)
    g, h = pl.program_id(0), pl.program_id(2)
    t_L = g * L + jnp.arange(L, dtype=jnp.int32)  # the tile's output steps
    taps = _Taps(seg_ref, t_L, T)
    out_LD = jnp.zeros((L, in_ref.shape[-1]), jnp.float32)
    for k in range(K):
        out_LD += _tap(in_ref, w_ref, taps, t_L, h, k, P, light, transposed)
    plgpu.store(out_ref, out_LD.astype(out_ref.dtype), mask=(t_L < T)[:, None])


def _dweight_kernel(x_ref, dy_ref, *refs, T, K, P, L, light, segmented):
    """``dw[t, k] = sum_d x[t + k - P, d] dy[t, d]`` for the tile's steps ``t``, one ``[L, Kp]`` tile."""
    seg_ref, dw_ref = refs if segmented else (None, *refs)
    t_L = pl.program_id(0) * L + jnp.arange(L, dtype=jnp.int32)
    taps = _Taps(seg_ref, t_L, T)
    dy_here_LD = taps.rows(dy_ref, t_L, taps.ok(t_L))  # zero past T and on padding: no dw there
    dw_LK = jnp.zeros((L, _pow2(K)), jnp.float32)
    for k in range(K):
        dw_LK = _put_column(dw_LK, k, _dweight_tap(x_ref, taps, t_L, k, P, dy_here_LD))
    _store_dweight(dw_ref, dw_LK, t_L, T, K, light)


def _fused_backward_kernel(x_ref, w_ref, dy_ref, *refs, T, K, P, L, light, segmented):
    """dx (the transposed taps) and dw in one tap loop over the tile's steps ``s``."""
    seg_ref, dx_ref, dw_ref = refs if segmented else (None, *refs)
    g, h = pl.program_id(0), pl.program_id(2)
    s_L = g * L + jnp.arange(L, dtype=jnp.int32)
    taps = _Taps(seg_ref, s_L, T)
    dy_here_LD = taps.rows(dy_ref, s_L, taps.ok(s_L))
    dx_LD = jnp.zeros(dy_here_LD.shape, jnp.float32)
    dw_LK = jnp.zeros((L, _pow2(K)), jnp.float32)
    for k in range(K):
        dx_LD += _tap(dy_ref, w_ref, taps, s_L, h, k, P, light, transposed=True)
        dw_LK = _put_column(dw_LK, k, _dweight_tap(x_ref, taps, s_L, k, P, dy_here_LD))
    plgpu.store(dx_ref, dx_LD.astype(dx_ref.dtype), mask=(s_L < T)[:, None])
    _store_dweight(dw_ref, dw_LK, s_L, T, K, light)


def _tap(in_ref, w_ref, taps, t_L, h, k, P, light, transposed):
    """Tap ``k``'s ``[L, D]`` float32 term of the taps loop (``_taps_kernel``)."""
    r_L = t_L + (P - k if transposed else k - P)
    return taps.rows(in_ref, r_L, taps.ok(r_L)) * _tap_weight(w_ref, h, k, r_L if transposed else t_L, taps.T, light)


def _dweight_tap(x_ref, taps, t_L, k, P, dy_here_LD):
    """``[L]``: tap ``k``'s ``sum_d x[t + k - P, d] dy[t, d]``, a reduction within the ``D`` lanes of a row."""
    r_L = t_L + (k - P)
    return jnp.sum(taps.rows(x_ref, r_L, taps.ok(r_L)) * dy_here_LD, axis=1)


def _put_column(dw_LK, k, dw_L):
    """``dw_LK`` with column ``k`` set to ``dw_L``: a select, as Triton has no value slicing to write into."""
    return jnp.where(jnp.arange(dw_LK.shape[1], dtype=jnp.int32)[None, :] == k, dw_L[:, None], dw_LK)


def _store_dweight(dw_ref, dw_LK, t_L, T, K, light):
    """One store per program: light, the ``[Kp]`` sum over the tile's rows; dynamic, the masked ``[L, Kp]`` tile."""
    if light:
        dw_ref[...] = jnp.sum(dw_LK, axis=0)
        return
    k_K = jnp.arange(dw_LK.shape[1], dtype=jnp.int32)
    plgpu.store(dw_ref.at[:, pl.ds(0, dw_LK.shape[1])], dw_LK.astype(dw_ref.dtype),
                mask=(t_L < T)[:, None] & (k_K < K)[None, :])


class _Taps:
    """Which reads of a tile are live: step ``r`` read on behalf of the tile's step ``here`` (both ``[L]``)."""

    def __init__(self, seg_ref, here_L, T):
        self.seg_ref, self.T = seg_ref, T
        self.here_ok = here_L < T
        if seg_ref is not None:
            self.seg_here = seg_ref[jnp.clip(here_L, 0, T - 1)]
            self.here_ok &= self.seg_here != 0

    def ok(self, r_L):
        """``[L]`` bool: ``r`` inside ``[0, T)`` and, with segments, in the tile step's own segment."""
        ok = self.here_ok & (r_L >= 0) & (r_L < self.T)
        if self.seg_ref is not None:
            ok &= self.seg_ref[jnp.clip(r_L, 0, self.T - 1)] == self.seg_here
        return ok

    def rows(self, ref, r_L, ok_L):
        """``ref[r]`` as float32 ``[L, D]``, zero where not ``ok``; clamped indices keep every load in bounds."""
        rows_LD = ref[jnp.clip(r_L, 0, self.T - 1), :].astype(jnp.float32)
        return jnp.where(ok_L[:, None], rows_LD, 0.0)


def _tap_weight(w_ref, h, k, rows_L, T, light):
    """Tap ``k`` of head ``h`` at weight rows ``rows``: a scalar (light) or ``[L, 1]`` (dynamic), float32."""
    if light:
        return w_ref[h, k].astype(jnp.float32)
    return w_ref[jnp.clip(rows_L, 0, T - 1), h, k].astype(jnp.float32)[:, None]


# Argument checks: one-line errors naming the argument
def _check(x_BTC, weight, segment_ids_BT, settings: _Settings, light):
    if getattr(x_BTC, "ndim", None) != 3:
        raise UserError(f"x must be [batch, time, channels]; got shape {getattr(x_BTC, 'shape', None)}")
    B, T, C = x_BTC.shape
    want = 2 if light else 4
    if getattr(weight, "ndim", None) != want or (not light and weight.shape[:2] != (B, T)):
        names = "[heads, kernel_size]" if light else f"[batch, time, heads, kernel_size] = [{B}, {T}, H, K]"
        raise UserError(f"weight must be {names}; got shape {getattr(weight, 'shape', None)}")
    H, K = weight.shape[-2:]
    if K < 1 or H < 1 or C % H:
        raise UserError(f"weight [.., H={H}, K={K}]: need K >= 1 and channels C={C} divisible by H")
    P, block_t, num_warps, backward, interpret = settings
    if not isinstance(P, int) or not 0 <= P <= K - 1:
        raise UserError(f"padding_left must be an int in 0..K-1 = 0..{K - 1}; got {P!r}")
    if segment_ids_BT is not None and getattr(segment_ids_BT, "shape", None) != (B, T):
        raise UserError(f"segment_ids must be [batch, time] = [{B}, {T}]; got {getattr(segment_ids_BT, 'shape', None)}")
    for name, value in (("block_t", block_t), ("num_warps", num_warps)):
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise UserError(f"{name} must be a power of two (Triton needs one); got {value!r}")
    if backward not in BACKWARDS:
        raise UserError(f"backward must be one of {', '.join(BACKWARDS)}; got {backward!r}")
    # The compiled kernel's limits, known here only by the default backend (the kernel is chosen at lowering).
    backend = jax.default_backend()
    if interpret or backend == "cpu":
        return
    if backend == "tpu":
        raise UserError("impl='pallas' has no TPU (Mosaic) kernel yet; use impl='band' on TPU")
    if C // H & (C // H - 1):
        raise UserError(f"impl='pallas' on {backend} needs a power-of-two head width C/H (Triton); got {C // H}")


def _segments(segment_ids_BT):
    return None if segment_ids_BT is None else jnp.asarray(segment_ids_BT, jnp.int32)
