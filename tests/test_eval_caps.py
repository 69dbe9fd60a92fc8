"""Evaluation caps (``config.data.max_validation_examples`` / ``max_test_examples``): each evaluation split holds its
first N examples (in the split's order, on every process), the validation and the other splits separately, for
padded sets and document streams alike, and the log says which split is capped and by how much."""
from __future__ import annotations

import numpy as np
import pytest

from lconv.data import pipeline, sources
from lconv.data.data_config import DataConfig
from lconv.errors import UserError


class Words:
    """"w17 w3" -> [17, 3]: every example's ids are known to the test."""

    vocab_size = 64

    def encode(self, text):
        return np.asarray([int(w[1:]) for w in text.split()], np.int32)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


def _split(name: str, count: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(len(name))
    return [{"en": f"w{4 + i % 50} w{int(rng.integers(4, 64))}", "de": f"w{4 + i % 50}", "text": f"w{4 + i % 50} w5"}
            for i in range(count)]


@pytest.fixture
def splits(monkeypatch):
    """A dataset of 40 training, 30 validation and 25 test examples, held in memory."""
    data = {"train": _split("train", 40), "validation": _split("validation", 30), "test": _split("test", 25)}

    def get_source(name, split, *args, **kwargs):
        spec = sources.dataset_spec(name)
        return data[split], spec.input_key, spec.target_key

    monkeypatch.setattr(sources, "get_source", get_source)
    monkeypatch.setattr(sources, "source_report", lambda *args, **kwargs: {})
    return data


def _config(**fields):
    return {**dict(dataset="ddtp/en_de", batch_size=4, eval_batch_size=4, max_input_length=8, max_target_length=8,
                   read_threads=1), **fields}


def test_each_split_holds_its_first_examples_up_to_its_own_cap(splits, lconv_log):
    data = pipeline.make_datasets(_config(max_validation_examples=7, max_test_examples=12), Words(),
                                  process_index=0, process_count=1)
    validation, test = data.eval_sets["validation"], data.eval_sets["test"]
    assert [e["inputs"] for e in validation.examples] == [e["en"] for e in splits["validation"][:7]]
    assert [e["targets"] for e in test.examples] == [e["de"] for e in splits["test"][:12]]
    assert (len(validation), len(test)) == (2, 3)  # batches of 4 rows: ceil(7 / 4), ceil(12 / 4)
    assert validation.stats["eval_examples"] == 7 and sum(1 for _ in test) == 3
    log = "\n".join(lconv_log())
    assert "the validation split is capped at its first 7 of 30 examples (23 left out; " \
           "config.data.max_validation_examples=7)" in log
    assert "the test split is capped at its first 12 of 25 examples (13 left out; config.data.max_test_examples=12)" \
           in log


def test_no_cap_or_a_cap_past_the_split_keeps_every_example_and_logs_nothing(splits, lconv_log):
    for caps in ({}, dict(max_validation_examples=30, max_test_examples=1000)):
        data = pipeline.make_datasets(_config(**caps), Words(), process_index=0, process_count=1)
        assert [e["inputs"] for e in data.eval_sets["validation"].examples] == [e["en"] for e in splits["validation"]]
        assert len(data.eval_sets["test"].examples) == 25
    assert not [line for line in lconv_log() if "capped" in line]


def test_processes_share_the_capped_examples_between_them(splits):
    shards = [pipeline.make_datasets(_config(max_test_examples=9), Words(), process_index=p, process_count=2)
              .eval_sets["test"] for p in (0, 1)]
    assert sorted(e["targets"] for s in shards for e in s.examples) == sorted(e["de"] for e in splits["test"][:9])
    assert len(shards[0]) == len(shards[1]) == 3  # ceil(ceil(9 / 2) / 2 rows each): the steps stay in lockstep


def test_a_document_stream_reads_its_first_documents(splits, lconv_log):
    config = _config(dataset="ddtp/lm_en", stream=True, max_validation_examples=5, eval_batch_size=2)
    data = pipeline.make_datasets(config, Words(), process_index=0, process_count=1)
    tokens = [t for batch in data.eval_sets["validation"] for t in batch["targets"][batch["targets"] > 0].tolist()]
    expected = [t for doc in splits["validation"][:5] for t in [*Words().encode(doc["text"]).tolist(), 1]]
    assert sorted(tokens) == sorted(expected)  # every token of the first 5 documents, once, and no other
    assert any("the validation split is capped at its first 5 of 30 examples" in line for line in lconv_log())


@pytest.mark.parametrize("field,value", [("max_validation_examples", -1), ("max_test_examples", 2.5),
                                         ("max_test_examples", "10")])
def test_a_bad_cap_is_a_one_line_error(field, value):
    with pytest.raises(UserError, match=rf"^config.data.{field}={value!r}: must be an integer >= 0 \(0 = the whole "
                                        r"split\)$"):
        DataConfig.from_config({field: value})
