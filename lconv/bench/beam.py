"""Suite ``beam``: beam search over a whole split, sentences/s by decoding batch size (``decode.batch_size``), for the
README default's models through the path eval.py takes. What and how: docs/benchmarks.md, "The beam suite"."""
from __future__ import annotations

import argparse
import collections
import logging
import math
import time
from typing import Any

import jax
import numpy as np

from lconv.bench import report, timing
from lconv.configs import common, default
from lconv.constants import EOS_ID
from lconv.data import pipeline, sources
from lconv.data.data_config import DataConfig
from lconv.decode_settings import DecodeSettings
from lconv.infer import batching, compiled
from lconv.run import model_setup, restore, schema

logger = logging.getLogger(__name__)

MODELS = timing.labelled(("dynamicconv", "attention"))  # label -> registered name (picks configs/default.py's)
ROWS = (16, 64, 256, 512, 1024)
BASE_ROWS = 64  # the speed-ups are over this size: the eval batch the issue measured
REPEATS = 3
SOURCE_TOKENS = (6, 40)  # fewest and most tokens of a synthetic source, EOS included


def sentences() -> int:
    """The split's size: DDTP's 1,216 test sentences on an accelerator; fewer on CPU, where a pass takes long."""
    return 1216 if jax.default_backend() != "cpu" else 256


def synthetic_split(count: int, vocab: int, rows: int, seed: int = 0) -> pipeline.EvalSet:
    """``count`` random sources of ``SOURCE_TOKENS`` lengths as an eval set of ``rows`` rows per batch."""
    rng = np.random.default_rng(seed)
    low, high = SOURCE_TOKENS
    tokens = [{"inputs": np.append(rng.integers(4, vocab, n - 1), EOS_ID).astype(np.int32),
               "targets": np.asarray([EOS_ID], np.int32)} for n in rng.integers(low, high + 1, count)]
    return pipeline.EvalSet([{"inputs": "", "targets": ""}] * count, tokens, rows, math.ceil(count / rows),
                            {"inputs": 64, "targets": 64}, collections.Counter())


def run(count: int, rows_list: tuple[int, ...], deadline: float | None = None,
        smoke: bool = False) -> list[report.Row]:
    """Each model decodes the split at every batch size of ``rows_list`` up to ``count`` and at auto's, the models
    alternating; no new size starts after ``deadline``. ``smoke``: a smoke test's sizes."""
    setups = {}
    for label, mixer in MODELS.items():
        config = default.get_config(mixer)
        if smoke:
            common.smoke_test_sizes(config)
        config = schema.validate_config(config)
        model = model_setup.build_model(config, config.data.vocab_size)
        args, kwargs = model_setup.model_inputs(model_setup.dummy_batch(config))
        params = jax.jit(model.init)(jax.random.key(0), *args, **kwargs)["params"]
        setups[label] = (config, model, params, synthetic_split(count, config.data.vocab_size,
                                                                config.data.eval_batch_size))
    config, _, params, eval_set = next(iter(setups.values()))
    auto = min(count, compiled.decode_rows(config.infer, compiled.platform_of(params), eval_set.batch_size,
                                           config.decode.beam_size))
    results = []
    sizes = sorted({r for r in rows_list if r <= count} - {auto})
    # auto's size first, then 64 (the speed-ups' base), then the rest: what a deadline cuts is the least needed
    for rows in [auto, *sorted(sizes, key=lambda r: (r != BASE_ROWS, r))]:
        if deadline is not None and time.monotonic() > deadline:
            logger.info(f"  rows {rows} and more: cut, the time ran out")
            break
        for label, setup in setups.items():
            row = _decode_row(*setup, rows, auto, model_name=label)
            results.append(row)
            batches = f"{row['batches']} batch{'es' if row['batches'] != 1 else ''}"
            logger.info(f"  {label:12s} rows {rows:5d}{' (auto)' if row['auto'] else '':7s}: "
                        f"{row['sentences_per_s']:8.1f} sentences/s ({batches}; first pass with compile "
                        f"{row['first_pass_s']:.1f} s)")
    return results


TRAINED_ROWS = (256, 64, 16)  # the trained run's decoding batch sizes, after auto's: the widest first


def test_split(config: Any, tokenizer: Any, limit: int | None = None) -> pipeline.EvalSet:
    """The test split of ``config``'s dataset as eval.py reads it, its first ``limit`` sentences if given."""
    data = DataConfig.from_config(config.data)
    source, input_key, target_key = sources.config_source(data, "test")
    lengths = {"inputs": data.eval_max_input_length, "targets": data.eval_max_target_length}
    split = pipeline.make_eval_set(source, input_key, target_key, tokenizer, lengths, data.eval_batch_size)
    if limit is None or limit >= len(split.tokens):
        return split
    return pipeline.EvalSet(split.examples[:limit], split.tokens[:limit], split.batch_size,
                            math.ceil(limit / split.batch_size), split.lengths, split.stats)


def rows_order(auto: int, rows_list: tuple[int, ...], count: int) -> list[int]:
    """auto's size first (what eval.py and train.py use), then ``rows_list``'s up to ``count``, auto's left out."""
    return [auto] + [r for r in dict.fromkeys(rows_list) if r <= count and r != auto]


