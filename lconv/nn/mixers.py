"""The token-mixer registry: one name -> one Flax linen module, one call signature for all.

Every token mixer (LightConv, DynamicConv, self-attention, Fixed, Hadamard, CoLT5, kNN memory) is a
``flax.linen.Module`` that maps an (already normalised) sequence to an update of the same shape. The model
layer around it owns the layer norm, the residual dropout and the residual add, so mixers are swappable
per layer by name.

The contract:

    y_BTC = mixer(x_BTC, *, segment_ids=None, positions=None, deterministic=True, decode=False)

- ``x_BTC``: ``[batch, time, features]``; ``y_BTC`` has the same shape and ``x_BTC``'s dtype.
- ``segment_ids``: ``[batch, time]`` int, ``0`` = padding; packed examples carry ids ``1, 2, ...``. A mixer never
  mixes information across segments or from padding. ``None`` means one segment covering every position.
- ``positions``: ``[batch, time]`` int, position of each token inside its segment (needed by position-dependent
  mixers such as Fixed / Hadamard attention). ``None`` means ``arange(time)`` (or, while decoding, the
  position kept in the cache).
- ``deterministic``: ``False`` enables dropout / DropConnect (needs a ``'dropout'`` rng).
- ``decode``: causal mixers keep their state in the ``'cache'`` collection and accept a chunk of one or more new
  positions per call; the outputs equal the full causal pass. The cache is created by a first call with
  ``decode=True`` under ``mutable=['cache']`` on a full-length (max decode length) dummy input, as in flax
  ``examples/wmt``; non-causal mixers raise ``ValueError`` when asked to decode.
- Constructor fields every mixer accepts: ``num_heads``, ``causal``, ``dtype`` (computation dtype; softmax and
  accumulation stay in float32), ``param_dtype``, ``matmul_precision`` (``"default" | "high" | "highest"``, the
  precision of its dots, ``lconv.ops.precision``; a conv's own arithmetic is always exact). The rest are
  mixer-specific and come from the config.

Metadata on each mixer class, read by the models and the configs alike:

- ``model_fields``: ``{constructor field: model value}``, the fields a model layer fills, by name, from its
  ``ModelConfig`` (``conv_impl``, ``dropout`` rates, ...) and the layer (``causal``, ``kernel_size``). Nothing is
  passed by a coincidence of names: a value the model does not have is an error, not a silent drop.
- ``sides``: where the mixer may sit, ``("encoder", "decoder")`` or one of them (CoLT5's routing ranks future
  tokens: encoder only; the kNN memory lives in a decoder's document stream: decoder only).

Registered names map to ``"module:Class"`` strings imported on first use, so the registry has no import cycles
and every mixer family can live in its own file.
"""
from __future__ import annotations

import importlib
from typing import Any

import flax.linen as nn

from lconv.errors import UserError

_REGISTRY: dict[str, str] = {
    "lightconv": "lconv.nn.conv:LightConvBlock",  # conv_type='lightweight' is the block's default
    "dynamicconv": "lconv.nn.conv:DynamicConvBlock",
    "attention": "lconv.nn.attention:SelfAttention",
    "fixed": "lconv.nn.attention:FixedAttention",
    "hadamard": "lconv.nn.attention:HadamardAttention",
    "colt5": "lconv.nn.colt5:CoLT5Attention",
    "knn_memory": "lconv.nn.knn_memory:KNNMemoryAttention",
}


def mixer_names() -> list[str]:
    return sorted(_REGISTRY)


def mixer_class(name: str) -> type[nn.Module]:
    """The module class registered under ``name``; a clear error for an unknown name."""
    if name not in _REGISTRY:
        raise UserError(f"unknown mixer {name!r}; choose one of {mixer_names()}")
    module_name, class_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def model_fields(name: str) -> dict[str, str]:
    """``{constructor field: model value}`` that a model layer passes to mixer ``name``."""
    return dict(getattr(mixer_class(name), "model_fields", {}))


def sides(name: str) -> tuple[str, ...]:
    """Where mixer ``name`` may sit: ``"encoder"``, ``"decoder"`` or both."""
    return tuple(getattr(mixer_class(name), "sides", ("encoder", "decoder")))


def make_mixer(mixer_name: str, /, **kwargs: Any) -> nn.Module:
    """Builds mixer ``mixer_name`` with its constructor fields (plus flax's ``name``); unknown fields fail clearly."""
    cls = mixer_class(mixer_name)
    fields = {f for f in getattr(cls, "__dataclass_fields__", {}) if f not in ("parent", "name")}
    unknown = sorted(set(kwargs) - fields - {"name"})
    if unknown:
        raise UserError(f"mixer {mixer_name!r} has no field(s) {unknown}; its fields are {sorted(fields)}")
    return cls(**kwargs)
