"""Document streams for language models that carry state across steps (a stateful mixer's: ``lconv.nn.mixer_state``).

A row of a stream batch reads whole documents one after another, a window of ``window`` tokens per step, so state
threaded from step to step sees each document in order; ``get_state`` / ``set_state`` resume exactly. A window never
holds two documents (``document_start[r] = 1`` on a document's first). The rules: docs/data.md.
"""
from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from lconv.constants import EOS_ID
from lconv.errors import UserError


class DocumentStream:
    """Iterator of stream batches (docs/data.md) with grain-style ``get_state`` / ``set_state``."""

    def __init__(self, source, text_key: str, tokenizer, *, window: int, rows: int, seed: int = 0,
                 num_epochs: int | None = None, shuffle: bool = True, process_index: int = 0,
                 process_count: int = 1, with_weights: bool = False,
                 token_cache: dict[int, np.ndarray] | None = None):
        if window < 2 or rows < 1:
            raise UserError(f"a document stream needs window >= 2 and rows >= 1; got window={window}, rows={rows}")
        self.source, self.text_key, self.tokenizer = source, text_key, tokenizer
        self.window, self.rows, self.seed, self.num_epochs, self.shuffle = window, rows, seed, num_epochs, shuffle
        self.with_weights = with_weights
        self.token_cache = token_cache  # source index -> ids + EOS, kept across passes (evaluation) when given
        self.shard = np.arange(process_index, len(source), process_count)  # source indices of this process
        if not len(self.shard):
            raise UserError(f"the document stream of process {process_index} has no documents "
                             f"({len(source)} in the source, {process_count} processes)")
        self.stats = collections.Counter()
        self._tokens: dict[int, np.ndarray] = {}  # row -> the ids of its current document (+ EOS)
        self.set_state({"epoch": 0, "next": 0, "rows": [[-1, 0]] * rows})

    # ---- state ---------------------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """Where every row is: ``rows[r] = [source index of its document (-1 none), next token offset]``."""
        return {"epoch": self._epoch, "next": self._next, "rows": [list(r) for r in self._rows]}

    def set_state(self, state: Mapping[str, Any]) -> None:
        rows = [[int(d), int(o)] for d, o in state["rows"]]
        if len(rows) != self.rows:
            raise UserError(f"stream state has {len(rows)} rows but this stream has {self.rows}; "
                             "data.batch_size (and the process count) must match the checkpoint's")
        self._epoch, self._next, self._rows = int(state["epoch"]), int(state["next"]), rows
        self._order = self._epoch_order(self._epoch)
        self._tokens = {r: self._encode(d) for r, (d, _) in enumerate(rows) if d >= 0}

    # ---- iteration -----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        L, B = self.window, self.rows
        targets = np.zeros((B, L), np.int32)  # PAD_ID = 0
        starts = np.zeros((B,), np.int32)
        lengths = np.zeros((B,), np.int32)
        for r in range(B):
            doc, offset = self._rows[r]
            if doc < 0 or offset >= len(self._tokens[r]):  # finished (or never started): take the next document
                doc, offset = self._take_document(r)
                starts[r] = doc >= 0
            if doc < 0:  # the stream is exhausted for this row
                continue
            piece = self._tokens[r][offset:offset + L]
            targets[r, :len(piece)], lengths[r] = piece, len(piece)
            self._rows[r] = [doc, offset + len(piece)]
        if self.num_epochs is not None and not lengths.any():
            raise StopIteration
        inside_BL = np.arange(L)[None, :] < lengths[:, None]
        self.stats["stream_windows"] += int((lengths > 0).sum())
        self.stats["stream_padding_tokens"] += int((~inside_BL[lengths > 0]).sum())
        batch = {"targets": targets, "targets_segmentation": inside_BL.astype(np.int32),
                 "targets_position": np.where(inside_BL, np.arange(L)[None, :], 0).astype(np.int32),
                 "document_start": starts}
        if self.with_weights:
            batch["example_weight"] = (lengths > 0).astype(np.float32)
        return batch

    # ---- helpers -------------------------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.shard
        return np.random.default_rng([self.seed, epoch]).permutation(self.shard)

    def _take_document(self, row: int) -> tuple[int, int]:
        """Gives ``row`` the next non-empty document of the order: ``(source index, 0)``, or ``(-1, 0)`` at the end."""
        while True:
            if self._next >= len(self._order):
                if self.num_epochs is not None and self._epoch + 1 >= self.num_epochs:
                    self._rows[row] = [-1, 0]
                    return -1, 0
                self._epoch, self._next = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
            doc = int(self._order[self._next])
            self._next += 1
            tokens = self._encode(doc)
            if len(tokens) > 1:  # more than the EOS
                self._tokens[row], self._rows[row] = tokens, [doc, 0]
                self.stats["stream_documents"] += 1
                return doc, 0
            self.stats["stream_empty_documents"] += 1

    def _encode(self, doc: int) -> np.ndarray:
        if self.token_cache is not None and doc in self.token_cache:
            return self.token_cache[doc]
        text = self.source[doc][self.text_key]
        text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        ids = np.concatenate([np.asarray(self.tokenizer.encode(text), np.int32), [EOS_ID]]).astype(np.int32)
        if self.token_cache is not None:
            self.token_cache[doc] = ids
        return ids


class StreamEvalSet:
    """An evaluation split as a document stream in source order (every token once), tokenised once."""

    def __init__(self, source, text_key, tokenizer, *, window, rows, process_index=0, process_count=1):
        token_cache: dict[int, np.ndarray] = {}
        self._make = lambda: DocumentStream(source, text_key, tokenizer, window=window, rows=rows, num_epochs=1,
                                            shuffle=False, process_index=process_index,
                                            process_count=process_count, with_weights=True,
                                            token_cache=token_cache)
        self.batch_size, self.lengths = rows, {"targets": window}
        counting = self._make()
        self.num_batches = sum(1 for _ in counting)
        self.stats = counting.stats
        self.examples = None  # a stream has no per-example decode; it is scored by perplexity

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        stream = self._make()
        for _ in range(self.num_batches):
            # Past this process's last window (another process has more): all-padding rows, for lockstep.
            yield next(stream, None) or self._padding()

    def _padding(self) -> dict[str, np.ndarray]:
        B, L = self.batch_size, self.lengths["targets"]
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return {"targets": zeros(B, L), "targets_segmentation": zeros(B, L), "targets_position": zeros(B, L),
                "document_start": zeros(B), "example_weight": np.zeros((B,), np.float32)}

    def __len__(self) -> int:
        return self.num_batches

