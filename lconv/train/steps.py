"""The compiled steps: one optimizer update (with gradient accumulation and the mixers' carried state threaded
through),
the evaluation loss, and a pass of it over a split.

Steps are ``jax.jit`` with ``in_shardings`` / ``out_shardings`` and a donated state. The dropout rng is
``fold_in(seed, step)``, so no rng state is saved.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lconv.data import pipeline
from lconv.infer import decode_and_score, scoring
from lconv.nn import common as nn_common
from lconv.nn import mixer_state
from lconv.train import metrics, setup

logger = logging.getLogger(__name__)

PyTree = Any
Batch = dict[str, Any]


def apply_model(apply_fn: Callable, params: PyTree, carried: mixer_state.MixerState, batch: Batch,
                **kwargs: Any) -> tuple[jax.Array, mixer_state.MixerState]:
    """``(logits, the mixers' state after this window)`` (with ``logits=False`` among ``kwargs``, the model's
    ``OutputLayer`` instead of logits). With a state (a stream batch), rows whose ``document_start`` is set first
    start over (each mixer's ``reset_state``), then the window reads and updates it; no state (the empty state,
    ``None`` or ``{}``) is a plain apply."""
    args, model_kwargs = setup.model_inputs(batch)
    if not carried:
        return apply_fn({"params": params}, *args, **model_kwargs, **kwargs), carried
    carried = carried.reset(batch["document_start"] > 0)
    return carried.apply(apply_fn, params, *args, **model_kwargs, **kwargs)


def _split_rows(tree: PyTree, micro: int) -> PyTree:
    """``[B, ...] -> [micro, B / micro, ...]`` with row ``r`` in micro-batch ``r % micro``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, micro, *x.shape[1:]), 0, 1), tree)


def _merge_rows(tree: PyTree) -> PyTree:
    """The inverse of ``_split_rows``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


def make_train_step(config: Any, lr_schedule: optax.Schedule) -> Callable[..., tuple[Any, dict]]:
    """``(state, batch[, lr_factor]) -> (state, sums)``: one optimizer update from a global batch.

    ``lr_factor`` (a float32 scalar; 1 when not given) multiplies the update, so the learning rate is the
    schedule's times it: the time-shaped schedule of ``optim.schedule="budget"``
    (``lconv.train.budget.TimeSchedule``). Every optimiser lconv builds ends in the learning rate's scaling, so
    that is the same as scaling the rate.

    With ``optim.grad_accum_steps = n`` (fairseq's update-freq) the batch's rows are split into ``n`` micro-batches
    (row ``r`` goes to micro-batch ``r % n``, so every data shard contributes to each) whose summed gradients are
    scanned, then divided by the batch's total target tokens: the update equals the unsplit batch's, with a
    ``1/n`` activation footprint.
    """
    smoothing = config.optim.label_smoothing
    micro = int(config.optim.grad_accum_steps)

    def train_step(state, batch, lr_factor=1.0):
        def loss_sums(params, carried, batch, dropout_rng):
            outputs, carried = apply_model(state.apply_fn, params, carried, batch, deterministic=False,
                                          rngs={"dropout": dropout_rng}, logits=not config.optim.fused_loss)
            sums = metrics.label_smoothed_loss(outputs, batch["targets"], batch["targets_segmentation"] > 0,
                                               smoothing)
            return sums["loss"], (sums, carried)

        grad_sums = jax.grad(loss_sums, has_aux=True)  # gradient of the summed (not averaged) loss
        dropout_rng = jax.random.fold_in(jax.random.key(config.seed), state.step)
        if micro == 1:
            grads, (sums, carried) = grad_sums(state.params, state.mixer_state, batch, dropout_rng)
        else:
            def accumulate(total, index_state_batch):
                index, micro_state, micro_batch = index_state_batch
                grads, (sums, micro_state) = grad_sums(state.params, micro_state, micro_batch,
                                                        jax.random.fold_in(dropout_rng, index))
                return jax.tree.map(jnp.add, total, (grads, sums)), micro_state

            split_batch, split_state = _split_rows(batch, micro), _split_rows(state.mixer_state, micro)
            first = jax.tree.map(lambda x: x[0], (split_state, split_batch))
            grads_and_sums = jax.eval_shape(grad_sums, state.params, *first, dropout_rng)
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (grads_and_sums[0], grads_and_sums[1][0]))
            (grads, sums), split_state = jax.lax.scan(accumulate, zeros,
                                                       (jnp.arange(micro), split_state, split_batch))
            carried = _merge_rows(split_state)
        grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)  # token-weighted mean
        sums["grad_norm"] = optax.tree.norm(grads)
        sums["lr"] = lr_schedule(state.step) * lr_factor
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: (u * lr_factor).astype(u.dtype), updates)
        return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                             opt_state=opt_state, mixer_state=carried), sums

    return nn_common.under_axis_rules(train_step, config.mesh.rules)


def make_eval_step(config: Any) -> Callable:
    """``(params, apply_fn, batch, state) -> (sums, state)``; ``state`` (the mixers' carried state) is empty
    except on streams."""
    def eval_step(params, apply_fn, batch, carried):
        outputs, carried = apply_model(apply_fn, params, carried, batch, deterministic=True,
                                      logits=not config.optim.fused_loss)
        weights = (batch["targets_segmentation"] > 0) & (batch["example_weight"][:, None] > 0)
        return metrics.label_smoothed_loss(outputs, batch["targets"], weights, config.optim.label_smoothing), carried

    return nn_common.under_axis_rules(eval_step, config.mesh.rules)


def jit_eval_step(config: Any, mesh: jax.sharding.Mesh) -> Callable:
    """``make_eval_step`` jitted once per run. The state it returns keeps the batch's sharding, so the next
    window's call hits the same compilation (left to XLA it comes back as an equivalent but different spec,
    and every pass would compile twice)."""
    return jax.jit(make_eval_step(config), static_argnums=1, out_shardings=(None, setup.batch_sharding(mesh)))


def one_step_ahead(previous: PyTree, current: PyTree) -> PyTree:
    """Waits for ``previous`` (the outputs of the step before this one) and returns ``current``, to be passed as
    ``previous`` next time: the host dispatches at most one step ahead of the device, so the device always has the
    next step queued and never a long queue.

    Unbounded async dispatch deadlocked two processes on CPU: XLA's CPU client admits a fixed number of programs
    per device and launches a program's per-device parts from a thread pool, so a device's places filled with later
    programs while an earlier one, whose all-reduce the other devices were already in (over gloo), waited for one.
    A loop that reads nothing back for many steps (an evaluation pass) now waits here each step."""
    jax.block_until_ready(previous)
    return current


def global_batch(batch: Batch, sharding: jax.sharding.Sharding) -> Batch:
    """This process's rows -> global arrays laid out by ``sharding``."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def evaluate_loss(eval_step: Callable, params: PyTree, apply_fn: Callable, eval_set: Iterable[Batch],
                  mesh: jax.sharding.Mesh, carried: mixer_state.MixerState | None = None,
                  stop_when: tuple[Callable[[], bool], str] | None = None) -> dict[str, float]:
    """Validation loss / perplexity / accuracy over every example (padding rows weigh zero); an ``EvalSet``'s
    examples packed several to a row (``pipeline.loss_batches``).

    With several processes each feeds its shard's rows of every global batch (``eval_set`` has the same number of
    batches on every process), so the sums cover the whole split once and are the same on every process.

    ``eval_step`` is ``jit_eval_step(config, mesh)``, built once per run so periodic
    evaluations reuse its compilation. ``carried``: on a stream eval set, the mixers' starting state
    (``init_mixer_state`` for the eval batch's rows, sharded as the batch) that the pass threads from window to
    window; ``None`` or empty otherwise. ``stop_when``: ``(over, why)``; one process stops the pass once
    ``over()`` (a time budget, ``why`` naming it): the scores cover the batches done, ``unscored_batches`` counts
    the rest, and a warning says so.
    """
    sharding = setup.batch_sharding(mesh)
    eval_set = pipeline.loss_batches(eval_set)
    total, carried, done, previous = None, carried or mixer_state.empty(), 0, None
    with jax.set_mesh(mesh):
        for batch in eval_set:
            batch = {k: v for k, v in batch.items() if k != "example_index"}
            sums, carried = eval_step(params, apply_fn, global_batch(batch, sharding), carried)
            total = sums if total is None else jax.tree.map(jnp.add, total, sums)
            done += 1
            previous = one_step_ahead(previous, total)
            if stop_when and done < len(eval_set) and stop_when[0]():  # the clock is now the device's, less a batch
                break
    scores = metrics.summarize(total)
    if stop_when and done < len(eval_set):
        scores["unscored_batches"] = len(eval_set) - done
        logger.warning(f"{stop_when[1]} ran out: the loss pass stopped after {done} of {len(eval_set)} "
                       f"batches ({scores['tokens']:.0f} tokens); its scores cover those only")
    return scores


