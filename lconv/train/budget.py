"""The run's time budget, ``train.max_minutes``: training, the final validation and the test score together.

Training stops when the time left is what the final evaluation needs (its measured estimate x ``SAFETY_MARGIN``); an
estimate that was short makes the final passes stop at the budget too, and a warning says so. How the estimate is
measured: docs/training.md, "A time budget for the whole run".
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from lconv.data import pipeline
from lconv.deadline import Deadline
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled, time_estimate

logger = logging.getLogger(__name__)

clock: Callable[[], float] = time.monotonic  # seconds; the tests put a fake clock here

PROBE_BATCHES = 3  # validation batches timed for the estimate: the first compiles, the others are timed
# Training leaves the final evaluation its estimate times this: a shared machine's load changes after the probe.
SAFETY_MARGIN = 1.5
# Measured once training has had this share: its programs are needed anyway, and a trained model decodes as at the end.
MEASURE_AT_SHARE = 0.2
PROVISIONAL_RESERVE_SHARE = 0.25  # training's reserve for the final evaluation until it is measured
# Fewer updates than this leave the initialisation, whose scores mean nothing (``check_useful`` fails).
MIN_USEFUL_UPDATES = 10


class Budget:
    """``train.max_minutes`` from ``start`` (the run's start ``clock()``; default now); 0 = no budget."""

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
        """Keeps ``PROVISIONAL_RESERVE_SHARE`` of the budget for the final evaluation until ``measure`` has run."""
        self._measure, self._measure_at = measure, MEASURE_AT_SHARE * self.seconds
        self.reserve = PROVISIONAL_RESERVE_SHARE * self.seconds

    def training_over(self) -> bool:
        """Whether training must stop now to leave the final evaluation its time (measuring it when due)."""
        if not self.enabled:
            return False
        if self._measure is not None and (self.elapsed() >= self._measure_at or clock() >= self.training_end()):
            measure, self._measure = self._measure, None
            measure()
        return clock() >= self.training_end()

    def training_end(self) -> float:
        """The ``clock()`` at which training stops: the budget's end less the final evaluation's reserve."""
        return self.start + self.seconds - self.reserve

    def check_useful(self, step: int, minutes: float) -> None:
        """A one-line ``UserError`` when the budget stopped training before ``MIN_USEFUL_UPDATES`` updates."""
        if step >= MIN_USEFUL_UPDATES:
            return
        left = max(self.seconds - self.elapsed(), 0.0)
        raise UserError(f"train.max_minutes={minutes:g} cannot fit a useful run: training has to stop after {step} "
                        f"update(s) ({self.elapsed():.0f} s in), leaving the final evaluation its {self.reserve:.0f} s "
                        f"of the {left:.0f} s left, and a model needs {MIN_USEFUL_UPDATES}; give it train.max_minutes="
                        f"{math.ceil((self.elapsed() + self.reserve) / 60) + 1} or more (or 0: no budget)")

    def deadline(self) -> Deadline | None:
        """What the final evaluation's passes stop at: the budget's end with one process, else None."""
        if not self.enabled or jax.process_count() > 1:
            return None
        return Deadline(self.start + self.seconds, "train.max_minutes", clock=lambda: clock())  # the tests' clock


def _seconds_per_batch(evaluate: Callable[[Any], Any], eval_set: Any) -> float:
    """The time of one batch of ``evaluate(batches)`` over ``eval_set``, its compilation untimed."""
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
    """Seconds the final evaluation of ``run`` will take: the validation loss pass and the test split's."""
    config, eval_sets = run.config, run.data.eval_sets
    validation = pipeline.loss_batches(eval_sets["validation"])
    per_batch = _seconds_per_batch(evaluate_loss, validation)
    seconds = per_batch * len(validation)
    split = config.decode.split
    if config.train.eval_after_training and split in eval_sets:
        if config.task == "lm":
            seconds += per_batch * len(pipeline.loss_batches(eval_sets[split]))
        else:
            seconds += time_estimate.estimate_decode_seconds(config.infer, eval_sets[split], translator, settings,
                                                             clock)
    return seconds
