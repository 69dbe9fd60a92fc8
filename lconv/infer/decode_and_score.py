"""Evaluation: decode a split (or any text file), detokenise, score with sacreBLEU / ROUGE, write the outputs.

With several processes (a pod) each holds a shard of an eval split. ``score_split`` gathers the shards, so every
process builds the same batches of the whole split and runs the same programs (each batch's rows split over the
mesh), every process gets every hypothesis and the same scores, and process 0 writes them.

Nothing is changed silently: sources longer than ``config.data.eval_max_input_length`` tokens are cut to it with a
warning naming each and its length (``SourceLengths.warning``, the rule every surface follows) and counted
(``truncated_sources``, ``longest_source_tokens``, ``source_token_limit`` in the scores); blank lines of a text
file are not decoded, get empty outputs in their place and are counted by the caller.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from etils import epath

from lconv import outputs
from lconv.constants import PAD_ID
from lconv.data import pipeline
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled, scoring

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import flax.linen as nn

    from lconv.data.tokenizer import Tokenizer


def decode_batches(config: Any, model: nn.Module, params: Any, eval_set: pipeline.EvalSet,
                   settings: DecodeSettings, *, translator: Callable[..., Any] | None = None,
                   per_batch: Callable[[list[int]], dict[str, Any]] | None = None
                   ) -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    """``(batch, translator(batch's sources, settings))`` over every example of ``eval_set`` (a
    ``compiled.Translator``'s best-beam ids ``[B, L]``, or its ``hypotheses``), the whole split (``whole_split``),
    ``compiled.decode_rows`` rows per batch (``config.decode.batch_size``; auto: the eval batch on CPU, wider on an
    accelerator; padding rows included, the caller drops rows with ``example_index < 0``); fewer rows
    (``compiled.row_bucket``) when the whole set is smaller than one batch.

    Examples are decoded in order of source length, each batch cut to the shortest width in ``compiled.WIDTHS``
    that holds it: a batch of short sentences neither encodes nor attends over 256 padding positions, and its beam
    search stops early together. That is a handful of compiled shapes, each compiled once per ``translator`` (pass
    one to reuse its programs across calls; ``settings``: the search's, built by the caller; ``per_batch(examples)``:
    more arguments for the batch of those example indices, such as their ``prefixes``). A ``compiled.Translator``
    compiles the later widths' programs in the background (``prepare``) while the first batches decode.

    A batch that runs the device out of memory is decoded again in halves (``in_batches``).

    With several processes every one of them holds the whole split, so all build the same plan (order, batches,
    widths) and run the same programs in step. Each batch is one global array whose rows are split over the batch
    axes of the mesh ``params`` live on, and the best beams come back whole to every process.
    """
    translator = translator or compiled.Translator(config, model, params)
    rows, order = _decode_plan(config, params, eval_set, settings.beam_size)
    prepare = getattr(translator, "prepare", None)  # a compiled.Translator's; not a plain function's
    if prepare is not None and per_batch is None:  # the later widths compile while the first ones decode
        widths = _plan_batches(eval_set, order, rows)[1]
        for width in dict.fromkeys(widths):
            if width != widths[0]:  # the first width compiles as its batches decode
                prepare(rows, width, settings)

    def translate_batch(chosen: list[int], rows: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        batch, width = _padded_batch(eval_set, chosen, rows)
        more = per_batch(chosen) if per_batch else {}
        return batch, translator(batch["inputs"][:, :width], settings, **more)  # [rows, L]

    for _, decoded in in_batches(order, rows, translate_batch):
        yield decoded


def _decode_plan(config: Any, params: Any, eval_set: pipeline.EvalSet, beam_size: int) -> tuple[int, list[int]]:
    """``(rows per batch, the examples' order)`` of ``decode_batches``: shortest sources first."""
    rows = compiled.decode_rows(config, compiled.platform_of(params), eval_set.batch_size, beam_size)
    rows = compiled.row_bucket(len(eval_set.tokens), rows)
    return rows, sorted(range(len(eval_set.tokens)), key=lambda i: len(eval_set.tokens[i]["inputs"]))


def _padded_batch(eval_set: pipeline.EvalSet, chosen: list[int], rows: int) -> tuple[dict[str, np.ndarray], int]:
    """The ``chosen`` examples padded to ``rows`` rows, and the width bucket their sources are cut to."""
    return pipeline.pad_batch([eval_set.tokens[i] for i in chosen], chosen, rows, eval_set.lengths), _width(
        eval_set, chosen)


def _width(eval_set: pipeline.EvalSet, chosen: list[int]) -> int:
    """The width bucket the ``chosen`` examples' sources are cut to (within the padded width)."""
    longest = max([len(eval_set.tokens[i]["inputs"]) for i in chosen] + [1])
    return compiled.width_bucket(longest, eval_set.lengths["inputs"])


def _plan_batches(eval_set: pipeline.EvalSet, order: list[int], rows: int) -> tuple[list[list[int]], list[int]]:
    """``decode_batches``' batches (runs of ``rows`` examples of ``order``) and each one's width bucket."""
    batches = [order[start:start + rows] for start in range(0, len(order), rows)]
    return batches, [_width(eval_set, chosen) for chosen in batches]


def estimate_decode_seconds(config: Any, eval_set: pipeline.EvalSet, translator: compiled.Translator,
                            settings: DecodeSettings, clock: Callable[[], float] = time.monotonic) -> float:
    """Seconds ``decode_batches`` will take over ``eval_set`` with ``translator`` and ``settings``.

    A batch takes a fixed time (encoding its sources, the search's set-up) and then its search steps, at most its
    longest row's length limit (``step_bound``), each in a step's time; both times grow with the width (the encoder
    and the cross-attention read every source position, the bookkeeping every output position). Both are measured
    at the plan's narrowest and widest widths, on the narrowest width's first and last batches (two step counts
    at one width separate the fixed time from a step's), each the fastest of ``PROBE_REPEATS`` calls after their
    programs are compiled, and taken linear in the width in between. The plan's other widths are ``prepare``d in
    the background once the timing is done, so the split's decoding with the same ``translator`` compiles nothing.
    (The width alone undercounted the widest batches, whose rows search 5x the first batch's steps; steps with a
    single probe per width overcounted a step of the widest by its 1 s of encoding.)"""
    eval_set = whole_split(eval_set, config.data.eval_batch_size)  # what score_split decodes (a collective)
    if not eval_set.tokens:
        return 0.0
    rows, order = _decode_plan(config, translator.params, eval_set, settings.beam_size)
    batches, widths = _plan_batches(eval_set, order, rows)
    steps = [step_bound(config, settings, eval_set, chosen, width) for chosen, width in zip(batches, widths)]
    narrow, wide = widths[0], max(widths)
    short, long = 0, max(i for i, width in enumerate(widths) if width == narrow)  # the narrowest width's batches
    fixed, per_step = {}, {}
    for compiling in [translator.prepare(rows, width, settings) for width in dict.fromkeys((narrow, wide))]:
        compiling.result()  # the probes' programs, compiled without running them
    for width in dict.fromkeys((narrow, wide)):
        sources = {i: _padded_batch(eval_set, batches[i], rows)[0]["inputs"][:, :width] for i in (short, long)}
        times = {i: min(_seconds_of_call(translator, sources[i], settings, clock) for _ in range(PROBE_REPEATS))
                 for i in dict.fromkeys(sources)}
        if steps[long] - steps[short] >= MIN_STEPS_APART:
            per_step[width] = max((times[long] - times[short]) / (steps[long] - steps[short]), 0.0)
            fixed[width] = max(times[short] - per_step[width] * steps[short], 0.0)
        else:  # one step count: the fixed time counted as steps (more than it is)
            fixed[width], per_step[width] = 0.0, times[short] / steps[short]
    for width in dict.fromkeys(widths):  # after the timing, which a compile beside it would slow
        translator.prepare(rows, width, settings)

    def linear(values: dict[int, float], width: int) -> float:
        return values[narrow] + (values[wide] - values[narrow]) * (width - narrow) / max(wide - narrow, 1)

    return sum(linear(fixed, width) + linear(per_step, width) * count for width, count in zip(widths, steps))


# Each probe is the fastest of this many calls. A program's first call is slower (its buffers' first touch: 0.78 s
# against 0.60 for the default run's narrowest probe on a slow 2-core CPU), and a probe of 1-3 s is short enough for
# a moment's load to slow it, while its step time multiplies into the split's ~1,000 steps. Slowing only adds time.
# (Load that lasts through both calls still counts: the default run once stopped training 60 s early on an estimate
# of 76 s for an evaluation of 52 s, and the same checkpoint's estimate beside a compilation gave 64 s against 37.)
PROBE_REPEATS = 2
MIN_STEPS_APART = 8  # the two probes of a width separate its fixed time from a step's when their bounds differ so


def _seconds_of_call(translator: compiled.Translator, inputs_BS: np.ndarray, settings: DecodeSettings,
                     clock: Callable[[], float]) -> float:
    start = clock()
    translator(inputs_BS, settings)
    return clock() - start


def step_bound(config: Any, settings: DecodeSettings, eval_set: pipeline.EvalSet, chosen: list[int],
               width: int) -> int:
    """The most search steps decoding the ``chosen`` examples at ``width`` takes: the longest row's length limit
    (``settings.max_len_a * source length + max_len_b`` tokens and EOS, ``search.translate_hypotheses``'s rule),
    within the program's output length. The search may end sooner (``decode.stop``; every row finished)."""
    output_len = compiled.max_output_len(config, settings, width)
    if settings.max_len_a is None and settings.max_len_b is None:
        return output_len
    longest = max(min(len(eval_set.tokens[i]["inputs"]), width) for i in chosen)
    limit = math.floor((settings.max_len_a or 0.0) * longest + (settings.max_len_b or 0)) + 1
    return min(max(limit, 1), output_len)


def in_batches(order: Sequence[int], rows: int,
               decode: Callable[[list[int], int], Any]) -> Iterator[tuple[list[int], Any]]:
    """``(chosen, decode(chosen, rows))`` for consecutive runs of ``rows`` indices of ``order``. A batch that runs
    the device out of memory is decoded again as batches of half the rows (logged), down to one row; with several
    processes, which must all run the same batches, that is a one-line error naming the field instead."""
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


def score_split(config: Any, model: nn.Module, params: Any, tokenizer: Tokenizer,
                eval_sets: Mapping[str, pipeline.EvalSet], workdir: str, settings: DecodeSettings, *,
                split: str | None = None, translator: compiled.Translator | None = None,
                stop_when: tuple[Callable[[], bool], str] | None = None) -> dict[str, Any]:
    """Decodes ``split`` of the eval sets, writes ``<workdir>/<split>.hyp.txt`` and ``<split>.scores.json``.

    With several processes each holds a shard of the split; they decode the whole split together
    (``whole_split``, ``decode_batches``), so every process gets every hypothesis and the same scores, and process
    0 writes them. A collective: every process calls it. ``settings``: the search's (the caller's boundary builds
    them from ``config.decode``); ``translator``: one whose programs to reuse.
    ``stop_when``: ``(over, why)``; decoding stops once ``over()`` (one process only: a time budget, ``why`` naming
    it), and the scores cover the examples decoded by then (``undecoded`` counts the rest; a warning says so)."""
    split = split or config.decode.split
    if split not in eval_sets:
        raise UserError(f"split {split!r} is not prepared; available: {sorted(eval_sets)}")
    eval_set = whole_split(eval_sets[split], config.data.eval_batch_size)
    start = time.time()
    hypotheses = {}
    for batch, tokens in decode_batches(config, model, params, eval_set, settings, translator=translator):
        for row, index in enumerate(batch["example_index"]):
            if index >= 0:
                hypotheses[int(index)] = tokenizer.decode(tokens[row])
        if stop_when and stop_when[0]() and len(hypotheses) < len(eval_set.tokens):
            logger.warning(f"{stop_when[1]} ran out: {split} decoding stopped after {len(hypotheses)} of "
                           f"{len(eval_set.tokens)} examples (the shortest sources); its scores cover those only, "
                           f"and eval.py --split={split} scores them all")
            break
    seconds = time.time() - start
    order = sorted(hypotheses)
    hyps = [hypotheses[i] for i in order]
    refs = [eval_set.examples[i]["targets"] for i in order]
    sources = [eval_set.examples[i]["inputs"] for i in order]
    lengths = measure_sources(tokenizer, sources, eval_set.lengths["inputs"])
    scores = score_texts(config.task, hyps, refs, split_compounds=config.decode.compound_split)
    scores.update(split=split, examples=len(hyps), decode_seconds=seconds,
                  sentences_per_s=len(hyps) / max(seconds, 1e-9), beam_size=settings.beam_size,
                  **lengths.counts())
    if len(hyps) < len(eval_set.tokens):
        scores["undecoded"] = len(eval_set.tokens) - len(hyps)
    write_outputs(workdir, split, hyps, scores)
    lengths.log(lambda i: f"{split}[{order[i]}]", SOURCE_LIMIT)
    logger.info(format_report(scores, sources, refs, hyps, config.decode.num_print))
    return scores


def whole_split(eval_set: pipeline.EvalSet, rows: int) -> pipeline.EvalSet:
    """The whole split on every process, in source order, ``rows`` (``data.eval_batch_size``) rows per batch.

    ``eval_set`` is either already whole (one process, or ``rows`` rows per batch) or this process's shard as
    ``pipeline.make_datasets`` builds it: process ``p`` of ``P`` holds examples ``p, p + P, p + 2P, ...`` in
    ``rows / P`` rows per batch. The shards are gathered (a collective) and interleaved back into source order.
    """
    count = jax.process_count()
    if count == 1 or eval_set.batch_size == rows:
        return eval_set
    if eval_set.batch_size * count != rows:
        raise ValueError(f"an eval set of {eval_set.batch_size} rows per batch is neither the whole split "
                         f"({rows} rows) nor one of {count} process shards of it ({rows // count} rows)")
    local = {"examples": eval_set.examples, "stats": dict(eval_set.stats),
             "tokens": [{key: ids.tolist() for key, ids in example.items()} for example in eval_set.tokens]}
    shards = allgather_json(local)
    total = sum(len(shard["examples"]) for shard in shards)
    if [len(shard["examples"]) for shard in shards] != [len(range(p, total, count)) for p in range(count)]:
        raise ValueError(f"eval shards of {[len(s['examples']) for s in shards]} examples are not the "
                         f"p::{count} shards of {total} examples that pipeline.make_eval_set builds")
    examples = [shards[i % count]["examples"][i // count] for i in range(total)]
    tokens = [{key: np.asarray(ids, np.int32) for key, ids in shards[i % count]["tokens"][i // count].items()}
              for i in range(total)]
    stats = sum((collections.Counter(shard["stats"]) for shard in shards), collections.Counter())
    return pipeline.EvalSet(examples, tokens, rows, math.ceil(total / rows), dict(eval_set.lengths), stats)


def allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-able ``value``, in process order; the same list on every process (a collective:
    every process calls it at the same point)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(encoded)], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)  # process_allgather needs one shape on every process
    padded[:len(encoded)] = encoded
    gathered = np.asarray(multihost_utils.process_allgather(padded))  # [P, longest]
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths)]


def score_texts(task: str, hypotheses: Sequence[str], references: Sequence[str], *,
                split_compounds: bool = False) -> dict[str, Any]:
    """ROUGE-1/2/L and the paper's ROUGE-Lsum for summarisation; for every other task sacreBLEU and, beside it,
    tokenized BLEU (with fairseq's compound splitting when ``split_compounds``, ``config.decode.compound_split``:
    the paper's WMT En-De number). ``{}`` (no score) when there is no example."""
    if not hypotheses and not references:
        return {}
    if task == "summarization":
        return {**scoring.rouge(hypotheses, references), **scoring.rouge_lsum(hypotheses, references)}
    return {**scoring.bleu(hypotheses, references),
            **scoring.tokenized_bleu(hypotheses, references, split_compounds=split_compounds)}


@dataclasses.dataclass
class SourceLengths:
    """The sources cut to the decoder's input limit; lengths in tokens with EOS, the unit the limit counts."""

    truncated: list[int]  # indices of the sources longer than ``limit``
    longest: int  # the longest source (0 when there is none)
    limit: int  # config.data.eval_max_input_length
    cut_from: list[int] = dataclasses.field(default_factory=list)  # the lengths of the ``truncated`` ones

    def counts(self) -> dict[str, int]:
        return {"truncated_sources": len(self.truncated), "longest_source_tokens": self.longest,
                "source_token_limit": self.limit}

    def warning(self, name: Callable[[int], str], limit: str, *, keeps: str = "cut to") -> str:
        """The one rule for over-long inputs on every surface (the API, eval.py, an exported program): each is cut
        and this line says which and by how much, e.g. ``warning: 1 input cut to 32 tokens
        (config.data.eval_max_input_length, EOS included): sources[3] had 81``. ``name(index)`` names an input as
        its caller knows it; ``limit`` says where the limit comes from; ``keeps``: ``"cut to the last"`` for an
        LM prompt, which keeps the tokens nearest its continuation."""
        count, shown = len(self.truncated), 5
        cut = ", ".join(f"{name(i)} had {n}" for i, n in zip(self.truncated[:shown], self.cut_from))
        more = f" and {count - shown} more" if count > shown else ""
        return f"{count} input{'s' if count != 1 else ''} {keeps} {self.limit} tokens ({limit}): {cut}{more}"

    def log(self, name: Callable[[int], str], limit: str, **kwargs: Any) -> None:
        if self.truncated:
            logger.warning(self.warning(name, limit, **kwargs))


def measure_sources(tokenizer: Tokenizer, sources: Sequence[str], limit: int) -> SourceLengths:
    """Which of ``sources`` decoding cuts to ``limit`` tokens (EOS included), and the longest length."""
    lengths = [len(ids) + 1 for ids in tokenizer.encode_batch(list(sources))] if sources else []
    cut = [i for i, n in enumerate(lengths) if n > limit]
    return SourceLengths(cut, max(lengths, default=0), limit, [lengths[i] for i in cut])


SOURCE_LIMIT = "config.data.eval_max_input_length, EOS included"  # where a source's limit comes from


def write_outputs(workdir: str, name: str, hypotheses: Sequence[str] | None, scores: Mapping[str, Any]) -> None:
    """``<workdir>/<name>.hyp.txt`` (one line per hypothesis, unless None) and ``<name>.scores.json``, local or a
    URL (``gs://``); process 0 only."""
    if jax.process_index() != 0:
        return
    directory = epath.Path(workdir)
    if hypotheses is not None:
        outputs.write_atomically(directory / f"{name}.hyp.txt", lines_text(hypotheses))
    outputs.write_atomically(directory / f"{name}.scores.json", json.dumps(scores, indent=2))


def lines_text(outputs: Sequence[str]) -> str:
    """One output per line: a newline inside an output becomes a space, so line i stays example i's."""
    return "".join(h.replace("\n", " ") + "\n" for h in outputs)


def format_report(scores: Mapping[str, Any], sources: Sequence[str], references: Sequence[str],
                  hypotheses: Sequence[str], num_print: int) -> str:
    """The first ``num_print`` (source, reference, hypothesis) triples, then the scores on one line."""
    if not hypotheses:
        return f"{scores['split']}: no examples, nothing to score"
    lines = []
    for i in range(min(num_print, len(hypotheses))):
        lines += [f"  source:     {sources[i][:300]}", f"  reference:  {references[i][:300]}",
                  f"  hypothesis: {hypotheses[i][:300]}", ""]
    if "bleu" in scores:
        head = f"{scores['split']}: sacreBLEU {scores['bleu']:.2f}  ({scores['bleu_signature']})"
    else:
        head = f"{scores['split']}: " + "  ".join(f"{k} {scores[k]:.2f}" for k in ("rouge1", "rouge2", "rougeL"))
    head += f"  on {scores['examples']} examples, {scores['sentences_per_s']:.1f} sentences/s"
    return "\n".join(["sample outputs:"] + lines + [head])


class ListSource:
    """A random-access source over in-memory examples (what ``make_eval_set`` reads)."""

    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


@dataclasses.dataclass
class LineOutputs:
    """One output per input line, in order, and what was not decoded as given: ``translate_lines``' translations
    (or summaries) of source lines, ``generate_lines``' continuations of an LM's prompts."""

    hypotheses: list[str]  # one per input line, in order; "" for a blank source line
    blank: list[int]  # indices of the blank (empty or whitespace-only) source lines: not decoded ([] for prompts)
    lengths: SourceLengths  # of the decoded lines; its indices are line indices too
    nbest: list[list[dict[str, Any]]] | None = None  # with ``nbest``: per line, best first (``nbest_entries``)


def translate_lines(config: Any, model: nn.Module, params: Any, tokenizer: Tokenizer, sources: Sequence[str],
                    settings: DecodeSettings, *, translator: compiled.Translator | None = None,
                    name: Callable[[int], str] = "sources[{}]".format, nbest: int = 0,
                    prefixes: Sequence[np.ndarray] | None = None) -> LineOutputs:
    """Decodes each line of ``sources`` (translation or summarisation) by the search ``settings`` say (a beam
    search, or samples), on ``translator``'s programs when given. With ``nbest``, also the first
    ``nbest`` hypotheses of each line (``LineOutputs.nbest``). ``prefixes``: per line, the ids each of its
    outputs starts with (``search.Prefix``; checked by the caller to fit the output limit).

    A blank line is not decoded (from EOS alone a model hallucinates) and gets an empty output (and n-best list)
    in its place, so the outputs stay aligned with the input lines. Lines longer than
    ``config.data.eval_max_input_length`` tokens are cut to it with a warning naming each by ``name(index)``
    (``SourceLengths.warning``); ``LineOutputs`` says which. With several processes each passes the same lines
    (and gets every output).
    """
    kept = [i for i, source in enumerate(sources) if source.strip()]
    blank = [i for i, source in enumerate(sources) if not source.strip()]
    limit = config.data.eval_max_input_length
    measured = measure_sources(tokenizer, [sources[i] for i in kept], limit)
    lengths = SourceLengths([kept[i] for i in measured.truncated], measured.longest, limit, measured.cut_from)
    lengths.log(name, SOURCE_LIMIT)
    examples = [{"inputs": sources[i], "targets": ""} for i in kept]
    eval_set = pipeline.make_eval_set(ListSource(examples), "inputs", "targets", tokenizer,
                                      {"inputs": limit, "targets": config.data.eval_max_target_length},
                                      config.data.eval_batch_size)
    translator = translator or compiled.Translator(config, model, params)
    hypotheses = [""] * len(sources)
    lists = [[] for _ in sources] if nbest else None
    per_batch = None if prefixes is None else (lambda chosen: {"prefixes": [prefixes[kept[i]] for i in chosen]})
    for batch, found in decode_batches(config, model, params, eval_set, settings, translator=translator.hypotheses,
                                       per_batch=per_batch):
        for row, index in enumerate(batch["example_index"]):
            if index >= 0:
                hypotheses[kept[int(index)]] = tokenizer.decode(found.tokens[row, 0])
                if nbest:
                    lists[kept[int(index)]] = nbest_entries(tokenizer, found, row, nbest)
    return LineOutputs(hypotheses, blank, lengths, lists)


def nbest_entries(tokenizer: Tokenizer, found: Any, row: int, count: int) -> list[dict[str, Any]]:
    """Row ``row``'s first ``count`` hypotheses of ``found`` (a ``search.Hypotheses``), best first: ``text``,
    ``score`` (the search's length-penalised score), ``token_scores`` and ``tokens`` (the ids, EOS included).
    Empty slots (a search that finished fewer) are left out."""
    entries = []
    for n in range(count):
        if not np.isfinite(found.scores[row, n]):
            break  # empty slots come last (-inf)
        tokens = found.tokens[row, n]
        length = int(np.sum(tokens != PAD_ID))  # PAD is never generated: the tokens up to EOS
        entries.append({"text": tokenizer.decode(tokens), "score": float(found.scores[row, n]),
                        "token_scores": found.token_scores[row, n, :length].tolist(),
                        "tokens": tokens[:length].tolist()})
    return entries


def generate_lines(config: Any, tokenizer: Tokenizer, prompts: Sequence[str], generator: compiled.Generator,
                   settings: DecodeSettings, *, name: Callable[[int], str] = "prompts[{}]".format,
                   nbest: int = 0) -> LineOutputs:
    """Continues each of ``prompts`` (an LM run) by up to ``settings.max_len`` tokens, greedy at temperature 0,
    else sampled. With ``nbest``, the first ``nbest`` of ``Generator.hypotheses`` per prompt instead (the beams or
    samples ``settings`` ask for): ``LineOutputs.nbest``, and the best one's text as the output. A blank prompt
    starts from BOS alone. A prompt longer than ``settings.prompt_limit`` keeps its last tokens (those nearest the
    continuation), with a warning naming it by ``name(index)``; ``LineOutputs.lengths`` says which were cut.
    Prompts of similar length share a batch, and a batch one program per shape bucket."""
    limit = settings.prompt_limit(config.model.max_len)
    encoded = tokenizer.encode_batch(list(prompts)) if prompts else []
    if limit == 0 and any(len(ids) for ids in encoded):  # every prompt would be dropped, not cut
        raise UserError(f"max_len={settings.max_len} new tokens leave no room for a prompt in the model's "
                        f"config.model.max_len={config.model.max_len} positions (BOS included); ask for at most "
                        f"{settings.max_len - 1} to keep a prompt's last token, or give blank prompts")
    cut = [i for i, ids in enumerate(encoded) if len(ids) > limit]
    lengths = SourceLengths(cut, max((len(ids) for ids in encoded), default=0), limit, [len(encoded[i]) for i in cut])
    lengths.log(name, f"what config.model.max_len={config.model.max_len} leaves beside max_len={settings.max_len} "
                "new ones and BOS", keeps="cut to the last")
    encoded = [ids[len(ids) - limit:] if len(ids) > limit else ids for ids in encoded]
    rows = compiled.decode_rows(config, compiled.platform_of(generator.params), config.data.eval_batch_size,
                                settings.beam_size if nbest else 1)
    rows = compiled.row_bucket(len(encoded), rows)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))

    def generate_batch(chosen: list[int], rows: int) -> np.ndarray:
        width = compiled.width_bucket(max(len(encoded[i]) for i in chosen), limit) or 1
        prompt_BP = np.zeros((rows, width), np.int32)  # PAD rows for a short last batch
        prompt_len_B = np.zeros((rows,), np.int32)
        for row, i in enumerate(chosen):
            prompt_BP[row, :len(encoded[i])], prompt_len_B[row] = encoded[i], len(encoded[i])
        if nbest:
            return generator.hypotheses(prompt_BP, prompt_len_B, settings)  # [rows, N, max_len]
        return generator(prompt_BP, prompt_len_B, settings)  # [rows, max_len]

    outputs = [""] * len(prompts)
    lists = [[] for _ in prompts] if nbest else None
    for chosen, found in in_batches(order, rows, generate_batch):
        for row, i in enumerate(chosen):
            if nbest:
                lists[i] = nbest_entries(tokenizer, found, row, nbest)
                outputs[i] = lists[i][0]["text"] if lists[i] else ""
            else:
                outputs[i] = tokenizer.decode(found[row])
    return LineOutputs(outputs, [], lengths, lists)
