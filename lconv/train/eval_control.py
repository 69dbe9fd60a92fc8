"""Evaluation control: the metric that picks ``<workdir>/best``, and early stopping (``config.train.best_metric``,
``validation_beam_size``, ``validation_lenpen``, ``patience``; docs/config.md).

With ``best_metric="loss"`` the best checkpoint is the lowest validation loss, as it always was. With ``bleu``
(translation) or ``rougeL`` (summarization) each validation pass also decodes the validation split with its own
search (greedy by default: the cheapest) and scores it, as fairseq's ``--eval-bleu`` and
``--best-checkpoint-metric`` do; ``data.max_validation_examples`` caps what it decodes. ``patience`` stops training
after that many passes in a row without a better value (fairseq's ``--patience``), counted from the run's start or
resume; the final evaluation still runs. The training loop's one call: its validation pass hands its loss scores to
``Tracker.after_validation`` and asks ``Tracker.stop_reason`` after it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from lconv.decode_settings import DecodeSettings
from lconv.run import checkpoints

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
    """Scores each validation pass by the chosen metric, offers it to the best checkpoint, and counts the passes in
    a row that did not beat the best."""

    def __init__(self, control: EvalControl, best: checkpoints.BestCheckpointer) -> None:
        self.control, self.best = control, best
        self.passes_without_better = 0

    def after_validation(self, run: Any, step: int, scores: dict[str, Any],
                         stop_when: tuple[Any, str] | None = None) -> dict[str, Any]:
        """``scores`` (a validation loss pass of ``run``, a ``setup.Run``) with the decoded metric added when it is
        the chosen one; the state is offered to the best checkpoint. A pass cut short (``unscored_batches``, or a
        decode ``stop_when`` stopped: the final evaluation's time budget) is not comparable with the others: it is
        not offered."""
        if "unscored_batches" in scores:
            return scores
        value = scores["loss"]
        if self.control.decodes:
            decoded = self._decode(run, stop_when)
            scores, value = {**scores, self.control.metric: decoded[self.control.metric]}, decoded[self.control.metric]
            if "undecoded" in decoded:
                return scores
        better = self.best.beats(value)
        self.best.offer(step, run.state, scores["loss"], value)
        self.passes_without_better = 0 if better else self.passes_without_better + 1
        return scores

    def stop_reason(self) -> str | None:
        """Why training stops early (``patience`` passes without a better value), or None."""
        patience = self.control.patience
        if not patience or self.passes_without_better < patience:
            return None
        return (f"early stopping: {patience} validation pass(es) in a row without a better {self.control.metric} "
                f"than {self.best.value:.4g} (config.train.patience={patience})")

    def _decode(self, run: Any, stop_when: tuple[Any, str] | None) -> dict[str, Any]:
        """The validation split decoded with the control's search and scored (``split_scoring.score_split``)."""
        from lconv.infer import split_scoring  # decoding's modules: imported by the runs that decode only

        settings = DecodeSettings.build(run.config.decode, beam_size=self.control.beam_size,
                                        lenpen=self.control.lenpen)
        return split_scoring.score_split(run.config.infer, run.model, run.state.params, run.tokenizer,
                                         run.data.eval_sets, run.workdir, settings, split="validation",
                                         stop_when=stop_when)
