"""A correct toy mixer written as a user would (no lconv internals), and copies of it broken on purpose, one per
rule of ``lconv.testing.RULES``: each must fail the checker on its own rule. Importable as ``toy_mixers:Class``
(tests/ is on the path), so the tests also use the ``package.module:Class`` route of the registry.

``PrefixMean``: each token's update is a learned projection of the mean of the tokens it may see (its segment;
in causal use, up to itself). Decoding keeps the inputs so far in a ``'cache'``. ``CarriedMean`` adds a state
carried from one window of a document to the next (the contract's ``state``).
"""
from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp


class PrefixMean(nn.Module):
    model_fields: ClassVar[dict[str, str]] = {"causal": "causal", "dropout": "attention_dropout", "dtype": "dtype"}
    label: ClassVar[str] = "Prefix mean"

    num_heads: int = 1  # unused: every mixer accepts it
    causal: bool = False
    dropout: float = 0.0
    dtype: Any = jnp.float32

    def visible(self, seg_BT: jax.Array) -> jax.Array:
        """``[B, T, S]``: which tokens each token may read."""
        same = (seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, :, None] > 0)
        T = seg_BT.shape[1]
        return same & jnp.tril(jnp.ones((T, T), bool)) if self.causal else same

    def project(self, mean_BTC: jax.Array, deterministic: bool) -> jax.Array:
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        y = nn.Dense(mean_BTC.shape[-1], kernel_init=kernel, use_bias=False, dtype=self.dtype, name="proj",
                     precision=jax.lax.Precision.HIGHEST)(mean_BTC)
        return nn.Dropout(self.dropout)(y, deterministic=deterministic)

    @nn.compact
    def __call__(self, x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False):
        return self.mix(x_BTC, segment_ids, deterministic, decode)

    def mix(self, x_BTC, segment_ids, deterministic, decode):
        B, T, C = x_BTC.shape
        if decode:
            if not self.causal:
                raise ValueError("PrefixMean: decode=True needs causal=True")
            return self.decode_step(x_BTC, deterministic).astype(x_BTC.dtype)
        seg_BT = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
        w_BTS = self.visible(seg_BT).astype(jnp.float32)
        w_BTS = w_BTS / jnp.maximum(w_BTS.sum(-1, keepdims=True), 1.0)
        mean_BTC = jnp.einsum("bts,bsc->btc", w_BTS, x_BTC.astype(jnp.float32), precision="highest")
        return self.project(mean_BTC.astype(self.dtype), deterministic).astype(x_BTC.dtype)

    def decode_step(self, x_BTC, deterministic):
        B, T, C = x_BTC.shape
        initialized = self.has_variable("cache", "inputs")
        inputs = self.variable("cache", "inputs", jnp.zeros, (B, T, C), jnp.float32)  # T: the max length
        index = self.variable("cache", "index", lambda: jnp.array(0, jnp.int32))
        if not initialized:  # the first call sizes the cache
            return self.project(jnp.zeros((B, T, C), self.dtype), deterministic)
        start = index.value
        inputs.value = jax.lax.dynamic_update_slice(inputs.value, x_BTC.astype(jnp.float32), (0, start, 0))
        index.value = start + T
        L = inputs.value.shape[1]
        upto_TL = jnp.arange(L)[None, :] <= (start + jnp.arange(T))[:, None]
        w_TL = upto_TL / upto_TL.sum(-1, keepdims=True)
        mean_BTC = jnp.einsum("tl,blc->btc", w_TL, inputs.value, precision="highest")
        return self.project(mean_BTC.astype(self.dtype), deterministic)


class CarriedMean(PrefixMean):
    """PrefixMean plus the mean of the previous window's last example, carried per row in the ``'carry'``
    collection: the row's first example (the document the last window's ends with) reads it."""

    state: ClassVar[tuple[str, ...]] = ("carry",)
    reads_state: ClassVar[bool] = True

    @nn.compact
    def __call__(self, x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False):
        y = self.mix(x_BTC, segment_ids, deterministic, decode)
        if not (self.has_variable("carry", "mean") or self.is_mutable_collection("carry")):
            return y  # no state given: a fresh document
        B, T, C = x_BTC.shape
        carried = self.variable("carry", "mean", jnp.zeros, (B, C), jnp.float32)
        seg_BT = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
        reads_BT = (seg_BT == seg_BT[:, :1]) & (seg_BT > 0) & self.reads_state
        y = y + (reads_BT[..., None] * carried.value[:, None, :]).astype(y.dtype)
        if self.is_mutable_collection("carry") and not decode and not self.is_initializing():
            w_BT = ((seg_BT == seg_BT.max(-1, keepdims=True)) & (seg_BT > 0)).astype(jnp.float32)
            mean_BC = jnp.einsum("bt,btc->bc", w_BT, x_BTC.astype(jnp.float32), precision="highest")
            carried.value = mean_BC / jnp.maximum(w_BT.sum(-1, keepdims=True), 1.0)
        return y


# ---------------------------------------------------------------- broken on purpose, one rule each
class NoCausalField(PrefixMean):  # fields: a decoder layer could not make it causal
    model_fields: ClassVar[dict[str, str]] = {"dropout": "attention_dropout"}


