"""Helpers every lconv module shares: projections with logical axis names, activation sharding constraints, dropout
rngs, input checks, and the incremental-decoding cache of attention-like mixers (docs/models.md, "Sharding and the
decoding cache")."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lconv.constants import (
    ACT_BATCH,
    ACT_CONV,
    ACT_EMBED,
    ACT_HEADS,
    ACT_LENGTH,
    ACT_MLP,
    ACT_VOCAB,
    DEFAULT_AXIS_RULES,
    EMBED,
    HEADS,
)
from lconv.errors import UserError
from lconv.ops import dropout as dropout_ops
from lconv.ops import layer_norm
from lconv.ops.attention import attention_mask, decode_mask
from lconv.ops.dense import dense_dot_general
from lconv.ops.precision import lax_precision

Array = jax.Array
DType = Any


# fairseq's q/k/v_proj init when Q, K and V share the model width (its note: converges much better); out_proj keeps 1.
QKV_GAIN = 1 / math.sqrt(2)


def xavier_dense(features: int, axes: tuple[str, str], *, use_bias: bool = True, dtype: DType = jnp.float32,
                 param_dtype: DType = jnp.float32, precision: str = "default", name: str | None = None,
                 gain: float = 1.0) -> nn.Dense:
    """fairseq's ``Linear`` (xavier-uniform, zero bias) with logical axis names, so it shards by the mesh rules."""
    kernel_init = nn.initializers.variance_scaling(gain**2, "fan_avg", "uniform")  # gain 1 = xavier_uniform()
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=lax_precision(precision),
        kernel_init=nn.with_logical_partitioning(kernel_init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[-1:]),
        dot_general=dense_dot_general,  # its weight gradient in the layout XLA:CPU's matmuls take (lconv.ops.dense)
        name=name,
    )


# The logical axes of attention projections: into the (flattened) heads, and back to the model width.
TO_HEADS = (EMBED, HEADS)
FROM_HEADS = (HEADS, EMBED)


# Logical layouts of activations, for ``constrain``.
BTC = (ACT_BATCH, ACT_LENGTH, ACT_EMBED)  # the residual stream, a block's input and output
BTHD = (ACT_BATCH, ACT_LENGTH, ACT_HEADS, None)  # queries / keys / values; [B, T, H, K] dynamic conv kernels
BHTD = (ACT_BATCH, ACT_HEADS, ACT_LENGTH, None)  # head-major values (a cross-attention's decoding cache)
BHDT = (ACT_BATCH, ACT_HEADS, None, ACT_LENGTH)  # head-major keys, length last: the logits dot's own layout
BTF = (ACT_BATCH, ACT_LENGTH, ACT_MLP)  # FFN hidden units
BT_CONV = (ACT_BATCH, ACT_LENGTH, ACT_CONV)  # the conv block's inner width
BTV = (ACT_BATCH, ACT_LENGTH, ACT_VOCAB)  # logits

AxisRules = tuple[tuple[str, Any], ...]


def axis_rules(rules: Sequence[Sequence[Any]] = ()) -> AxisRules:
    """``rules`` then lconv's ``DEFAULT_AXIS_RULES`` for the names it lacks, so an older config still shards them."""
    given = tuple((str(name), target if isinstance(target, (str, type(None))) else tuple(target))
                  for name, target in rules)
    named = {name for name, _ in given}
    return given + tuple(rule for rule in DEFAULT_AXIS_RULES if rule[0] not in named)


def under_axis_rules(fn: Callable, rules: Sequence[Sequence[Any]] = ()) -> Callable:
    """``fn`` run under ``axis_rules(rules)``: activation constraints are read at trace time, so wrap before jit."""
    merged = list(axis_rules(rules))

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with nn.logical_axis_rules(merged):
            return fn(*args, **kwargs)

    return wrapped


def constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
    """Pins ``x``'s layout by logical axis names under the current mesh (a no-op without one); a dim keeps only the mesh
    axes that exist and divide it, so the split is never uneven."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    fitted = [tuple(kept) if len(kept) > 1 else (kept[0] if kept else None)
              for kept in _fitted_axes(mesh, x.shape, axes)]
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*fitted))


def local_shape(shape: Sequence[int], axes: tuple[str | None, ...]) -> tuple[int, ...]:
    """One device's block of ``shape`` as ``constrain(x, axes)`` pins it: what chunked computations size by."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tuple(shape)
    return tuple(size // math.prod(mesh.shape[name] for name in kept)
                 for size, kept in zip(shape, _fitted_axes(mesh, shape, axes)))


