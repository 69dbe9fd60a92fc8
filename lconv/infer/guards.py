"""Generation guards against degenerate output: fairseq's ``--no-repeat-ngram-size`` and ``--min-len``.

A guard bans (log-prob -inf) what a step may not pick: with ``no_repeat_ngram_size = n`` a token completing an n-gram
already in the hypothesis, with ``min_len = m`` EOS before ``m`` output tokens. A row's forced EOS is never banned, and
steps before ``start_B`` (an LM's prompt) are left alone. ``Guards.of`` is None when both are off.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lconv.constants import IMPOSSIBLE_LOGP

Array = jax.Array


class Guards(NamedTuple):
    """The guards of one search (static: part of a compiled program's key, through ``DecodeSettings``)."""

    no_repeat_ngram_size: int  # n > 0: no n-gram twice in a hypothesis; 0 = off
    min_len: int  # m > 0: no EOS before m output tokens; 0 = off

    @classmethod
    def of(cls, settings: Any) -> Guards | None:
        """The guards ``settings`` (a ``DecodeSettings``) ask for, or None when both are off."""
        guards = cls(int(settings.no_repeat_ngram_size), int(settings.min_len))
        return guards if guards.no_repeat_ngram_size or guards.min_len else None


def apply(logp_BNV: Array, history_BNL: Array, i: Array, guards: Guards, *, eos_id: int,
          start_B: Array | None = None, limit_B: Array | None = None) -> Array:
    """Step ``i``'s log-probs with what the guards ban set to -inf, given each hypothesis' ``history_BNL`` (positions
    ``< i``), where each row's output starts (``start_B``) and its token limit (``limit_B``, None: none)."""
    B, N, V = logp_BNV.shape
    start_B = jnp.zeros((B,), jnp.int32) if start_B is None else start_B
    banned_BNV = jnp.zeros((B, N, V), bool)
    if guards.no_repeat_ngram_size:
        banned_BNV = _repeated_ngram_ends(history_BNL, i, guards.no_repeat_ngram_size, V)  # [B, N, V]
    is_eos_V = jnp.arange(V) == eos_id  # [V]
    if guards.min_len:
        short_B11 = (i < start_B + guards.min_len)[:, None, None]  # [B, 1, 1] EOS would end the output too soon
        banned_BNV = banned_BNV | (short_B11 & is_eos_V)
    if limit_B is not None:
        banned_BNV = banned_BNV & ~((i + 1 >= limit_B)[:, None, None] & is_eos_V)  # EOS forced at the limit stays
    banned_BNV = banned_BNV & (i >= start_B)[:, None, None]  # a prompt's steps are forced, not guarded
    return jnp.where(banned_BNV, IMPOSSIBLE_LOGP, logp_BNV)


def _repeated_ngram_ends(history_BNL: Array, i: Array, n: int, V: int) -> Array:
    """``[B, N, V]``: the tokens that would complete, at position ``i``, an n-gram the hypothesis already holds."""
    B, N, L = history_BNL.shape
    J = L - n + 1  # n-gram starts that fit the history
    if J <= 0:
        return jnp.zeros((B, N, V), bool)
    if n == 1:  # every token already present
        match_BNJ = jnp.ones((B, N, J), bool)
    else:
        last_BNK = jax.lax.dynamic_slice_in_dim(history_BNL, jnp.maximum(i - (n - 1), 0), n - 1, axis=2)  # [B,N,n-1]
        match_BNJ = jnp.ones((B, N, J), bool)
        for k in range(n - 1):  # the n-gram at j has token j + k equal to the k-th of the last n - 1
            match_BNJ = match_BNJ & (history_BNL[:, :, k:k + J] == last_BNK[:, :, k:k + 1])  # [B, N, J]
    match_BNJ = match_BNJ & (jnp.arange(J) <= i - n)  # [B, N, J] only n-grams that end before position i
    ends_BNJ = history_BNL[:, :, n - 1:n - 1 + J]  # [B, N, J] the token completing each n-gram
    b_BNJ = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, N, J))
    n_BNJ = jnp.broadcast_to(jnp.arange(N)[None, :, None], (B, N, J))
    # An int32 scatter (the common dtype for scatters on every backend; a bool one is untried on GPU/TPU here).
    hits_BNV = jnp.zeros((B, N, V), jnp.int32).at[b_BNJ, n_BNJ, ends_BNJ].max(match_BNJ.astype(jnp.int32))
    return hits_BNV > 0  # [B, N, V]
