"""Decoding lines of text, one output per line in order: the API's ``translate`` / ``generate`` and eval.py's files. A
translation's blank line is not decoded and gets an empty output (from EOS alone a model hallucinates); an LM's blank
prompt starts from BOS alone. Over-long inputs are cut by ``source_lengths``' rule."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lconv import console
from lconv.constants import PAD_ID
from lconv.data import pipeline
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import batching, compiled
from lconv.infer.infer_config import InferConfig
from lconv.infer.source_lengths import SOURCE_LIMIT, SourceLengths, measure_sources

if TYPE_CHECKING:
    import flax.linen as nn

    from lconv.data.tokenizer import Tokenizer


@dataclasses.dataclass
class LineOutputs:
    """One output per input line, in order, and what was not decoded as given."""

    hypotheses: list[str]  # one per input line, in order; "" for a blank source line
    blank: list[int]  # indices of the blank (empty or whitespace-only) source lines: not decoded ([] for prompts)
    lengths: SourceLengths  # of the decoded lines; its indices are line indices too
    nbest: list[list[dict[str, Any]]] | None = None  # with ``nbest``: per line, best first (``nbest_entries``)


def translate_lines(config: InferConfig, model: nn.Module, params: Any, tokenizer: Tokenizer, sources: Sequence[str],
                    settings: DecodeSettings, *, translator: compiled.Translator | None = None,
                    name: Callable[[int], str] = "sources[{}]".format, nbest: int = 0,
                    prefixes: Sequence[np.ndarray] | None = None, progress: str | None = None) -> LineOutputs:
    """Translates (or summarises) each line of ``sources`` by ``settings``; ``nbest``: also each line's hypotheses;
    ``prefixes``: each line's forced first ids; ``name(index)``: a line's name in warnings."""
    kept = [i for i, source in enumerate(sources) if source.strip()]
    blank = [i for i, source in enumerate(sources) if not source.strip()]
    limit = config.max_input_length
    measured = measure_sources(tokenizer, [sources[i] for i in kept], limit)
    lengths = SourceLengths([kept[i] for i in measured.truncated], measured.longest, limit, measured.cut_from)
    lengths.log(name, SOURCE_LIMIT)
    examples = [{"inputs": sources[i], "targets": ""} for i in kept]  # a list is a random-access source
    eval_set = pipeline.make_eval_set(examples, "inputs", "targets", tokenizer,
                                      {"inputs": limit, "targets": config.max_target_length},
                                      config.eval_batch_size)
    translator = translator or compiled.Translator(config, model, params)
    hypotheses = [""] * len(sources)
    lists = [[] for _ in sources] if nbest else None
    per_batch = None if prefixes is None else (lambda chosen: {"prefixes": [prefixes[kept[i]] for i in chosen]})
    bar = _bar(len(kept), progress)
    for batch, found in batching.decode_batches(config, model, params, eval_set, settings,
                                                translator=translator.hypotheses, per_batch=per_batch):
        for row, index in enumerate(batch["example_index"]):
            if index >= 0:
                hypotheses[kept[int(index)]] = tokenizer.detokenize(found.tokens[row, 0])
                if nbest:
                    lists[kept[int(index)]] = nbest_entries(tokenizer, found, row, nbest)
                bar.update(1)
    bar.close()
    return LineOutputs(hypotheses, blank, lengths, lists)


def _bar(total: int, progress: str | None) -> Any:
    """``console.pass_bar`` of ``total`` lines described by ``progress``; without one, none (the API's calls)."""
    from tqdm import tqdm

    return console.pass_bar(total, progress, "line") if progress else tqdm(disable=True)


def nbest_entries(tokenizer: Tokenizer, found: Any, row: int, count: int) -> list[dict[str, Any]]:
    """Row ``row``'s first ``count`` hypotheses of ``found``, best first, as dicts; empty slots left out."""
    entries = []
    for n in range(count):
        if not np.isfinite(found.scores[row, n]):
            break  # empty slots come last (-inf)
        tokens = found.tokens[row, n]
        length = int(np.sum(tokens != PAD_ID))  # PAD is never generated: the tokens up to EOS
        entries.append({"text": tokenizer.detokenize(tokens), "score": float(found.scores[row, n]),
                        "token_scores": found.token_scores[row, n, :length].tolist(),
                        "tokens": tokens[:length].tolist()})
    return entries


def generate_lines(config: InferConfig, tokenizer: Tokenizer, prompts: Sequence[str], generator: compiled.Generator,
                   settings: DecodeSettings, *, name: Callable[[int], str] = "prompts[{}]".format,
                   nbest: int = 0, progress: str | None = None) -> LineOutputs:
    """Continues each of ``prompts`` (an LM run) by up to ``settings.max_len`` tokens, greedy or sampled; a prompt over
    ``settings.prompt_limit`` keeps its last tokens."""
    limit = settings.prompt_limit(config.max_positions)
    encoded = tokenizer.encode_batch(list(prompts)) if prompts else []
    if limit == 0 and any(len(ids) for ids in encoded):  # every prompt would be dropped, not cut
        raise UserError(f"max_len={settings.max_len} new tokens leave no room for a prompt in the model's "
                        f"config.model.max_len={config.max_positions} positions (BOS included); ask for at most "
                        f"{settings.max_len - 1} to keep a prompt's last token, or give blank prompts")
    cut = [i for i, ids in enumerate(encoded) if len(ids) > limit]
    lengths = SourceLengths(cut, max((len(ids) for ids in encoded), default=0), limit, [len(encoded[i]) for i in cut])
    lengths.log(name, f"what config.model.max_len={config.max_positions} leaves beside max_len={settings.max_len} "
                "new ones and BOS", keeps="cut to the last")
    encoded = [ids[len(ids) - limit:] if len(ids) > limit else ids for ids in encoded]
    rows = compiled.decode_rows(config, compiled.platform_of(generator.params), config.eval_batch_size,
                                settings.beam_size if nbest else 1)
    rows = compiled.row_bucket(len(encoded), rows)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))

    def generate_batch(chosen: list[int], rows: int) -> np.ndarray:
        width = compiled.width_bucket(max(len(encoded[i]) for i in chosen), limit) or 1
        prompt_BP = compiled.pad_rows([encoded[i] for i in chosen], rows, width)  # PAD rows for a short last batch
        prompt_len_B = np.asarray([len(encoded[i]) for i in chosen] + [0] * (rows - len(chosen)), np.int32)
        if nbest:
            return generator.hypotheses(prompt_BP, prompt_len_B, settings)  # [rows, N, max_len]
        return generator(prompt_BP, prompt_len_B, settings)  # [rows, max_len]

    outputs = [""] * len(prompts)
    lists = [[] for _ in prompts] if nbest else None
    bar = _bar(len(prompts), progress)
    for chosen, found in batching.in_batches(order, rows, generate_batch):
        for row, i in enumerate(chosen):
            if nbest:
                lists[i] = nbest_entries(tokenizer, found, row, nbest)
                outputs[i] = lists[i][0]["text"] if lists[i] else ""
            else:
                outputs[i] = tokenizer.detokenize(found[row])
        bar.update(len(chosen))
    bar.close()
    return LineOutputs(outputs, [], lengths, lists)
