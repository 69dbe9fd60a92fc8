"""The loss pass: a model's label-smoothed loss, perplexity and accuracy over a split (padding rows weigh zero), as
training's validation and eval.py's scoring of an LM both run it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lconv import console
from lconv.data import pipeline, stream
from lconv.deadline import Deadline
from lconv.errors import UserError
from lconv.infer import reports, scoring, shards
from lconv.nn import common as nn_common
from lconv.nn import mixer_state
from lconv.run import metrics, model_setup
from lconv.run.schema import RunConfig

logger = logging.getLogger(__name__)

PyTree = Any
Batch = dict[str, Any]


def make_eval_step(config: RunConfig) -> Callable:
    """``(params, apply_fn, batch, state) -> (sums, state)``; ``state``: the mixers' carried state (streams)."""
    def eval_step(params, apply_fn, batch, carried):
        outputs, carried = model_setup.apply_model(apply_fn, params, carried, batch, deterministic=True,
                                                   logits=not config.optim.fused_loss)
        weights = (batch["targets_segmentation"] > 0) & (batch["example_weight"][:, None] > 0)
        return metrics.label_smoothed_loss(outputs, batch["targets"], weights, config.optim.label_smoothing,
                                           config.optim.label_smoothing_split), carried

    return nn_common.under_axis_rules(eval_step, config.mesh.rules)


def jit_eval_step(config: RunConfig, mesh: jax.sharding.Mesh) -> Callable:
    """``make_eval_step`` jitted once per run, its returned state in the batch's sharding (one compilation)."""
    return jax.jit(make_eval_step(config), static_argnums=1, out_shardings=(None, model_setup.batch_sharding(mesh)))


def evaluate_loss(eval_step: Callable, params: PyTree, apply_fn: Callable, eval_set: Iterable[Batch],
                  mesh: jax.sharding.Mesh, carried: mixer_state.MixerState | None = None,
                  deadline: Deadline | None = None) -> dict[str, float]:
    """Validation loss / perplexity / accuracy over every example of ``eval_set``, the same on every process;
    ``carried``: a stream's starting state; past ``deadline`` the pass stops (``unscored_batches``)."""
    sharding = model_setup.batch_sharding(mesh)
    eval_set = pipeline.loss_batches(eval_set)
    total, carried, done, previous = None, carried or mixer_state.empty(), 0, None
    bar = console.pass_bar(len(eval_set) if hasattr(eval_set, "__len__") else None, "loss pass", "batch")
    with jax.set_mesh(mesh):
        for batch in eval_set:
            batch = {k: v for k, v in batch.items() if k != "example_index"}
            sums, carried = eval_step(params, apply_fn, model_setup.global_batch(batch, sharding), carried)
            total = sums if total is None else jax.tree.map(jnp.add, total, sums)
            done += 1
            previous = model_setup.one_step_ahead(previous, total)
            bar.update(1)
            if deadline and done < len(eval_set) and deadline.passed():  # the clock is now the device's, less a batch
                break
    bar.close()
    scores = metrics.summarize(total)
    if deadline and done < len(eval_set):
        scores["unscored_batches"] = len(eval_set) - done
        logger.warning(f"{deadline.name} ran out: the loss pass stopped after {done} of {len(eval_set)} "
                       f"batches ({scores['tokens']:.0f} tokens); its scores cover those only")
    return scores


def score_perplexity(config: RunConfig, model: Any, params: PyTree, eval_set: Iterable[Batch], workdir: str, split: str,
                     *, mesh: jax.sharding.Mesh | None = None, eval_step: Callable[..., Any] | None = None,
                     deadline: Deadline | None = None, output_name: str | None = None,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """An LM's token-level perplexity (and loss, accuracy) on ``split``, written to ``<split>.scores.json``
    (``output_name``, plus ``extra``); ``mesh`` and ``eval_step``: a training run's own, so nothing compiles again."""
    mesh = model_setup.make_mesh(config.mesh) if mesh is None else mesh
    eval_step = jit_eval_step(config, mesh) if eval_step is None else eval_step
    carried = model_setup.init_mixer_state(config, model, config.data.eval_batch_size,
                                           model_setup.batch_sharding(mesh))
    scores = dict(evaluate_loss(eval_step, params, model.apply, eval_set, mesh, carried, deadline), split=split)
    if "unscored_batches" not in scores:
        scores.update(_word_perplexity(eval_set, scores))
    scores.update(extra or {})
    reports.write_outputs(workdir, output_name or split, None, scores)
    per_word = f", {scores['word_ppl']:.2f} per word" if "word_ppl" in scores else ""
    logger.info(f"{split}: perplexity {scores['ppl']:.2f} per token{per_word} (nll {scores['nll']:.4f}/token over "
                f"{scores['tokens']:.0f} tokens)")
    return scores


def _word_perplexity(eval_set: Any, scores: dict[str, Any]) -> dict[str, float]:
    """The per-word perplexity of an eval set of whole texts; ``{}`` for stream windows or when a text was cut."""
    examples, stats = getattr(eval_set, "examples", None), getattr(eval_set, "stats", {})
    if examples is None or not hasattr(eval_set, "tokens"):
        return {}
    local = [scoring.word_count(e["targets"] for e in examples), int(stats.get("eval_targets_truncated", 0))]
    words, truncated = np.sum(shards.allgather_json(local), axis=0) if jax.process_count() > 1 else local
    if truncated or not words:
        return {}
    return scoring.word_perplexity(scores["nll"] * scores["tokens"], int(words))


def stream_perplexity(config: RunConfig, model: Any, params: PyTree, tokenizer: Any, documents: list[str],
                      eval_step: Callable[..., Any] | None = None) -> dict[str, float]:
    """``documents`` scored as eval.py scores a document-stream LM's split, the mixers' state carried."""
    cfg = config.data
    mesh = model_setup.make_mesh(config.mesh)
    eval_set = stream.StreamEvalSet([{"text": text} for text in documents], "text", tokenizer,
                                    window=int(cfg.max_target_length), rows=int(cfg.eval_batch_size))
    if eval_set.num_batches == 0:  # evaluate_loss would have no sums to summarize
        raise UserError("texts: nothing to score: a document-stream run skips empty texts, as its data pipeline "
                        "does, and no text given has a token")
    carried = model_setup.init_mixer_state(config, model, int(cfg.eval_batch_size), model_setup.batch_sharding(mesh))
    scores = evaluate_loss(eval_step or jit_eval_step(config, mesh), params, model.apply, eval_set, mesh, carried)
    return {"ppl": scores["ppl"], "nll": scores["nll"], "tokens": scores["tokens"]}
