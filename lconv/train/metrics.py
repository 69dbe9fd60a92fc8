"""Losses as sums + denominators (summed on devices, divided on the host): loss, perplexity, accuracy."""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def label_smoothed_loss(logits_BTV: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array,
                        label_smoothing: float) -> dict[str, jax.Array]:
    """fairseq's label-smoothed cross-entropy, summed over weighted tokens.

    ``loss = (1 - eps) * nll + eps * mean_v(-log p_v)``; returns sums ``{loss, nll, correct, tokens}`` so that
    gradient accumulation and multi-device reductions stay exact (divide on the host).
    """
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    smooth_BT = -logp_BTV.mean(axis=-1)
    loss_BT = (1.0 - label_smoothing) * nll_BT + label_smoothing * smooth_BT
    weights_BT = weights_BT.astype(jnp.float32)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
    return {
        "loss": (loss_BT * weights_BT).sum(),
        "nll": (nll_BT * weights_BT).sum(),
        "correct": (correct_BT * weights_BT).sum(),
        "tokens": weights_BT.sum(),
    }


def summarize(sums: dict[str, Any]) -> dict[str, float]:
    """Host-side ratios of summed metrics: loss/token, nll/token, perplexity, accuracy."""
    sums = {k: float(np.asarray(v)) for k, v in sums.items()}
    tokens = max(sums.get("tokens", 0.0), 1.0)
    out = {"loss": sums["loss"] / tokens, "nll": sums["nll"] / tokens, "accuracy": sums["correct"] / tokens}
    out["ppl"] = math.exp(min(out["nll"], 50.0))
    out["tokens"] = sums.get("tokens", 0.0)
    return out
