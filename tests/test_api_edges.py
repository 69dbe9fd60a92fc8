"""The API's small edges (issue 56): each bad argument is one line before any work, as eval.py's flags are."""
from __future__ import annotations

import helpers
import jax
import pytest
import tiny_runs

import lconv
from lconv.api import Model
from lconv.errors import UserError


@pytest.fixture(scope="module")
def mt():
    return Model(tiny_runs.in_memory(tiny_runs.translation_config()))


@pytest.fixture(scope="module")
def lm():
    return Model(tiny_runs.in_memory(tiny_runs.lm_config()))


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


def test_a_device_listed_twice_is_one_line_not_a_storage_failure(tiny_run):
    """It was reported as a storage failure with ~1,150 lines of orbax noise."""
    device = jax.devices("cpu")[0]
    with pytest.raises(UserError) as error:
        lconv.load(str(tiny_run.workdir), devices=[device, device])
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
