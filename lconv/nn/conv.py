"""Flax linen modules for lightweight and dynamic convolutions, parameterised as fairseq does.

- ``LightweightConv1d``: a learned ``[H, K]`` kernel, softmax-normalised over K, DropConnect, optional bias. -
``DynamicConv1d``: a kernel predicted per position by ``Dense(C -> H*K)`` (no bias) from the conv input. -
``LightConvBlock`` / ``DynamicConvBlock``: the paper's Fig. 2 block, a token mixer:
  ``Dense(d -> 2d)`` + GLU, the conv, ``Dense(d -> d)``.

The conv is exact in float32 on every backend (``lconv.ops``). Decoding keeps the last ``K - 1`` conv inputs in the
``'cache'`` collection (``conv_state [B, K-1, C]``); see docs/models.md.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv import ops
from lconv.constants import ACT_CONV, CONV, EMBED, HEADS, KERNEL
from lconv.errors import UserError
from lconv.nn.common import BT_CONV, BTHD, Dropout, check_input, constrain, segments_and_positions, xavier_dense
from lconv.ops import activations
from lconv.ops import conv as conv_ops
from lconv.ops.precision import lax_precision

Array = jax.Array
Dtype = Any


def light_kernel_init(key: Array, shape_HK: tuple[int, int], dtype: Dtype = jnp.float32) -> Array:
    """xavier-uniform of fairseq's ``[H, 1, K]`` weight: fan_in = K, fan_out = H * K."""
    H, K = shape_HK
    bound = (6.0 / (K + H * K)) ** 0.5
    return jax.random.uniform(key, shape_HK, dtype, -bound, bound)


class _ConvBase(nn.Module):
    """Fields and helpers shared by the two conv modules."""

    num_heads: int
    kernel_size: int
    causal: bool = False
    padding_left: int | None = None  # None: K-1 when causal, K//2 (odd K only) when centred
    weight_softmax: bool = True
    weight_dropout: float = 0.0  # DropConnect on the normalised kernel, training only
    use_bias: bool = False
    impl: str = "auto"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    matmul_precision: str = "default"  # of DynamicConv1d's kernel projection; the conv itself is always HIGHEST

    def _padding(self) -> int:
        K = self.kernel_size
        if K < 1:
            raise UserError(f"kernel_size must be >= 1; got {K}")
        if self.padding_left is not None:
            if self.causal and self.padding_left != K - 1:
                raise UserError(f"padding_left must be K-1={K - 1} for a causal conv; got {self.padding_left}")
            return self.padding_left
        if self.causal:
            return K - 1
        if K % 2 == 0:
            raise UserError(f"kernel_size must be odd for a centred (non-causal) conv; got {K}")
        return K // 2

    def _check_channels(self, x_BTC: Array) -> int:
        _, _, C = check_input(x_BTC)
        conv_ops.check_heads(C, self.num_heads, "num_heads")
        return C

    def _normalise(self, logits: Array, deterministic: bool) -> Array:
        """Softmax over K in float32, then DropConnect (scaled by 1/(1-p) by Dropout)."""
        weight = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) if self.weight_softmax else logits
        return Dropout(self.weight_dropout, name="weight_dropout")(weight, deterministic=deterministic)

    def _bias(self, y_BTC: Array) -> Array:
        if not self.use_bias:
            return y_BTC
        bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), (CONV,)), (y_BTC.shape[-1],),
            self.param_dtype,
        )
        return y_BTC + bias.astype(y_BTC.dtype)

    def _convolve(self, x_BTC: Array, weight: Array, padding_left: int, segment_ids: Array | None, decode: bool,
                  full_fn: Callable[..., Array], step_fn: Callable[..., tuple[Array, Array]]) -> Array:
        """``full_fn`` over the input, or while decoding ``step_fn`` on the cached last K-1 inputs; plus the bias."""
        if decode:
            state_BPC, initialised = self._decode_state(x_BTC)
            if initialised:
                y_BTC, state_BPC.value = step_fn(x_BTC, state_BPC.value, weight)
                return self._bias(y_BTC)
        return self._bias(full_fn(x_BTC, weight, padding_left, impl=self.impl, segment_ids=segment_ids))

    def _decode_state(self, x_BTC: Array) -> tuple[nn.Variable, bool]:
        """Returns the cache variable and whether it existed before this call (False = cache-creating call)."""
        if not self.causal:
            raise UserError("decode=True needs a causal conv (causal=True)")
        initialised = self.has_variable("cache", "conv_state")
        B, _, C = x_BTC.shape
        state_BPC = self.variable("cache", "conv_state", ops.init_conv_state, B, self.kernel_size, C, x_BTC.dtype)
        return state_BPC, initialised


