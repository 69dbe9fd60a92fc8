"""The study's speed table: every mixer's training and decoding speed at the study's sizes, the mixers taking turns in
one process so all meet the same host conditions (random weights: every beam runs to its length limit)."""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lconv.bench import timing
from lconv.study import plan

logger = logging.getLogger(__name__)

SPEED_FILE = "speed.json"  # under <docs_dir>/results/, beside results.json
DECODE_SOURCES = 64  # validation sources per decoding pass


@dataclasses.dataclass
class _Contender:
    """One mixer's programs for one task: a train step and a decoding pass, each timed per call."""

    mixer: str
    train: Any  # () -> None, one update on the shared batch
    decode: Any  # () -> None, one pass over the shared sources
    target_tokens: int  # real target tokens in the shared batch
    sentences: int  # sentences (or LM rows) a decoding pass produces


def measure(study: ml_collections.ConfigDict, templates: Sequence[plan.Planned], tokenizer_dirs: dict[str, str],
            rounds: int = 5) -> list[dict[str, Any]]:
    """A row per (task, mixer): train tokens/s and decode sentences/s, medians of ``rounds`` turns."""
    rows = []
    for task in study.tasks:
        planned = [t for t in templates if t.key.task == task and t.config is not None]
        if not planned:
            continue
        batch, sources = _shared_inputs(planned[0].config, tokenizer_dirs[task])
        contenders = [_contender(t, batch, sources, study) for t in planned]
        # the first round compiles
        times = timing.alternate({(c.mixer, kind): getattr(c, kind) for c in contenders
                                  for kind in ("train", "decode")}, rounds)
        for c in contenders:
            train_s, decode_s = (timing.summarize(times[(c.mixer, kind)])["median_s"] for kind in ("train", "decode"))
            rows.append({"task": task, "mixer": c.mixer, "label": plan.label(c.mixer), "rounds": rounds,
                         "train_tokens_per_s": c.target_tokens / train_s,
                         "decode_sentences_per_s": c.sentences / decode_s, "train_step_s": train_s,
                         "decode_pass_s": decode_s, "decode_sentences": c.sentences})
            logger.info(f"speed {task}/{c.mixer}: {rows[-1]['train_tokens_per_s']:,.0f} train tokens/s, "
                        f"{rows[-1]['decode_sentences_per_s']:,.1f} decode sentences/s")
    return rows


def _shared_inputs(config: ml_collections.ConfigDict, tokenizer_dir: str) -> tuple[dict[str, np.ndarray], Any]:
    """The task's first training batch and first ``DECODE_SOURCES`` validation examples, shared by every mixer."""
    from lconv.data import pipeline
    from lconv.data import tokenizer as tokenizer_lib

    config = ml_collections.ConfigDict(config.to_dict())
    config.data.eval_splits = ("validation",)
    data = pipeline.make_datasets(config.data, tokenizer_lib.load_tokenizer(tokenizer_dir))
    batch = {k: np.asarray(v) for k, v in next(data.train_iter).items()}
    validation = data.eval_sets["validation"]
    if config.task == "lm":  # the LM generates from BOS: no sources
        return batch, None
    count = min(DECODE_SOURCES, len(validation.tokens))
    sources = dataclasses.replace(validation, examples=validation.examples[:count], tokens=validation.tokens[:count],
                                  num_batches=math.ceil(count / validation.batch_size))
    return batch, sources


def _contender(template: plan.Planned, batch: dict[str, np.ndarray], sources: Any,
               study: ml_collections.ConfigDict) -> _Contender:
    from lconv.decode_settings import DecodeSettings
    from lconv.infer import batching, compiled
    from lconv.run import model_setup, schema
    from lconv.study import measure
    from lconv.train import setup, update

    config = copy.deepcopy(template.config)
    with config.unlocked():  # the step and the search are measured: the loop's own fields (logging, checkpoints,
        # budget) are checked when the run launches, and fail that run, not the speed table
        config.train = ml_collections.ConfigDict({"num_steps": config.train.num_steps})
    config = schema.validate_config(config)
    vocab = config.data.vocab_size
    mesh = model_setup.make_mesh(config.mesh, jax.devices()[:1])
    model = model_setup.build_model(config, vocab)
    tx, lr = update.build_optimizer(config.optim, config.train.num_steps)
    state, shardings = setup.create_state(config, model, mesh, tx)
    train_step = update.jit_train_step(config, lr, shardings, mesh)
    device_batch = model_setup.global_batch({k: v for k, v in batch.items() if k != "example_index"},
                                            model_setup.batch_sharding(mesh))
    decode_params = jax.tree.map(jnp.copy, state.params)  # the train step donates the state's own
    holder = {"state": state}

    def train() -> None:
        with jax.set_mesh(mesh):
            holder["state"], sums = train_step(holder["state"], device_batch, np.float32(1.0))
        jax.block_until_ready(sums)

    if config.task == "lm":
        generate = measure.lm_generator(model, config.decode, study.lm_generate_rows, study.lm_generate_tokens)

        def decode() -> None:
            jax.block_until_ready(generate(decode_params))
        sentences = study.lm_generate_rows
    else:
        settings = DecodeSettings.build(config.decode)
        translator = compiled.Translator(config.infer, model, decode_params)

        def decode() -> None:
            for _ in batching.decode_batches(config.infer, model, decode_params, sources, settings,
                                                     translator=translator):
                pass
        sentences = len(sources.tokens)
    targets = int((batch["targets_segmentation"] > 0).sum()) if "targets_segmentation" in batch else int(
        np.size(batch["targets"]))
    return _Contender(template.key.mixer, train, decode, targets, sentences)


def write(rows: Sequence[dict[str, Any]], docs_dir: str) -> str:
    """``<docs_dir>/results/speed.json``: the rows and the machine they were measured on."""
    from lconv.study import run as run_lib

    path = os.path.join(docs_dir, "results", SPEED_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    run_lib.write_json(path, {"machine": timing.machine_info(), "rows": list(rows)})
    return path


def read(docs_dir: str) -> dict[str, Any] | None:
    from lconv.study import run as run_lib

    return run_lib.read_json(os.path.join(docs_dir, "results", SPEED_FILE))
