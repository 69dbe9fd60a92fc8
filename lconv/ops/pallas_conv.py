"""The ``"pallas"`` implementation of ``lconv.ops.light_conv`` / ``dynamic_conv``: one fused kernel per pass.

Same semantics as ``lconv.ops.conv`` (fairseq's): ``y[t, c] = sum_k w[t, h(c), k] * x[t + k - P, c]`` with heads
owning contiguous blocks of ``D = C // H`` channels, zero outside the sequence, and with ``segment_ids`` a tap
reads zero across a segment boundary or from padding (segment 0), so padding outputs zero. The weights arrive
normalised (softmax, DropConnect); the kernels do the conv's arithmetic and its custom VJP:

- forward: ``y`` from ``x`` and ``w``;
- backward, one kernel for both gradients: ``dx[s] = sum_k w[s + P - k, k] dy[s + P - k]`` and
  ``dw[t, h, k] = sum_d x[t + k - P, h, d] dy[t, h, d]`` (light: summed over ``B, T`` by the kernel per tile,
  then over the ``B x G`` tiles by XLA: a ``[B, G, H, K]`` partial, ``H K / (L C)`` of ``x``'s size, under 1%).

Grid and blocks. One program per ``(g, b, h)``: time tile ``g`` of ``L`` steps (``block_t``, a power of two),
batch row ``b``, head ``h`` (its ``D`` channels). ``x``, ``dy``, a dynamic ``w`` and the segment ids are handed to
each program as its whole row (a block spanning ``T``): on Triton a block is only a base pointer, so the program
loads exactly its ``L`` steps plus the ``K - 1`` halo, one ``[L, D]`` load per tap at rows ``t + k - P``, and keeps
the taps' weights in registers (scalars for light, an ``[L]`` column per tap for dynamic). The taps re-read
overlapping rows, which L1 serves; the halo (``(K - 1) / L`` of ``x``: 47% at K=31, L=64) is an L2 hit when the
neighbouring tile's program runs alongside, which is why ``g`` is the first grid axis (Pallas maps it to CUDA's
fastest-scheduled ``x``). Rows outside ``[0, T)`` are read at clamped indices and zeroed with the tap's mask, so no
load is ever out of bounds and no negative start is needed (interpret mode's ``dynamic_slice`` would clamp one and
shift the data). Stores of the last, partial tile are masked. All arithmetic is float32 elementwise FMAs (no dots,
so no TF32): exact in float32 on every backend, and bfloat16 inputs accumulate in float32.

Bytes moved (fwd + bwd, per token, float32, C channels, H heads): the floor reads ``x, dy, w`` and writes
``y, dx, dw`` once: ``16 C`` light, ``16 C + 8 H K`` dynamic. Here the backward re-reads ``x`` and ``w`` (the
forward read them too; keeping ``y`` instead would cost more): ``20 C`` (1.25x the floor) and
``20 C + 12 H K`` (1.3x at C=512, H=8, K=31), plus the segment ids (4 bytes per read) and the halo.

Why these shapes: Triton needs every loaded array's size to be a power of two (``L`` and ``D``: true for the
paper's heads, D = 64..128) and has no value slicing, so shifting must happen in the loads; whole-row blocks keep
every load in bounds without padding copies of ``x``. Mosaic (TPU) wants ``(8, 128)``-aligned blocks and cannot
gather rows (``int indexing``), so this kernel is GPU + interpret only; a TPU version would take
``pl.Element(L + K - 1, padding=(P, K - 1 - P))`` windows (Mosaic supports element-padded blocks, Triton not).
``pl.pallas_call`` on GPU is lowered through Triton (``plgpu.CompilerParams``), not Mosaic GPU, whose copies want
warpgroup-aligned byte counts.

``interpret=None`` is decided per backend being lowered (``jax.lax.platform_dependent``): interpret mode when the
computation is lowered for CPU, Triton for CUDA/ROCm, so an export traced on CPU for CUDA carries the compiled
kernel. Interpret mode runs the grid as a loop: for tests, not speed.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lconv.errors import UserError

Array = jax.Array

BLOCK_T = 64  # time tile: 64 x D float32 per operand in registers (D = 64: 32 per thread at 4 warps)
NUM_WARPS = 4


def light_conv_pallas(x_BTC: Array, weight_HK: Array, padding_left: int, segment_ids_BT: Array | None = None, *,
                      block_t: int = BLOCK_T, interpret: bool | None = None) -> Array:
    """Lightweight conv with a shared normalised ``[H, K]`` kernel; ``[B, T, C]`` in ``x``'s dtype."""
    _check(x_BTC, weight_HK, padding_left, segment_ids_BT, block_t, interpret, light=True)
    return _conv(x_BTC, weight_HK, _segments(segment_ids_BT), padding_left, block_t, interpret)


