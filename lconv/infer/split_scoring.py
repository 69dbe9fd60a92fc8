"""Decoding a prepared eval split and scoring it: the end of training and ``eval.py --split``.

With several processes each holds a shard of the split; they decode the whole split together
(``shards.whole_split``), so every process gets every hypothesis and the same scores, and process 0 writes them.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lconv import console
from lconv.data import pipeline
from lconv.deadline import Deadline
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import batching, compiled, reports, scoring, shards
from lconv.infer.infer_config import InferConfig
from lconv.infer.source_lengths import SOURCE_LIMIT, measure_sources

if TYPE_CHECKING:
    import flax.linen as nn

    from lconv.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def score_split(config: InferConfig, model: nn.Module, params: Any, tokenizer: Tokenizer,
                eval_sets: Mapping[str, pipeline.EvalSet], workdir: str, settings: DecodeSettings, *,
                split: str | None = None, translator: compiled.Translator | None = None,
                deadline: Deadline | None = None, output_name: str | None = None,
                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Decodes ``split`` of the eval sets, writes ``<workdir>/<split>.hyp.txt`` and ``<split>.scores.json``
    (``output_name`` in place of ``<split>``; ``extra`` added to the scores), with a progress bar.

    A collective: every process calls it. ``settings``: the search's; ``translator``: one whose programs to reuse.
    ``deadline``: decoding stops once it has passed (a time budget), and the scores cover the examples decoded
    by then (``undecoded`` counts the rest; a warning says so)."""
    split = split or config.split
    if split not in eval_sets:
        raise UserError(f"split {split!r} is not prepared; available: {sorted(eval_sets)}")
    eval_set = shards.whole_split(eval_sets[split], config.eval_batch_size)
    start = time.time()
    hypotheses = _decode(config, model, params, tokenizer, eval_set, settings, split, translator, deadline)
    seconds = time.time() - start
    order = sorted(hypotheses)
    hyps = [hypotheses[i] for i in order]
    refs = [eval_set.examples[i]["targets"] for i in order]
    sources = [eval_set.examples[i]["inputs"] for i in order]
    lengths = measure_sources(tokenizer, sources, eval_set.lengths["inputs"])
    scores = scoring.score_texts(config.task, hyps, refs, split_compounds=config.compound_split)
    scores.update(split=split, examples=len(hyps), decode_seconds=seconds,
                  sentences_per_s=len(hyps) / max(seconds, 1e-9), beam_size=settings.beam_size,
                  **lengths.counts())
    if len(hyps) < len(eval_set.tokens):
        scores["undecoded"] = len(eval_set.tokens) - len(hyps)
    scores.update(extra or {})
    reports.write_outputs(workdir, output_name or split, hyps, scores)
    lengths.log(lambda i: f"{split}[{order[i]}]", SOURCE_LIMIT)
    logger.info(reports.format_report(scores, sources, refs, hyps, config.num_print))
    return scores


def _decode(config: InferConfig, model: nn.Module, params: Any, tokenizer: Tokenizer, eval_set: pipeline.EvalSet,
            settings: DecodeSettings, split: str, translator: compiled.Translator | None,
            deadline: Deadline | None) -> dict[int, str]:
    """{example index: its hypothesis} of ``eval_set``, every one unless ``deadline`` stops the pass, with a
    progress bar and its ETA in sentences (``console.pass_bar``: on a terminal only)."""
    hypotheses = {}
    bar = console.pass_bar(len(eval_set.tokens), f"decoding {split}", "sentence")
    try:
        for batch, tokens in batching.decode_batches(config, model, params, eval_set, settings,
                                                     translator=translator):
            for row, index in enumerate(batch["example_index"]):
                if index >= 0:
                    hypotheses[int(index)] = tokenizer.detokenize(tokens[row])
                    bar.update(1)
            if deadline and deadline.passed() and len(hypotheses) < len(eval_set.tokens):
                logger.warning(f"{deadline.name} ran out: {split} decoding stopped after {len(hypotheses)} of "
                               f"{len(eval_set.tokens)} examples (the shortest sources); its scores cover those "
                               f"only, and eval.py --split={split} scores them all")
                break
    finally:
        bar.close()
    return hypotheses
