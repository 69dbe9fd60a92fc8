"""``train.max_minutes`` budgets the whole run, the final evaluation included (``lconv.train.budget``): training
stops when the time left is the final evaluation's measured estimate, the progress bar counts to the budget, and
decoding that would run past it stops there, saying so. Timed on a fake clock, so the numbers are exact."""
import collections
import concurrent.futures
import json
import math
import types

import helpers
import jax
import numpy as np
import pytest
import tiny_config
import tiny_runs

from lconv.data import pipeline
from lconv.data import tokenizer as tokenizer_lib
from lconv.deadline import Deadline
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import batching, split_scoring, time_estimate
from lconv.infer.infer_config import InferConfig
from lconv.run import model_setup
from lconv.train import budget, logs, loop, update

_ONE_DEVICE = jax.devices("cpu")[:1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def timed_run(tiny_data, tmp_path, monkeypatch):
    """``timed_run(max_minutes)``: the tiny config trained for up to 1000 steps on a fake clock where every batch
    put on the device, trained or evaluated, takes 1 s; returns ``(result, progress bar, validation batches)``."""
    clock = FakeClock()
    monkeypatch.setattr(budget, "clock", clock)
    real_global_batch = model_setup.global_batch

    def one_second_per_batch(batch, sharding):
        clock.now += 1.0
        return real_global_batch(batch, sharding)

    monkeypatch.setattr(model_setup, "global_batch", one_second_per_batch)
    bars = []

    class RecordedProgress(logs.Progress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(logs, "Progress", RecordedProgress)

    def run(max_minutes, **optim):
        config = tiny_config.training_config(tiny_data.data_dir, 1000, max_minutes=max_minutes, eval_every=1000,
                                             checkpoint_every=1000, log_every=5)
        config.optim.update(optim)
        workdir = helpers.new_workdir(tiny_data, tmp_path / f"budget_{max_minutes}")
        start = clock.now
        result = loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)
        assert clock.now - start == result["run_seconds"]
        tokenizer = tokenizer_lib.load_tokenizer(str(workdir))
        validation = pipeline.make_datasets(config.data, tokenizer).eval_sets["validation"]
        return result, bars[-1], len(pipeline.loss_batches(validation))  # the loss pass's (packed) batches

    return run


@pytest.mark.slow  # trains in-process (compiles a train and an eval step)
def test_a_budget_ends_the_run_with_its_final_validation_and_the_bar_counts_to_it(timed_run, tmp_path):
    """With optim.schedule=budget too (where training ends does not depend on the rate): each logged rate is the
    time schedule's at its update's fake second."""
    result, bar, validation_batches = timed_run(1.0, schedule="budget", warmup_fraction=0.2, decay_fraction=0.5,
                                                learning_rate=1e-3)
    # Probe (once MEASURE_AT_SHARE of the budget is gone): 1 batch compiled untimed + 2 timed (3 s); the steps go
    # on until what is left is the reserve (the estimate, 1 s a batch, x the margin); then the final validation.
    assert result["final_evaluation_estimate_seconds"] == validation_batches == result["final_evaluation_seconds"]
    reserve = budget.SAFETY_MARGIN * validation_batches
    assert result["step"] == math.ceil(60 - 3 - reserve) < 1000  # the budget, not num_steps, ended training
    assert result["run_seconds"] == 3 + result["step"] + validation_batches <= 60  # within the budget
    assert 60 - result["run_seconds"] < reserve - validation_batches + 1  # less than the margin and a step unused
    assert "unscored_batches" not in result["validation"] and result["validation"]["tokens"] > 1000  # all of it
    assert bar.total == 60 and bar.bar.unit == "s"  # counts to the budget, in seconds
    assert bar.bar.n == 3 + result["step"]  # where training ended: the rest of the bar is the evaluation

    lrs = _logged_rates(tmp_path / "budget_1.0")
    for step, lr in lrs.items():
        progress = _time_progress(step, reserve)
        floor = update.TimeSchedule.FLOOR if progress < 0.2 else 0
        want = 1e-3 * max(update.time_factor(progress, 0.2, 0.5), floor)
        assert lr == pytest.approx(want, rel=1e-5, abs=1e-9), (step, lr, want)
    assert max(lrs.values()) > 0.8e-3 and lrs[max(lrs)] < 0.1e-3  # near the peak, then near 0 at the end


def _logged_rates(workdir) -> dict[int, float]:
    """Each train log window's last update's learning rate, by its step."""
    rows = [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if r["split"] == "train"}


def _time_progress(step: int, reserve: float) -> float:
    """The share of a ``timed_run(1.0)``'s training time gone when its update ``step`` took its rate: update n takes
    it n - 1 fake seconds into training, +3 once the final evaluation's probe ran (after MEASURE_AT_SHARE of the
    budget); until then training ends where the provisional reserve begins, after it where ``reserve`` does."""
    if step <= budget.MEASURE_AT_SHARE * 60:
        return (step - 1) / (60 - budget.PROVISIONAL_RESERVE_SHARE * 60)
    return (step - 1 + 3) / (60 - reserve)


@pytest.mark.slow  # trains in-process
def test_a_cooldown_multiplies_the_schedules_rate_down_to_the_end_of_the_budgets_training(timed_run, tmp_path):
    result, _, validation_batches = timed_run(1.0, schedule="constant", warmup_steps=0, cooldown_fraction=0.5,
                                              learning_rate=1e-3)
    reserve = budget.SAFETY_MARGIN * validation_batches
    assert result["step"] == math.ceil(60 - 3 - reserve)  # the budget ended training, not num_steps (1000)
    lrs = _logged_rates(tmp_path / "budget_1.0")
    for step, lr in lrs.items():
        want = 1e-3 * min(1.0, (1.0 - _time_progress(step, reserve)) / 0.5)
        assert lr == pytest.approx(want, rel=1e-5, abs=1e-9), (step, lr, want)
    assert lrs[min(lrs)] == pytest.approx(1e-3) and lrs[max(lrs)] < 0.1e-3  # the peak, then near 0 at the end


@pytest.mark.slow  # trains in-process
def test_an_evaluation_longer_than_the_budget_is_cut_at_it_and_says_so(timed_run, lconv_log, monkeypatch):
    monkeypatch.setattr(budget, "MIN_USEFUL_UPDATES", 1)  # the cut itself, on the few updates such a budget has
    result, bar, validation_batches = timed_run(0.25)  # 15 s: less than the validation's batches alone
    # Training runs until MEASURE_AT_SHARE of the budget is gone (a step a second), then the 3 s measurement finds
    # the evaluation longer than what is left: training stops there, and the evaluation has the rest.
    steps_before = math.ceil(budget.MEASURE_AT_SHARE * 15)
    assert validation_batches > 15 and result["step"] == steps_before
    assert result["run_seconds"] == 15.0 and result["first_update_seconds"] == 1.0
    # the start's parts, on the same clock: setup takes no fake time, the first update its one second
    assert result["setup_seconds"] == {"data and tokenizer": 0.0, "datasets": 0.0, "model and optimizer state": 0.0}
    assert any(m.startswith("update 1 done 1.0 s after the start: data and tokenizer 0.0 s") for m in lconv_log())
    left = 15 - steps_before - 3
    assert result["validation"]["unscored_batches"] == validation_batches - left
    (warning,) = [m for m in lconv_log() if "train.max_minutes ran out" in m]
    assert f"after {left} of {validation_batches} batches" in warning
    (ahead,) = [m for m in lconv_log() if "estimated at" in m]  # said when measured, with a budget that fits
    assert f"at {validation_batches} s" in ahead and f"train.max_minutes=0.25 has {left} s left" in ahead
    needed = steps_before + 3 + budget.SAFETY_MARGIN * validation_batches
    assert f"train.max_minutes={math.ceil(needed / 60) + 1} " in ahead
    assert bar.total == 15


@pytest.mark.slow  # trains in-process
def test_a_budget_that_cannot_fit_useful_training_fails_in_one_line_instead_of_scoring(timed_run):
    """15 s: training must stop after 3 updates to leave the evaluation its time, too few to score anything."""
    with pytest.raises(UserError) as raised:
        timed_run(0.25)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("train.max_minutes=0.25 cannot fit a useful run: ")
    assert f"after {math.ceil(budget.MEASURE_AT_SHARE * 15)} update(s)" in message


def test_the_useful_run_check_names_the_budget_that_would_fit(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(budget, "clock", clock)
    run_budget = budget.Budget(1.0)
    run_budget.reserve = 50.0
    clock.now += 40.0
    run_budget.check_useful(budget.MIN_USEFUL_UPDATES, 1.0)  # enough updates: nothing to say
    with pytest.raises(UserError, match=r"^train.max_minutes=1 cannot fit a useful run: training has to stop after "
                                        r"2 update\(s\) \(40 s in\), leaving the final evaluation its 50 s of the 20 s "
                                        r"left, and a model needs 10; give it train.max_minutes=3 or more"):
        run_budget.check_useful(2, 1.0)


def test_the_time_schedule_follows_the_budgets_training_time():
    clock = FakeClock()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budget, "clock", clock)
        run_budget = budget.Budget(2.0)  # 120 s from now; the evaluation keeps the last 20
        run_budget.reserve = 20.0
        clock.now += 10.0  # setup: training starts 10 s in, so it has 90 s
        shaped = update.TimeSchedule(run_budget, "budget", 0.1, 0.3)
        factors = {}
        for second in (0, 4.5, 9, 45, 63, 72, 81, 90, 95):
            clock.now = run_budget.start + 10.0 + second
            factors[second] = shaped.factor()
        assert factors == pytest.approx({0: update.TimeSchedule.FLOOR, 4.5: 0.5, 9: 1.0, 45: 1.0, 63: 1.0,
                                         72: 2 / 3, 81: 1 / 3, 90: 0.0, 95: 0.0})
        assert update.TimeSchedule(run_budget, "inverse_sqrt", 0.1, 0.3).factor() == 1.0  # other schedules: 1
        assert update.TimeSchedule(budget.Budget(0.0), "budget", 0.1, 0.3).factor() == 1.0  # no budget: no shape


def test_a_cooldown_falls_to_zero_over_the_last_share_of_the_steps_or_the_time_whichever_ends_first():
    clock = FakeClock()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budget, "clock", clock)
        by_steps = update.TimeSchedule(budget.Budget(0.0), "inverse_sqrt", 0.1, 0.3, cooldown_fraction=0.25,
                                       num_steps=100)  # no budget: the share of num_steps done
        assert {step: by_steps.factor(step) for step in (0, 50, 75, 80, 90, 99)} == pytest.approx(
            {0: 1.0, 50: 1.0, 75: 1.0, 80: 0.8, 90: 0.4, 99: 0.04})
        run_budget = budget.Budget(2.0)  # training from 10 s to 100 s, as above
        run_budget.reserve = 20.0
        clock.now += 10.0
        by_time = update.TimeSchedule(run_budget, "constant", 0.1, 0.3, cooldown_fraction=0.25, num_steps=1000)
        factors = {}
        for second, step in ((0, 0), (45, 10), (72, 20), (81, 30), (90, 40), (95, 50), (45, 900)):
            clock.now = run_budget.start + 10.0 + second
            factors[second, step] = by_time.factor(step)
        assert factors == pytest.approx({(0, 0): 1.0, (45, 10): 1.0, (72, 20): 0.8, (81, 30): 0.4, (90, 40): 0.0,
                                         (95, 50): 0.0, (45, 900): 0.4})  # the last: 90% of the steps done
        unshaped = update.TimeSchedule(run_budget, "inverse_sqrt", 0.1, 0.3, cooldown_fraction=0.0, num_steps=1000)
        assert unshaped.factor(999) == 1.0
        clock.now = run_budget.start + 10.0 + 72  # the budget schedule decays over its own decay_fraction alone
        shaped = update.TimeSchedule(run_budget, "budget", 0.1, 0.3, cooldown_fraction=0.25, num_steps=1000)
        shaped.first_update = run_budget.start + 10.0
        assert shaped.factor(999) == pytest.approx(2 / 3)