def dynamic_conv_pallas(x_BTC: Array, weight_BTHK: Array, padding_left: int, segment_ids_BT: Array | None = None,
                        *, block_t: int = BLOCK_T, interpret: bool | None = None) -> Array:
    """Dynamic conv with a normalised kernel per position, ``[B, T, H, K]``; ``[B, T, C]`` in ``x``'s dtype."""
    _check(x_BTC, weight_BTHK, padding_left, segment_ids_BT, block_t, interpret, light=False)
    return _conv(x_BTC, weight_BTHK, _segments(segment_ids_BT), padding_left, block_t, interpret)


# ----------------------------------------------------------------------------------------------------------------
# The custom VJP
# ----------------------------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _conv(x_BTC, weight, seg_BT, padding_left, block_t, interpret):
    return _forward(x_BTC, weight, seg_BT, padding_left, block_t, interpret)


def _conv_fwd(x_BTC, weight, seg_BT, padding_left, block_t, interpret):
    return _forward(x_BTC, weight, seg_BT, padding_left, block_t, interpret), (x_BTC, weight, seg_BT)


def _conv_bwd(padding_left, block_t, interpret, residuals, dy_BTC):
    x_BTC, weight, seg_BT = residuals
    dx_BTC, dw = _backward(x_BTC, weight, seg_BT, dy_BTC, padding_left, block_t, interpret)
    return dx_BTC, dw, None  # segment ids are integers: no cotangent


_conv.defvjp(_conv_fwd, _conv_bwd)


def _forward(x_BTC, weight, seg_BT, P, L, interpret):
    B, T, C = x_BTC.shape
    H, K = weight.shape[-2:]
    D, G = C // H, pl.cdiv(T, L)
    light, segmented = weight.ndim == 2, seg_BT is not None
    kernel = functools.partial(_forward_kernel, T=T, K=K, P=P, L=L, light=light, segmented=segmented)
    operands = (x_BTC, weight) + ((seg_BT,) if segmented else ())
    in_specs = [_row_spec(T, D), _weight_spec(weight)] + ([_segment_spec(T)] if segmented else [])
    call = functools.partial(
        _pallas, kernel, grid=(G, B, H), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, L, D), lambda g, b, h: (b, g, h)),
        out_shape=jax.ShapeDtypeStruct((B, T, C), x_BTC.dtype),
    )
    return _run(call, operands, interpret)


def _backward(x_BTC, weight, seg_BT, dy_BTC, P, L, interpret):
    B, T, C = x_BTC.shape
    H, K = weight.shape[-2:]
    D, G = C // H, pl.cdiv(T, L)
    light, segmented = weight.ndim == 2, seg_BT is not None
    kernel = functools.partial(_backward_kernel, T=T, K=K, P=P, L=L, light=light, segmented=segmented)
    operands = (x_BTC, weight, dy_BTC) + ((seg_BT,) if segmented else ())
    in_specs = [_row_spec(T, D), _weight_spec(weight), _row_spec(T, D)] + ([_segment_spec(T)] if segmented else [])
    if light:  # per-tile partial sums [B, G, H, K], reduced below
        dw_spec = pl.BlockSpec((None, None, None, K), lambda g, b, h: (b, g, h, 0))
        dw_shape = jax.ShapeDtypeStruct((B, G, H, K), jnp.float32)
    else:
        dw_spec = pl.BlockSpec((None, L, None, K), lambda g, b, h: (b, g, h, 0))
        dw_shape = jax.ShapeDtypeStruct((B, T, H, K), weight.dtype)
    call = functools.partial(
        _pallas, kernel, grid=(G, B, H), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, L, D), lambda g, b, h: (b, g, h)), dw_spec],
        out_shape=[jax.ShapeDtypeStruct((B, T, C), x_BTC.dtype), dw_shape],
    )
    dx_BTC, dw = _run(call, operands, interpret)
    if light:
        dw = dw.sum((0, 1)).astype(weight.dtype)
    return dx_BTC, dw


def _pallas(kernel, *operands, interpret, **spec):
    params = None if interpret else plgpu.CompilerParams(num_warps=NUM_WARPS)
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