def _fitted_axes(mesh: Any, shape: Sequence[int], axes: tuple[str | None, ...]) -> list[list[str]]:
    """Per dim, the mesh axes ``axes`` names that the mesh has and whose sizes divide it (``constrain``'s rule)."""
    spec = nn.logical_to_mesh_axes(axes, axis_rules(nn.get_logical_axis_rules()))
    fitted = []
    for size, target in zip(shape, spec):
        names = (target,) if isinstance(target, str) else tuple(target or ())
        kept: list[str] = []
        for name in names:
            if name not in mesh.axis_names or size % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[name]):
                break
            kept.append(name)
        fitted.append(kept)
    return fitted


def dense(features: int, name: str, mdl: nn.Module, axes: tuple[str, str], gain: float = 1.0) -> nn.Dense:
    """``xavier_dense`` with a module's ``use_bias``, ``dtype``, ``param_dtype`` and ``matmul_precision``."""
    return xavier_dense(features, axes, use_bias=getattr(mdl, "use_bias", True), dtype=mdl.dtype,
                        param_dtype=mdl.param_dtype, precision=getattr(mdl, "matmul_precision", "default"), name=name,
                        gain=gain)


def project_heads(mdl: nn.Module, name: str, x_BTC: Array, H: int, D: int, gain: float = QKV_GAIN) -> Array:
    """A Q/K/V projection into heads, ``[B, T, C] -> [B, T, H, D]`` (fairseq's gain), pinned batch- and head-split."""
    y_BTC = dense(H * D, name, mdl, TO_HEADS, gain=gain)(x_BTC)
    return constrain(_one_cotangent(y_BTC).reshape(*x_BTC.shape[:2], H, D), BTHD)


@jax.custom_vjp
def _one_cotangent(x: Array) -> Array:
    """The identity, whose cotangent XLA:CPU writes out once (one array for weight and bias gradients)."""
    return x


def _one_cotangent_fwd(x):
    return x, None


def _one_cotangent_bwd(_, g):
    def cpu(g):  # as [N, C], a shape no head-major layout fits: XLA writes it out row-major, then both read it
        return lax.optimization_barrier(g.reshape(-1, g.shape[-1])).reshape(g.shape)

    return (lax.platform_dependent(g, cpu=cpu, default=lambda g: g),)


_one_cotangent.defvjp(_one_cotangent_fwd, _one_cotangent_bwd)


def dropout_rng(mdl: nn.Module, rate: float, deterministic: bool) -> Array | None:
    return None if deterministic or rate == 0.0 else mdl.make_rng("dropout")


def decode_cache_update(mdl: nn.Module, new: dict[str, Array]) -> tuple[dict[str, Array] | None, Array | None]:
    """Writes a chunk into the ``'cache'`` collection: ``(full cached arrays, chunk start index)``, or ``(None, None)``
    on the first call, which creates the zeroed cache and lets the caller do its full pass."""
    initialized = mdl.has_variable("cache", "cache_index")
    cached = {n: mdl.variable("cache", "cached_" + n, jnp.zeros, a.shape, a.dtype) for n, a in new.items()}
    cache_index = mdl.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:
        return None, None
    i = cache_index.value
    for n, a in new.items():
        cached[n].value = lax.dynamic_update_slice(cached[n].value, a.astype(cached[n].value.dtype),
                                                   (0, i) + (0,) * (a.ndim - 2))
    cache_index.value = i + next(iter(new.values())).shape[1]
    return {n: v.value for n, v in cached.items()}, i


def attention_context(mdl: nn.Module, new: dict[str, Array], decode: bool) -> tuple[dict[str, Array], Array]:
    """What a chunk attends to, ``(arrays, mask [B, 1, T, S])``: its own arrays, or while decoding the cache."""
    seg_BT = new["segment_ids"]
    mask_B1TS = attention_mask(seg_BT, seg_BT, causal=mdl.causal)
    if not decode:
        return new, mask_B1TS
    require_causal(mdl.causal, type(mdl).__name__)
    cache, index = decode_cache_update(mdl, new)
    if cache is None:
        return new, mask_B1TS
    return cache, decode_mask(seg_BT, cache["segment_ids"], index)


def decode_positions(mdl: nn.Module, pos_BT: Array, default: bool) -> Array:
    """While decoding, default positions continue from the cache: ``cache_index + arange(T)``."""
    if default and mdl.has_variable("cache", "cache_index"):
        return mdl.get_variable("cache", "cache_index") + pos_BT
    return pos_BT


def check_input(x_BTC: Array, name: str = "x_BTC") -> tuple[int, int, int]:
    if x_BTC.ndim != 3:
        raise UserError(f"{name} must be [batch, time, features], got shape {x_BTC.shape}")
    return x_BTC.shape


