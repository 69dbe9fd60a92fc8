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
