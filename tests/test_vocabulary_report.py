"""The vocabulary actually used is reported when it is not the one asked: a small training text gives SentencePiece
fewer pieces than ``config.data.vocab_size``, and the run says so in one warning line (issue 57: 4,000 asked, 395
given, and the log did not say)."""
from __future__ import annotations

import pytest
from test_eval_caps import _config, splits  # noqa: F401 (the in-memory dataset fixture)

from lconv.data import pipeline
from lconv.data import tokenizer as tokenizer_lib

TEXTS = [f"the {w} tool converts {w} files and images" for w in ("small", "fast", "big", "old", "new", "odd")] * 5


@pytest.fixture(scope="module")
def small_tokenizer():
    """A tokenizer trained, as a run trains it, on a text far too small for the 4,000 pieces asked."""
    return tokenizer_lib.train_tokenizer(TEXTS, 4000, max_sentences=1000, num_threads=1)


def test_a_vocabulary_smaller_than_asked_is_one_warning_line(splits, small_tokenizer, lconv_log):  # noqa: F811
    used = small_tokenizer.vocab_size
    assert tokenizer_lib.MIN_VOCAB_SIZE <= used < 4000 and small_tokenizer.requested_vocab_size == 4000
    pipeline.make_datasets(_config(vocab_size=4000), small_tokenizer, process_index=0, process_count=1)
    lines = [line for line in lconv_log() if "vocabulary" in line]
    assert lines == [f"warning: vocabulary: {used:,} pieces, not the 4,000 config.data.vocab_size asks for (the "
                     f"training text is too small for more); the model is built for {used:,}"]


def test_the_vocabulary_asked_and_given_says_nothing(splits, small_tokenizer, lconv_log):  # noqa: F811
    pipeline.make_datasets(_config(vocab_size=small_tokenizer.vocab_size), small_tokenizer, process_index=0,
                           process_count=1)
    assert not [line for line in lconv_log() if "vocabulary" in line]
