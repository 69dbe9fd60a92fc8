"""What runs after each update: the stop (signals and the time budget), the log, validation and the checkpoint.

``lconv.train.loop`` runs a step, then hands a ``StepEnd`` to each hook in turn; a hook may set why training
stops after this step. Each hook owns its state (the log window, the spike guard, the budget's clock); the loop
owns none. docs/training.md has what each guards against.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import signal
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from lconv.errors import LossSpike, NonFiniteLoss
from lconv.run import checkpoints, metrics
from lconv.train import budget as budget_lib
from lconv.train import logs

logger = logging.getLogger(__name__)

STOP_REASONS = (None, "train.max_minutes", "SIGTERM", "SIGINT")  # weakest first: Ctrl-C wins over a preemption


@dataclasses.dataclass
class StepEnd:
    """One update done: its step and metric sums (device arrays), and what the hooks decide about it."""

    step: int
    sums: dict[str, Any]
    stop_reason: str | None = None  # why training stops after this step
    spiking: bool = False  # a state in a loss spike is never checkpointed

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None


class Hook(Protocol):
    def after_step(self, end: StepEnd) -> None: ...


class Stopped(BaseException):
    """A signal during the final evaluation (``Preemption(interrupt=True)``); a BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class Preemption:
    """SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) sets a flag; the loop saves a checkpoint and stops
    cleanly at the next step. A second Ctrl-C interrupts at once. With ``interrupt`` (the final validation and
    test decoding, which have no step to stop at and nothing left to save) the signal raises ``Stopped`` instead."""

    def __init__(self, interrupt: bool = False) -> None:
        self.signal_name: str | None = None
        self.interrupt = interrupt
        self.outer = signal.default_int_handler  # the SIGINT handler it takes over from (the CLIs': on_interrupt)
        try:
            outer = signal.getsignal(signal.SIGINT)
            self.outer = outer if callable(outer) and not isinstance(getattr(outer, "__self__", None), Preemption) \
                else self.outer
            signal.signal(signal.SIGTERM, self._handler)
            signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread (e.g. in a notebook worker)
            pass

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handler(self, signum, frame) -> None:
        del frame
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:  # a second Ctrl-C interrupts at once
            signal.signal(signal.SIGINT, self.outer)
        if self.interrupt:
            raise Stopped(self.signal_name)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, self.outer)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def agreed_stop(self, out_of_time: bool, step: int | None = None, every: int = 1) -> str | None:
        """Why every process stops after this step (``"SIGINT"``, ``"SIGTERM"``, ``"train.max_minutes"``), or None.

        The checkpoint save that follows a stop is a collective, so the processes agree on the strongest local
        reason (``STOP_REASONS`` order) and stop at the same step. With several processes that is an all-gather,
        done at multiples of ``every`` (always when ``step`` is None); a signal or the clock is kept until then."""
        local = self.signal_name or ("train.max_minutes" if out_of_time else None)
        if jax.process_count() == 1:
            return local
        if step is not None and step % max(every, 1):
            return None
        from jax.experimental import multihost_utils

        codes = multihost_utils.process_allgather(np.asarray(STOP_REASONS.index(local), np.int32))  # [P]
        return STOP_REASONS[int(np.max(codes))]


class StopHook:
    """Signals and the time budget: sets the step's stop reason, and times this launch's first update."""

    def __init__(self, preemption: Preemption, budget: budget_lib.Budget, max_minutes: float, every: int,
                 on_first_update: Callable[[float], None]) -> None:
        self.preemption, self.budget, self.max_minutes, self.every = preemption, budget, max_minutes, every
        self.on_first_update = on_first_update

    def after_step(self, end: StepEnd) -> None:
        if self.budget.first_update_seconds is None:  # the device's time: the update done, not dispatched
            jax.block_until_ready(end.sums)
            self.budget.first_update_seconds = self.budget.elapsed()
            self.on_first_update(self.budget.first_update_seconds)
        end.stop_reason = self.preemption.agreed_stop(self.budget.training_over(), end.step, self.every)
        if end.stop_reason == "train.max_minutes":  # agreed: every process fails at the same step
            self.budget.check_useful(end.step, self.max_minutes)


