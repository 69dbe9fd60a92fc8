"""The API's decoding, round 2: forced prefixes and ensembles, each against an independent reference, a beam
search by brute force on the models' full teacher-forced passes (its first steps forced by hand, its step
distribution the mean of the members'), and the per-token mixture of the members' own ``score``."""
from __future__ import annotations

import copy
import functools
import math

import helpers
import jax
import numpy as np
import pytest
import tiny_runs

import lconv
from lconv.api import Model
from lconv.constants import EOS_ID, PAD_ID
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled

SOURCES = ["A small tool to convert images.", "Library for the X window system, with fonts and files."]
WIDTH = 32  # the tiny runs' sources and outputs fit one 32-wide bucket


@pytest.fixture(scope="module")
def mt():
    return Model(tiny_runs.in_memory(tiny_runs.translation_config()))


@pytest.fixture(scope="module")
def mt_other():
    """The same architecture from another seed: a second member with other distributions."""
    return Model(tiny_runs.in_memory(tiny_runs.translation_config(), seed=1))


@functools.cache
def _teacher_forced(model: Model):
    return jax.jit(lambda inputs_BS, targets_BT: model.module.apply({"params": model.params}, inputs_BS, targets_BT))


def _step_log_probs(members: list[Model], source_ids: list[int], hypotheses: list[list[int]], rows: int) -> np.ndarray:
    """``[len(hypotheses), V]`` float64: log of the members' mean next-token probability after each hypothesis,
    each member's from its full teacher-forced pass (a causal decoder: the position after the hypothesis reads it
    alone)."""
    inputs_BS = np.tile(np.asarray(source_ids, np.int32), (rows, 1))
    targets_BT = np.full((rows, WIDTH), PAD_ID, np.int32)
    for row, tokens in enumerate(hypotheses):
        targets_BT[row, :len(tokens)] = tokens
    position = np.asarray([len(tokens) for tokens in hypotheses])
    probs = 0.0
    for member in members:
        logits_BTV = np.asarray(_teacher_forced(member)(inputs_BS, targets_BT), np.float64)
        logits_BV = logits_BTV[np.arange(len(hypotheses)), position]
        logits_BV -= logits_BV.max(-1, keepdims=True)
        probs = probs + np.exp(logits_BV) / np.exp(logits_BV).sum(-1, keepdims=True)
    return np.log(probs / len(members))


def _reference_beam(members: list[Model], source: str, *, beam: int, lenpen: float,
                    prefix: list[int] = ()) -> list[tuple[float, list[int]]]:
    """The best ``beam`` finished hypotheses, best first, as ``(score, tokens)``: each step extends every alive
    hypothesis by every token (PAD never; only EOS at the length limit; while in ``prefix``, only its token, with
    its log-prob), keeps the best ``2 * beam`` extensions, of which those ending in EOS finish (scored
    ``sum(log p) / len**lenpen``) and the best ``beam`` others stay alive; run to the limit, no early stop."""
    decode = members[0].config.decode
    source_ids = list(members[0].tokenizer.encode(source)) + [EOS_ID]
    limit = min(int(decode.max_len_a * len(source_ids) + decode.max_len_b) + 1,
                compiled.max_output_len(members[0].config.infer, DecodeSettings.build(decode), WIDTH))
    limit = max(limit, len(prefix) + 1)
    alive, finished = [(0.0, [])], []
    for i in range(limit):
        logp_AV = _step_log_probs(members, source_ids, [tokens for _, tokens in alive], beam)
        logp_AV[:, PAD_ID] = -np.inf
        allowed = [prefix[i]] if i < len(prefix) else [EOS_ID] if i + 1 == limit else range(logp_AV.shape[1])
        extensions = [(score + logp_AV[a, v], tokens + [v]) for a, (score, tokens) in enumerate(alive)
                      for v in allowed if np.isfinite(logp_AV[a, v])]
        best = sorted(extensions, key=lambda e: -e[0])[:2 * beam]
        finished += [(score / len(tokens) ** lenpen, tokens) for score, tokens in best if tokens[-1] == EOS_ID]
        alive = [(score, tokens) for score, tokens in best if tokens[-1] != EOS_ID][:beam]
    return sorted(finished, key=lambda f: -f[0])[:beam]