# ----------------------------------------------------------------------------------------------------------------
# The kernels: one program = (time tile of L steps, batch row, head)
# ----------------------------------------------------------------------------------------------------------------
def _forward_kernel(x_ref, w_ref, *refs, T, K, P, L, light, segmented):
    seg_ref, y_ref = refs if segmented else (None, *refs)
    g, h = pl.program_id(0), pl.program_id(2)
    t_L = g * L + jnp.arange(L, dtype=jnp.int32)  # the tile's output steps
    taps = _Taps(seg_ref, t_L, T)
    y_LD = jnp.zeros((L, x_ref.shape[-1]), jnp.float32)
    for k in range(K):
        s_L = t_L + (k - P)  # tap k of step t reads step s
        x_LD = taps.rows(x_ref, s_L, taps.ok(s_L))
        y_LD += x_LD * _tap_weight(w_ref, h, k, t_L, T, light)
    plgpu.store(y_ref, y_LD.astype(y_ref.dtype), mask=(t_L < T)[:, None])


def _backward_kernel(x_ref, w_ref, dy_ref, *refs, T, K, P, L, light, segmented):
    seg_ref, dx_ref, dw_ref = refs if segmented else (None, *refs)
    g, h = pl.program_id(0), pl.program_id(2)
    s_L = g * L + jnp.arange(L, dtype=jnp.int32)  # the tile's steps: inputs of dx, outputs of dw
    taps = _Taps(seg_ref, s_L, T)
    dy_here_LD = taps.rows(dy_ref, s_L, taps.ok(s_L))  # zero past T and on padding: no dw there
    dx_LD = jnp.zeros(dy_here_LD.shape, jnp.float32)
    for k in range(K):
        # dx: output step t = s + P - k read step s through tap k (the same segment test, seen from s).
        t_L = s_L + (P - k)
        dx_LD += taps.rows(dy_ref, t_L, taps.ok(t_L)) * _tap_weight(w_ref, h, k, t_L, T, light)
        # dw: step s's tap k read step s + k - P.
        r_L = s_L + (k - P)
        dw_L = jnp.sum(taps.rows(x_ref, r_L, taps.ok(r_L)) * dy_here_LD, axis=1)
        if light:
            dw_ref[k] = jnp.sum(dw_L)
        else:
            # A [L, 1] column: interpret mode's masked store takes slices only, no integer index.
            plgpu.store(dw_ref.at[:, pl.ds(k, 1)], dw_L[:, None].astype(dw_ref.dtype), mask=(s_L < T)[:, None])
    plgpu.store(dx_ref, dx_LD.astype(dx_ref.dtype), mask=(s_L < T)[:, None])


class _Taps:
    """Which reads of a tile are live: step ``r`` read on behalf of the tile's step ``here`` (both ``[L]``)."""

    def __init__(self, seg_ref, here_L, T):
        self.seg_ref, self.T = seg_ref, T
        self.here_ok = here_L < T
        if seg_ref is not None:
            self.seg_here = seg_ref[jnp.clip(here_L, 0, T - 1)]
            self.here_ok &= self.seg_here != 0

    def ok(self, r_L):
        """``[L]`` bool: ``r`` inside ``[0, T)`` and, with segments, in the tile step's own (non-padding) segment."""
        ok = self.here_ok & (r_L >= 0) & (r_L < self.T)
        if self.seg_ref is not None:
            ok &= self.seg_ref[jnp.clip(r_L, 0, self.T - 1)] == self.seg_here
        return ok

    def rows(self, ref, r_L, ok_L):
        """``ref[r]`` as float32 ``[L, D]``, zero where not ``ok``; clamped indices keep every load in bounds."""
        rows_LD = ref[jnp.clip(r_L, 0, self.T - 1), :].astype(jnp.float32)
        return jnp.where(ok_L[:, None], rows_LD, 0.0)


def _tap_weight(w_ref, h, k, t_L, T, light):
    """Tap ``k`` of head ``h`` for output steps ``t``: a scalar (light) or ``[L, 1]`` (dynamic), float32."""
    if light:
        return w_ref[h, k].astype(jnp.float32)
    return w_ref[jnp.clip(t_L, 0, T - 1), h, k].astype(jnp.float32)[:, None]


# ----------------------------------------------------------------------------------------------------------------
# Argument checks: one-line errors naming the argument
# ----------------------------------------------------------------------------------------------------------------
def _check(x_BTC, weight, padding_left, segment_ids_BT, block_t, interpret, light):
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
    if not isinstance(padding_left, int) or not 0 <= padding_left <= K - 1:
        raise UserError(f"padding_left must be an int in 0..K-1 = 0..{K - 1}; got {padding_left!r}")
    if segment_ids_BT is not None and getattr(segment_ids_BT, "shape", None) != (B, T):
        raise UserError(f"segment_ids must be [batch, time] = [{B}, {T}]; got {getattr(segment_ids_BT, 'shape', None)}")
    if not isinstance(block_t, int) or block_t < 1 or block_t & (block_t - 1):
        raise UserError(f"block_t must be a power of two (Triton loads need one); got {block_t!r}")
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
