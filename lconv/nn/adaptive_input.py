"""Adaptive input embeddings (Baevski & Auli 2019) with fairseq's parameterisation (``fairseq.modules.AdaptiveInput``).

The vocabulary is cut at ``cutoffs`` into bands, the most frequent ids first; band ``i`` has its own table ``d_in /
factor**i`` wide and a bias-free projection to the model width, so rare words get narrow embeddings. The tables are also
the adaptive softmax's when tied (``band_weights``). fairseq's names: docs/fairseq.md.
"""
from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv.constants import ACT_VOCAB, EMBED, MLP, PAD_ID, VOCAB
from lconv.nn.common import DType, constrain
from lconv.ops.precision import lax_precision


def band_edges(cutoffs: Sequence[int], vocab_size: int) -> list[tuple[int, int]]:
    """``[(first id, end id)]`` of each band: ``[0, c0), [c0, c1), ..., [c_last, vocab_size)``."""
    edges = [0, *cutoffs, vocab_size]
    return list(zip(edges[:-1], edges[1:]))


def band_width(input_dim: int, factor: float, band: int) -> int:
    """fairseq's ``int(initial_dim // factor**band)`` (the same rounding, so the shapes match its checkpoints)."""
    return int(input_dim // factor**band)


class AdaptiveInput(nn.Module):
    """``[B, T] int -> [B, T, output_dim]``: each token looked up in its band's table and projected to the width."""

    vocab_size: int
    cutoffs: Sequence[int]
    input_dim: int  # band 0's width (fairseq's decoder_input_dim)
    output_dim: int  # the model width every band is projected to (fairseq's decoder_embed_dim)
    factor: float = 4.0
    dtype: DType = jnp.float32
    matmul_precision: str = "default"  # lconv.ops.precision

    def setup(self) -> None:
        tables, projections = [], []
        for band, (start, end) in enumerate(band_edges(self.cutoffs, self.vocab_size)):
            width = band_width(self.input_dim, self.factor, band)
            tables.append(self.param(f"band_{band}", nn.with_logical_partitioning(
                embedding_init(zero_row=PAD_ID if band == 0 else None), (VOCAB, EMBED)), (end - start, width)))
            # xavier-uniform as fairseq's Linear; [width, d] as every flax kernel ([in, out])
            projections.append(self.param(f"band_{band}_projection", nn.with_logical_partitioning(
                nn.initializers.xavier_uniform(), (MLP, EMBED)), (width, self.output_dim)))
        self.tables, self.projections = tables, projections

    def band_weights(self, band: int) -> tuple[jax.Array, jax.Array]:
        """Band ``band``'s ``(table [ids, width], projection [width, d])``: what a tied adaptive softmax reads."""
        return self.tables[band], self.projections[band]

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        out_BTC = jnp.zeros((*tokens_BT.shape, self.output_dim), self.dtype)
        for band, (start, end) in enumerate(band_edges(self.cutoffs, self.vocab_size)):
            in_band_BT = (tokens_BT >= start) & (tokens_BT < end)
            # every token reads a row of every band (clipped ids), keeping its own band's: static shapes, few flops
            table = constrain(self.tables[band].astype(self.dtype), (ACT_VOCAB, None))  # gathered, as Embed
            rows_BTW = jnp.take(table, jnp.clip(tokens_BT - start, 0, end - start - 1), axis=0)
            projected_BTC = jnp.dot(rows_BTW, self.projections[band].astype(self.dtype),
                                    precision=lax_precision(self.matmul_precision))
            out_BTC = jnp.where(in_band_BT[..., None], projected_BTC, out_BTC)
        return out_BTC


def embedding_init(zero_row: int | None = PAD_ID) -> nn.initializers.Initializer:
    """fairseq's ``Embedding`` init, ``N(0, width^-1/2)``, with the padding row zeroed (adaptive input: in band 0)."""
    def init(key: jax.Array, shape: tuple[int, ...], dtype: DType = jnp.float32) -> jax.Array:
        table = jax.random.normal(key, shape, dtype) * shape[1] ** -0.5
        return table if zero_row is None else table.at[zero_row].set(0.0)

    return init
