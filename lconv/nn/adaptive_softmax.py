"""Adaptive softmax (Grave et al. 2017) with fairseq's parameterisation, as an output layer for large vocabularies.

The vocabulary is cut at ``cutoffs = (c0, c1, ...)``: the head scores the ``c0`` most frequent ids plus one entry
per tail cluster; tail cluster ``i`` (ids ``[c_i, c_{i+1})``) scores its ids from a ``d / factor**(i+1)``-wide
projection. ``log p(w) = log p_head(w)`` for ``w < c0`` and ``log p_head(cluster i) + log p_tail_i(w)`` otherwise.
fairseq: ``head = Linear(d, c0 + n_tails, bias=False)``; ``tail_i = Linear(d, d // factor**(i+1), bias=False)``,
``Dropout``, ``Linear(., c_{i+1} - c_i, bias=False)``; xavier-uniform weights.

Tied to adaptive input embeddings (fairseq's ``--tie-adaptive-weights``, ``lconv.nn.adaptive_input``), the ``tied``
bands replace the output weights: the head scores the frequent ids against band 0's table (``x @ E_0^T``, plus its
own cluster kernel ``head_clusters``, fairseq's ``head.class_proj``), and tail ``i`` scores against band ``i+1``'s
table (``h @ E_{i+1}^T``). With ``tie_projections`` (``--tie-adaptive-proj``) tail ``i``'s projection is band
``i+1``'s input projection transposed (``x @ P_{i+1}^T``: the input maps ``width -> d``, the tail ``d -> width``).

The layer returns the full ``[B, T, V]`` log-probabilities (float32), so the loss, the metrics and beam search use it
as they use logits (a log-softmax of normalised log-probabilities is the identity). The saving is in parameters and
in the tails' matmuls (``d / factor`` wide instead of ``d``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv.constants import EMBED, MLP, VOCAB
from lconv.errors import UserError
from lconv.nn.common import xavier_dense
from lconv.ops.precision import lax_precision


def check_cutoffs(cutoffs: Sequence[int], vocab_size: int, d_model: int, factor: float, field: str) -> None:
    """One-line ``ValueError`` naming ``field`` unless ``0 < c0 < c1 < ... < vocab_size`` and every tail has width."""
    cuts = list(cutoffs)
    if not cuts or any(b <= a for a, b in zip([0] + cuts, cuts + [vocab_size])):
        raise UserError(f"{field}={tuple(cuts)} must increase strictly within (0, vocab_size={vocab_size})")
    if factor < 1 or int(d_model // factor ** len(cuts)) < 1:
        raise UserError(f"{field}: factor={factor} leaves tail {len(cuts)} of d_model={d_model} with no width")


class AdaptiveSoftmax(nn.Module):
    vocab_size: int
    cutoffs: Sequence[int]
    factor: float = 4.0
    dropout: float = 0.0
    matmul_precision: str = "default"  # lconv.ops.precision
    tie_projections: bool = False  # with ``tied``: the tails' projections are the input's, transposed

    @nn.compact
    def __call__(self, x_BTC: jax.Array, *, deterministic: bool = True,
                 tied: Sequence[tuple[jax.Array, jax.Array]] | None = None) -> jax.Array:
        """``[B, T, d] -> [B, T, V]`` log-probabilities. ``tied``: each adaptive input band's ``(table [ids, width],
        projection [width, d])`` (``AdaptiveInput.band_weights``), used as the output weights."""
        d = x_BTC.shape[-1]
        check_cutoffs(self.cutoffs, self.vocab_size, d, self.factor, "adaptive_softmax_cutoffs")
        edges = [*self.cutoffs, self.vocab_size]
        x = x_BTC.astype(jnp.float32)

        def linear(features, axes, name):
            return xavier_dense(features, axes, use_bias=False, precision=self.matmul_precision, name=name)

        def against(h: jax.Array, weight: Any) -> jax.Array:  # h @ weight^T, float32
            return jnp.dot(h, jnp.asarray(weight, jnp.float32).T, precision=lax_precision(self.matmul_precision))

        if tied is None:
            head_logits = linear(edges[0] + len(self.cutoffs), (EMBED, VOCAB), "head")(x)
        else:  # the frequent ids against band 0's table, then the clusters
            clusters = linear(len(self.cutoffs), (EMBED, VOCAB), "head_clusters")(x)
            head_logits = jnp.concatenate([against(x, tied[0][0]), clusters], axis=-1)
        head_logp = jax.nn.log_softmax(head_logits, axis=-1)
        parts = [head_logp[..., :edges[0]]]  # the frequent ids: [B, T, c0]
        for i in range(len(self.cutoffs)):
            width = int(d // self.factor ** (i + 1))
            if tied is not None and self.tie_projections:
                h_BTW = against(x, tied[i + 1][1])  # the input's [width, d] projection, transposed
            else:
                h_BTW = linear(width, (EMBED, MLP), f"tail_{i}_projection")(x)
            h_BTW = nn.Dropout(self.dropout)(h_BTW, deterministic=deterministic)
            if tied is None:
                # The tail's input side is named EMBED: the rules send mlp and vocab both to the tensor axis, and
                # one array cannot use an axis twice, so EMBED (fsdp) is the side FSDP shards.
                tail_logits = linear(edges[i + 1] - edges[i], (EMBED, VOCAB), f"tail_{i}")(h_BTW)
            else:
                tail_logits = against(h_BTW, tied[i + 1][0])
            cluster_BT1 = head_logp[..., edges[0] + i, None]  # log p(cluster i)
            parts.append(cluster_BT1 + jax.nn.log_softmax(tail_logits, axis=-1))  # [B, T, c_{i+1} - c_i]
        return jnp.concatenate(parts, axis=-1)  # [B, T, V] log-probabilities