def run_trained(workdir: str, rows_list: tuple[int, ...] = TRAINED_ROWS, *, limit: int | None = None,
                deadline: float | None = None) -> list[report.Row]:
    """The trained run in ``workdir`` decodes its test split at auto's batch size and each of ``rows_list``'s."""
    trained = restore.load_trained(workdir, devices=jax.devices()[:1])
    config, model, params = trained.config, trained.model, trained.params
    eval_set = test_split(config, trained.tokenizer, limit)
    count = len(eval_set.tokens)
    auto = min(count, compiled.decode_rows(config.infer, compiled.platform_of(params), eval_set.batch_size,
                                           config.decode.beam_size))
    results = []
    for rows in rows_order(auto, rows_list, count):
        if deadline is not None and time.monotonic() > deadline:
            logger.info(f"  rows {rows} and the sizes after it: cut, the time ran out")
            break
        row = _decode_row(config, model, params, eval_set, rows, auto, model_name=config.model.decoder_mixer,
                          step=trained.steps[-1])
        results.append(row)
        logger.info(f"  trained step {row['step']} rows {rows:5d}{' (auto)' if row['auto'] else '':7s}: "
                    f"{row['sentences_per_s']:8.1f} sentences/s (first pass with compile {row['first_pass_s']:.1f} s)")
    return results


def trained_section(rows: list[report.Row], final: dict[str, float] | None, info: dict[str, str],
                    command: str) -> str:
    """The trained run's decoding rates by batch size, beside its final evaluation's own rate."""
    r0 = rows[0]
    if final:
        final_text = (f"The run's final evaluation decoded its {final.get('examples')} test sentences at "
                      f"{final.get('sentences_per_s') or float('nan'):.1f} sentences/s, its programs' compilation "
                      f"and the first pass's warm-up included ({final.get('decode_seconds') or float('nan'):.1f} s).")
    else:
        final_text = "The run's final evaluation left no rate."
    return "\n\n".join([
        f"### Beam search of the trained default run, by decoding batch size (`{command}`)\n",
        f"Machine: {timing.describe(info)}. The run stage's checkpoint (step {r0['step']}, its {r0['model']} "
        f"decoder), beam {r0['beam']}, over the first {r0['sentences']} sentences of its test split through "
        f"`decode_batches` (eval.py's path); median of {REPEATS} passes after a first pass that compiles. "
        f"auto is `decode.batch_size = 0`'s choice here. {final_text}",
        report.markdown_table(["rows", "auto", "batches", "sentences/s", "first pass with compile, s"],
                              [[r["rows"], "yes" if r["auto"] else "", r["batches"], r["sentences_per_s"],
                                r["first_pass_s"]] for r in rows])])


def _decode_row(config: Any, model: Any, params: Any, eval_set: pipeline.EvalSet, rows: int, auto: int, *,
                model_name: str = "", **fields: Any) -> report.Row:
    """A batch size's row: the first pass over ``eval_set`` (it compiles) and the median of ``REPEATS`` more."""
    config = config.replace(decode={"batch_size": rows})
    translator = compiled.Translator(config.infer, model, params)  # fresh programs: each batch size compiles its own
    settings = DecodeSettings.build(config.decode)

    def decode_split():
        batches = batching.decode_batches(config.infer, model, params, eval_set, settings, translator=translator)
        return [best for _, best in batches]

    first_s = timing.time_calls(decode_split, 1, warmup=0)[0]
    median_s = timing.summarize(timing.time_calls(decode_split, REPEATS, warmup=0))["median_s"]
    count = len(eval_set.tokens)
    return dict(model=model_name, rows=rows, auto=rows == auto, sentences=count, batches=math.ceil(count / rows),
                beam=config.decode.beam_size, **fields, seconds=median_s, sentences_per_s=count / median_s,
                first_pass_s=first_s)


def section(rows: list[report.Row], info: dict[str, str], command: str) -> str:
    sizes = sorted({r["rows"] for r in rows})
    labels = list(MODELS)

    def cell(label, size, key):
        return next((r[key] for r in rows if r["model"] == label and r["rows"] == size), None)

    def speedup(label, size):
        base, value = cell(label, BASE_ROWS, "sentences_per_s"), cell(label, size, "sentences_per_s")
        return value / base if base and value else None

    auto = {r["model"]: r["rows"] for r in rows if r["auto"]}
    parts = [f"### Beam search over a split by decoding batch size (`{command}`)\n",
             f"Machine: {timing.describe(info)}. configs/default.py's translation models, untrained, beam "
             f"{rows[0]['beam']}, {rows[0]['sentences']} synthetic sources of {SOURCE_TOKENS[0]}-{SOURCE_TOKENS[1]} "
             f"tokens through `decode_batches` (eval.py's path); median of {REPEATS} passes after a first pass that "
             f"compiles. `decode.batch_size = 0` picks {', '.join(f'{m}: {n}' for m, n in auto.items())} rows here. "
             "Untrained beams run to the length limit, so the absolute rates are below a trained model's.\n",
             "**Sentences/s, by rows per decoding batch**\n",
             report.markdown_table(["model"] + [f"{n} rows" for n in sizes],
                                   [[lab] + [cell(lab, n, "sentences_per_s") for n in sizes] for lab in labels]),
             "**Speed-up over 64 rows (the eval batch the issue measured)**\n",
             report.markdown_table(["model"] + [f"{n} rows" for n in sizes],
                                   [[lab] + [speedup(lab, n) for n in sizes] for lab in labels]),
             "**First pass, compilation included, seconds**\n",
             report.markdown_table(["model"] + [f"{n} rows" for n in sizes],
                                   [[lab] + [cell(lab, n, "first_pass_s") for n in sizes] for lab in labels])]
    return "\n\n".join(p.strip() for p in parts)


def run_suite(opts: argparse.Namespace, info: dict[str, str]) -> list[report.Row]:
    count = 32 if opts.quick else sentences()
    rows = run(count, (16, 32) if opts.quick else ROWS)
    report.write_results(opts.out, "beam", rows, section(rows, info, opts.command), opts.doc)
    return rows
