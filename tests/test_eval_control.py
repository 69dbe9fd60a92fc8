"""Evaluation control (lconv/train/eval_control.py): the best checkpoint by a chosen metric, kept across a resume,
and early stopping after ``train.patience`` validation passes without a better value."""
import json

import helpers
import jax
import numpy as np
import pytest

from lconv.errors import UserError
from lconv.run import checkpoints
from lconv.train import eval_control


def test_the_best_checkpoint_by_bleu_keeps_the_highest_and_a_resume_reads_it_back(tmp_path):
    state = {"w": jax.device_put(np.arange(4, dtype=np.float32))}
    control = eval_control.EvalControl("bleu", beam_size=1, lenpen=1.0, patience=2)
    best = eval_control.best_checkpointer(control, str(tmp_path), async_save=False)
    tracker = eval_control.Tracker(control, best)
    decoded = iter([5.0, 7.0, 6.0, 7.0])  # the BLEU of each pass's validation decode
    tracker._decode = lambda run, deadline: {"bleu": next(decoded)}
    run = type("Run", (), {"state": state})
    stops = []
    for step, loss in zip((2, 4, 6, 8), (3.0, 2.0, 1.0, 0.5)):
        scores = tracker.after_validation(run, step, {"loss": loss})
        stops.append(tracker.stop_reason())
        assert scores["bleu"] == best.value if step <= 4 else scores["bleu"] <= best.value
    assert stops[:3] == [None, None, None] and "2 validation pass(es)" in stops[3] and "bleu" in stops[3]
    best.close()
    assert best.checkpointer.read_data(4) == {"step": 4, "validation_loss": 2.0, "validation_bleu": 7.0}
    resumed = eval_control.best_checkpointer(control, str(tmp_path))
    assert resumed.value == 7.0 and not resumed.beats(7.0) and resumed.beats(7.5)
    by_loss = eval_control.best_checkpointer(eval_control.EvalControl("loss", 1, 1.0, 0), str(tmp_path))
    assert by_loss.value == 2.0 and by_loss.beats(1.9)  # the record keeps the loss too
    for checkpointer in (resumed, by_loss):
        checkpointer.close()


def test_a_pass_cut_short_is_neither_scored_nor_counted():
    control = eval_control.EvalControl("loss", 1, 1.0, patience=1)
    tracker = eval_control.Tracker(control, best=None)  # never reached: nothing is offered
    assert tracker.after_validation(None, 5, {"loss": 9.0, "unscored_batches": 3}) == {"loss": 9.0,
                                                                                       "unscored_batches": 3}
    assert tracker.stop_reason() is None


@pytest.mark.parametrize("task, fields, named", [
    ("lm", dict(best_metric="bleu"), ["config.train.best_metric='bleu'", "lm", "loss"]),
    ("translation", dict(best_metric="rougeL"), ["config.train.best_metric='rougeL'", "bleu"]),
    ("translation", dict(validation_beam_size=0), ["config.train.validation_beam_size"]),
    ("summarization", dict(patience=-1), ["config.train.patience"]),
])
def test_the_settings_are_checked_with_the_config(task, fields, named):
    from lconv.configs import common
    from lconv.run import schema

    config = common.base_config()
    config.task = task
    if task == "lm":
        config.model.encoder_layers = 0
    config.train.update(fields)
    with pytest.raises(UserError) as error:
        schema.validate_config(config)
    helpers.one_line_error(error, *named)


@pytest.mark.slow  # trains and decodes a tiny model in this process: compiles for many seconds
def test_a_run_picks_its_best_by_bleu_and_stops_after_patience(tiny_data, tmp_path, lconv_log):
    import tiny_config

    from lconv.train import loop

    config = tiny_config.training_config(tiny_data.data_dir, num_steps=12, eval_every=2,
                                         best_metric="bleu", patience=1)
    config.data.max_validation_examples = 16  # the validation decode: a few seconds
    workdir = helpers.new_workdir(tiny_data, tmp_path / "run")
    result = loop.train_and_evaluate(config, str(workdir), devices=jax.devices("cpu")[:1])
    with open(workdir / "metrics.jsonl") as f:
        passes = [(r["step"], r["bleu"]) for r in map(json.loads, f) if r["split"] == "validation"]
    # patience=1: training stops at the first pass whose BLEU is not above every earlier one
    expected_stop = next((step for i, (step, bleu) in enumerate(passes[1:], 1)
                          if bleu <= max(b for _, b in passes[:i])), 12)
    assert result["step"] == expected_stop
    if expected_stop < 12:
        assert any(f"stopping at step {expected_stop}: early stopping" in line for line in lconv_log())
    best = checkpoints.BestCheckpointer(str(workdir), metric="bleu", higher_is_better=True)
    record = best.checkpointer.read_data(best.checkpointer.latest_step())
    assert record["validation_bleu"] == max(bleu for _, bleu in passes) and "validation_loss" in record
    best.close()


