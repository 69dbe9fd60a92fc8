"""Losses as sums + denominators (summed on devices, divided on the host): loss, perplexity, accuracy."""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lconv.nn.decoder_ends import OutputLayer


def smoothing_weight(label_smoothing: float, split: str, vocab_size: int) -> float:
    """The weight ``a`` of ``loss = (1 - a) * nll + a * mean_v(-log p_v)``: ``eps`` for ``split="all"``, ``eps * V / (V
    - 1)`` for fairseq's ``"others"``."""
    if split not in ("all", "others"):
        raise ValueError(f"label smoothing split must be 'all' or 'others'; got {split!r}")
    if split == "all" or not label_smoothing:
        return float(label_smoothing)
    return float(label_smoothing) * vocab_size / (vocab_size - 1)


def label_smoothed_loss(outputs: jax.Array | OutputLayer, targets_BT: jax.Array, weights_BT: jax.Array,
                        label_smoothing: float, split: str = "all") -> dict[str, jax.Array]:
    """The label-smoothed cross-entropy's sums ``{loss, nll, correct, tokens}`` (divided on the host); ``outputs``:
    logits ``[B, T, V]`` or a model's ``OutputLayer`` (chunked, the same to rounding)."""
    weights_BT = weights_BT.astype(jnp.float32)
    vocab = outputs.valid_vocab if isinstance(outputs, OutputLayer) else outputs.shape[-1]
    label_smoothing = smoothing_weight(label_smoothing, split, vocab)
    if isinstance(outputs, OutputLayer):
        return {**outputs.loss_sums(targets_BT, weights_BT, label_smoothing), "tokens": weights_BT.sum()}
    logp_BTV = jax.nn.log_softmax(outputs.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    smooth_BT = -logp_BTV.mean(axis=-1)  # inf with an output vocabulary's -inf ids: the config forbids smoothing
    loss_BT = nll_BT if label_smoothing == 0 else (1.0 - label_smoothing) * nll_BT + label_smoothing * smooth_BT
    correct_BT = (jnp.argmax(outputs, axis=-1) == targets_BT).astype(jnp.float32)
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