def score_perplexity(config: Any, model: Any, params: PyTree, eval_set: Iterable[Batch], workdir: str, split: str,
                     *, mesh: jax.sharding.Mesh | None = None, eval_step: Callable[..., Any] | None = None,
                     stop_when: tuple[Callable[[], bool], str] | None = None) -> dict[str, Any]:
    """An LM's token-level perplexity (and loss, accuracy) on ``split``; written to ``<split>.scores.json``.
    ``mesh`` and ``eval_step``: a training run's own, so the end-of-training score compiles nothing new;
    ``stop_when``: ``evaluate_loss``'s (a pass cut short has no per-word perplexity)."""
    mesh = setup.make_mesh(config.mesh) if mesh is None else mesh
    eval_step = jit_eval_step(config, mesh) if eval_step is None else eval_step
    carried = setup.init_mixer_state(config, model, config.data.eval_batch_size, setup.batch_sharding(mesh))
    scores = dict(evaluate_loss(eval_step, params, model.apply, eval_set, mesh, carried, stop_when), split=split)
    if "unscored_batches" not in scores:
        scores.update(_word_perplexity(eval_set, scores))
    decode_and_score.write_outputs(workdir, split, None, scores)
    per_word = f", {scores['word_ppl']:.2f} per word" if "word_ppl" in scores else ""
    logger.info(f"{split}: perplexity {scores['ppl']:.2f} per token{per_word} (nll {scores['nll']:.4f}/token over "
                f"{scores['tokens']:.0f} tokens)")
    return scores


def _word_perplexity(eval_set: Any, scores: dict[str, Any]) -> dict[str, float]:
    """The per-word perplexity of an eval set of whole texts (``scoring.word_count`` over every process's
    examples); ``{}`` for document-stream windows or when a text was cut (its NLL would not be the text's)."""
    examples, stats = getattr(eval_set, "examples", None), getattr(eval_set, "stats", {})
    if examples is None or not hasattr(eval_set, "tokens"):
        return {}
    local = [scoring.word_count(e["targets"] for e in examples), int(stats.get("eval_targets_truncated", 0))]
    words, truncated = np.sum(decode_and_score.allgather_json(local), axis=0) if jax.process_count() > 1 else local
    if truncated or not words:
        return {}
    return scoring.word_perplexity(scores["nll"] * scores["tokens"], int(words))