class _Best:
    """A best checkpoint in memory (``BestCheckpointer``'s ``value``, ``beats`` and ``offer``, lower is better)."""

    def __init__(self, value: float = float("inf")) -> None:
        self.value = value

    def beats(self, value: float) -> bool:
        return value < self.value

    def offer(self, step, state, validation_loss, value=None) -> bool:
        if not self.beats(validation_loss if value is None else value):
            return False
        self.value = validation_loss if value is None else value
        return True


# (step, validation scores): a pass cut short by a time budget is logged but neither compared nor counted
_PASSES = [(2, {"loss": 5.0}), (4, {"loss": 4.0}), (6, {"loss": 4.5}), (8, {"loss": 4.2, "unscored_batches": 2}),
           (10, {"loss": 3.9}), (12, {"loss": 4.0}), (14, {"loss": 3.95}), (16, {"loss": 4.1}), (18, {"loss": 3.8})]


def _train(tracker, workdir, passes, resumed_step=0):
    """Each pass through the tracker and into metrics.jsonl as the training loop logs it; the step the run stops
    at (patience ran out), or None."""
    from lconv.train import logs

    workdir.mkdir(exist_ok=True)
    writer = logs.MetricWriter(str(workdir), resumed_step=resumed_step)
    try:
        for step, scores in passes:
            writer.write(step, "validation", tracker.after_validation(type("Run", (), {"state": None}), step,
                                                                      dict(scores)))
            if tracker.stop_reason():
                return step
    finally:
        writer.close()
    return None


@pytest.mark.parametrize("interrupted_at", [2, 4, 6, 8, 10, 12])
def test_patience_counts_across_a_resume_and_stops_at_the_uninterrupted_runs_pass(tmp_path, interrupted_at):
    """Killed after logging two more passes than its last checkpoint (``interrupted_at``), a resumed run replays
    the count and its best value from metrics.jsonl and stops at the pass the uninterrupted run stops at. Counted
    from the resume against the best checkpoint's value (as it was), it stopped elsewhere."""
    control = eval_control.EvalControl("loss", 1, 1.0, patience=3)
    whole = _train(eval_control.Tracker(control, _Best()), tmp_path / "whole", _PASSES)
    assert whole == 16  # 12, 14, 16: three passes in a row not below 3.9 (the cut pass at 8 is not one)
    workdir = tmp_path / "resumed"
    before = [(s, scores) for s, scores in _PASSES if s <= interrupted_at + 4]  # logged, then killed
    first = eval_control.Tracker(control, _Best())
    assert _train(first, workdir, before) in (None, 16)
    best_checkpoint = _Best(min(p["loss"] for s, p in before if "unscored_batches" not in p))  # saved past the resume
    resumed = eval_control.Tracker(control, best_checkpoint)
    resumed.resume(str(workdir), interrupted_at)
    rest = [(s, scores) for s, scores in _PASSES if s > interrupted_at]
    assert _train(resumed, workdir, rest, resumed_step=interrupted_at) == whole
    logged = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [s for s, _ in _PASSES if s <= whole]
    fresh = eval_control.Tracker(control, _Best(best_checkpoint.value))  # the count restarted at the resume
    if interrupted_at in (8, 12):  # 8: the checkpoint's 3.9, saved at 10, makes 10 no better; 12: 14-18 go on
        assert _train(fresh, tmp_path / "fresh", rest) != whole


def test_a_run_resumed_where_patience_ran_out_stops_there(tmp_path):
    control = eval_control.EvalControl("loss", 1, 1.0, patience=3)
    assert _train(eval_control.Tracker(control, _Best()), tmp_path, _PASSES) == 16
    resumed = eval_control.Tracker(control, _Best(3.9))
    resumed.resume(str(tmp_path), 16)
    assert resumed.passes_without_better == 3 and "3 validation pass(es)" in resumed.stop_reason()
    assert "3.9" in resumed.stop_reason()
    without = eval_control.Tracker(eval_control.EvalControl("loss", 1, 1.0, patience=0), _Best(3.9))
    without.resume(str(tmp_path), 16)  # no patience: nothing read, nothing counted
    assert without.passes_without_better == 0 and without.stop_reason() is None


def test_a_metrics_log_with_an_infinite_or_foreign_step_is_read_past(tmp_path):
    """metrics.jsonl from elsewhere: a row whose step is 1e999 (JSON's infinity) or not a number is not a pass,
    and the log's other rows still are; the resume's row bookkeeping skips it the same way."""
    from lconv.train import logs

    rows = ['{"step": 2, "split": "validation", "loss": 3.0}', '{"step": 1e999, "split": "validation", "loss": 1}',
            '{"step": "x", "split": "validation", "loss": 1}', '{"step": 4, "split": "validation", "loss": 2.5}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert eval_control.validation_values(str(tmp_path), 10, "loss") == [3.0, 2.5]
    assert [logs._row_key(row) for row in rows] == [(2, "validation"), None, None, (4, "validation")]