def test_a_cooldown_with_the_budget_schedule_is_said_not_ignored_silently(lconv_log):
    """The default config's cooldown_fraction meets --config.optim.schedule=budget: not applied, and said once."""
    update.TimeSchedule(budget.Budget(0.0), "budget", 0.1, 0.3, cooldown_fraction=0.25, num_steps=1000)
    update.TimeSchedule(budget.Budget(0.0), "cosine", 0.1, 0.3, cooldown_fraction=0.25, num_steps=1000)
    update.TimeSchedule(budget.Budget(0.0), "budget", 0.1, 0.3, cooldown_fraction=0.0, num_steps=1000)
    (line,) = [m for m in lconv_log() if "cooldown_fraction" in m]
    assert "cooldown_fraction=0.25" in line and "schedule=budget" in line and "decay_fraction=0.3" in line


def test_without_a_budget_the_bar_counts_steps():
    bar = logs.Progress(3, 10, budget.Budget(0.0))
    bar.advance(4)
    assert (bar.total, bar.bar.n, bar.bar.unit) == (10, 4, "step")
    bar.close()


# ----------------------------------------------------------------------------------------------------------------
# Decoding: the estimate and the cap
# ----------------------------------------------------------------------------------------------------------------
COMPILE_SECONDS, SECONDS_PER_STEP, SECONDS_PER_STEP_AND_WIDTH = 5.0, 0.01, 0.0002
FIXED_SECONDS_PER_WIDTH = 0.004  # encoding the sources


