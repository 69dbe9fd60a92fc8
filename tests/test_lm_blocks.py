"""fairseq-eval-lm's rows (``lconv.infer.lm_blocks``), written out by hand from fairseq 0.12.2's
``TokenBlockDataset`` (include_targets) and ``LMContextWindowDataset`` for a three-text stream."""
from __future__ import annotations

import numpy as np
import pytest

from lconv.errors import UserError
from lconv.infer import lm_blocks

EOS, START = 1, 3  # an lconv-native model: BOS starts each text, so a text start shows apart from an EOS before it
TEXTS = [np.array([5, 6, 7]), np.array([8]), np.array([9, 10])]  # stream: 5 6 7 1 | 8 1 | 9 10 1


def _rows(**settings):
    rows = lm_blocks.fairseq_rows(TEXTS, start_id=START, eos_id=EOS, **settings)
    return [(r.inputs.tolist(), r.targets[r.first_scored:].tolist(), r.first_scored) for r in rows]


def test_blocks_of_the_stream_cross_texts():
    assert _rows(sample_break_mode="none", tokens_per_sample=4, context_window=0) == [
        ([3, 5, 6, 7], [5, 6, 7, 1], 0),
        ([3, 8, 1, 9], [8, 1, 9, 10], 0),  # starts a text: the decoder start, not the EOS before it
        ([10], [1], 0)]  # mid-text: the token before the block


def test_complete_blocks_pack_whole_texts_and_eos_blocks_are_texts():
    assert _rows(sample_break_mode="complete", tokens_per_sample=6, context_window=0) == [
        ([3, 5, 6, 7, 1, 8], [5, 6, 7, 1, 8, 1], 0), ([3, 9, 10], [9, 10, 1], 0)]
    assert _rows(sample_break_mode="eos", tokens_per_sample=6, context_window=0) == [
        ([3, 5, 6, 7], [5, 6, 7, 1], 0), ([3, 8], [8, 1], 0), ([3, 9, 10], [9, 10, 1], 0)]


def test_a_context_window_prepends_the_previous_rows_last_inputs_unscored():
    # blocks of 4 - 2 = 2 tokens; each row reads the 2 inputs before it (its own context included)
    assert _rows(sample_break_mode="none", tokens_per_sample=4, context_window=2) == [
        ([3, 5], [5, 6], 0),
        ([3, 5, 6, 7], [7, 1], 2),
        ([6, 7, 3, 8], [8, 1], 2),
        ([3, 8, 3, 9], [9, 10], 2),
        ([3, 9, 10], [1], 2)]


def test_settings_fairseq_would_not_run_are_one_line_errors():
    with pytest.raises(UserError, match="sample_break_mode='complete_doc': must be one of eos, none, complete"):
        lm_blocks.check_settings("complete_doc", 8, 0, 16)
    with pytest.raises(UserError, match="tokens_per_sample=4: must be an integer > context_window=4"):
        lm_blocks.check_settings("none", 4, 4, 16)
    with pytest.raises(UserError, match="do not fit the model's config.model.max_len=16"):
        lm_blocks.check_settings("none", 32, 0, 16)
    with pytest.raises(UserError, match=r"texts\[0\] has 4 tokens with EOS"):
        lm_blocks.fairseq_rows(TEXTS, sample_break_mode="eos", tokens_per_sample=3, context_window=0, start_id=START,
                               eos_id=EOS)
