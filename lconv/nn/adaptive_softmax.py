"""Adaptive softmax (Grave et al. 2017) with fairseq's parameterisation, as an output layer for large vocabularies: a
head for the frequent ids and the tail clusters, each tail from a ``factor`` times narrower projection, optionally tied
to the adaptive input. It returns full ``[B, T, V]`` float32 log-probabilities, so the loss and beam search use it as
logits. fairseq's layer by layer: docs/models.md, "The mixers in detail"."""
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
        """``[B, T, d] -> [B, T, V]`` log-probabilities; ``tied``: the input bands' tables and projections."""
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
                # Tail input side named EMBED: mlp and vocab both go to the tensor axis, so EMBED (fsdp) is FSDP's.
                tail_logits = linear(edges[i + 1] - edges[i], (EMBED, VOCAB), f"tail_{i}")(h_BTW)
            else:
                tail_logits = against(h_BTW, tied[i + 1][0])
            cluster_BT1 = head_logp[..., edges[0] + i, None]  # log p(cluster i)
            parts.append(cluster_BT1 + jax.nn.log_softmax(tail_logits, axis=-1))  # [B, T, c_{i+1} - c_i]
        return jnp.concatenate(parts, axis=-1)  # [B, T, V] log-probabilities
