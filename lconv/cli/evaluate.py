"""``eval.py``: a trained workdir, scored on a split of its dataset or run over a text file."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from lconv.data import pipeline
from lconv.errors import UserError
from lconv.infer import evaluate
from lconv.train import setup, steps


def run(workdir: str, *, split: str = "test", average_last: int = 1, checkpoint: str = "latest",
        beam_size: int | None = None, lenpen: float | None = None, source_file: str | None = None,
        reference_file: str | None = None, output_file: str | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Scores ``split`` of the run's dataset (BLEU / ROUGE, or perplexity for an LM), or translates/summarises
    ``source_file`` line by line (scored when ``reference_file`` is given). Params only are restored."""
    def override(config):
        if beam_size is not None:
            config.decode.beam_size = beam_size
        if lenpen is not None:
            config.decode.lenpen = lenpen
        if config.task == "lm" and source_file is not None:
            raise UserError("--source_file is for translation/summarization runs; an lm run is scored by perplexity")

    trained = setup.load_trained(workdir, average_last=average_last, checkpoint=checkpoint, overrides=override)
    config, model, params, tokenizer = trained.config, trained.model, trained.params, trained.tokenizer
    log(f"checkpoint(s) {trained.steps}")
    if source_file is None:
        config.data.eval_splits = (split,)
        data = pipeline.make_datasets(config.data, tokenizer)
        if config.task == "lm":
            return steps.score_perplexity(config, model, params, data.eval_sets[split], workdir, split, log)
        return evaluate.score_split(config, model, params, tokenizer, data.eval_sets, workdir, split=split, log=log)
    sources = _read_lines(source_file)
    references = _read_lines(reference_file) if reference_file else None
    if references is not None and len(references) != len(sources):
        raise UserError(f"--reference_file has {len(references)} lines for {len(sources)} source lines")
    hypotheses = evaluate.translate_lines(config, model, params, tokenizer, sources)
    with open(output_file or os.path.join(workdir, "output.txt"), "w", encoding="utf-8") as f:
        f.writelines(h.replace("\n", " ") + "\n" for h in hypotheses)
    scores = {"examples": len(hypotheses)}
    if references is not None:
        scores.update(evaluate.score_texts(config.task, hypotheses, references))
        log(json.dumps({k: v for k, v in scores.items() if k != "bleu_text"}))
    return scores


def _read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]
