"""The run's time budget, ``train.max_minutes``: training, the final validation and the test score together.

Training stops when the time left is what the final evaluation needs (its estimate x ``SAFETY_MARGIN``), so that the
whole run ends within the budget.
What the evaluation needs is measured (``estimate_final_evaluation``) once training has had ``MEASURE_AT_SHARE`` of
the budget (one process; several measure before the first update, together): the validation loss over a few
batches of the validation split, and for a decoded test split (BLEU / ROUGE) its first batch decoded twice,
extrapolated to every batch of both splits. When the estimate was short (or the evaluation alone needs more than
the budget), the final passes stop at the budget too (one process; ``Budget.stop_when``): their scores then cover the
batches done by then, and a warning says so.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from lconv.data import pipeline
from lconv.decode_settings import DecodeSettings
from lconv.infer import compiled, time_estimate

logger = logging.getLogger(__name__)

clock: Callable[[], float] = time.monotonic  # seconds; the tests put a fake clock here

PROBE_BATCHES = 3  # validation batches timed for the estimate: the first compiles, the others are timed
# Training leaves the final evaluation its estimate times this: the probe times a few batches before training, and a
# shared machine's load changes (the walk-through's default run on a busy 2-core CPU needed about twice its
# estimate, and its test decoding was cut to 64 of 1,216 sentences); a cut evaluation costs more than the margin.
SAFETY_MARGIN = 1.5
# One process measures the final evaluation once training has had this share of the budget (or when the provisional
# reserve is all that is left), not before the first update: the measurement compiles the evaluation and decoding
# programs (about 25 s on a slow 2-core CPU), which the end needs anyway, so moving it only moves time; and a model
# some minutes in decodes as the final one will, where an untrained one babbles to the length limit.
MEASURE_AT_SHARE = 0.2
PROVISIONAL_RESERVE_SHARE = 0.25  # training's reserve for the final evaluation until it is measured


class Budget:
    """``train.max_minutes`` from ``start`` (the ``clock()`` when the run started; default now); 0 = no budget
    (nothing is ever over)."""

    def __init__(self, minutes: float, start: float | None = None) -> None:
        self.seconds, self.start = 60.0 * minutes, clock() if start is None else start
        self.estimate = 0.0  # seconds the final evaluation is estimated to take (``estimate_final_evaluation``)
        self.reserve = 0.0  # seconds training leaves it: the estimate x SAFETY_MARGIN
        self._measure: Callable[[], None] | None = None  # ``measure_later``'s, until it has run
        self.first_update_seconds: float | None = None  # this launch's first update was done this long after start
        self._measure_at = 0.0

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def elapsed(self) -> float:
        return clock() - self.start

    def measure_later(self, measure: Callable[[], None]) -> None:
        """Keeps ``PROVISIONAL_RESERVE_SHARE`` of the budget for the final evaluation until ``measure`` (which sets
        ``estimate`` and ``reserve``) has run: ``training_over`` runs it once ``MEASURE_AT_SHARE`` of the budget is
        gone, or sooner if only the provisional reserve is left."""
        self._measure, self._measure_at = measure, MEASURE_AT_SHARE * self.seconds
        self.reserve = PROVISIONAL_RESERVE_SHARE * self.seconds

    def training_over(self) -> bool:
        """Whether training must stop now to leave the final evaluation its time (measuring it first when
        ``measure_later``'s time has come)."""
        if not self.enabled:
            return False
        if self._measure is not None and (self.elapsed() >= self._measure_at or clock() >= self.training_end()):
            measure, self._measure = self._measure, None
            measure()
        return clock() >= self.training_end()

    def training_end(self) -> float:
        """The ``clock()`` at which training stops: the budget's end less the final evaluation's reserve."""
        return self.start + self.seconds - self.reserve

    def over(self) -> bool:
        return self.enabled and self.elapsed() >= self.seconds

    def stop_when(self) -> tuple[Callable[[], bool], str] | None:
        """What the final evaluation's passes stop at (``over``, named): with one process and a budget; several
        processes would stop at different batches of their collectives, so they finish the passes."""
        return (self.over, "train.max_minutes") if self.enabled and jax.process_count() == 1 else None


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

    def __init__(self, budget: Budget, schedule: str, warmup_fraction: float, decay_fraction: float, *,
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
        now = clock()
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


def _seconds_per_batch(evaluate: Callable[[Any], Any], eval_set: Any) -> float:
    """The time of one batch of ``evaluate(batches)`` over ``eval_set``: its first batch compiles untimed, the next
    ``PROBE_BATCHES - 1`` are timed; a set of one batch is timed with its compilation (an upper bound)."""
    start = clock()
    evaluate(itertools.islice(iter(eval_set), 1))
    if len(eval_set) < 2:
        return clock() - start
    timed = min(PROBE_BATCHES - 1, len(eval_set) - 1)
    start = clock()
    evaluate(itertools.islice(iter(eval_set), 1, 1 + timed))
    return (clock() - start) / timed


def estimate_final_evaluation(run: Any, evaluate_loss: Callable[[Any], Any],
                              translator: compiled.Translator | None, settings: DecodeSettings) -> float:
    """Seconds the final evaluation of ``run`` will take: the validation loss pass (``evaluate_loss(batches)``),
    and with ``train.eval_after_training`` the test split's (an LM's perplexity: the same pass; else decoding
    with ``translator`` and ``settings``, ``time_estimate.estimate_decode_seconds``)."""
    config, eval_sets = run.config, run.data.eval_sets
    validation = pipeline.loss_batches(eval_sets["validation"])
    per_batch = _seconds_per_batch(evaluate_loss, validation)
    seconds = per_batch * len(validation)
    split = config.decode.split
    if config.train.eval_after_training and split in eval_sets:
        if config.task == "lm":
            seconds += per_batch * len(pipeline.loss_batches(eval_sets[split]))
        else:
            seconds += time_estimate.estimate_decode_seconds(config, eval_sets[split], translator, settings, clock)
    return seconds
