"""The paper's metrics beside the modern ones, against independent computations: fairseq's compound-splitting
script (its Perl rewrite's outputs), a hand-written corpus BLEU, a hand-computed ROUGE-Lsum and word perplexity."""
import collections
import math

import pytest
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

from lconv.infer import scoring

# `perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'` (fairseq's scripts/compound_split_bleu.sh), run on each input.
PERL_OUTPUTS = {
    "state-of-the-art": "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art",
    "a-b-c-d": "a ##AT##-##AT## b-c ##AT##-##AT## d",
    "x - y": "x - y",
    "-a b-": "-a b-",
    "Baden-Württemberg's co-operation": "Baden ##AT##-##AT## Württemberg's co ##AT##-##AT## operation",
}


@pytest.mark.parametrize("text", sorted(PERL_OUTPUTS))
def test_compound_split_is_the_scripts_rewrite(text):
    assert scoring.compound_split(text) == PERL_OUTPUTS[text]


def _corpus_bleu(hyps, refs):
    """Papineni et al.'s corpus BLEU on whitespace tokens: clipped n-gram precisions (n <= 4), geometric mean,
    brevity penalty; no smoothing."""
    matches, totals, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for hyp, ref in zip(hyps, refs):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            hc = collections.Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            rc = collections.Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity = min(0.0, 1 - ref_len / hyp_len)
    return 100 * math.exp(log_precision + brevity)


def test_tokenized_bleu_splits_compounds_then_scores_plain_bleu():
    hyps = ["The state-of-the-art model, a well-known one, translates.", "Baden-Württemberg is green.",
            "A co-operation of long-term partners works here today."]
    refs = ["The state-of-the-art system, a well-known one, translates well.", "Baden-Württemberg is very green.",
            "The co-operation of long-term partners works today."]
    tokenize = Tokenizer13a()
    prepared = lambda texts: [scoring.compound_split(tokenize(t)) for t in texts]  # noqa: E731
    got = scoring.tokenized_bleu(hyps, refs)
    assert got["tokenized_bleu"] == pytest.approx(_corpus_bleu(prepared(hyps), prepared(refs)), rel=1e-9)
    plain = scoring.tokenized_bleu(hyps, refs, split_compounds=False)["tokenized_bleu"]
    assert plain == pytest.approx(_corpus_bleu([tokenize(t) for t in hyps], [tokenize(t) for t in refs]), rel=1e-9)
    assert got["tokenized_bleu"] > plain  # matched compounds count as several n-grams: the paper's number is higher


def test_rouge_lsum_takes_the_union_of_sentence_lcs_where_rouge_l_takes_one_lcs():
    hyp, ref = "b c. a.", "a. b c."  # the same sentences, swapped
    assert scoring.rouge_lsum([hyp], [ref])["rougeLsum"] == pytest.approx(100.0)  # every ref word is hit
    assert scoring.rouge([hyp], [ref])["rougeL"] == pytest.approx(100 * 2 / 3)  # LCS "b c" of 3 words each way


def test_word_perplexity_counts_words_plus_one_end_of_sentence_per_text():
    words = scoring.word_count(["the cat sat", "a  dog\n"])  # 3 + 1 + 2 + 1
    assert words == 7
    got = scoring.word_perplexity(12.0, words)
    assert got["words"] == 7 and got["word_ppl"] == pytest.approx(math.exp(12.0 / 7))
    with pytest.raises(ValueError, match="no words"):
        scoring.word_perplexity(1.0, scoring.word_count([]))


def test_evaluation_reports_the_papers_metrics_beside_the_modern_ones():
    hyps, refs = ["A well-known cat sat here."], ["The well-known cat sat there."]
    translation = scoring.score_texts("translation", hyps, refs, split_compounds=True)
    assert translation["bleu"] == scoring.bleu(hyps, refs)["bleu"]
    assert translation["tokenized_bleu"] == scoring.tokenized_bleu(hyps, refs)["tokenized_bleu"]
    assert "compound split" in translation["tokenized_bleu_text"]
    summary = scoring.score_texts("summarization", hyps, refs)
    assert summary["rougeLsum"] == scoring.rouge_lsum(hyps, refs)["rougeLsum"] and "rouge2" in summary


def test_an_lms_eval_set_of_whole_texts_gets_a_per_word_perplexity_and_a_cut_one_none():
    from types import SimpleNamespace

    from lconv.run import loss_pass

    texts = ["the cat sat", "a dog ran far"]  # 4 + 5 words with their end-of-sentence
    whole = SimpleNamespace(examples=[{"targets": t} for t in texts], tokens=[{}, {}], stats={})
    scores = {"nll": 2.0, "tokens": 12.0}  # 24 nats over the pieces
    assert loss_pass._word_perplexity(whole, scores) == {"word_ppl": pytest.approx(math.exp(24.0 / 9)), "words": 9.0}
    cut = SimpleNamespace(examples=whole.examples, tokens=whole.tokens, stats={"eval_targets_truncated": 1})
    assert loss_pass._word_perplexity(cut, scores) == {}
