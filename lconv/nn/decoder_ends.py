"""The decoder's two ends as fairseq builds them: its token embeddings (one table or adaptive input, optionally
narrower than the model and projected in) and what its output layer reads (the last layer's output, optionally
projected out; the adaptive input's tables when the adaptive softmax is tied to them).

fairseq's decoder (``TransformerDecoder``, ``LightConvDecoder``): ``x = embed_scale * embed_tokens(tokens)``, then
``project_in_dim`` (``Linear(decoder_input_dim -> decoder_embed_dim, bias=False)``, present when the embedding is
narrower or wider than the model), then positions; after the layers (and the final norm) ``project_out_dim``
(``Linear(decoder_embed_dim -> decoder_output_dim, bias=False)``, present when the widths differ and the adaptive
weights are not tied), then the output layer. ``embed_scale`` is ``sqrt(decoder_embed_dim)``, the model's width,
whatever the embedding's: lconv scales after the projection (``ScaleAndPosition``), the same product.
"""
from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv.constants import EMBED, MLP, PAD_ID, VOCAB
from lconv.nn.adaptive_input import AdaptiveInput
from lconv.nn.common import Embed, xavier_dense
from lconv.nn.model_config import ModelConfig


def token_embedding(cfg: ModelConfig, name: str) -> nn.Module:
    """The decoder's embeddings: adaptive input bands (``adaptive_input_cutoffs``), or one ``N(0, width^-1/2)``
    table ``decoder_input_width`` wide with a zero PAD row, as fairseq's ``Embedding``."""
    width = cfg.decoder_input_width
    if cfg.adaptive_input_cutoffs:
        return AdaptiveInput(cfg.vocab_size, tuple(cfg.adaptive_input_cutoffs), width, cfg.side("decoder").d_model,
                             cfg.adaptive_input_factor, dtype=cfg.dtype, matmul_precision=cfg.matmul_precision,
                             name=name)

    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
        return (jax.random.normal(key, shape, dtype) * width ** -0.5).at[PAD_ID].set(0.0)

    return Embed(cfg.vocab_size, width, dtype=cfg.dtype, matmul_precision=cfg.matmul_precision,
                 embedding_init=nn.with_logical_partitioning(init, (VOCAB, EMBED)), name=name)


def project_in(cfg: ModelConfig) -> nn.Module | None:
    """``decoder_input_width -> d_model`` without bias, for a single table of another width (adaptive input
    projects each band itself)."""
    if cfg.adaptive_input_cutoffs or cfg.decoder_input_width == cfg.side("decoder").d_model:
        return None
    return xavier_dense(cfg.side("decoder").d_model, (MLP, EMBED), use_bias=False, dtype=cfg.dtype,
                        precision=cfg.matmul_precision, name="project_in")


def project_out(cfg: ModelConfig) -> nn.Module | None:
    """``d_model -> decoder_output_width`` without bias, before the output layer."""
    if cfg.decoder_output_width == cfg.side("decoder").d_model:
        return None
    return xavier_dense(cfg.decoder_output_width, (EMBED, MLP), use_bias=False, dtype=cfg.dtype,
                        precision=cfg.matmul_precision, name="project_out")


def tied_bands(cfg: ModelConfig, embedding: nn.Module) -> Sequence[tuple[jax.Array, jax.Array]] | None:
    """The adaptive input's ``(table, projection)`` per band when the adaptive softmax is tied to them."""
    if not cfg.tie_adaptive_weights:
        return None
    return [embedding.band_weights(band) for band in range(len(cfg.adaptive_input_cutoffs) + 1)]
