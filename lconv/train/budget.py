"""The run's time budget, ``train.max_minutes``: training, the final validation and the test score together.

Training stops when the time left is what the final evaluation needs (its estimate x ``SAFETY_MARGIN``), so that the
whole run ends within the budget.
What the evaluation needs is measured before the first update (``estimate_final_evaluation``): the validation loss
over a few batches of the validation split, and for a decoded test split (BLEU / ROUGE) its first batch decoded
twice, extrapolated to every batch of both splits. When the estimate was short (or the evaluation alone needs more than
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

from lconv.infer import compiled, decode_and_score

logger = logging.getLogger(__name__)

clock: Callable[[], float] = time.monotonic  # seconds; the tests put a fake clock here

PROBE_BATCHES = 3  # validation batches timed for the estimate: the first compiles, the others are timed
# Training leaves the final evaluation its estimate times this: the probe times a few batches before training, and a
# shared machine's load changes (the walk-through's default run on a busy 2-core CPU needed about twice its
# estimate, and its test decoding was cut to 64 of 1,216 sentences); a cut evaluation costs more than the margin.
SAFETY_MARGIN = 1.5


class Budget:
    """``train.max_minutes`` from ``start`` (the ``clock()`` when the run started; default now); 0 = no budget
    (nothing is ever over)."""

    def __init__(self, minutes: float, start: float | None = None) -> None:
        self.seconds, self.start = 60.0 * minutes, clock() if start is None else start
        self.estimate = 0.0  # seconds the final evaluation is estimated to take (``estimate_final_evaluation``)
        self.reserve = 0.0  # seconds training leaves it: the estimate x SAFETY_MARGIN

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def elapsed(self) -> float:
        return clock() - self.start

    def training_over(self) -> bool:
        """Whether training must stop now to leave the final evaluation its time."""
        return self.enabled and self.seconds - self.elapsed() <= self.reserve

    def over(self) -> bool:
        return self.enabled and self.elapsed() >= self.seconds

    def stop_when(self) -> tuple[Callable[[], bool], str] | None:
        """What the final evaluation's passes stop at (``over``, named): with one process and a budget; several
        processes would stop at different batches of their collectives, so they finish the passes."""
        return (self.over, "train.max_minutes") if self.enabled and jax.process_count() == 1 else None


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
                              translator: compiled.Translator | None) -> float:
    """Seconds the final evaluation of ``run`` will take: the validation loss pass (``evaluate_loss(batches)``),
    and with ``train.eval_after_training`` the test split's (an LM's perplexity: the same pass; else decoding
    with ``translator``, ``decode_and_score.estimate_decode_seconds``)."""
    config, eval_sets = run.config, run.data.eval_sets
    per_batch = _seconds_per_batch(evaluate_loss, eval_sets["validation"])
    seconds = per_batch * len(eval_sets["validation"])
    split = config.decode.split
    if config.train.eval_after_training and split in eval_sets:
        if config.task == "lm":
            seconds += per_batch * len(eval_sets[split])
        else:
            seconds += decode_and_score.estimate_decode_seconds(config, eval_sets[split], translator, clock)
    return seconds