class LightweightConv1d(_ConvBase):
    """Lightweight convolution: a softmax-normalised ``[H, K]`` kernel shared over positions; ``[B,T,C] -> [B,T,C]``."""

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, deterministic: bool = True,
                 decode: bool = False) -> Array:
        self._check_channels(x_BTC)
        padding_left = self._padding()
        logits_HK = self.param(
            "weight", nn.with_logical_partitioning(light_kernel_init, (HEADS, KERNEL)),
            (self.num_heads, self.kernel_size), self.param_dtype,
        )
        weight_HK = self._normalise(logits_HK, deterministic)
        return self._convolve(x_BTC, weight_HK, padding_left, segment_ids, decode, ops.light_conv,
                              ops.light_conv_step)


class DynamicConv1d(_ConvBase):
    """Dynamic convolution: per-position kernels from ``Dense(C -> H*K)`` of the input; ``[B,T,C] -> [B,T,C]``."""

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, deterministic: bool = True,
                 decode: bool = False) -> Array:
        self._check_channels(x_BTC)
        padding_left = self._padding()
        H, K = self.num_heads, self.kernel_size
        # fairseq's effective init is PyTorch's default Linear, U(+-1/sqrt(C)); EMBED names the side FSDP shards.
        predictor = nn.Dense(
            H * K,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=lax_precision(self.matmul_precision),
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"), (EMBED, HEADS)
            ),
            name="weight_linear",
        )
        logits_BTHK = constrain(predictor(x_BTC).reshape(*x_BTC.shape[:2], H, K), BTHD)  # head-major: h*K + k
        weight_BTHK = self._normalise(logits_BTHK, deterministic)
        return self._convolve(x_BTC, weight_BTHK, padding_left, segment_ids, decode, ops.dynamic_conv,
                              ops.dynamic_conv_step)


class GLUProjection(nn.Module):
    """``Dense(C -> 2 * features)`` + GLU (fairseq's ``linear1``), with F split so each device's GLU is local."""

    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    matmul_precision: str = "default"

    @nn.compact
    def __call__(self, x_BTC: Array, keep_BT: Array | None = None) -> Array:
        """``[B, T, C] -> [B, T, features]``; ``keep_BT``: positions whose output is kept (the rest are zeroed)."""
        C, F = x_BTC.shape[-1], self.features
        kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.xavier_uniform(), (EMBED, CONV)),
                            (C, 2 * F), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), (CONV,)), (2 * F,),
                          self.param_dtype)
        x_BTC, kernel, bias = nn.dtypes.promote_dtype(x_BTC, kernel, bias, dtype=self.dtype)
        # Gathered, then split by F: the partitioner would replicate a split moved across the reshape's merged dims.
        kernel_CGF = constrain(constrain(kernel.reshape(C, 2, F), (None, None, None)), (None, None, ACT_CONV))
        h_BTGF = jnp.einsum("btc,cgf->btgf", x_BTC, kernel_CGF, precision=lax_precision(self.matmul_precision))
        h_BTGF = h_BTGF + bias.reshape(2, F)
        value_BTF = h_BTGF[..., 0, :]
        if keep_BT is not None:  # zeroed before the GLU's product, so that product is the only [B, T, F] it writes
            value_BTF = value_BTF * keep_BT[..., None].astype(value_BTF.dtype)
        return activations.glu(value_BTF, h_BTGF[..., 1, :])


