"""The ``"shift"`` implementation of ``lconv.ops.light_conv`` / ``dynamic_conv``: fast on CPU.

K multiply-adds of shifted inputs that XLA fuses into one loop, with a custom VJP (dx the same way, dw by band tiles),
over blocks of about ``CHUNK_TOKENS`` tokens so the temporaries stay small. Details: docs/kernels.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lconv.ops.precision import CONV_PRECISION

# Tokens per loop step: negligible loop overhead, a step's temporaries still in cache (docs/benchmarks.md).
CHUNK_TOKENS = 1024


def shift_conv(x_BTC: jax.Array, weight: jax.Array, padding_left: int, tile_length: int) -> jax.Array:
    """``weight`` is ``[H, K]`` (light) or ``[B, T, H, K]`` (dynamic), already normalised. Float32 result."""
    return _shift_conv(x_BTC, weight, padding_left, tile_length)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _shift_conv(x_BTC, weight, padding_left, tile_length):
    return _forward(x_BTC, weight, padding_left)


def _shift_conv_fwd(x_BTC, weight, padding_left, tile_length):
    return _forward(x_BTC, weight, padding_left), (x_BTC, weight)


def _shift_conv_bwd(padding_left, tile_length, residuals, dy_BTC):
    x_BTC, weight = residuals
    dx_BTC, dw = _backward(x_BTC, weight, dy_BTC.astype(jnp.float32), padding_left, tile_length)
    return dx_BTC.astype(x_BTC.dtype), dw.astype(weight.dtype)


_shift_conv.defvjp(_shift_conv_fwd, _shift_conv_bwd)


# The loops over blocks
def _forward(x_BTC, weight, P):
    B, T, C = x_BTC.shape
    K = weight.shape[-1]
    blocks = _Blocks(B, T)

    def step(i, y_BTC):
        b, t, _ = blocks.start(i)
        x_win = blocks.window(x_BTC, b, t, P, K - P)  # [Bc, Tc + K, C]: one spare step, see _shifted_sum
        w = weight if weight.ndim == 2 else blocks.window(weight, b, t, 0, 1)
        y_blk = _shifted_sum(x_win, w, [(k, 0, k) for k in range(K)])
        return jax.lax.dynamic_update_slice(y_BTC, y_blk, (b, t, 0))

    return blocks.loop(step, jnp.zeros((B, T, C), jnp.float32))  # every step overwrites its block


def _backward(x_BTC, weight, dy_BTC, P, L):
    B, T, C = x_BTC.shape
    H, K = weight.shape[-2:]
    blocks = _Blocks(B, T)
    light = weight.ndim == 2
    left, right = K - 1 - P, P + 1  # the input gradient's taps read dy[s + P - k]

    def step(i, carry):
        dx_BTC, dw = carry
        b, t, fresh_from = blocks.start(i)
        dy_win = blocks.window(dy_BTC, b, t, left, right)
        w = weight if light else blocks.window(weight, b, t, left, right)
        dx_blk = _shifted_sum(dy_win, w, [(K - 1 - k, K - 1 - k, k) for k in range(K)])
        dx_BTC = jax.lax.dynamic_update_slice(dx_BTC, dx_blk, (b, t, 0))
        x_win = blocks.window(x_BTC, b, t, P, K - 1 - P)  # [Bc, Tc + K - 1, C]
        dy_blk = dy_win[:, left : left + blocks.Tc]
        if light:  # a block that overlaps the previous one (T not a multiple of Tc) adds only its new steps
            fresh = (t + jnp.arange(blocks.Tc) >= fresh_from)[None, :, None]
            dw_BTHK = _band_weight_grad(x_win, jnp.where(fresh, dy_blk, 0.0), K, H, L)
            return dx_BTC, dw + dw_BTHK.sum((0, 1))
        dw_BTHK = _band_weight_grad(x_win, dy_blk, K, H, L)
        return dx_BTC, jax.lax.dynamic_update_slice(dw, dw_BTHK, (b, t, 0, 0))

    # Filled from dy, not a constant, which XLA would merge across layers and hold at the step's peak.
    never_read = dy_BTC[0, 0, 0] * 0.0  # not folded to 0 (NaN * 0 is NaN), so it waits for dy
    dx0 = jnp.broadcast_to(never_read, (B, T, C))
    dw0 = jnp.zeros(weight.shape, jnp.float32) if light else jnp.broadcast_to(never_read, weight.shape)
    return blocks.loop(step, (dx0, dw0))


class _Blocks:
    """Blocks of ``Bc`` rows x ``Tc`` steps covering ``[B, T]`` (a row's last piece may overlap: ``start``)."""

    def __init__(self, B, T):
        if T >= CHUNK_TOKENS:
            self.Bc, self.Tc = 1, CHUNK_TOKENS
        else:  # several whole rows: the largest divisor of B that keeps the block near CHUNK_TOKENS
            self.Bc = max(d for d in range(1, B + 1) if B % d == 0 and d * T <= max(CHUNK_TOKENS, T))
            self.Tc = T
        self.T, self.n_rows, self.n_pieces = T, B // self.Bc, -(-T // self.Tc)

    def start(self, i):
        """Block ``i``'s first row, first step, and the step from which its outputs are new."""
        row, piece = i // self.n_pieces, i % self.n_pieces
        nominal = piece * self.Tc
        return row * self.Bc, jnp.minimum(nominal, self.T - self.Tc), nominal

    def window(self, a, b, t, left, right):
        """Rows ``b : b + Bc``, steps ``[t - left, t + Tc + right)`` of ``a`` (``[B, T, ...]``), zero outside."""
        n = self.Tc + left + right
        if n > self.T:  # short rows: pad the block's rows (small) and read them at the block's start
            rows = jax.lax.dynamic_slice_in_dim(a, b, self.Bc, axis=0)
            return jax.lax.dynamic_slice_in_dim(_pad_time(rows, left, right), t, n, axis=1)
        # dynamic_slice clamps its start: pad the clamped read and re-slice so steps outside [0, T) are zeros.
        clamped = jnp.clip(t - left, 0, self.T - n)
        inner = jax.lax.dynamic_slice(a, (b, clamped) + (0,) * (a.ndim - 2), (self.Bc, n) + a.shape[2:])
        return jax.lax.dynamic_slice_in_dim(_pad_time(inner, left, right), t - clamped, n, axis=1)

    def loop(self, step, init):
        n = self.n_rows * self.n_pieces
        return step(0, init) if n == 1 else jax.lax.fori_loop(0, n, step, init)


# One block
def _shifted_sum(a_BSC, weight, taps):
    """``sum over (a_offset, w_offset, k) in taps of a[:, a_offset + t] * w[:, w_offset + t, :, k]``, float32, over
    inputs with their halo (``S - K`` steps: one extra, dropped, keeps XLA:CPU from a dot fusion)."""
    B, S, C = a_BSC.shape
    H, K = weight.shape[-2:]
    T = S - K
    a_BSHD = a_BSC.reshape(B, S, H, C // H)
    total = None
    for a_offset, w_offset, k in taps:
        w_k = weight[:, k, None] if weight.ndim == 2 else weight[:, w_offset : w_offset + T + 1, :, k, None]
        term = a_BSHD[:, a_offset : a_offset + T + 1].astype(jnp.float32) * w_k.astype(jnp.float32)
        total = term if total is None else total + term
    return total[:, :T].reshape(B, T, C)


def _band_weight_grad(x_win_BSC, dy_BTC, K, H, L):
    """``dw[b, t, h, k] = sum_d x_win[b, t + k, h, d] dy[b, t, h, d]`` as ``[B, T, H, K]`` float32."""
    B, T, C = dy_BTC.shape
    D, G = C // H, -(-T // L)
    x_padded = _pad_time(x_win_BSC, 0, (G + 1) * L - x_win_BSC.shape[1])
    tiles_BHGDL = x_padded.reshape(B, G + 1, L, H, D).transpose(0, 3, 1, 4, 2)
    windows_BHGDW = jnp.concatenate([tiles_BHGDL[:, :, :G], tiles_BHGDL[:, :, 1:, :, : K - 1]], axis=-1)
    dy_BHGLD = _pad_time(dy_BTC, 0, G * L - T).reshape(B, G, L, H, D).transpose(0, 3, 1, 2, 4)
    gram_BHGLW = jnp.einsum(
        "bhgld,bhgdw->bhglw", dy_BHGLD, windows_BHGDW.astype(dy_BHGLD.dtype), precision=CONV_PRECISION,
        preferred_element_type=jnp.float32,
    )
    dw_BHGLK = _unskew(gram_BHGLW, K)
    return dw_BHGLK.transpose(0, 2, 3, 1, 4).reshape(B, G * L, H, K)[:, :T]


def _unskew(band_LW, K):
    """``[..., L, L+K-1] -> [..., L, K]``, ``out[i, k] = band[i, i + k]`` (read with row stride ``L + K``)."""
    *lead, L, W = band_LW.shape
    flat = jnp.pad(band_LW.reshape(*lead, L * W), [(0, 0)] * len(lead) + [(0, L)])  # [..., L * (W + 1)]
    return flat.reshape(*lead, L, W + 1)[..., :K]


def _pad_time(a, left, right):
    return jnp.pad(a, [(0, 0), (left, right)] + [(0, 0)] * (a.ndim - 2))