def head_dims(num_heads: int, qkv_features: int | None, C: int) -> tuple[int, int]:
    """``(H, D)``: ``num_heads`` heads of ``D = width / H`` over ``qkv_features`` (None = the input width C)."""
    if num_heads <= 0:
        raise UserError(f"num_heads must be positive, got {num_heads}")
    width = qkv_features or C
    if width <= 0 or width % num_heads:
        what = f"qkv_features={qkv_features}" if qkv_features else f"the input width C={C} (qkv_features unset)"
        raise UserError(f"{what} must be a positive multiple of num_heads={num_heads}")
    return num_heads, width // num_heads


def check_dropout(rate: float, field: str = "attention_dropout") -> None:
    if not 0.0 <= rate < 1.0:
        raise UserError(f"{field} must be in [0, 1), got {rate}")


def require_causal(causal: bool, mixer: str) -> None:
    if not causal:
        raise UserError(f"{mixer}: decode=True needs causal=True (a non-causal mixer cannot decode)")


def check_max_len(max_len: int, T: int) -> None:
    if max_len <= 0:
        raise UserError(f"max_len must be positive, got {max_len}")
    if T > max_len:
        raise UserError(f"sequence length {T} exceeds max_len={max_len}; raise max_len in the config")


def check_positions(pos_BT: Array, max_len: int) -> None:
    """Positions outside ``[0, max_len)`` are an error when they are concrete (under jit they cannot be seen)."""
    try:
        p = np.asarray(pos_BT)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if p.size and (p.min() < 0 or p.max() >= max_len):
        raise UserError(f"positions must lie in [0, max_len={max_len}), got [{p.min()}, {p.max()}]; "
                         "raise max_len")


def segments_and_positions(x_BTC: Array, segment_ids: Array | None, positions: Array | None,
                           seg_name: str = "segment_ids") -> tuple[Array, Array]:
    """Defaults: one segment everywhere (ids 1), positions ``arange(T)``; checks both are ``[B, T]``."""
    B, T = x_BTC.shape[:2]
    if segment_ids is None:
        segment_ids = jnp.ones((B, T), jnp.int32)
    elif segment_ids.shape != (B, T):
        raise UserError(f"{seg_name} must be [batch, time] = {(B, T)}, got {segment_ids.shape}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    elif positions.shape != (B, T):
        raise UserError(f"positions must be [batch, time] = {(B, T)}, got {positions.shape}")
    return jnp.asarray(segment_ids, jnp.int32), jnp.asarray(positions, jnp.int32)


class Embed(nn.Embed):
    """``nn.Embed`` whose table is gathered along its width before it is read (a width-sharded lookup could only be
    batch-split by replicating); ``table_axes``: the names the gathered table keeps."""

    table_axes: tuple[str | None, str | None] = (ACT_VOCAB, None)
    matmul_precision: str = "default"  # of ``attend`` (tied output logits); lookups are exact whatever it is

    def __call__(self, inputs: Array) -> Array:
        """``[...] int -> [..., features]``."""
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Embed: input type must be an integer")
        (table,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        return jnp.take(constrain(table, self.table_axes), inputs, axis=0)

    def attend(self, query: Array) -> Array:
        """Tied output logits ``[..., num_embeddings]``, float32 whatever ``dtype`` (the loss's softmax reads them)."""
        query, table = self.promote_dtype(query, self.output_table(), dtype=self.dtype)
        return jnp.dot(query, table.T, precision=lax_precision(self.matmul_precision),
                       preferred_element_type=jnp.float32)

    def output_table(self) -> Array:
        """The table as a tied output layer reads it: ``[V, C]``, its own dtype, rows split as ``table_axes``."""
        return constrain(self.embedding, self.table_axes)


class LayerNorm(nn.Module):
    """``nn.LayerNorm``'s parameters and values, computed by ``lconv.ops.layer_norm`` to keep less for the backward."""

    epsilon: float = 1e-5
    dtype: DType = jnp.float32  # of the output; the statistics and the arithmetic are float32
    param_dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        C = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), (EMBED,)), (C,),
                           self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), (EMBED,)), (C,),
                          self.param_dtype)
        return layer_norm.layer_norm(x, scale, bias, self.epsilon, jnp.dtype(self.dtype or x.dtype))


class Dropout(nn.Module):
    """``nn.Dropout``'s interface and rng stream with ``lconv.ops.dropout``'s 16-bit mask (half the random words)."""

    rate: float
    deterministic: bool | None = None
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, x: Array, deterministic: bool | None = None) -> Array:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return x
        return dropout_ops.dropout(self.make_rng(self.rng_collection), self.rate, x)