def _assert_like_reference(entries: list[dict], reference: list[tuple[float, list[int]]]) -> None:
    assert [entry["tokens"] for entry in entries] == [tokens for _, tokens in reference]
    np.testing.assert_allclose([entry["score"] for entry in entries], [score for score, _ in reference],
                               rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Forced prefixes
# ----------------------------------------------------------------------------------------------------------------
def test_a_prefix_forced_beam_equals_a_beam_whose_first_steps_are_forced_by_hand(mt):
    prefixes = ["Werkzeug", [7, 11, 13]]  # a string (tokenised) and token ids
    forced = [list(mt.tokenizer.encode(prefixes[0])), prefixes[1]]
    found = mt.translate(SOURCES, beam_size=3, lenpen=0.6, nbest=3, prefix=prefixes)
    for source, ids, entries in zip(SOURCES, forced, found):
        _assert_like_reference(entries, _reference_beam([mt], source, beam=3, lenpen=0.6, prefix=ids))
        for entry in entries:  # the prefix's tokens are scored as score() scores them
            assert entry["tokens"][:len(ids)] == ids
            by_score = mt.score(source, entry["tokens"])
            np.testing.assert_allclose(entry["token_scores"], by_score["token_scores"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two more programs (a beam of one, sampling): CI runs it, the quick command skips it
def test_a_prefix_forces_a_greedy_search_and_samples_too(mt):
    prefix = [7, 11, 13]
    greedy = mt.translate(SOURCES[0], beam_size=1, nbest=1, prefix=prefix)
    _assert_like_reference(greedy, _reference_beam([mt], SOURCES[0], beam=1, lenpen=mt.config.decode.lenpen,
                                                  prefix=prefix))  # the stored lenpen, which translate used
    samples = mt.translate(SOURCES, temperature=1.0, seed=3, nbest=2, prefix=[prefix, "Werkzeug"])
    forced = [prefix, list(mt.tokenizer.encode("Werkzeug"))]
    assert all(entry["tokens"][:len(ids)] == ids for ids, entries in zip(forced, samples) for entry in entries)
    programs = mt._translator.jitted._cache_size()
    mt.translate(SOURCES[:1], beam_size=1, nbest=1, prefix=[[5, 6, 7, 8, 9]])  # another prefix: the same program
    assert mt._translator.jitted._cache_size() == programs


def test_prefix_arguments_are_checked(mt):
    for kwargs, named in [(dict(prefix=["a"]), ["2 sources", "1 prefixes"]),
                          (dict(prefix=[[5, EOS_ID], "b"]), ["prefix[0]", "without EOS"]),
                          (dict(prefix=["a", [PAD_ID]]), ["prefix[1]"]),
                          (dict(prefix=["a", [5] * 40]), ["prefix[1]", "40 tokens", "at most"]),
                          (dict(prefix="a"), ["prefix", "a list"])]:
        with pytest.raises(UserError) as error:
            mt.translate(SOURCES, **kwargs)
        helpers.one_line_error(error, *named)


# ----------------------------------------------------------------------------------------------------------------
# Ensembles
# ----------------------------------------------------------------------------------------------------------------
def test_an_ensemble_of_one_model_is_that_model(mt):
    alone = lconv.ensemble([mt])
    _assert_same_up_to_rounding(alone.translate(SOURCES, beam_size=3, nbest=3), mt.translate(SOURCES, beam_size=3,
                                                                                             nbest=3))
    np.testing.assert_allclose(alone.score(SOURCES[0], "Ein Werkzeug.")["token_scores"],
                               mt.score(SOURCES[0], "Ein Werkzeug.")["token_scores"], rtol=1e-6, atol=1e-6)


def test_an_ensemble_of_one_model_twice_is_that_model(mt):
    """One Model object listed twice: each member is its own module instance, so the search's caches are not
    shared (they were: its translation differed from the model's, its scores from score()'s by 0.71 nats)."""
    twice = lconv.ensemble([mt, mt])
    assert twice.module.members[0] is not twice.module.members[1]
    found = twice.translate(SOURCES, beam_size=3, nbest=3)
    _assert_same_up_to_rounding(found, mt.translate(SOURCES, beam_size=3, nbest=3))
    target = found[0][0]["tokens"]
    np.testing.assert_allclose(twice.score(SOURCES[0], target)["token_scores"],
                               mt.score(SOURCES[0], target)["token_scores"], rtol=1e-5, atol=1e-6)


def test_an_ensembles_length_limits_are_its_members_minimum_said_once(mt, lconv_log):
    """A member with fewer positions than the first member's limits would read positions it has not learned (NaN
    scores, an empty n-best): the ensemble takes the members' minimum and says so once."""
    short = copy.copy(mt)
    short.config = mt.config.replace(model={"max_len": 9}, data={"eval_max_input_length": 9,
                                                                 "eval_max_target_length": 9})
    pair = lconv.ensemble([mt, short])
    for limit in ("eval_max_input_length", "eval_max_target_length"):
        assert getattr(pair.config.data, limit) == 9 < getattr(mt.config.data, limit)
    assert pair.config.model.max_len == 9 and mt.config.model.max_len > 9  # the member's own config is kept
    (line,) = [m for m in lconv_log() if "ensemble" in m]
    assert "models[1]" in line and "eval_max_input_length" in line
    assert lconv.ensemble([mt, mt]).config == mt.config


def test_an_ensemble_of_runs_on_different_datasets_is_said(mt, lconv_log):
    """Members trained on en_de and on de_en (one tokenizer) were averaged without a word (round 27, r27-31): two
    corpora of one direction are a fair ensemble, a swapped direction is not, so it is said, naming each."""
    other = copy.copy(mt)
    other.config = mt.config.replace(data={"dataset": "ddtp/de_en"})
    lconv.ensemble([mt, other])
    (line,) = [m for m in lconv_log() if "different datasets" in m]
    assert f"models[0]: {mt.config.data.dataset}" in line and "models[1]: ddtp/de_en" in line
    lconv.ensemble([mt, mt])
    assert len([m for m in lconv_log() if "different datasets" in m]) == 1


def test_the_ensemble_warning_names_the_members_field_that_binds(lm, lconv_log):
    """A member's positions (model.max_len) cap its input limit: the warning named the member's
    eval_max_input_length, which was larger, instead of the max_len that set the value. (An LM's, since a seq2seq
    run's limits are within its positions from the start.)"""
    short = copy.copy(lm)
    short.config = lm.config.replace(model={"max_len": 9}, data={"eval_max_target_length": 7})
    lconv.ensemble([lm, short])
    (line,) = [m for m in lconv_log() if "ensemble" in m]
    data = lm.config.data
    assert f"eval_max_input_length {data.eval_max_input_length} -> 9 (models[1]'s config.model.max_len)" in line
    assert f"eval_max_target_length {data.eval_max_target_length} -> 7 (models[1]'s " \
           "config.data.eval_max_target_length)" in line, line


def _assert_same_up_to_rounding(a: list[list[dict]], b: list[list[dict]]) -> None:
    """The same hypotheses, scores equal to float32 rounding (the ensemble normalises its log-probs twice)."""
    assert len(a) == len(b)
    for entries_a, entries_b in zip(a, b):
        assert [e["tokens"] for e in entries_a] == [e["tokens"] for e in entries_b]
        np.testing.assert_allclose([e["score"] for e in entries_a], [e["score"] for e in entries_b], rtol=1e-6)


@pytest.mark.slow  # the ensemble's programs and each member's reference passes: CI runs it, the quick command skips it
def test_an_ensemble_of_two_decodes_the_mean_of_their_distributions(mt, mt_other):
    pair = lconv.ensemble([mt, mt_other])
    found = pair.translate(SOURCES, beam_size=2, lenpen=0.6, nbest=2)
    for source, entries in zip(SOURCES, found):
        _assert_like_reference(entries, _reference_beam([mt, mt_other], source, beam=2, lenpen=0.6))
    # score(): per token, the log of the members' mean probability of it, from each member's own score().
    target = found[0][0]["tokens"]
    expected = np.logaddexp(mt.score(SOURCES[0], target)["token_scores"],
                            mt_other.score(SOURCES[0], target)["token_scores"]) - math.log(2)
    np.testing.assert_allclose(pair.score(SOURCES[0], target)["token_scores"], expected, rtol=1e-5, atol=1e-6)
    assert lconv.ensemble([pair, mt]).module.members[2] is not None  # members of members: three, weighed alike
    with pytest.raises(UserError) as error:
        pair.kernels(SOURCES[0])
    helpers.one_line_error(error, "kernels()", "ensemble")


@pytest.mark.slow  # a three-member ensemble's programs: CI runs it, the quick command skips it
def test_a_nested_ensemble_weighs_each_model_alike_and_scores_as_its_search_does(mt, mt_other):
    """ensemble([ensemble([a, b]), a]): three members, a twice (each its own module instance), so per token the
    log of (2 p_a + p_b) / 3; the search's scores equal score()'s of the tokens it found (they were 1.58 off)."""
    nested = lconv.ensemble([lconv.ensemble([mt, mt_other]), mt])
    found = nested.translate(SOURCES[:1], beam_size=2, nbest=1)[0][0]
    scored = nested.score(SOURCES[0], found["tokens"])
    own = [np.asarray(m.score(SOURCES[0], found["tokens"])["token_scores"], np.float64) for m in (mt, mt_other)]
    expected = np.log((2 * np.exp(own[0]) + np.exp(own[1])) / 3)
    np.testing.assert_allclose(scored["token_scores"], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(found["token_scores"], scored["token_scores"], rtol=1e-5, atol=1e-5)


def test_ensembles_of_what_cannot_decode_together_are_one_line_errors(mt):
    lm = Model(tiny_runs.in_memory(tiny_runs.lm_config()))
    for models, named in [([], ["models", "non-empty"]), (mt, ["models", "list"]), ([mt, "runs/x"], ["models[1]"]),
                          ([mt, lm], ["models[1]", "DecoderOnlyLM", "translation models"])]:
        with pytest.raises(UserError) as error:
            lconv.ensemble(models)
        helpers.one_line_error(error, *named)


# ----------------------------------------------------------------------------------------------------------------
# Language models: beams, n samples and per-text perplexity
# ----------------------------------------------------------------------------------------------------------------
PROMPTS = ["A small library for the window system", "", "Fonts"]  # ragged: 7 tokens, none (BOS alone), one


@pytest.fixture(scope="module")
def lm():
    return Model(tiny_runs.in_memory(tiny_runs.lm_config()))


def _assert_scored_as_score_scores(lm: Model, prompt: str, entries: list[dict], lenpen: float, max_len: int) -> None:
    """Each entry's token scores are ``score(prompt, its tokens)``'s (a teacher-forced pass over BOS, the prompt
    and the continuation), and its score their sum over ``len**lenpen``; EOS last, within ``max_len``."""
    for entry in entries:
        tokens = entry["tokens"]
        assert tokens[-1] == EOS_ID and EOS_ID not in tokens[:-1] and len(tokens) <= max_len
        assert entry["text"] == lm.tokenizer.detokenize(tokens)
        by_score = lm.score(prompt, tokens)
        np.testing.assert_allclose(entry["token_scores"], by_score["token_scores"], rtol=1e-5, atol=1e-5)
        assert entry["score"] == pytest.approx(np.sum(by_score["token_scores"]) / len(tokens) ** lenpen, rel=1e-5)
    assert [e["score"] for e in entries] == sorted((e["score"] for e in entries), reverse=True)


def test_lm_beam_nbest_scores_are_score_of_the_same_texts(lm):
    found = lm.generate(PROMPTS, max_len=6, beam_size=3, lenpen=0.6, nbest=3)
    for prompt, entries in zip(PROMPTS, found):
        assert len(entries) == 3 and len({tuple(e["tokens"]) for e in entries}) == 3
        _assert_scored_as_score_scores(lm, prompt, entries, 0.6, 6)
    assert lm.generate(PROMPTS, max_len=6, beam_size=3, lenpen=0.6) == [entries[0]["text"] for entries in found]
    (alone,) = lm.generate(PROMPTS[0], max_len=6, beam_size=3, lenpen=0.6, nbest=1)  # alone: the same beam
    assert alone["tokens"] == found[0][0]["tokens"] and alone["score"] == pytest.approx(found[0][0]["score"], rel=1e-6)


@pytest.mark.slow  # the sampling program: CI runs it, the quick command skips it
def test_lm_samples_per_prompt_come_with_their_token_scores_and_depend_on_the_prompt_alone(lm):
    samples = lm.generate(PROMPTS, max_len=6, temperature=1.0, seed=4, nbest=3)
    for prompt, entries in zip(PROMPTS, samples):
        assert len(entries) == 3
        _assert_scored_as_score_scores(lm, prompt, entries, lm.config.decode.lenpen, 6)
    alone = lm.generate(PROMPTS[2], max_len=6, temperature=1.0, seed=4, nbest=3)
    assert [e["tokens"] for e in alone] == [e["tokens"] for e in samples[2]]
    assert [e["tokens"] for e in lm.generate(PROMPTS[2], max_len=6, temperature=1.0, seed=5, nbest=3)] != \
        [e["tokens"] for e in samples[2]]


def test_per_text_perplexity_adds_up_to_the_corpus_perplexity(lm):
    texts = ["The package provides tools.", "Fonts", "A small library for the window system with fonts."]
    per_text = lm.perplexity(texts, per_text=True)
    corpus = lm.perplexity(texts)  # the corpus path (a summed loss): token-weighted, the per-text numbers add up
    assert sum(t["tokens"] for t in per_text) == corpus["tokens"]
    assert sum(t["nll"] * t["tokens"] for t in per_text) / corpus["tokens"] == pytest.approx(corpus["nll"], rel=1e-5)
    for text, got in zip(texts, per_text):
        alone = lm.perplexity([text])  # a corpus of one: the same numbers
        assert got["tokens"] == alone["tokens"] == len(lm.tokenizer.encode(text)) + 1
        assert got["nll"] == pytest.approx(alone["nll"], rel=1e-5) and got["ppl"] == pytest.approx(math.exp(got["nll"]))
    one = lm.perplexity(texts[1])  # a string: one dict (a batch of one row: float32 sums in another order)
    assert one.keys() == per_text[1].keys() and one["nll"] == pytest.approx(per_text[1]["nll"], rel=1e-6)
    with pytest.raises(UserError) as error:
        lm.perplexity(texts, per_text=True, sample_break_mode="none")
    helpers.one_line_error(error, "sample_break_mode='none'", "per-text")


# ----------------------------------------------------------------------------------------------------------------
# Bad arguments and long inputs (issue 56): one line before any work, or the warning every surface gives
# ----------------------------------------------------------------------------------------------------------------
def test_an_lm_beam_wider_than_its_vocabulary_is_one_line(lm):
    """generate(beam_size=600) was accepted over a 512 vocabulary, and 10**9 was a MemoryError traceback."""
    for beam in (lm.tokenizer.vocab_size, 10**9):
        with pytest.raises(UserError) as error:
            lm.generate(["a"], beam_size=beam)
        helpers.one_line_error(error, f"beam_size={beam}", str(lm.tokenizer.vocab_size - 1))


def test_a_bytes_prefix_is_one_line(mt):
    for prefix, sources in ((b"Ein", "A tool."), ([b"Ein"], ["A tool."])):
        with pytest.raises(UserError) as error:
            mt.translate(sources, prefix=prefix)
        helpers.one_line_error(error, "prefix", "bytes")


def test_a_bool_layer_is_no_layer(mt):
    """``layer=True`` was taken as layer 1."""
    for layer in (True, 1.0, "1"):
        with pytest.raises(UserError) as error:
            mt.extract_features("A tool.", layer=layer)
        helpers.one_line_error(error, f"layer={layer!r}", "integer")


def test_a_device_listed_twice_is_one_line_not_a_storage_failure(tmp_path):
    """It was reported as a storage failure with ~1,150 lines of orbax noise; now refused before the run is read
    (the folder here holds no run at all)."""
    device = jax.devices("cpu")[0]
    with pytest.raises(UserError) as error:
        lconv.load(str(tmp_path), devices=[device, device])
    helpers.one_line_error(error, "devices", "twice")


LONG = " ".join(["Library for the X window system, with fonts and files."] * 30)  # hundreds of tokens


def test_an_lm_score_that_cuts_a_long_pair_says_so(lm, lconv_log, monkeypatch):
    """lm.score cut a pair longer than config.model.max_len without the warning every other path gives."""
    from lconv.infer import lm_scoring

    monkeypatch.setattr(lm_scoring, "continuation_scores", lambda config, fn, params, prompts, targets:
                        [{"score": 0.0, "token_scores": []}] * len(prompts))  # the scoring itself is tested elsewhere
    lm.score(["A tool.", LONG], ["short", "short"])
    (line,) = [m for m in lconv_log() if "cut" in m]
    assert "sources[1] had" in line and "config.model.max_len" in line and "sources[0]" not in line


def test_extract_features_says_when_it_cuts_a_sentence_or_target(lm, mt, lconv_log):
    """extract_features cut long inputs silently (it reads the eval limits' first tokens)."""
    inputs, targets, _ = lm._teacher_forced_ids(LONG, None)
    assert inputs is None and len(targets) == lm.config.data.eval_max_target_length
    inputs, targets, _ = mt._teacher_forced_ids(LONG, LONG)
    assert len(inputs) == mt.config.data.eval_max_input_length
    lines = [m for m in lconv_log() if "cut" in m]
    assert len(lines) == 3 and "sentence had" in lines[0] and "target had" in lines[2], lines
    mt._teacher_forced_ids("A tool.", "Ein Werkzeug.")
    assert len([m for m in lconv_log() if "cut" in m]) == 3  # a short pair: nothing said


def test_generate_at_the_advertised_maximum_does_not_drop_the_prompt(lm):
    """max_len = config.model.max_len - 1 left no room for a prompt: it was dropped without a word."""
    positions = lm.config.model.max_len
    with pytest.raises(UserError) as error:
        lm.generate(["A small library"], max_len=positions - 1)
    helpers.one_line_error(error, f"max_len={positions - 1}", "no room for a prompt", f"at most {positions - 2}")
    with pytest.raises(UserError) as error:
        lm.generate(["A small library"], max_len=positions)
    helpers.one_line_error(error, f"max_len={positions}", f"at most {positions - 2}")
