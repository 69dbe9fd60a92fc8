"""Evaluation control: the metric that picks ``<workdir>/best``, and early stopping (``config.train.best_metric``,
``validation_beam_size``, ``validation_lenpen``, ``patience``). The training loop's validation pass hands its scores to
``Tracker.after_validation`` and asks ``Tracker.stop_reason``. The rules: docs/training.md, "Evaluation"."""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import numpy as np
from etils import epath

from lconv import json_text
from lconv.deadline import Deadline
from lconv.decode_settings import DecodeSettings
from lconv.run import checkpoints
from lconv.train import logs

logger = logging.getLogger(__name__)

HIGHER_IS_BETTER = {"loss": False, "bleu": True, "rougeL": True}


@dataclasses.dataclass(frozen=True)
class EvalControl:
    """``config.train``'s evaluation-control fields, checked by the schema."""

    metric: str  # "loss" | "bleu" | "rougeL"
    beam_size: int  # the validation decode's search (metric bleu / rougeL)
    lenpen: float
    patience: int  # 0 = never stop early

    @classmethod
    def from_config(cls, train: Any) -> EvalControl:
        return cls(str(train.best_metric), int(train.validation_beam_size), float(train.validation_lenpen),
                   int(train.patience))

    @property
    def decodes(self) -> bool:
        return self.metric != "loss"


def best_checkpointer(control: EvalControl, workdir: str, **options: Any) -> checkpoints.BestCheckpointer:
    """The ``BestCheckpointer`` that keeps the best state by ``control.metric``."""
    return checkpoints.BestCheckpointer(workdir, metric=control.metric,
                                        higher_is_better=HIGHER_IS_BETTER[control.metric], **options)


class Tracker:
    """Scores each validation pass, offers it to the best checkpoint, and counts passes without a better one."""

    def __init__(self, control: EvalControl, best: checkpoints.BestCheckpointer) -> None:
        self.control, self.best = control, best
        self.passes_without_better = 0
        # the value the count compares with: the best checkpoint's, but where a resume replays it (``resume``)
        self.best_value = best.value if best is not None else _worst(control.metric)

    def after_validation(self, run: Any, step: int, scores: dict[str, Any],
                         deadline: Deadline | None = None) -> dict[str, Any]:
        """``scores`` (a validation loss pass of ``run``) with the decoded metric added when chosen; the state is
        offered to the best checkpoint unless the pass was cut short."""
        if "unscored_batches" in scores:
            return scores
        value = scores["loss"]
        if self.control.decodes:
            decoded = self._decode(run, deadline)
            scores, value = {**scores, self.control.metric: decoded[self.control.metric]}, decoded[self.control.metric]
            if "undecoded" in decoded:
                return scores
        better = _beats(self.control.metric, value, self.best_value)
        self.best.offer(step, run.state, scores["loss"], value)
        self.passes_without_better = 0 if better else self.passes_without_better + 1
        self.best_value = value if better else self.best_value
        return scores

    def resume(self, workdir: str, step: int) -> None:
        """The count and value an uninterrupted run had after ``step``, replayed from ``metrics.jsonl``."""
        if not self.control.patience:
            return
        values = validation_values(workdir, step, self.control.metric)
        if values:
            self.best_value, self.passes_without_better = replay(self.control.metric, values)
        if jax.process_count() > 1:  # every process stops at the same pass: process 0's reading of the log
            from jax.experimental import multihost_utils

            agreed = multihost_utils.broadcast_one_to_all(np.array([self.best_value, self.passes_without_better]))
            self.best_value, self.passes_without_better = float(agreed[0]), int(agreed[1])
        if self.passes_without_better:
            logger.info(f"resumed with {self.passes_without_better} validation pass(es) in a row without a better "
                        f"{self.control.metric} than {self.best_value:.4g} (config.train.patience="
                        f"{self.control.patience})")

    def stop_reason(self) -> str | None:
        """Why training stops early (``patience`` passes without a better value), or None."""
        patience = self.control.patience
        if not patience or self.passes_without_better < patience:
            return None
        return (f"early stopping: {patience} validation pass(es) in a row without a better {self.control.metric} "
                f"than {self.best_value:.4g} (config.train.patience={patience})")

    def _decode(self, run: Any, deadline: Deadline | None) -> dict[str, Any]:
        """The validation split decoded with the control's search and scored (``split_scoring.score_split``)."""
        from lconv.infer import split_scoring  # decoding's modules: imported by the runs that decode only

        settings = DecodeSettings.build(run.config.decode, beam_size=self.control.beam_size,
                                        lenpen=self.control.lenpen)
        return split_scoring.score_split(run.config.infer, run.model, run.state.params, run.tokenizer,
                                         run.data.eval_sets, run.workdir, settings, split="validation",
                                         deadline=deadline)


def _worst(metric: str) -> float:
    return -math.inf if HIGHER_IS_BETTER[metric] else math.inf


def _beats(metric: str, value: float, best: float) -> bool:
    return value > best if HIGHER_IS_BETTER[metric] else value < best


def replay(metric: str, values: list[float]) -> tuple[float, int]:
    """``(best value, passes in a row without a better one)`` after the passes that scored ``values``, in order."""
    best, count = _worst(metric), 0
    for value in values:
        better = _beats(metric, value, best)
        best, count = (value, 0) if better else (best, count + 1)
    return best, count


def validation_values(workdir: str, step: int, metric: str) -> list[float]:
    """``metric``'s value of each validation pass in ``metrics.jsonl`` up to ``step`` (cut passes left out)."""
    path = epath.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    by_step = {}
    for line in logs.read_metrics(path).splitlines():
        try:
            row = json_text.loads(line)
            if row.get("split") != "validation" or int(row["step"]) > step:
                continue
            if "unscored_batches" in row or "undecoded" in row or metric not in row:
                continue
            by_step[int(row["step"])] = float(row[metric])
        except (ValueError, OverflowError, KeyError, TypeError, AttributeError):  # a torn or foreign line: not a pass
            continue
    return [by_step[s] for s in sorted(by_step)]
