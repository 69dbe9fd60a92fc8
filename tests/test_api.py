"""``lconv.load`` and the ``Model`` API: outputs equal to the search functions run on each example alone (so
padding to shape buckets changes nothing), programs reused within a bucket, kernels equal to a NumPy recomputation,
perplexity and ``score`` equal to a NumPy log-softmax, n-best scores equal to ``score`` of the same pairs, samples
that depend on the input and seed alone, and one-line errors for calls that do not fit the run."""
from __future__ import annotations

import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
import sacrebleu
import tiny_runs

import lconv
from lconv.api import Model
from lconv.constants import EOS_ID, PAD_ID
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled, search

SOURCES = ["A small tool to convert images.", "Library for the X window system, with fonts and files.",
           "Fast text editor."]


@pytest.fixture
def workdir(tiny_run):
    """The shared tiny translation run (tests/conftest.py, 6 updates on one device): what ``lconv.load`` reads."""
    return tiny_run.workdir


@pytest.fixture(scope="session")
def lm():
    return Model(tiny_runs.in_memory(tiny_runs.lm_config()))


@pytest.fixture(scope="session")
def mt():
    """An untrained tiny translation model (what is checked, the same numbers two ways, needs no training)."""
    return Model(tiny_runs.in_memory(tiny_runs.translation_config()))


def _alone(model: Model, source: str, beam_size: int) -> str:
    """``source`` translated by itself, unpadded, straight through ``search.translate_hypotheses``' best beam."""
    ids_1S = np.append(model.tokenizer.encode(source), EOS_ID)[None].astype(np.int32)
    settings = DecodeSettings.build(model.config.decode, beam_size=beam_size)
    found = search.translate_hypotheses(model.module, {"params": model.params}, ids_1S, beam_size=beam_size,
                                        max_len=compiled.max_output_len(model.config.infer, settings, 32),
                                        lenpen=settings.lenpen, max_len_a=settings.max_len_a,
                                        max_len_b=settings.max_len_b, stop=settings.stop, temperature=0.0, top_k=0,
                                        top_p=1.0)
    return model.tokenizer.detokenize(np.asarray(found.tokens)[0, 0])


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_three_lines_from_import_to_a_translation(workdir):
    model = lconv.load(str(workdir))
    translations = model.translate(SOURCES[:2] + [""], beam_size=2)
    assert translations[:2] == [_alone(model, s, beam_size=2) for s in SOURCES[:2]]
    assert translations[2] == ""  # a blank source is not decoded
    assert model.steps == [6] and model.task == "translation"  # the latest checkpoint


def test_bleu_is_sacrebleu_of_the_translations(workdir):
    model = lconv.load(str(workdir), checkpoint="latest", average_last=1)
    references = ["Ein kleines Werkzeug.", "Bibliothek für X.", "Schneller Editor."]
    scores = model.bleu(SOURCES, references, beam_size=2)
    expected = sacrebleu.corpus_bleu(model.translate(SOURCES, beam_size=2), [references])
    assert scores["bleu"] == pytest.approx(expected.score) and scores["bleu_signature"].startswith("nrefs:1")
    with pytest.raises(UserError) as error:
        model.bleu(SOURCES, references[:2])
    helpers.one_line_error(error, "3 sources", "2 references")


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_calls_in_one_shape_bucket_compile_once():
    model = Model(tiny_runs.in_memory(tiny_runs.translation_config()))
    model.translate(["Fast tool.", "A library for the window system."])
    model.translate(["Images and fonts for the small server with python support.", "Data."], lenpen=0.5)
    assert model._translator.jitted._cache_size() == 1  # other lengths, same (2 rows, 32 wide) bucket
    model.translate(SOURCES)  # 3 rows: the 4-row bucket
    assert model._translator.jitted._cache_size() == 2


