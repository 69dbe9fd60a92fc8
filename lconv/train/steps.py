"""The compiled train step: one optimizer update (with gradient accumulation and the mixers' carried state threaded
through). The evaluation loss and its pass over a split are ``lconv.run.loss_pass``'s, shared with eval.py.

Steps are ``jax.jit`` with ``in_shardings`` / ``out_shardings`` and a donated state. The dropout rng is
``fold_in(seed, step)``, so no rng state is saved.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lconv.nn import common as nn_common
from lconv.run import metrics, model_setup
from lconv.run.schema import RunConfig

PyTree = Any


def _split_rows(tree: PyTree, micro: int) -> PyTree:
    """``[B, ...] -> [micro, B / micro, ...]`` with row ``r`` in micro-batch ``r % micro``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, micro, *x.shape[1:]), 0, 1), tree)


def _merge_rows(tree: PyTree) -> PyTree:
    """The inverse of ``_split_rows``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


def make_train_step(config: RunConfig, lr_schedule: optax.Schedule) -> Callable[..., tuple[Any, dict]]:
    """``(state, batch[, lr_factor]) -> (state, sums)``: one optimizer update from a global batch.

    ``lr_factor`` (a float32 scalar; 1 when not given) multiplies the update, so the learning rate is the
    schedule's times it: the time-shaped schedule of ``optim.schedule="budget"``
    (``lconv.train.schedule.TimeSchedule``). Every optimiser lconv builds ends in the learning rate's scaling, so
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
            outputs, carried = model_setup.apply_model(state.apply_fn, params, carried, batch, deterministic=False,
                                                       rngs={"dropout": dropout_rng},
                                                       logits=not config.optim.fused_loss)
            sums = metrics.label_smoothed_loss(outputs, batch["targets"], batch["targets_segmentation"] > 0,
                                               smoothing, config.optim.label_smoothing_split)
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


def jit_train_step(config: RunConfig, lr_schedule: optax.Schedule, state_shardings: PyTree,
                   mesh: jax.sharding.Mesh) -> Callable[..., tuple[Any, dict]]:
    """``make_train_step`` jitted over ``mesh``: the state in its shardings (donated), the batch's rows split over
    the mesh's batch axes."""
    return jax.jit(make_train_step(config, lr_schedule),
                   in_shardings=(state_shardings, model_setup.batch_sharding(mesh), None),
                   out_shardings=(state_shardings, None), donate_argnums=0)