class FakeTranslator:
    """Decodes nothing (every hypothesis is EOS) and costs fake time: a compilation per width not ``prepare``d
    before, then a fixed time and per search step a time, both growing linearly with the width, for as many steps
    as the longest row may search (a*length + b tokens and EOS, within the program's output length): how a beam
    search's time goes."""

    def __init__(self, clock):
        self.clock, self.params, self.widths, self.compiled = clock, {"w": np.zeros(1)}, set(), []

    def prepare(self, rows, width, settings):  # compiles in the background: no time of the caller's
        self.widths.add(width)
        done = concurrent.futures.Future()
        done.set_result(None)
        return done

    def __call__(self, inputs_BS, settings):
        width = inputs_BS.shape[1]
        longest = int(np.max(np.sum(inputs_BS != 0, axis=1)))
        steps = min(math.floor(settings.max_len_a * longest + settings.max_len_b) + 1,
                    int(min(settings.max_len_a * width + settings.max_len_b, 200)))
        self.clock.now += FIXED_SECONDS_PER_WIDTH * width
        self.clock.now += steps * (SECONDS_PER_STEP + SECONDS_PER_STEP_AND_WIDTH * width)
        if width not in self.widths:
            self.clock.now += COMPILE_SECONDS
            self.compiled.append(width)
        self.widths.add(width)
        return np.ones((inputs_BS.shape[0], 2), np.int32)