class LightConvBlock(nn.Module):
    """The paper's conv block, a token mixer: input dropout, ``Dense(d -> 2d)`` + GLU, padding zeroed, the conv,
    ``Dense(d -> d)`` (``conv_features``: fairseq's ``conv_dim``)."""

    # Mixer metadata (lconv.nn.mixers): the fields a model layer fills from its config, and where it may sit.
    model_fields: ClassVar[dict[str, str]] = {
        "num_heads": "num_heads", "kernel_size": "kernel_size", "causal": "causal", "use_glu": "use_glu",
        "conv_features": "conv_features", "input_dropout": "input_dropout", "weight_dropout": "weight_dropout",
        "conv_impl": "conv_impl", "dtype": "dtype", "matmul_precision": "matmul_precision",
        "weight_softmax": "weight_softmax"}
    sides: ClassVar[tuple[str, ...]] = ("encoder", "decoder")
    label: ClassVar[str] = "LightConv"
    example_fields: ClassVar[dict[str, Any]] = {"kernel_size": 3}

    num_heads: int
    kernel_size: int
    causal: bool = False
    conv_type: str = "lightweight"  # or "dynamic"
    use_glu: bool = True
    conv_features: int | None = None
    input_dropout: float = 0.0
    weight_dropout: float = 0.0
    weight_softmax: bool = True
    conv_bias: bool = False
    padding_left: int | None = None
    conv_impl: str = "auto"  # the conv op's impl (lconv.ops.conv), named as in config.model
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    matmul_precision: str = "default"  # of the projections (lconv.ops.precision); the conv is always HIGHEST

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, positions: Array | None = None,
                 deterministic: bool = True, decode: bool = False) -> Array:
        check_input(x_BTC)
        segments_and_positions(x_BTC, segment_ids, positions)  # shapes only: a conv reads no positions
        if self.conv_type not in ("lightweight", "dynamic"):
            raise UserError(f"conv_type must be 'lightweight' or 'dynamic'; got {self.conv_type!r}")
        d = x_BTC.shape[-1]
        conv_d = self.conv_features or d
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        precision = self.matmul_precision
        x_BTC = Dropout(self.input_dropout)(x_BTC, deterministic=deterministic)
        keep_BT = None if segment_ids is None else segment_ids != 0  # fairseq zeroes padded positions before the conv
        if self.use_glu:
            h_BTC = GLUProjection(conv_d, name="linear1", matmul_precision=precision, **dense)(x_BTC, keep_BT)
        else:
            h_BTC = xavier_dense(conv_d, (EMBED, CONV), name="linear1", precision=precision, **dense)(x_BTC)
            if keep_BT is not None:
                h_BTC = h_BTC * keep_BT[..., None].astype(h_BTC.dtype)
        h_BTC = constrain(h_BTC, BT_CONV)  # channels (= heads' blocks) split like the heads
        conv_cls = LightweightConv1d if self.conv_type == "lightweight" else DynamicConv1d
        h_BTC = conv_cls(
            num_heads=self.num_heads,
            kernel_size=self.kernel_size,
            causal=self.causal,
            padding_left=self.padding_left,
            weight_softmax=self.weight_softmax,
            weight_dropout=self.weight_dropout,
            use_bias=self.conv_bias,
            impl=self.conv_impl,
            matmul_precision=precision,
            name="conv",
            **dense,
        )(h_BTC, segment_ids=segment_ids, deterministic=deterministic, decode=decode)
        h_BTC = constrain(h_BTC, BT_CONV)
        return xavier_dense(d, (CONV, EMBED), name="linear2", precision=precision, **dense)(h_BTC)


class DynamicConvBlock(LightConvBlock):
    """``LightConvBlock`` with a dynamic conv (registry name ``"dynamicconv"``)."""

    label: ClassVar[str] = "DynamicConv"
    variant: ClassVar[str] = "dynamic"

    conv_type: str = "dynamic"
