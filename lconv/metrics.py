"""Losses as sums + denominators (divided on the host), and the text metrics: sacreBLEU, ROUGE, perplexity."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def label_smoothed_loss(logits_BTV, targets_BT, weights_BT, label_smoothing):
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


def summarize(sums):
    """Host-side ratios of summed metrics: loss/token, nll/token, perplexity, accuracy."""
    sums = {k: float(np.asarray(v)) for k, v in sums.items()}
    tokens = max(sums.get("tokens", 0.0), 1.0)
    out = {"loss": sums["loss"] / tokens, "nll": sums["nll"] / tokens, "accuracy": sums["correct"] / tokens}
    out["ppl"] = math.exp(min(out["nll"], 50.0))
    out["tokens"] = sums.get("tokens", 0.0)
    return out


def bleu(hypotheses, references):
    """Corpus sacreBLEU (13a tokenisation on detokenised text) with its signature."""
    import sacrebleu

    metric = sacrebleu.metrics.BLEU()
    result = metric.corpus_score(list(hypotheses), [list(references)])
    return {"bleu": result.score, "bleu_signature": str(metric.get_signature()), "bleu_text": str(result)}


def rouge(hypotheses, references):
    """ROUGE-1/2/L F-measures (``rouge-score``, stemmed), averaged over examples, in percent."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    n = 0
    for hyp, ref in zip(hypotheses, references):
        scores = scorer.score(ref, hyp)
        for key in totals:
            totals[key] += scores[key].fmeasure
        n += 1
    return {key: 100.0 * value / max(n, 1) for key, value in totals.items()}