class SpikeGuard:
    """The divergence guard: a log window whose mean loss exceeds ``factor`` x the median of the (up to
    ``history``) windows before it is a spike. No checkpoint is written during a spike, so the last one is from
    before it; ``windows`` spikes in a row stop the run. Judged from the second window on: the first is about
    ln(vocab), the loss of a uniform guess, so a window far above it has diverged, however early."""

    def __init__(self, factor: float, windows: int, history: int = 20, min_history: int = 1) -> None:
        self.factor, self.windows, self.min_history = factor, windows, min_history
        self.losses: collections.deque[float] = collections.deque(maxlen=history)
        self.in_a_row = 0

    def observe(self, loss: float, step: int, last_checkpoint: int | None) -> bool:
        """Records a window's mean ``loss``; returns whether it is a spike; raises ``LossSpike`` on the
        ``windows``-th in a row."""
        median = statistics.median(self.losses) if len(self.losses) >= self.min_history else math.inf
        spike = bool(self.factor) and loss > self.factor * median
        if not spike:
            self.losses.append(loss)
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        if self.in_a_row >= self.windows:
            raise LossSpike(
                f"loss {loss:.4g} by step {step} is above {self.factor:g} x its running median {median:.4g} for "
                f"{self.in_a_row} log windows in a row; stopped, and the last checkpoint before the spike is kept "
                f"(step {last_checkpoint}); lower config.optim.learning_rate, set optim.clip_norm, or set "
                "train.spike_factor=0 to turn the guard off")
        return True


def check_finite(sums: dict[str, Any], step: int, ckpt: checkpoints.Checkpointer) -> dict[str, float]:
    """Raises on a non-finite loss in ``sums`` (a window of steps ending at ``step``); returns the summary."""
    summary = metrics.summarize(sums)
    if not math.isfinite(summary["loss"]):
        raise NonFiniteLoss(
            f"non-finite loss ({summary['loss']}) by step {step}; the last good checkpoint is kept "
            f"(step {ckpt.latest_step()}); lower config.optim.learning_rate or set optim.clip_norm")
    return summary


class LogHook:
    """Sums each log window's metrics and writes them (metrics.jsonl, TensorBoard, the bar). A window also ends at
    each checkpoint, where its loss is checked first: a diverged state is never saved, nor one in a spike."""

    def __init__(self, writer: logs.MetricWriter, progress: logs.Progress, guard: SpikeGuard,
                 ckpt: checkpoints.Checkpointer, *, log_every: int, checkpoint_every: int, num_steps: int) -> None:
        self.writer, self.progress, self.guard, self.ckpt = writer, progress, guard, ckpt
        self.log_every, self.checkpoint_every, self.num_steps = log_every, checkpoint_every, num_steps
        self.window_sums: dict[str, Any] | None = None
        self.window_start = time.time()
        self.spiking = False

    def after_step(self, end: StepEnd) -> None:
        step, sums = end.step, end.sums
        self.window_sums = sums if self.window_sums is None else jax.tree.map(jnp.add, self.window_sums, sums)
        self.progress.advance(step)
        saving = end.stopping or step % self.checkpoint_every == 0
        if step % self.log_every == 0 or step == self.num_steps or saving:
            summary = check_finite(self.window_sums, step, self.ckpt)  # never checkpoint a diverged state
            self.spiking = self.guard.observe(summary["loss"], step, self.ckpt.latest_step())
            summary.update(lr=float(sums["lr"]), grad_norm=float(sums["grad_norm"]),
                           tokens_per_s=summary["tokens"] / max(time.time() - self.window_start, 1e-9))
            self.writer.write(step, "train", summary)
            self.progress.set_postfix(loss=f"{summary['loss']:.3f}", ppl=f"{summary['ppl']:.1f}",
                                      tok_s=f"{summary['tokens_per_s']:.0f}")
            self.window_sums, self.window_start = None, time.time()
        end.spiking = self.spiking


class ValidationHook:
    """A validation pass every ``eval_every`` steps (not at the last: the final evaluation has its own), then
    ``early_stop``'s reason to stop, if any."""

    def __init__(self, score_validation: Callable[[int], Any], early_stop: Callable[[], str | None], *,
                 eval_every: int, num_steps: int) -> None:
        self.score_validation, self.early_stop = score_validation, early_stop
        self.eval_every, self.num_steps = eval_every, num_steps

    def after_step(self, end: StepEnd) -> None:
        if end.step % self.eval_every or end.step >= self.num_steps:
            return
        self.score_validation(end.step)
        if not end.stopping and self.early_stop():  # agreed: every process has the same scores
            end.stop_reason = self.early_stop()


class CheckpointHook:
    """Saves every ``checkpoint_every`` steps (``Checkpointer.save`` decides) and at a stop, never in a spike."""

    def __init__(self, ckpt: checkpoints.Checkpointer, run: Any) -> None:
        self.ckpt, self.run = ckpt, run

    def data_item(self) -> Any:
        return checkpoints.gather_process_states(self.run.data.train_iter.get_state())

    def after_step(self, end: StepEnd) -> None:
        if not end.spiking:
            self.ckpt.save(end.step, self.run.state, self.data_item, force=end.stopping)

    def final(self, step: int, spiking: bool) -> None:
        """The last step's checkpoint (unless in a spike), then the checkpointer closed."""
        if not spiking:
            self.ckpt.save(step, self.run.state, self.data_item, force=True)
        self.ckpt.close()
