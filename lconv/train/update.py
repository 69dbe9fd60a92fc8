"""One update: the learning rate, the optimizer and the compiled train step.

The rate is ``step_rate`` (traced in the step) times ``TimeSchedule``'s factor by the share of training done (host-side,
the step's ``lr_factor``): a schedule change is made here alone. The optimisers are fairseq's; the dropout rng is
``fold_in(seed, step)``. Schedules and the budget: docs/training.md; parity: docs/fairseq.md.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lconv.nn import common as nn_common
from lconv.run import metrics, model_setup
from lconv.run.schema import OptimConfig, RunConfig
from lconv.train import budget as budget_lib

logger = logging.getLogger(__name__)

PyTree = Any


# The learning rate
def step_rate(optim: OptimConfig, num_steps: int) -> optax.Schedule:
    """Linear warmup from ``warmup_init_lr``, then inverse-sqrt (fairseq), cosine (to ``min_lr`` over ``cosine_period``)
    or constant; ``budget`` is the peak throughout."""
    peak, warmup, init = optim.learning_rate, max(int(optim.warmup_steps), 0), optim.warmup_init_lr
    if optim.schedule == "budget":
        return lambda step: jnp.full((), peak, jnp.float32)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = init + (peak - init) * step / max(warmup, 1)
        if optim.schedule == "inverse_sqrt":
            after = peak * jnp.sqrt(max(warmup, 1) / jnp.maximum(step, 1.0))
        elif optim.schedule == "cosine":
            period = int(optim.cosine_period) or num_steps - warmup
            progress = jnp.clip((step - warmup) / max(period, 1), 0.0, 1.0)
            after = optim.min_lr + 0.5 * (peak - optim.min_lr) * (1 + jnp.cos(math.pi * progress))
        else:
            after = jnp.asarray(peak, jnp.float32)
        return jnp.where(step < warmup, warm, after)

    return schedule


class TimeSchedule:
    """The learning rate's factor (0 to 1, the step's ``lr_factor``) by the share of training done: the budget's
    warmup-stable-decay, another schedule's cooldown, else 1 (docs/training.md, "A time budget for the whole run")."""

    FLOOR = 0.01  # the factor of the very first update (progress 0), so that it is not wasted

    def __init__(self, budget: budget_lib.Budget, schedule: str, warmup_fraction: float, decay_fraction: float, *,
                 cooldown_fraction: float = 0.0, num_steps: int = 0) -> None:
        self.budget, self.shaped = budget, schedule == "budget" and budget.enabled
        self.cooldown = cooldown_fraction if schedule != "budget" and num_steps > 0 else 0.0
        if schedule == "budget" and cooldown_fraction > 0:  # the default config's cooldown meets a budget schedule
            logger.warning(f"optim.cooldown_fraction={cooldown_fraction} is not applied with optim.schedule=budget, "
                           f"whose own decay (optim.decay_fraction={decay_fraction}) is its cooldown")
        self.active = self.shaped or self.cooldown > 0
        self.warmup, self.decay, self.num_steps = warmup_fraction, decay_fraction, num_steps
        self.first_update: float | None = None
        self._agreed: float | None = None

    def agreed_factor(self, step: int, every: int) -> float:
        """``factor(step)``, the same on every process: process 0's, agreed every ``every`` steps (a collective)."""
        if jax.process_count() == 1 or not self.active:
            return self.factor(step)
        if step % max(every, 1) == 0 or self._agreed is None:
            from jax.experimental import multihost_utils

            self._agreed = float(multihost_utils.broadcast_one_to_all(np.float32(self.time_progress())))
        return self._factor(self._agreed, step)

    def factor(self, step: int = 0) -> float:
        """This process's factor now, for the update from ``step`` (the first call starts the training time)."""
        return self._factor(self.time_progress(), step)

    def time_progress(self) -> float:
        """The share of this launch's training time gone (0 without a budget; the first call starts it)."""
        if not self.budget.enabled:
            return 0.0
        now = budget_lib.clock()
        if self.first_update is None:
            self.first_update = now
        span = max(self.budget.training_end() - self.first_update, 1e-9)
        return min(max((now - self.first_update) / span, 0.0), 1.0)

    def _factor(self, time_progress: float, step: int) -> float:
        if not self.active:
            return 1.0
        if self.shaped:
            floor = self.FLOOR if time_progress < self.warmup else 0.0
            return max(time_factor(time_progress, self.warmup, self.decay), floor)
        progress = max(time_progress, step / self.num_steps)
        return min(1.0, max(1.0 - progress, 0.0) / self.cooldown)


