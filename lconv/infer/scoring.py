"""Scores of decoded text against references: corpus sacreBLEU and ROUGE-1/2/L.

Both take one hypothesis per reference, in order, and at least one pair: an empty corpus has no score (callers
report "nothing to score" instead), and a length mismatch would silently score the wrong pairs.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _pairs(hypotheses: Iterable[str], references: Iterable[str]) -> tuple[list[str], list[str]]:
    hypotheses, references = list(hypotheses), list(references)
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    if not hypotheses:
        raise ValueError("no hypotheses to score: an empty corpus has no BLEU or ROUGE")
    return hypotheses, references


def bleu(hypotheses: Iterable[str], references: Iterable[str]) -> dict[str, Any]:
    """Corpus sacreBLEU (13a tokenisation on detokenised text) with its signature."""
    import sacrebleu

    hypotheses, references = _pairs(hypotheses, references)
    metric = sacrebleu.metrics.BLEU()
    result = metric.corpus_score(hypotheses, [references])
    return {"bleu": result.score, "bleu_signature": str(metric.get_signature()), "bleu_text": str(result)}


def rouge(hypotheses: Iterable[str], references: Iterable[str]) -> dict[str, float]:
    """ROUGE-1/2/L F-measures (``rouge-score``, stemmed), averaged over examples, in percent."""
    from rouge_score import rouge_scorer

    hypotheses, references = _pairs(hypotheses, references)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for hyp, ref in zip(hypotheses, references):
        scores = scorer.score(ref, hyp)
        for key in totals:
            totals[key] += scores[key].fmeasure
    return {key: 100.0 * value / len(hypotheses) for key, value in totals.items()}
