"""Several models decoding together (fairseq-generate's ``--path a.pt:b.pt``), as one flax module.

At every position the members' next-token distributions are averaged, as fairseq's ``EnsembleModel`` does:
``logsumexp_m(log p_m) - log M``, the mean of the probabilities (not a product of experts). These normalised log-probs
stand where a model's logits do, so one model's search and scoring code runs an ensemble too. Its params are
``{"members_0": ..., "members_1": ...}``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv.errors import UserError

Array = jax.Array


def mixture(logits: Sequence[Array]) -> Array:
    """``[B, T, V]`` float32 log-probs of the mean of the members' distributions (``logits``: one each)."""
    logp_MBTV = jnp.stack([jax.nn.log_softmax(x.astype(jnp.float32), axis=-1) for x in logits])  # [M, B, T, V]
    return jax.nn.logsumexp(logp_MBTV, axis=0) - jnp.float32(math.log(len(logits)))  # [B, T, V]


class Ensemble(nn.Module):
    """``members`` (all ``EncoderDecoder`` or all ``DecoderOnlyLM``, one vocabulary) as one model."""

    members: tuple[nn.Module, ...]

    @property
    def config(self) -> Any:
        """The first member's config: the decoder start id and the sizes the search reads (all members agree)."""
        return self.members[0].config

    def encode(self, inputs_BS: Array, **kwargs: Any) -> tuple[Array, ...]:
        return tuple(member.encode(inputs_BS, **kwargs) for member in self.members)  # ([B, S, C_m], ...)

    def run_decoder(self, encoded: tuple[Array, ...], inputs_BS: Array, decoder_input_BT: Array,
                    **kwargs: Any) -> Array:
        _logits_only(kwargs)
        return mixture([member.run_decoder(encoded_m, inputs_BS, decoder_input_BT, **kwargs)
                        for member, encoded_m in zip(self.members, encoded)])  # [B, T, V]

    def __call__(self, *args: Any, **kwargs: Any) -> Array:
        _logits_only(kwargs)
        return mixture([member(*args, **kwargs) for member in self.members])  # [B, T, V]


def _logits_only(kwargs: dict[str, Any]) -> None:
    if not kwargs.get("logits", True):
        raise UserError("an ensemble gives log-probs, not its members' output-layer inputs (logits=False)")


def check_members(modules: Sequence[nn.Module], names: Sequence[str]) -> None:
    """One model kind and one decoder start for all members (``names``: how the caller names each)."""
    if not modules:
        raise UserError("an ensemble needs at least one model")
    first = modules[0]
    for module, name in zip(modules[1:], names[1:]):
        if type(module) is not type(first):
            raise UserError(f"{name} is a {type(module).__name__}, {names[0]} a {type(first).__name__}: an "
                            "ensemble's members are all translation models or all language models")
        if module.config.decoder_start_id != first.config.decoder_start_id:
            raise UserError(f"{name} starts decoding with token {module.config.decoder_start_id}, {names[0]} "
                            f"with {first.config.decoder_start_id}: an ensemble's members read the same inputs")