def _split(lengths, rows=4):
    tokens = [{"inputs": np.append(np.full(n - 1, 7), 1).astype(np.int32), "targets": np.ones(2, np.int32)}
              for n in lengths]
    examples = [{"inputs": f"source {i}", "targets": f"Target {i}."} for i in range(len(lengths))]
    return pipeline.EvalSet(examples, tokens, rows, -(-len(lengths) // rows), {"inputs": 200, "targets": 8},
                            collections.Counter())


def _config(rows=4):
    # decode.batch_size = rows, not auto: auto widens the batch on an accelerator, and these tests count batches
    return types.SimpleNamespace(decode=types.SimpleNamespace(beam_size=2, batch_size=rows, compound_split=False,
                                                              num_print=0, split="test", lenpen=1.0),
                                 infer=InferConfig(task="translation", mesh_rules=(), batch_size=rows,
                                                   eval_batch_size=rows, max_input_length=200, max_target_length=200,
                                                   max_positions=200, split="test", compound_split=False,
                                                   num_print=0))


def _settings(config):
    return DecodeSettings.build(dict(vars(config.decode), max_len_a=1.2, max_len_b=10, stop="optimal"))


@pytest.mark.parametrize("lengths,widths", [
    # batches of widths 32, 32, 64, 200 (the padded width)
    ([3, 5, 9, 10, 12, 20, 25, 30, 31, 40, 45, 60, 70, 100, 130, 150], {32, 64, 200}),
    # one batch of the narrowest width: its fixed time is counted as steps
    ([5, 9, 20, 31, 40, 60, 70, 100, 130, 150, 3], {32, 128, 200}),
])
def test_the_decoding_estimate_is_what_decoding_the_split_takes(lengths, widths):
    """The estimate times the narrowest width's first and last batches at the plan's narrowest and widest widths
    (the fixed time of a batch apart from its steps' time) and prepares the other widths, so the split's decoding
    with the same translator compiles nothing and takes what was estimated: per batch its fixed time, and its
    longest row's steps at its width's step time. With a single step count at the narrowest width the fixed time is
    counted as steps: the estimate is then above what decoding takes, never below."""
    clock = FakeClock()
    eval_set, config = _split(lengths), _config()
    settings = _settings(config)
    translator = FakeTranslator(clock)
    estimate = time_estimate.estimate_decode_seconds(config.infer, eval_set, translator, settings, clock)
    assert translator.widths == widths
    start = clock.now
    batches = list(batching.decode_batches(config.infer, None, {"w": np.zeros(1)}, eval_set, settings,
                                                   translator=translator))
    assert len(batches) == -(-len(lengths) // 4) and translator.compiled == []  # all prepared
    if len(lengths) == 16:
        assert estimate == pytest.approx(clock.now - start)
    else:
        assert clock.now - start < estimate < 2 * (clock.now - start)


def test_a_probe_slowed_by_a_moment_of_load_does_not_move_the_estimate():
    """Each probe is the fastest of its calls: a call slowed by other work (here every other call, by 40%) leaves
    the estimate where an idle machine puts it."""
    lengths = [3, 5, 9, 10, 12, 20, 25, 30, 31, 40, 45, 60, 70, 100, 130, 150]

    class Loaded(FakeTranslator):
        calls = 0

        def __call__(self, inputs_BS, settings):
            start, self.calls = self.clock.now, self.calls + 1
            out = super().__call__(inputs_BS, settings)
            self.clock.now += 0.4 * (self.clock.now - start) * (self.calls % 2)
            return out

    estimates = []
    for translator_class in (FakeTranslator, Loaded):
        clock = FakeClock()
        config = _config()
        estimates.append(time_estimate.estimate_decode_seconds(config.infer, _split(lengths), translator_class(clock),
                                                                  _settings(config), clock))
    assert estimates[1] == pytest.approx(estimates[0])
    assert time_estimate.PROBE_REPEATS >= 2


def test_decoding_a_split_prepares_its_later_widths():
    """``decode_batches`` has a ``compiled.Translator`` compile the widths after the first in the background, so
    the decoding compiles only its first width in turn."""
    clock = FakeClock()
    eval_set, config = _split([5, 9, 20, 31, 40, 60, 70, 100]), _config()
    translator = FakeTranslator(clock)
    list(batching.decode_batches(config.infer, None, {"w": np.zeros(1)}, eval_set, _settings(config),
                                         translator=translator))
    assert translator.compiled == [32] and translator.widths == {32, 128}


def test_decoding_stops_where_the_budget_runs_out_and_the_scores_say_how_much(tmp_path, lconv_log):
    clock = FakeClock()
    eval_set, config = _split([5, 6, 7, 8, 9, 10, 11, 12, 13, 14]), _config()
    calls = collections.Counter()

    class Counting(FakeTranslator):
        def __call__(self, inputs_BS, settings):
            calls["batches"] += 1
            return super().__call__(inputs_BS, settings)

    scores = split_scoring.score_split(config.infer, None, {"w": np.zeros(1)}, tiny_runs.tokenizer(),
                                          {"test": eval_set}, str(tmp_path), _settings(config),
                                          translator=Counting(clock),
                                          deadline=Deadline(2, "train.max_minutes", clock=lambda: calls["batches"]))
    assert calls["batches"] == 2 and scores["examples"] == 8 and scores["undecoded"] == 2
    assert len((tmp_path / "test.hyp.txt").read_text().splitlines()) == 8
    (warning,) = [m for m in lconv_log() if "train.max_minutes" in m]
    assert "8 of 10" in warning and "--split=test" in warning
