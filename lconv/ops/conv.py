"""Pure functions for lightweight and dynamic convolutions (Wu et al., ICLR 2019), with fairseq's semantics: depthwise
1-D cross-correlations over time, heads owning contiguous channel blocks. ``impl`` picks the implementation (all equal
to 1e-5 in float32); ``segment_ids`` keeps packed rows apart; the ``*_step`` functions decode from a ``[B, K - 1, C]``
state. How each implementation works and what "auto" picks: docs/kernels.md."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lconv.errors import UserError
from lconv.ops import pallas_conv
from lconv.ops import shift as shift_conv
from lconv.ops.precision import CONV_PRECISION

Array = jax.Array

LIGHT_IMPLS = ("auto", "conv", "band", "shift", "unfold", "pallas")
DYNAMIC_IMPLS = ("auto", "band", "shift", "unfold", "pallas")


# Public API
def light_conv(x_BTC: Array, weight_HK: Array, padding_left: int, *, impl: str = "auto",
               segment_ids: Array | None = None, block_size: int | None = None) -> Array:
    """Lightweight convolution: one normalised ``[H, K]`` kernel shared over positions. Returns ``[B, T, C]``."""
    B, T, C, H, K = _check_light(x_BTC, weight_HK, padding_left)
    _check_segments(segment_ids, B, T)
    impl = _check_impl(impl, LIGHT_IMPLS, "light_conv")
    if impl == "auto":
        return _per_platform(light_conv, x_BTC, weight_HK, padding_left, segment_ids, block_size)
    if impl == "pallas":  # masks segments inside the kernel; its time tile is pallas_conv.BLOCK_T, not block_size
        return pallas_conv.light_conv_pallas(x_BTC, weight_HK, padding_left, segment_ids)
    if segment_ids is None:
        if impl == "conv":
            y = _light_conv_xla(x_BTC, weight_HK, padding_left)
        elif impl == "band":
            y = _light_band(x_BTC, weight_HK, padding_left, _block(block_size, T, K))
        elif impl == "shift":
            y = shift_conv.shift_conv(x_BTC, weight_HK, padding_left, _block(block_size, T, K))
        else:
            y = _dynamic_unfold(x_BTC, _broadcast_kernel(weight_HK, B, T), padding_left)
        return y.astype(x_BTC.dtype)
    valid_BTK = tap_mask(segment_ids, K, padding_left)
    if impl == "conv":  # depthwise conv, minus the taps that read across a boundary or from padding
        dropped_BTHK = _broadcast_kernel(weight_HK, B, T) * ~valid_BTK[:, :, None, :]
        y = _light_conv_xla(x_BTC, weight_HK, padding_left) - _dynamic_unfold(x_BTC, dropped_BTHK, padding_left)
        return y.astype(x_BTC.dtype)
    kept_BTHK = _broadcast_kernel(weight_HK, B, T) * valid_BTK[:, :, None, :]
    return _dynamic(x_BTC, kept_BTHK, padding_left, impl, block_size).astype(x_BTC.dtype)


def dynamic_conv(x_BTC: Array, weight_BTHK: Array, padding_left: int, *, impl: str = "auto",
                 segment_ids: Array | None = None, block_size: int | None = None) -> Array:
    """Dynamic convolution: a normalised ``[H, K]`` kernel per position (``weight [B, T, H, K]``)."""
    B, T, C, H, K = _check_dynamic(x_BTC, weight_BTHK, padding_left)
    _check_segments(segment_ids, B, T)
    impl = _check_impl(impl, DYNAMIC_IMPLS, "dynamic_conv")
    if impl == "auto":
        return _per_platform(dynamic_conv, x_BTC, weight_BTHK, padding_left, segment_ids, block_size)
    if impl == "pallas":  # the kernel masks taps itself: no [B, T, H, K] masked copy
        return pallas_conv.dynamic_conv_pallas(x_BTC, weight_BTHK, padding_left, segment_ids)
    if segment_ids is not None:
        weight_BTHK = weight_BTHK * tap_mask(segment_ids, K, padding_left)[:, :, None, :]
    return _dynamic(x_BTC, weight_BTHK, padding_left, impl, block_size).astype(x_BTC.dtype)


# The "auto" rule: "shift" measured fastest on CPU, "band" on a GPU (docs/kernels.md, docs/benchmarks.md).
_AUTO_IMPL = {"cpu": "shift"}  # platform (as jax.lax.platform_dependent names it) -> impl; others get "band"
_AUTO_DEFAULT = "band"


def choose_impl(backend: str | None = None) -> str:
    """The ``"auto"`` rule: the implementation measured fastest on ``backend`` (default: JAX's), whatever the shape."""
    return _AUTO_IMPL.get(backend or jax.default_backend(), _AUTO_DEFAULT)


def _per_platform(op, x_BTC, weight, padding_left, segment_ids, block_size):
    """``op`` with ``impl="auto"``: ``jax.lax.platform_dependent`` keeps the lowering platform's candidate."""
    def run(impl):
        return lambda x, w, seg: op(x, w, padding_left, impl=impl, segment_ids=seg, block_size=block_size)

    per_platform = {platform: run(impl) for platform, impl in _AUTO_IMPL.items()}
    return jax.lax.platform_dependent(x_BTC, weight, segment_ids, default=run(_AUTO_DEFAULT), **per_platform)


def tap_mask(segment_ids_BT: Array, kernel_size: int, padding_left: int) -> Array:
    """``[B, T, K]`` bool: tap ``k`` of position ``t`` reads ``t + k - padding_left`` inside ``t``'s segment."""
    seg_BT = jnp.asarray(segment_ids_BT)
    B, T = seg_BT.shape
    K = kernel_size
    seg_padded = jnp.pad(seg_BT, ((0, 0), (padding_left, K - 1 - padding_left)))  # zero = outside the sequence
    read_BTK = jnp.stack([seg_padded[:, k : k + T] for k in range(K)], axis=-1)
    return (read_BTK == seg_BT[:, :, None]) & (seg_BT[:, :, None] != 0)


def init_conv_state(batch_size: int, kernel_size: int, channels: int, dtype: Any = jnp.float32) -> Array:
    """Decoding state of a causal conv: the last ``P = K - 1`` inputs, ``[B, P, C]``, zeros before the start."""
    return jnp.zeros((batch_size, kernel_size - 1, channels), dtype)


def light_conv_step(x_BTC: Array, state_BPC: Array, weight_HK: Array) -> tuple[Array, Array]:
    """Causal light conv over ``T >= 1`` new positions given the last ``K - 1`` inputs: ``(y_BTC, new_state_BPC)``."""
    B, T, C, H, K = _check_light(x_BTC, weight_HK, weight_HK.shape[-1] - 1)
    _check_state(state_BPC, B, K, C)
    return dynamic_conv_step(x_BTC, state_BPC, _broadcast_kernel(weight_HK, B, T))


def dynamic_conv_step(x_BTC: Array, state_BPC: Array, weight_BTHK: Array) -> tuple[Array, Array]:
    """Causal dynamic conv over ``T >= 1`` new positions, each with its own kernel ``weight [B, T, H, K]``: K unrolled
    multiply-adds, not a dot (docs/kernels.md)."""
    B, T, C, H, K = _check_dynamic(x_BTC, weight_BTHK, weight_BTHK.shape[-1] - 1)
    _check_state(state_BPC, B, K, C)
    x_all = jnp.concatenate([state_BPC.astype(x_BTC.dtype), x_BTC], axis=1)  # [B, P+T, C]
    # Output t reads x_all[t : t + K]: a "valid" correlation, so no padding.
    x_BXHD = x_all.astype(jnp.float32).reshape(B, K - 1 + T, H, C // H)  # X = P + T
    w_BTHK = weight_BTHK.astype(jnp.float32)
    y_BTHD = sum(x_BXHD[:, k : k + T] * w_BTHK[..., k, None] for k in range(K))
    return y_BTHD.reshape(B, T, C).astype(x_BTC.dtype), x_all[:, T:]


# Implementations
def _dynamic(x_BTC, weight_BTHK, padding_left, impl, block_size):
    K = weight_BTHK.shape[-1]
    if impl == "band":
        return _dynamic_band(x_BTC, weight_BTHK, padding_left, _block(block_size, x_BTC.shape[1], K))
    if impl == "shift":
        return shift_conv.shift_conv(x_BTC, weight_BTHK, padding_left, _block(block_size, x_BTC.shape[1], K))
    return _dynamic_unfold(x_BTC, weight_BTHK, padding_left)


def _light_conv_xla(x_BTC, weight_HK, padding_left):
    """Depthwise ``conv_general_dilated``; lax convs are cross-correlations, as fairseq's are."""
    C = x_BTC.shape[-1]
    H, K = weight_HK.shape
    kernel_KC = jnp.repeat(weight_HK.T, C // H, axis=1)  # head h -> channels [h*D, (h+1)*D)
    return jax.lax.conv_general_dilated(
        x_BTC,
        kernel_KC[:, None, :].astype(x_BTC.dtype),  # [K, in/group = 1, C]
        window_strides=(1,),
        padding=[(padding_left, K - 1 - padding_left)],
        dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=C,
        precision=CONV_PRECISION,
        preferred_element_type=jnp.float32,
    )


def _dynamic_unfold(x_BTC, weight_BTHK, padding_left):
    B, T, C = x_BTC.shape
    H, K = weight_BTHK.shape[-2:]
    x_padded = jnp.pad(x_BTC, ((0, 0), (padding_left, K - 1 - padding_left), (0, 0)))
    windows_BTKHD = jnp.stack([x_padded[:, k : k + T] for k in range(K)], axis=2).reshape(B, T, K, H, C // H)
    y_BTHD = jnp.einsum(
        "btkhd,bthk->bthd", windows_BTKHD, weight_BTHK.astype(x_BTC.dtype), precision=CONV_PRECISION,
        preferred_element_type=jnp.float32,
    )
    return y_BTHD.reshape(B, T, C)


def _light_band(x_BTC, weight_HK, padding_left, L):
    B, T, C = x_BTC.shape
    H, K = weight_HK.shape
    windows_BGWHD, G = _tile_windows(x_BTC, padding_left, K, L, H)
    band_HLW = _skew(jnp.broadcast_to(weight_HK[:, None, :], (H, L, K)))  # band[h, i, i + k] = w[h, k]
    y_BGLHD = jnp.einsum(
        "hlw,bgwhd->bglhd", band_HLW.astype(x_BTC.dtype), windows_BGWHD, precision=CONV_PRECISION,
        preferred_element_type=jnp.float32,
    )
    return y_BGLHD.reshape(B, G * L, C)[:, :T]


def _dynamic_band(x_BTC, weight_BTHK, padding_left, L):
    B, T, C = x_BTC.shape
    H, K = weight_BTHK.shape[-2:]
    windows_BGWHD, G = _tile_windows(x_BTC, padding_left, K, L, H)
    weight_BGHLK = jnp.pad(weight_BTHK, ((0, 0), (0, G * L - T), (0, 0), (0, 0)))
    weight_BGHLK = weight_BGHLK.reshape(B, G, L, H, K).transpose(0, 1, 3, 2, 4)
    band_BGHLW = _skew(weight_BGHLK.astype(x_BTC.dtype))  # band[.., i, i + k] = w[.., i, k]
    y_BGLHD = jnp.einsum("bghlw,bgwhd->bglhd", band_BGHLW, windows_BGWHD, precision=CONV_PRECISION,
                         preferred_element_type=jnp.float32)
    return y_BGLHD.reshape(B, G * L, C)[:, :T]


def _tile_windows(x_BTC, padding_left, K, L, H):
    """Tiles of ``L`` outputs with their ``L + K - 1`` inputs, ``[B, G, W, H, D]`` and ``G``; needs ``L >= K - 1``."""
    B, T, C = x_BTC.shape
    G = -(-T // L)
    # (G + 1) tiles cover the left padding, T inputs, the right padding and the last tile's halo.
    x_padded = jnp.pad(x_BTC, ((0, 0), (padding_left, (G + 1) * L - T - padding_left), (0, 0)))
    tiles_BGLC = x_padded.reshape(B, G + 1, L, C)
    windows_BGWC = jnp.concatenate([tiles_BGLC[:, :G], tiles_BGLC[:, 1:, : K - 1]], axis=2)
    return windows_BGWC.reshape(B, G, L + K - 1, H, C // H), G


def _skew(rows_LK):
    """``[..., L, K] -> [..., L, L+K-1]`` with row ``i`` shifted right by ``i``, by pad/reshape/slice."""
    *lead, L, K = rows_LK.shape
    padded = jnp.pad(rows_LK, [(0, 0)] * len(lead) + [(0, 0), (0, L)])  # [..., L, L+K]
    flat = padded.reshape(*lead, L * (L + K))[..., : L * (L + K - 1)]
    return flat.reshape(*lead, L, L + K - 1)


def _broadcast_kernel(weight_HK, B, T):
    return jnp.broadcast_to(weight_HK, (B, T) + weight_HK.shape)


def _block(block_size, T, K):
    """Tile length: at least ``K - 1`` (the halo must fit one tile), 32 by default, never much longer than T."""
    if block_size is None:
        block_size = min(32, max(T, 1))
    elif block_size < 1:
        raise UserError(f"block_size must be >= 1; got {block_size}")
    return max(block_size, K - 1, 1)


# Argument checks: one-line ValueErrors naming the argument
def _check_x(x_BTC):
    if getattr(x_BTC, "ndim", None) != 3:
        raise UserError(f"x must be [batch, time, channels]; got shape {getattr(x_BTC, 'shape', None)}")
    return x_BTC.shape


def check_heads(C: int, H: int, what: str) -> None:
    """The one rule that heads own equal contiguous channel blocks (the conv ops, and the conv modules' fields)."""
    if H < 1 or C % H:
        raise UserError(f"{what}: channels C={C} must be divisible by the number of heads H={H}")


def _check_padding(padding_left, K):
    if not isinstance(padding_left, int) or not 0 <= padding_left <= K - 1:
        raise UserError(f"padding_left must be an int in 0..K-1 = 0..{K - 1}; got {padding_left!r}")


def _check_light(x_BTC, weight_HK, padding_left):
    B, T, C = _check_x(x_BTC)
    if getattr(weight_HK, "ndim", None) != 2:
        raise UserError(f"weight must be [heads, kernel_size]; got shape {getattr(weight_HK, 'shape', None)}")
    return (B, T, C, *_check_kernel(weight_HK.shape, C, padding_left))


def _check_dynamic(x_BTC, weight_BTHK, padding_left):
    B, T, C = _check_x(x_BTC)
    if getattr(weight_BTHK, "ndim", None) != 4 or weight_BTHK.shape[:2] != (B, T):
        raise UserError(
            f"weight must be [batch, time, heads, kernel_size] = [{B}, {T}, H, K]; "
            f"got shape {getattr(weight_BTHK, 'shape', None)}"
        )
    return (B, T, C, *_check_kernel(weight_BTHK.shape, C, padding_left))


def _check_kernel(weight_shape, C, padding_left):
    """``(H, K)`` from a weight shape ``[..., H, K]``, checked against the channels and ``padding_left``."""
    H, K = weight_shape[-2:]
    if K < 1:
        raise UserError(f"weight: kernel_size must be >= 1; got weight shape {weight_shape}")
    check_heads(C, H, "weight")
    _check_padding(padding_left, K)
    return H, K


def _check_segments(segment_ids, B, T):
    if segment_ids is None:
        return
    shape = getattr(segment_ids, "shape", None)
    if shape != (B, T):
        raise UserError(f"segment_ids must be [batch, time] = [{B}, {T}]; got shape {shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise UserError(f"segment_ids must be integers (0 = padding); got dtype {segment_ids.dtype}")


def _check_state(state_BPC, B, K, C):
    shape = getattr(state_BPC, "shape", None)
    if shape != (B, K - 1, C):
        raise UserError(f"state must be [batch, K-1, channels] = [{B}, {K - 1}, {C}]; got shape {shape}")


def _check_impl(impl, allowed, op):
    if impl not in allowed:
        raise UserError(f"{op}: impl must be one of {allowed}; got {impl!r}")
    return impl

