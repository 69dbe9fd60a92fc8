"""The learning rate: ``step_rate``, the optimiser's rate at an update (traced in the train step), times
``TimeSchedule``'s factor by the share of training done (host-side, the step's ``lr_factor``): the time-shaped
``budget`` schedule and the cooldown. docs/training.md has the schedules and the budget."""
from __future__ import annotations

import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lconv.errors import UserError
from lconv.train import budget as budget_lib

logger = logging.getLogger(__name__)


def step_rate(optim: Any, num_steps: int) -> optax.Schedule:
    """Linear warmup from ``warmup_init_lr``, then inverse-sqrt (fairseq), cosine, or constant. The cosine falls
    from the peak to ``min_lr`` over ``cosine_period`` updates after warmup (fairseq's ``--lr-period-updates``;
    0 = the rest of the run), and stays at ``min_lr`` after it. ``budget`` is the peak at every step: its shape is
    in time (``TimeSchedule``), a factor the train step multiplies the update by."""
    peak, warmup, init = optim.learning_rate, max(int(optim.warmup_steps), 0), optim.warmup_init_lr
    if optim.schedule not in ("inverse_sqrt", "cosine", "constant", "budget"):
        raise UserError(f"config.optim.schedule must be inverse_sqrt, cosine, constant or budget; got "
                        f"{optim.schedule!r}")
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
    """The learning rate's factor (0 to 1, the train step's ``lr_factor``) by the share of training done.

    ``optim.schedule="budget"``: by the share of this launch's training time gone, from its first update to where
    ``budget`` stops training (its end less the final evaluation's reserve): a linear warmup over
    ``warmup_fraction`` of it, the peak, then a linear decay to 0 over its last ``decay_fraction``
    (warmup-stable-decay). In time, not steps, so a slow host does not spend a fixed number of its few updates
    warming up, and the decay ends where training does whatever the host's speed.

    Any other schedule with ``cooldown_fraction`` > 0: the schedule's rate times a linear fall to 0 over the last
    ``cooldown_fraction`` of training, whichever of ``num_steps`` and the budget's training time ends it first
    (the share done is the larger of the two shares). Otherwise always 1."""

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
        """``factor(step)``, the same on every process: with several, the share of the training time gone is
        process 0's, taken at steps that are multiples of ``every`` (a collective; the processes' clocks differ,
        and a replicated update must not) and kept between them."""
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
