"""How ``fairseq-eval-lm`` cuts texts into the rows it scores, so that ``Model.perplexity`` scores a language model on
exactly fairseq's rows (``--sample-break-mode``, ``--tokens-per-sample``, ``--context-window``).

The texts, each ending in EOS, form one stream that fairseq's ``TokenBlockDataset`` cuts into blocks (``eos``: one per
text, ``none``: every ``tokens_per_sample`` tokens, ``complete``: whole texts packed); with ``context_window = c`` each
row is preceded by the last ``c`` inputs of the row before, unscored. docs/fairseq.md, "Language models".
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lconv.errors import UserError

SAMPLE_BREAK_MODES = ("eos", "none", "complete")


@dataclasses.dataclass(frozen=True)
class Row:
    inputs: np.ndarray  # [T] the decoder's inputs
    targets: np.ndarray  # [T] the next token of each input
    first_scored: int  # inputs before it are context: their predictions are not counted


def check_settings(sample_break_mode: str, tokens_per_sample: int, context_window: int, max_positions: int) -> None:
    """One-line errors naming the argument: a mode fairseq has, blocks of a token or more that fit the positions."""
    if sample_break_mode not in SAMPLE_BREAK_MODES:
        raise UserError(f"sample_break_mode={sample_break_mode!r}: must be one of {', '.join(SAMPLE_BREAK_MODES)}")
    if not (isinstance(context_window, int) and context_window >= 0):
        raise UserError(f"context_window={context_window!r}: must be an integer >= 0")
    if not (isinstance(tokens_per_sample, int) and tokens_per_sample > context_window):
        raise UserError(f"tokens_per_sample={tokens_per_sample!r}: must be an integer > context_window="
                        f"{context_window} (fairseq's blocks hold tokens_per_sample - context_window tokens)")
    if tokens_per_sample > max_positions:
        raise UserError(f"tokens_per_sample={tokens_per_sample}: rows that long do not fit the model's "
                        f"config.model.max_len={max_positions} positions")


def fairseq_rows(texts: Sequence[np.ndarray], *, sample_break_mode: str, tokens_per_sample: int,
                 context_window: int, start_id: int, eos_id: int) -> list[Row]:
    """The rows fairseq-eval-lm scores for ``texts`` (token ids without EOS), in its order."""
    pieces = [np.append(np.asarray(ids, np.int64), eos_id) for ids in texts]
    stream = np.concatenate(pieces) if pieces else np.zeros((0,), np.int64)
    block = tokens_per_sample - context_window
    if sample_break_mode == "eos":
        spans = _text_spans(pieces)
        too_long = [i for i, p in enumerate(pieces) if len(p) + context_window > tokens_per_sample]
        if too_long:  # fairseq-eval-lm skips them (longer than the model's positions): say so instead
            raise UserError(f"texts[{too_long[0]}] has {len(pieces[too_long[0]])} tokens with EOS: more than "
                            f"tokens_per_sample={tokens_per_sample} - context_window={context_window}")
    elif sample_break_mode == "none":
        spans = [(s, min(s + block, len(stream))) for s in range(0, len(stream), block)]
    else:
        spans = _complete_spans([len(p) for p in pieces], block)
    starts_text = set(np.cumsum([0] + [len(p) for p in pieces])[:-1].tolist())
    rows, context = [], np.zeros((0,), np.int64)
    for start, end in spans:
        before = start_id if start in starts_text else stream[start - 1]
        source = np.concatenate([[before], stream[start:end - 1]]).astype(np.int64)
        rows.append(Row(np.concatenate([context, source]), np.concatenate([context, stream[start:end]]),
                        len(context)))
        if context_window:
            context = rows[-1].inputs[-context_window:]
    return rows


def _text_spans(pieces: list[np.ndarray]) -> list[tuple[int, int]]:
    ends = np.cumsum([len(p) for p in pieces]).tolist()
    return list(zip([0] + ends[:-1], ends))


def _complete_spans(lengths: list[int], block: int) -> list[tuple[int, int]]:
    """fairseq's ``complete`` mode: texts added to the current block while they fit (a block takes at least one)."""
    spans, start, size = [], 0, 0
    for length in lengths:
        if size and size + length > block:
            spans.append((start, start + size))
            start, size = start + size, 0
        size += length
    if size:
        spans.append((start, start + size))
    return spans