def time_factor(progress: float, warmup_fraction: float, decay_fraction: float) -> float:
    """The budget schedule's shape: ``progress / w`` up to ``w``, 1 until ``1 - d``, then ``(1 - progress) / d``."""
    if progress < warmup_fraction:
        return progress / warmup_fraction
    return min(1.0, (1.0 - progress) / decay_fraction)


# The optimizer
def build_optimizer(optim: OptimConfig, num_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """fairseq's optimisers, weight decay decoupled (``p -= lr * weight_decay * p`` on every parameter); ``adamw`` is
    ``adam``'s PyTorch name. ``adam_eps_form`` and ``clip_form`` pick optax's or fairseq's formulas (docs/fairseq.md,
    "Training parity")."""
    lr = step_rate(optim, num_steps)
    if optim.optimizer in ("adam", "adamw"):
        if optim.adam_eps_form == "before_correction":
            tx = optax.chain(scale_by_fairseq_adam(optim.b1, optim.b2, optim.eps),
                             optax.add_decayed_weights(optim.weight_decay), optax.scale_by_learning_rate(lr))
        else:
            tx = optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
    else:  # nag (the schema's choice rule allows nothing else)
        tx = optax.chain(optax.trace(decay=optim.momentum, nesterov=True),
                         optax.add_decayed_weights(optim.weight_decay), optax.scale_by_learning_rate(lr))
    if optim.clip_norm:
        clip = (optax.clip_by_global_norm(optim.clip_norm) if optim.clip_form == "max_norm"
                else clip_by_norm_plus_eps(optim.clip_norm))
        tx = optax.chain(clip, tx)
    return tx, lr  # gradient accumulation happens inside the train step (make_train_step)


def scale_by_fairseq_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam as fairseq computes it: eps added to the uncorrected ``sqrt(v)`` (optax adds it after correction)."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

    def update(grads, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        # 1 - b^t as -expm1(t log b): float32's b ** t is off by t ulps, which 1 - b^t magnifies (fairseq uses float64).
        step_size = jnp.sqrt(-jnp.expm1(t * math.log(b2))) / -jnp.expm1(t * math.log(b1))
        updates = jax.tree.map(lambda m, v: step_size * (m / (jnp.sqrt(v) + eps)), mu, nu)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def clip_coefficient(norm: jax.Array, clip_norm: float, clip_form: str) -> jax.Array:
    """The factor the clip multiplies the gradient by at global norm ``norm`` (0 ``clip_norm``: no clip)."""
    if not clip_norm:
        return jnp.ones((), jnp.float32)
    if clip_form == "max_norm":
        return clip_norm / jnp.maximum(norm, clip_norm)
    return jnp.minimum(1.0, clip_norm / (norm + 1e-6))


def clip_by_norm_plus_eps(clip_norm: float) -> optax.GradientTransformation:
    """fairseq's clip (``clip_grad_norm_``): every gradient times ``min(1, clip_norm / (norm + 1e-6))``, even when 1."""

    def update(grads, state, params=None):
        del params
        coefficient = clip_coefficient(optax.tree.norm(grads), clip_norm, "norm_plus_eps")
        return jax.tree.map(lambda g: (g * coefficient).astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# The compiled step
def _split_rows(tree: PyTree, micro: int) -> PyTree:
    """``[B, ...] -> [micro, B / micro, ...]`` with row ``r`` in micro-batch ``r % micro``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, micro, *x.shape[1:]), 0, 1), tree)


def _merge_rows(tree: PyTree) -> PyTree:
    """The inverse of ``_split_rows``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


def make_train_step(config: RunConfig, lr_schedule: optax.Schedule) -> Callable[..., tuple[Any, dict]]:
    """``(state, batch[, lr_factor]) -> (state, sums)``: one optimizer update from a global batch, scaled by
    ``lr_factor``; with ``optim.grad_accum_steps = n`` row ``r`` goes to micro-batch ``r % n``."""
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
    """``make_train_step`` jitted over ``mesh``: the state donated in its shardings, the batch rows split."""
    return jax.jit(make_train_step(config, lr_schedule),
                   in_shardings=(state_shardings, model_setup.batch_sharding(mesh), None),
                   out_shardings=(state_shardings, None), donate_argnums=0)
