"""Scores of decoded text against references: corpus sacreBLEU and ROUGE-1/2/L, and the paper's metrics. Each takes one
hypothesis per reference, in order, and at least one pair."""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any


def score_texts(task: str, hypotheses: Sequence[str], references: Sequence[str], *,
                split_compounds: bool = False) -> dict[str, Any]:
    """A task's scores: ROUGE for summarisation, else sacreBLEU and tokenized BLEU; ``{}`` without examples."""
    if not hypotheses and not references:
        return {}
    if task == "summarization":
        return {**rouge(hypotheses, references), **rouge_lsum(hypotheses, references)}
    return {**bleu(hypotheses, references), **tokenized_bleu(hypotheses, references, split_compounds=split_compounds)}


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


# The paper's metrics, beside the modern ones
_COMPOUND = re.compile(r"(\S)-(\S)")


def compound_split(text: str) -> str:
    r"""fairseq's ``compound_split_bleu.sh``: ``"co-operation"`` -> ``"co ##AT##-##AT## operation"`` (no overlaps)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def tokenized_bleu(hypotheses: Iterable[str], references: Iterable[str], *, tokenize: str = "13a",
                   split_compounds: bool = True) -> dict[str, Any]:
    """The paper's WMT En-De BLEU: tokenized, compounds split, fairseq-score's BLEU (higher than sacreBLEU)."""
    import sacrebleu

    hypotheses, references = _pairs(hypotheses, references)
    tokenizer = sacrebleu.metrics.BLEU(tokenize=tokenize).tokenizer
    prepare = (lambda s: compound_split(tokenizer(s.strip()))) if split_compounds else (lambda s: tokenizer(s.strip()))
    metric = sacrebleu.metrics.BLEU(tokenize="none", smooth_method="none", force=True)
    result = metric.corpus_score([prepare(h) for h in hypotheses], [[prepare(r) for r in references]])
    name = f"tokenized BLEU ({tokenize}{', compound split' if split_compounds else ''})"
    return {"tokenized_bleu": result.score, "tokenized_bleu_text": f"{name} = {result.score:.2f}"}


def rouge_lsum(hypotheses: Iterable[str], references: Iterable[str]) -> dict[str, float]:
    """ROUGE-Lsum (summary-level LCS, as ROUGE-1.5.5), stemmed, averaged over examples, in percent."""
    from rouge_score import rouge_scorer

    hypotheses, references = _pairs(hypotheses, references)
    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=True)
    lines = lambda text: text if "\n" in text else re.sub(r"(?<=[.!?])\s+", "\n", text.strip())  # noqa: E731
    total = sum(scorer.score(lines(ref), lines(hyp))["rougeLsum"].fmeasure for hyp, ref in zip(hypotheses, references))
    return {"rougeLsum": 100.0 * total / len(hypotheses)}


def word_count(texts: Iterable[str]) -> int:
    """Words as word-level LMs count them: whitespace-separated words plus one end-of-sentence per text."""
    return sum(len(t.split()) + 1 for t in texts)


def word_perplexity(total_nll: float, words: int) -> dict[str, float]:
    """Per-word perplexity ``exp(nll / words)`` from a summed NLL over an LM's pieces."""
    if words < 1:
        raise ValueError("no words to score: word perplexity needs at least one text")
    return {"word_ppl": math.exp(total_nll / words), "words": float(words)}