class WrongDtype(PrefixMean):  # output: float16 out of a float32 input
    def __call__(self, x_BTC, **kwargs):
        return super().__call__(x_BTC, **kwargs).astype(jnp.float16)


class TupleOutput(PrefixMean):  # output: (y, aux) instead of y
    def __call__(self, x_BTC, **kwargs):
        y = super().__call__(x_BTC, **kwargs)
        return y, jnp.zeros(())


class NaNOutput(PrefixMean):  # output: NaN wherever it looks
    def __call__(self, x_BTC, **kwargs):
        return super().__call__(x_BTC, **kwargs) * jnp.nan


class RaisesOnCall(PrefixMean):  # runs: its own code raises, whatever the rngs
    def __call__(self, x_BTC, **kwargs):
        raise RuntimeError("RaisesOnCall: a bug in the mixer")


class AlwaysDropout(PrefixMean):  # deterministic: needs a dropout rng even when deterministic
    def __call__(self, x_BTC, **kwargs):
        y = super().__call__(x_BTC, **kwargs)
        keep = jax.random.bernoulli(self.make_rng("dropout"), 0.9, y.shape)
        return jnp.where(keep, y, 0.0)


class SameAxisTwice(PrefixMean):  # logical_axes: one name on both dimensions, which no mesh can shard
    def project(self, mean_BTC, deterministic):
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "embed"))
        mix = self.param("mix", kernel, (mean_BTC.shape[-1],) * 2)
        return super().project(mean_BTC @ mix.astype(mean_BTC.dtype), deterministic)


class NoAxisNames(PrefixMean):  # logical_axes: a bias created without names
    def project(self, mean_BTC, deterministic):
        bias = self.param("bias", nn.initializers.zeros, (mean_BTC.shape[-1],))
        return super().project(mean_BTC, deterministic) + bias.astype(mean_BTC.dtype)


class SegmentLeak(PrefixMean):  # segments: reads every real token of the row, whatever its segment
    def visible(self, seg_BT):
        real = (seg_BT[:, :, None] > 0) & (seg_BT[:, None, :] > 0)
        T = seg_BT.shape[1]
        return real & jnp.tril(jnp.ones((T, T), bool)) if self.causal else real


class PaddingLeak(PrefixMean):  # padding: real tokens also read the padding
    def visible(self, seg_BT):
        reads = ((seg_BT[:, :, None] == seg_BT[:, None, :]) | (seg_BT[:, None, :] == 0)) & (seg_BT[:, :, None] > 0)
        T = seg_BT.shape[1]
        return reads & jnp.tril(jnp.ones((T, T), bool)) if self.causal else reads


class PeeksAhead(PrefixMean):  # causality: a causal token also reads the next one
    def visible(self, seg_BT):
        same = (seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, :, None] > 0)
        T = seg_BT.shape[1]
        return same & jnp.tril(jnp.ones((T, T), bool), k=1) if self.causal else same


class ForgetfulDecoder(PrefixMean):  # decoding: each chunk sees only itself, not the cache
    def decode_step(self, x_BTC, deterministic):
        B, T, C = x_BTC.shape
        self.variable("cache", "index", lambda: jnp.array(0, jnp.int32))
        upto_TT = jnp.tril(jnp.ones((T, T)))
        mean_BTC = jnp.einsum("ts,bsc->btc", upto_TT / upto_TT.sum(-1, keepdims=True), x_BTC, precision="highest")
        return self.project(mean_BTC.astype(self.dtype), deterministic)


class EncoderThatDecodes(PrefixMean):  # decode_refusal: non-causal, and accepts decode=True anyway
    sides: ClassVar[tuple[str, ...]] = ("encoder",)

    def __call__(self, x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False):
        return super().__call__(x_BTC, segment_ids=segment_ids, deterministic=deterministic)


class NaNGradient(PrefixMean):  # gradients: sqrt at 0 has an infinite slope (times 0 gives NaN)
    def __call__(self, x_BTC, **kwargs):
        return super().__call__(x_BTC, **kwargs) + 0.0 * jnp.sqrt(jnp.abs(x_BTC) * 0.0)


class StateNeverMade(PrefixMean):  # state: declares a collection that init never makes
    state: ClassVar[tuple[str, ...]] = ("carry",)


class StateIgnored(CarriedMean):  # carry: writes its state and never reads it
    reads_state: ClassVar[bool] = False


class ResetToOnes(CarriedMean):  # reset: a reset row is ones, not init's zeros
    reset_state = staticmethod(lambda tree, reset_B: jax.tree.map(
        lambda a: jnp.where(jnp.asarray(reset_B)[:, None], 1.0, a), tree))


BROKEN = {  # class -> the rule it must fail
    NoCausalField: "fields", RaisesOnCall: "runs", WrongDtype: "output", TupleOutput: "output", NaNOutput: "output",
    AlwaysDropout: "deterministic", NoAxisNames: "logical_axes",
    SameAxisTwice: "logical_axes", SegmentLeak: "segments", PaddingLeak: "padding", PeeksAhead: "causality",
    ForgetfulDecoder: "decoding", EncoderThatDecodes: "decode_refusal", NaNGradient: "gradients",
    StateNeverMade: "state", StateIgnored: "carry", ResetToOnes: "reset",
}
