"""``lconv.load`` and the ``Model`` API: outputs equal to the search functions run on each example alone (so
padding to shape buckets changes nothing), programs reused within a bucket, kernels equal to a NumPy recomputation,
perplexity equal to a NumPy log-softmax, and one-line errors for calls that do not fit the run."""
from __future__ import annotations

import helpers
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu
import tiny_runs

import lconv
from lconv.api import Model
from lconv.constants import EOS_ID
from lconv.errors import UserError
from lconv.infer import compiled, search

SOURCES = ["A small tool to convert images.", "Library for the X window system, with fonts and files.",
           "Fast text editor."]


@pytest.fixture
def workdir(tiny_run):
    """The shared tiny translation run (tests/conftest.py, 6 updates on one device): what ``lconv.load`` reads."""
    return tiny_run.workdir


@pytest.fixture(scope="module")
def lm():
    return Model(tiny_runs.in_memory(tiny_runs.lm_config()))


def _alone(model: Model, source: str, beam_size: int) -> str:
    """``source`` translated by itself, unpadded, straight through ``search.translate``."""
    ids_1S = np.append(model.tokenizer.encode(source), EOS_ID)[None].astype(np.int32)
    best_1L = search.translate(model.module, {"params": model.params}, ids_1S, beam_size=beam_size,
                               max_len=compiled.max_output_len(model.config, 32), lenpen=model.config.decode.lenpen,
                               max_len_a=model.config.decode.max_len_a, max_len_b=model.config.decode.max_len_b)
    return model.tokenizer.decode(np.asarray(best_1L)[0])


def test_three_lines_from_import_to_a_translation(workdir):
    model = lconv.load(str(workdir))
    translations = model.translate(SOURCES[:2] + [""], beam_size=2)
    assert translations[:2] == [_alone(model, s, beam_size=2) for s in SOURCES[:2]]
    assert translations[2] == ""  # a blank source is not decoded
    assert model.steps == [6] and model.task == "translation"  # the latest checkpoint


def test_score_is_sacrebleu_of_the_translations(workdir):
    model = lconv.load(str(workdir), checkpoint="latest", average_last=1)
    references = ["Ein kleines Werkzeug.", "Bibliothek für X.", "Schneller Editor."]
    scores = model.score(SOURCES, references, beam_size=2)
    expected = sacrebleu.corpus_bleu(model.translate(SOURCES, beam_size=2), [references])
    assert scores["bleu"] == pytest.approx(expected.score) and scores["bleu_signature"].startswith("nrefs:1")
    with pytest.raises(UserError) as error:
        model.score(SOURCES, references[:2])
    helpers.one_line_error(error, "3 sources", "2 references")


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


def test_lm_generation_of_ragged_prompts_equals_each_prompt_alone(lm):
    prompts = ["A small library for the window system", ""]  # ragged: 7 tokens and none (BOS alone)
    greedy = lm.generate(prompts, max_len=6)
    for prompt, text in zip(prompts, greedy):
        ids = lm.tokenizer.encode(prompt)
        alone = search.lm_generate(lm.module, {"params": lm.params}, jnp.asarray(ids)[None] if len(ids) else None,
                                   batch_size=1, max_len=6)
        assert text == lm.tokenizer.decode(np.asarray(alone)[0])
    # top_k=1 keeps only the argmax, so sampling it at any temperature is greedy decoding.
    assert lm.generate(prompts, max_len=6, temperature=1.0, top_k=1, seed=5) == greedy
    assert lm.generate(prompts[::-1], max_len=6, temperature=1.0, top_k=1, seed=6) == greedy[::-1]
    assert lm._generator.jitted._cache_size() == 2  # greedy, top-k sampling: the seed is an argument


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
    with pytest.raises(UserError) as error:
        lm.perplexity("one text")  # a corpus measure: a list, even of one
    helpers.one_line_error(error, "texts", "list of strings")
    for kwargs, named in [(dict(max_len=0), ["max_len=0"]),
                          (dict(temperature=-1.0), ["temperature=-1.0"]),
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
                        (lambda: model.score(["a"], [None]), "references[0]"),
                        (lambda: model.score("a", ["b"]), "sources")]:
        with pytest.raises(UserError) as error:
            call()
        helpers.one_line_error(error, named)
