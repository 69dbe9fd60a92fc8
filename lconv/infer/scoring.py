"""Scores of decoded text against references: corpus sacreBLEU and ROUGE-1/2/L."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def bleu(hypotheses: Iterable[str], references: Iterable[str]) -> dict[str, Any]:
    """Corpus sacreBLEU (13a tokenisation on detokenised text) with its signature."""
    import sacrebleu

    metric = sacrebleu.metrics.BLEU()
    result = metric.corpus_score(list(hypotheses), [list(references)])
    return {"bleu": result.score, "bleu_signature": str(metric.get_signature()), "bleu_text": str(result)}


def rouge(hypotheses: Iterable[str], references: Iterable[str]) -> dict[str, float]:
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
