"""The decoder's two ends as fairseq builds them: its token embeddings (one table or adaptive input, optionally narrower
than the model and projected in) and what its output layer reads (the last layer's output, optionally projected out; the
adaptive input's tables when the adaptive softmax is tied to them). fairseq's names and order: docs/fairseq.md,
"Language models"."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from lconv.constants import ACT_VOCAB, EMBED, MLP, VOCAB
from lconv.nn.adaptive_input import AdaptiveInput, embedding_init
from lconv.nn.common import BTC, Embed, constrain, local_shape, xavier_dense
from lconv.nn.model_config import ModelConfig
from lconv.ops import linear_cross_entropy
from lconv.ops.precision import lax_precision


def token_embedding(cfg: ModelConfig, name: str) -> nn.Module:
    """The decoder's embeddings: adaptive input bands, or one table ``decoder_input_width`` wide, as fairseq's."""
    width = cfg.decoder_input_width
    if cfg.adaptive_input_cutoffs:
        return AdaptiveInput(cfg.vocab_size, tuple(cfg.adaptive_input_cutoffs), width, cfg.side("decoder").d_model,
                             cfg.adaptive_input_factor, dtype=cfg.dtype, matmul_precision=cfg.matmul_precision,
                             name=name)
    return embedding(cfg, width, name)


def embedding(cfg: ModelConfig, width: int, name: str) -> Embed:
    """One ``[V, width]`` table, initialised as fairseq's ``Embedding`` (a zero PAD row)."""
    return Embed(cfg.vocab_size, width, dtype=cfg.dtype, matmul_precision=cfg.matmul_precision,
                 embedding_init=nn.with_logical_partitioning(embedding_init(), (VOCAB, EMBED)), name=name)


def project_in(cfg: ModelConfig) -> nn.Module | None:
    """``decoder_input_width -> d_model`` without bias, for one table of another width (bands project themselves)."""
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


@struct.dataclass
class OutputLayer:
    """The output layer's inputs instead of its logits (``logits=False``): features ``[B, T, C]`` and the table ``[V,
    C]``, for a loss that makes the logits a chunk at a time."""

    features_BTC: jax.Array
    table_VC: jax.Array
    valid_vocab: int = struct.field(pytree_node=False)  # ids at or above it are never predicted
    dtype: Any = struct.field(pytree_node=False)  # the matmuls' input dtype; they accumulate in float32
    matmul_precision: str = struct.field(pytree_node=False)

    def loss_sums(self, targets_BT: jax.Array, weights_BT: jax.Array, label_smoothing: float) -> dict[str, jax.Array]:
        """``linear_cross_entropy.cross_entropy_sums``, chunked by the rows one device holds."""
        rows = local_shape(self.features_BTC.shape, BTC)[0]
        V = self.table_VC.shape[0]
        split_vocab = local_shape(self.table_VC.shape, (ACT_VOCAB, None))[0] < V
        return linear_cross_entropy.cross_entropy_sums(
            self.features_BTC, self.table_VC, targets_BT, weights_BT, label_smoothing=label_smoothing,
            valid_vocab=self.valid_vocab, dtype=self.dtype, precision=lax_precision(self.matmul_precision),
            rows_per_device=rows, vocab_slice=V if split_vocab else linear_cross_entropy.VOCAB_SLICE)

    def logits(self) -> jax.Array:
        """The float32 logits ``[B, T, V]`` (ids from ``valid_vocab`` on at -inf)."""
        return linear_cross_entropy.logits(self.features_BTC, self.table_VC, self.valid_vocab, self.dtype,
                                           lax_precision(self.matmul_precision))


class OutputProjection(nn.Module):
    """An untied output layer's ``kernel [C, V]`` (fairseq's init), read by ``OutputLayer`` as its table."""

    vocab_size: int
    width: int

    def setup(self) -> None:
        init = nn.with_logical_partitioning(nn.initializers.normal(self.width ** -0.5), (EMBED, VOCAB))
        self.kernel = self.param("kernel", init, (self.width, self.vocab_size), jnp.float32)

    def table(self) -> jax.Array:
        """The kernel as an output table ``[V, C]``, vocabulary rows split as ``Embed``'s."""
        return constrain(self.kernel.T, (ACT_VOCAB, None))
