"""Tokens forced at the start of each row's output (``Prefix``, ``search.Prefix``): a translation's prefix, an LM's
prompt."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class Prefix(NamedTuple):
    """Tokens forced at the start of each row's output (fairseq's ``prefix_tokens``): row b's token ``i < length[b]`` is
    ``tokens[b, i]``, scored by the model's log-prob."""

    tokens: Array  # [B, P] int32, anything after a row's length (PAD)
    length: Array  # [B] forced tokens per row (0: none)

    def at(self, i: Array) -> tuple[Array, Array]:
        """``(forcing_B, forced_B)`` at step ``i``: whether each row is still forced, and the token it is forced to."""
        column = jnp.minimum(i, self.tokens.shape[1] - 1)
        return i < self.length, jax.lax.dynamic_index_in_dim(self.tokens, column, 1, keepdims=False).astype(jnp.int32)

    def limits(self, limit_B: Array | None, batch_size: int, max_len: int) -> Array:
        """Each row's length limit (EOS included) raised to hold its prefix and EOS, within ``max_len``."""
        limit_B = jnp.full((batch_size,), max_len, jnp.int32) if limit_B is None else jnp.asarray(limit_B, jnp.int32)
        return jnp.clip(jnp.maximum(limit_B, self.length + 1), 1, max_len)  # [B]

    def repeat(self, n: int) -> Prefix:  # row b's prefix for rows b*n .. b*n + n-1, as tile_cache lays them out
        return Prefix(jnp.repeat(self.tokens, n, axis=0), jnp.repeat(self.length, n, axis=0))