def test_lightconv_kernels_are_the_softmax_of_the_weights_and_attention_layers_have_none():
    config = tiny_runs.translation_config()
    config.model.encoder_mixer, config.model.decoder_mixer = "lightconv", "attention"
    model = Model(tiny_runs.in_memory(config))
    kernels = model.kernels(SOURCES[0])
    logits_HK = np.asarray(model.params["encoder"]["layer_0"]["mixer"]["conv"]["weight"], np.float64)
    expected_HK = np.exp(logits_HK) / np.exp(logits_HK).sum(-1, keepdims=True)
    assert len(kernels["encoder"]) == 1 and kernels["encoder"][0].shape == (2, 3)
    np.testing.assert_allclose(kernels["encoder"][0], expected_HK, rtol=1e-6)
    assert kernels["decoder"] == [None]
    assert kernels["source_tokens"][-1] == "</s>" and kernels["target_tokens"][0] == "<s>"


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_dynamic_kernels_match_a_numpy_recomputation_from_the_conv_input():
    config = tiny_runs.translation_config()  # the default: DynamicConv both sides
    config.model.matmul_precision = "highest"  # the kernel projection in float32 on every backend (GPU: not TF32)
    model = Model(tiny_runs.in_memory(config))
    sentence = "The small package for images and fonts."  # tiny_runs' words: a few tokens, within the 32 limit
    kernels = model.kernels(sentence)
    ids_1S = np.append(model.tokenizer.encode(sentence), EOS_ID)[None].astype(np.int32)
    assert ids_1S.shape[1] < 32
    # The conv's input is the block's GLU output (linear1); the kernels are softmax(input @ W) over K.
    _, state = model.module.apply({"params": model.params}, ids_1S, capture_intermediates=lambda m, _: m.name ==
                                  "linear1", mutable=["intermediates"], method=model.module.encode)
    conv_input_SC = np.asarray(state["intermediates"]["encoder"]["layer_0"]["mixer"]["linear1"]["__call__"][0][0],
                               np.float64)
    W = np.asarray(model.params["encoder"]["layer_0"]["mixer"]["conv"]["weight_linear"]["kernel"], np.float64)
    logits_SHK = (conv_input_SC @ W).reshape(len(ids_1S[0]), 2, 3)  # head-major: h*K + k
    expected_SHK = np.exp(logits_SHK) / np.exp(logits_SHK).sum(-1, keepdims=True)
    np.testing.assert_allclose(kernels["encoder"][0], expected_SHK, rtol=1e-5, atol=1e-6)
    decoder_THK = kernels["decoder"][0]
    assert decoder_THK.shape == (len(kernels["target_tokens"]), 2, 3)
    np.testing.assert_allclose(decoder_THK.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_lm_generation_of_ragged_prompts_equals_each_prompt_alone(lm):
    prompts = ["A small library for the window system", ""]  # ragged: 7 tokens and none (BOS alone)
    greedy = lm.generate(prompts, max_len=6)
    for prompt, text in zip(prompts, greedy):
        ids = lm.tokenizer.encode(prompt)
        alone = search.lm_generate(lm.module, {"params": lm.params}, jnp.asarray(ids)[None] if len(ids) else None,
                                   batch_size=1, max_len=6, temperature=0.0, top_k=0, top_p=1.0)
        assert text == lm.tokenizer.detokenize(np.asarray(alone)[0])
    # top_k=1 keeps only the argmax, so sampling it at any temperature is greedy decoding.
    assert lm.generate(prompts, max_len=6, temperature=1.0, top_k=1, seed=5) == greedy
    assert lm.generate(prompts[::-1], max_len=6, temperature=1.0, top_k=1, seed=6) == greedy[::-1]
    assert lm._generator.jitted._cache_size() == 2  # greedy, top-k sampling: the seed is an argument


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_lm_perplexity_matches_a_numpy_log_softmax(lm):
    texts = ["The package provides tools.", "Fonts"]
    nll, tokens = 0.0, 0
    for text in texts:
        ids = np.append(lm.tokenizer.encode(text), EOS_ID)[None].astype(np.int32)
        logits_TV = np.asarray(lm.module.apply({"params": lm.params}, ids), np.float64)[0]
        logp_TV = logits_TV - np.log(np.exp(logits_TV - logits_TV.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits_TV.max(-1, keepdims=True)
        nll -= logp_TV[np.arange(ids.shape[1]), ids[0]].sum()
        tokens += ids.shape[1]
    scores = lm.perplexity(texts)
    assert scores["tokens"] == tokens
    assert scores["nll"] == pytest.approx(nll / tokens, rel=1e-5)
    assert scores["ppl"] == pytest.approx(np.exp(nll / tokens), rel=1e-4)


def test_calls_that_do_not_fit_the_run_are_one_line_errors(lm):
    with pytest.raises(UserError) as error:
        lm.translate(["x"])
    helpers.one_line_error(error, "translate()", "in-memory", "lm run", "generate", "perplexity")
    assert lm.generate("The package", max_len=4) == lm.generate(["The package"], max_len=4)[0]  # str in, str out
    for prompts, named in [([None], "prompts[0]"), (["ok", b"bytes"], "prompts[1]"), ([3], "prompts[0]"),
                           (None, "prompts"), (b"bytes", "prompts")]:
        with pytest.raises(UserError) as error:  # never decoded as "None" or "b'...'"
            lm.generate(prompts)
        helpers.one_line_error(error, named)
    for texts, named in [(["ok", None], "texts[1]"), (None, "texts"), (b"bytes", "texts"), ([], "texts")]:
        with pytest.raises(UserError) as error:  # a string is one text (one dict); anything else but strings errs
            lm.perplexity(texts)  # and no text has no perplexity (not a ppl of 1.0 over 0 tokens)
        helpers.one_line_error(error, named)
    assert lm.perplexity([], per_text=True) == []  # one result per text: none
    for kwargs, named in [(dict(max_len=0), ["max_len=0"]),
                          (dict(temperature=-1.0), ["temperature=-1.0"]),
                          (dict(temperature=1e-38), ["temperature=1e-38", "[1e-06, 1e+06]"]),  # sampled garbage
                          (dict(top_k=-2), ["top_k=-2"]),
                          (dict(top_p=0.0), ["top_p=0.0"]),
                          (dict(max_len=200), ["max_len=200", "config.model.max_len"])]:
        with pytest.raises(UserError) as error:
            lm.generate(["x"], **kwargs)
        assert helpers.one_line_error(error, *named).startswith(named[0])


def test_translate_takes_one_string_or_a_list_of_strings_and_nothing_else():
    model = Model(tiny_runs.in_memory(tiny_runs.translation_config()))
    one = model.translate("Fast text editor.", beam_size=2)
    assert isinstance(one, str) and one == model.translate(["Fast text editor."], beam_size=2)[0]
    for call, named in [(lambda: model.translate([None]), "sources[0]"),
                        (lambda: model.translate(["a", b"b"]), "sources[1]"),
                        (lambda: model.bleu(["a"], [None]), "references[0]"),
                        (lambda: model.bleu("a", ["b"]), "sources"),
                        (lambda: model.bleu([], []), "sources")]:  # an empty corpus: no BLEU, not {}
        with pytest.raises(UserError) as error:
            call()
        helpers.one_line_error(error, named)


# ----------------------------------------------------------------------------------------------------------------
# n-best lists, scoring given targets, sampling
# ----------------------------------------------------------------------------------------------------------------
def _tolerance(model: Model, **own) -> dict[str, float]:
    """Incremental decoding against a teacher-forced pass: float32 sums in another order, or the dtype's rounding."""
    return reference.tolerance(model.config.model.dtype, model.config.model.matmul_precision, **own)


@functools.cache
def _teacher_forced(model: Model):
    """``(inputs_1S, targets_1T) -> logits [1, T, V]``: the model's plain forward pass, jitted (compiled per shape;
    eager would take longer)."""
    return jax.jit(lambda inputs_1S, targets_1T: model.module.apply({"params": model.params}, inputs_1S, targets_1T))


def _numpy_token_scores(model: Model, source: str, target_ids: list[int]) -> np.ndarray:
    """log p(each target id) in float64 from the model's teacher-forced logits on the unpadded pair."""
    limit = model.config.data.eval_max_input_length
    inputs_1S = np.append(model.tokenizer.encode(source)[:limit - 1], EOS_ID)[None].astype(np.int32)
    targets_1T = np.asarray(target_ids, np.int32)[None]
    logits_TV = np.asarray(_teacher_forced(model)(inputs_1S, targets_1T), np.float64)[0]
    logp_TV = logits_TV - logits_TV.max(-1, keepdims=True)
    logp_TV -= np.log(np.exp(logp_TV).sum(-1, keepdims=True))
    return logp_TV[np.arange(len(target_ids)), target_ids]


def test_nbest_scores_are_scores_of_the_same_pairs(mt):
    """The issue's "the same numbers two ways": the search's per-token log-probs (incremental decoding, kept along
    the beams) equal ``score``'s (one teacher-forced pass) for every hypothesis. ``score`` takes the n-best ids:
    this untrained model's texts do not re-tokenise to the same ids, so comparing texts would compare other
    sequences."""
    lenpen = 0.6
    nbest = mt.translate(SOURCES, beam_size=3, lenpen=lenpen, nbest=3)
    assert [entry["text"] for entry, *_ in nbest] == mt.translate(SOURCES, beam_size=3, lenpen=lenpen)
    pairs = [(source, entry) for source, entries in zip(SOURCES, nbest) for entry in entries]
    assert len(pairs) == 9
    scored = mt.score([source for source, _ in pairs], [entry["tokens"] for _, entry in pairs])
    for (_, entry), by_score in zip(pairs, scored):
        tokens, token_scores = entry["tokens"], entry["token_scores"]
        assert tokens[-1] == EOS_ID and EOS_ID not in tokens[:-1] and len(token_scores) == len(tokens)
        assert entry["text"] == mt.tokenizer.detokenize(tokens)
        np.testing.assert_allclose(token_scores, by_score["token_scores"], **_tolerance(mt, rtol=1e-5, atol=1e-5))
        assert entry["score"] == pytest.approx(np.sum(token_scores) / len(tokens) ** lenpen, rel=1e-5)
        assert by_score["score"] == pytest.approx(np.sum(by_score["token_scores"]), rel=1e-6)
    for entries in nbest:  # best first, distinct hypotheses
        assert [e["score"] for e in entries] == sorted((e["score"] for e in entries), reverse=True)
        assert len({tuple(e["tokens"]) for e in entries}) == 3
    one = mt.translate(SOURCES[2], beam_size=3, lenpen=lenpen, nbest=2)  # a string: one list
    assert [e["tokens"] for e in one] == [e["tokens"] for e in nbest[2][:2]]
    assert mt.translate([SOURCES[0], ""], beam_size=3, nbest=2)[1] == []  # a blank source is not decoded


def test_score_is_a_numpy_log_softmax_of_the_teacher_forced_logits_with_translations_cuts(mt):
    limit = mt.config.data.eval_max_target_length
    long_target = " ".join(["images and fonts for the window system"] * 8)  # cut to the limit, as translate's
    targets = ["Ein kleines Werkzeug.", "", long_target]
    scored = mt.score(SOURCES, targets)
    for source, target, got in zip(SOURCES, targets, scored):
        ids = list(mt.tokenizer.encode(target))[:limit - 1] + [EOS_ID]
        expected = _numpy_token_scores(mt, source, ids)
        np.testing.assert_allclose(got["token_scores"], expected, **_tolerance(mt, rtol=1e-5, atol=1e-5))
        # the sum's error is at most the tokens' (TF32 dots on a GPU at "default" precision; exact on CPU)
        np.testing.assert_allclose(got["score"], expected.sum(), **_tolerance(mt, rtol=1e-5))
    assert len(scored[2]["token_scores"]) == limit and len(mt.tokenizer.encode(long_target)) > limit
    assert len(scored[1]["token_scores"]) == 1  # an empty target: EOS alone
    one = mt.score(SOURCES[0], targets[0])  # strings: one dict
    np.testing.assert_allclose(one["token_scores"], scored[0]["token_scores"], rtol=1e-6)
    for call, named in [(lambda: mt.score(SOURCES, targets[:2]), ["3 sources", "2 targets"]),
                        (lambda: mt.score(["a"], "b"), ["targets"]),
                        (lambda: mt.score(["a"], [None]), ["targets[0]"]),
                        (lambda: mt.score(["a"], [[5, 10 ** 6]]), ["targets[0]"]),
                        (lambda: mt.score(["a"], [[5, PAD_ID, 7]]), ["targets[0]", "ids in [1, "]),  # r27-43
                        (lambda: mt.score(["a", "b"], ["x", [EOS_ID, 5]]), ["targets[1]", "EOS"])]:
        with pytest.raises(UserError) as error:
            call()
        helpers.one_line_error(error, *named)


def _argmax_reference(model: Model, source: str) -> list[int]:
    """Greedy decoding by brute force: a full teacher-forced pass per token, PAD never chosen, EOS at the length
    limit (fairseq's ``max_len_a * source length + max_len_b`` tokens, EOS added, within the output limit)."""
    decode = model.config.decode
    source_ids = list(model.tokenizer.encode(source)) + [EOS_ID]
    limit = min(int(decode.max_len_a * len(source_ids) + decode.max_len_b) + 1,
                compiled.max_output_len(model.config.infer, DecodeSettings.build(decode), 32))
    inputs_1S = np.asarray([source_ids], np.int32)
    out = []
    while not out or (out[-1] != EOS_ID and len(out) < limit):
        targets_1T = np.full((1, 32), PAD_ID, np.int32)
        targets_1T[0, :len(out)] = out  # the position after them reads only them (causal)
        logits_V = np.asarray(_teacher_forced(model)(inputs_1S, targets_1T), np.float64)[0, len(out)]
        logits_V[PAD_ID] = -np.inf
        out.append(EOS_ID if len(out) + 1 == limit else int(np.argmax(logits_V)))
    return out


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_translation_samples_depend_on_the_source_and_seed_alone(mt):
    sampling = dict(temperature=1.0, seed=7, nbest=2)
    alone = mt.translate(SOURCES[1], **sampling)
    batch = [SOURCES[0], SOURCES[2], "Data.", SOURCES[1], "Fonts and files."]  # other rows, widths, a bucket of 8
    in_batch = mt.translate(batch, **sampling)[3]
    assert [e["tokens"] for e in in_batch] == [e["tokens"] for e in alone]
    assert [e["tokens"] for e in mt.translate(SOURCES[1], **{**sampling, "seed": 8})] != [e["tokens"] for e in alone]
    lenpen = mt.config.decode.lenpen
    for entry in alone:  # scored as beams are, under the model (not the tempered one)
        by_score = mt.score(SOURCES[1], entry["tokens"])
        np.testing.assert_allclose(entry["token_scores"], by_score["token_scores"], **_tolerance(mt, rtol=1e-5,
                                                                                                  atol=1e-5))
        assert entry["score"] == pytest.approx(np.sum(entry["token_scores"]) / len(entry["tokens"]) ** lenpen,
                                               rel=1e-5)
    assert alone[0]["score"] >= alone[1]["score"]
    # top_k=1 keeps only the argmax: sampling it is greedy decoding, here against a brute-force loop.
    greedy = mt.translate(SOURCES[1], temperature=1.0, top_k=1, seed=3, nbest=1)[0]["tokens"]
    assert greedy == _argmax_reference(mt, SOURCES[1])


def test_lm_samples_do_not_depend_on_the_batch(lm):
    prompt = "A small library for the window system"
    alone = lm.generate(prompt, max_len=6, temperature=1.0, seed=11)
    batch = ["Fonts", "", "The package provides tools for data.", prompt, "Network"]
    assert lm.generate(batch, max_len=6, temperature=1.0, seed=11)[3] == alone
    assert lm.generate(prompt, max_len=6, temperature=1.0, seed=12) != alone


def test_nbest_and_sampling_arguments_are_checked(mt):
    for kwargs, named in [(dict(nbest=5, beam_size=4), ["nbest=5", "beam size (4)"]),
                          (dict(nbest=0), ["nbest=0"]),
                          (dict(nbest=True), ["nbest=True"]),
                          (dict(temperature=1.0, beam_size=3), ["beam_size=3", "nbest"]),
                          (dict(temperature=-1.0), ["temperature=-1.0"]),
                          (dict(temperature=1.0, top_p=0.0), ["top_p=0.0"]),
                          (dict(temperature=1.0, seed=-1), ["seed=-1"])]:
        with pytest.raises(UserError) as error:
            mt.translate(["x"], **kwargs)
        assert helpers.one_line_error(error, *named).startswith(named[0])
