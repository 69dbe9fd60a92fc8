"""Decoding an eval set in batches: the plan (order, rows, widths) and the out-of-memory fallback.

Examples are decoded shortest source first, each batch cut to the narrowest width bucket
(``compiled.WIDTHS``) that holds it, so a batch of short sentences neither reads nor searches over padding and
its beams finish together. With several processes every one holds the whole split (``shards.whole_split``), builds
the same plan and runs the same programs; each batch is one global array split over the mesh's batch axes.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from lconv.data import pipeline
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled
from lconv.infer.infer_config import InferConfig

if TYPE_CHECKING:
    import flax.linen as nn

logger = logging.getLogger(__name__)


def decode_batches(config: InferConfig, model: nn.Module, params: Any, eval_set: pipeline.EvalSet,
                   settings: DecodeSettings, *, translator: Callable[..., Any] | None = None,
                   per_batch: Callable[[list[int]], dict[str, Any]] | None = None
                   ) -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    """``(batch, translator(batch's sources, settings))`` over every example of ``eval_set``, in ``plan``'s order.

    ``translator``: a ``compiled.Translator`` (or its ``hypotheses``) whose programs to reuse; ``per_batch(chosen)``:
    more arguments for the batch of those example indices (their ``prefixes``). Padding rows have
    ``example_index < 0``. A ``compiled.Translator`` compiles the later widths in the background while the first
    batches decode; a batch that runs out of device memory is decoded again in halves (``in_batches``).
    """
    translator = translator or compiled.Translator(config, model, params)
    rows, order = plan(config, params, eval_set, settings.beam_size)
    prepare = getattr(translator, "prepare", None)  # a compiled.Translator's; not a plain function's
    if prepare is not None and per_batch is None:
        widths = batches_of(eval_set, order, rows)[1]
        for width in dict.fromkeys(widths):
            if width != widths[0]:  # the first width compiles as its batches decode
                prepare(rows, width, settings)

    def translate_batch(chosen: list[int], rows: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        batch, width = padded_batch(eval_set, chosen, rows)
        more = per_batch(chosen) if per_batch else {}
        return batch, translator(batch["inputs"][:, :width], settings, **more)  # [rows, L]

    for _, decoded in in_batches(order, rows, translate_batch):
        yield decoded


def plan(config: InferConfig, params: Any, eval_set: pipeline.EvalSet, beam_size: int) -> tuple[int, list[int]]:
    """``(rows per batch, the examples' order)``: ``compiled.decode_rows`` rows (fewer when the set is smaller than
    a batch), shortest sources first."""
    rows = compiled.decode_rows(config, compiled.platform_of(params), eval_set.batch_size, beam_size)
    rows = compiled.row_bucket(len(eval_set.tokens), rows)
    return rows, sorted(range(len(eval_set.tokens)), key=lambda i: len(eval_set.tokens[i]["inputs"]))


def padded_batch(eval_set: pipeline.EvalSet, chosen: list[int], rows: int) -> tuple[dict[str, np.ndarray], int]:
    """The ``chosen`` examples padded to ``rows`` rows, and the width bucket their sources are cut to."""
    return pipeline.pad_batch([eval_set.tokens[i] for i in chosen], chosen, rows, eval_set.lengths), _width(
        eval_set, chosen)


def _width(eval_set: pipeline.EvalSet, chosen: list[int]) -> int:
    longest = max([len(eval_set.tokens[i]["inputs"]) for i in chosen] + [1])
    return compiled.width_bucket(longest, eval_set.lengths["inputs"])


def batches_of(eval_set: pipeline.EvalSet, order: list[int], rows: int) -> tuple[list[list[int]], list[int]]:
    """``decode_batches``' batches (runs of ``rows`` examples of ``order``) and each one's width bucket."""
    batches = [order[start:start + rows] for start in range(0, len(order), rows)]
    return batches, [_width(eval_set, chosen) for chosen in batches]


def in_batches(order: Sequence[int], rows: int,
               decode: Callable[[list[int], int], Any]) -> Iterator[tuple[list[int], Any]]:
    """``(chosen, decode(chosen, rows))`` for consecutive runs of ``rows`` indices of ``order``.

    A batch that runs the device out of memory is decoded again as batches of half the rows (logged), down to one
    row; with several processes, which must all run the same batches, that is a one-line error instead."""
    start = 0
    while start < len(order):
        chosen = list(order[start:start + rows])
        try:
            decoded = decode(chosen, rows)
        except jax.errors.JaxRuntimeError as error:
            if not compiled.is_out_of_memory(error):
                raise
            if rows == 1 or jax.process_count() > 1:
                raise UserError(f"decoding {rows} rows per batch ran out of device memory; set "
                                f"config.decode.batch_size lower (0 = auto) or shorten the inputs") from None
            logger.info(f"decoding {rows} rows per batch ran out of device memory: going on with {rows // 2} "
                        f"(config.decode.batch_size sets it)")
            rows //= 2
            continue
        yield chosen, decoded
        start += len(chosen)
