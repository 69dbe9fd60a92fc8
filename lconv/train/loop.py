"""The training loop: step -> update -> hooks, then the final evaluation.

``train_and_evaluate`` builds the run once (``setup.build_run``), restores its latest readable checkpoint (state
and data-iterator position, so a resume is exact), then each step runs the update (``lconv.train.update``) and
the hooks (``lconv.train.hooks``: stop, log, validation, checkpoint) until ``train.num_steps``, the time budget
or a signal; then it scores the test split (BLEU / ROUGE, or perplexity for LMs). ``train.max_minutes`` budgets
the whole run, the final evaluation included (``lconv.train.budget``).
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from lconv import json_text, outputs
from lconv.data import paths
from lconv.deadline import Deadline
from lconv.decode_settings import DecodeSettings
from lconv.infer import compiled, split_scoring
from lconv.run import checkpoints, integrity, loss_pass, model_setup
from lconv.run import workdir as workdir_lib
from lconv.train import budget as budget_lib
from lconv.train import eval_control, hooks, init_from, logs, setup, update

logger = logging.getLogger(__name__)


def train_and_evaluate(config: Any, workdir: str, *, devices: Sequence[jax.Device] | None = None,
                       accept_config_changes: bool = False) -> dict[str, Any]:
    """Trains ``config`` in ``workdir`` (resuming from its latest checkpoint), then evaluates. Returns metrics.

    ``devices``: the devices of the mesh (default: all). Checkpoints go to ``<workdir>/checkpoints`` (the last
    ``train.keep_checkpoints``) and the best by validation loss to ``<workdir>/best``. The workdir is locked for
    the run (``lconv.run.workdir``); ``accept_config_changes`` lets a resumed run change fields of the config its
    checkpoints were trained with. ``result["stopped_by"]`` names the signal that stopped it early, if any. With
    ``train.init_from`` a new run starts from another run's params (``lconv.train.init_from``).
    """
    started = budget_lib.clock()  # train.max_minutes counts from here: data preparation and setup included
    devices = jax.devices() if devices is None else list(devices)
    checked = setup.check_config(config, devices)  # before anything is written, the workdir included
    source = init_from.prepare(checked.config, workdir)  # train.init_from's run, checked against this one
    path = workdir_lib.make_workdir(workdir)
    with workdir_lib.lock(path):
        if source is not None:
            source.copy_tokenizer(path)  # before build_run loads the workdir's tokenizer
        run = setup.build_run(config, path, devices, accept_config_changes=accept_config_changes,
                              checked=checked)
        if source is not None and not checkpoints.has_checkpoint(path):
            source.restore_params(run)
        return _resume_then_train(run, started)


def _resume_then_train(run: setup.Run, started: float) -> dict[str, Any]:
    """Restores ``run``'s latest readable checkpoint (if any), sets up checkpointing, the metric writer and the
    validation pass (which also offers the best checkpoint), then ``_train_within_budget``; a full disk becomes
    ``checkpoints.disk_full``'s one-line error."""
    config = run.config
    verify, async_save = config.train.checkpoint_checksums, config.train.async_checkpoints
    ckpt = checkpoints.Checkpointer(run.workdir, keep=config.train.keep_checkpoints,
                                    save_every=config.train.checkpoint_every, checksums=verify, async_save=async_save)
    control = eval_control.EvalControl.from_config(config.train)  # the metric of the best checkpoint, patience
    best = eval_control.best_checkpointer(control, run.workdir, checksums=verify, async_save=async_save)
    tracker = eval_control.Tracker(control, best)
    if ckpt.latest_step() is not None:
        run.state, data_item = ckpt.restore_latest_readable(checkpoints.abstract_like(run.state))
        checkpoints.restore_iterator(run.data.train_iter, data_item, ckpt.directory)
        logger.info(f"resumed from step {int(run.state.step)}")
        tracker.resume(run.workdir, int(run.state.step))  # patience's count, before the log drops later rows
        workdir_lib.write_config(run.record, run.workdir, run.config_changes, has_checkpoint=True)
    writer = logs.MetricWriter(run.workdir, resumed_step=int(run.state.step))
    eval_step = loss_pass.jit_eval_step(config, run.mesh)
    eval_state = model_setup.init_mixer_state(config, run.model, config.data.eval_batch_size,
                                              model_setup.batch_sharding(run.mesh))

    def score_validation(step: int, deadline: Deadline | None = None) -> dict[str, float]:
        scores = loss_pass.evaluate_loss(eval_step, run.state.params, run.state.apply_fn,
                                         run.data.eval_sets["validation"], run.mesh, eval_state, deadline)
        scores = tracker.after_validation(run, step, scores, deadline)  # + BLEU / ROUGE-L if chosen; offered
        writer.write(step, "validation", scores)
        return scores

    with integrity.orbax_errors_to_file(ckpt.error_log):
        try:
            return _train_within_budget(run, ckpt, best, writer, score_validation, eval_step, started,
                                        tracker.stop_reason)
        except Exception as err:
            if not checkpoints.is_disk_full(err):
                raise
            raise checkpoints.disk_full(err, ckpt, best) from None


def _train_within_budget(run: setup.Run, ckpt: checkpoints.Checkpointer, best: checkpoints.BestCheckpointer,
                         writer: logs.MetricWriter, score_validation: Callable[[int], Any],
                         eval_step: Callable[..., Any], started: float,
                         early_stop: Callable[[], str | None] = lambda: None) -> dict[str, Any]:
    """Trains within ``train.max_minutes`` (its final evaluation's share measured and reserved), then runs the
    final evaluation unless a signal stopped training; returns the run's result."""
    t0, budget = time.time(), budget_lib.Budget(run.config.train.max_minutes, started)
    reservation = {}  # the translator the measurement compiled, for the test split's decoding to reuse
    settings = run.config.search  # the test split's search: the config's, built once
    if budget.enabled:
        def measure() -> None:
            reservation["translator"] = _reserve_final_evaluation(run, budget, eval_step, settings)

        if jax.process_count() == 1:  # one clock: measured once training is under way (budget.measure_later)
            budget.measure_later(measure)
        else:  # each process's clock would pick another step for the measurement's collectives: all of them, now
            measure()
    try:
        if pending_final_evaluation(run.workdir) == int(run.state.step):  # stopped before: what the rerun does
            logger.info(f"the final evaluation of step {int(run.state.step)} was stopped: running it, no more "
                        "training")
            ckpt.close()
            step, stopped_by = int(run.state.step), None
        elif early_stop():  # resumed at the pass where patience ran out (a rerun): it stops there, as it did
            logger.info(f"stopping at step {int(run.state.step)}: {early_stop()}")
            ckpt.close()
            step, stopped_by = int(run.state.step), None
        else:
            if budget.enabled and jax.process_count() == 1 and budget_lib.clock() >= budget.training_end():
                budget.check_useful(int(run.state.step), run.config.train.max_minutes)  # setup took it all
            step, stopped_by = train(run, ckpt, writer, score_validation, budget, early_stop)
    except BaseException:
        best.close()  # complete a best checkpoint still being written
        raise
    result = {"step": step, "train_minutes": (time.time() - t0) / 60}
    if budget.first_update_seconds is not None:
        result["first_update_seconds"] = budget.first_update_seconds
        result["setup_seconds"] = dict(run.setup_seconds)
    try:
        if not stopped_by:
            evaluation_start = budget_lib.clock()
            stopped_by = _final_evaluation(run, step, result, score_validation, eval_step, writer, budget,
                                           reservation.get("translator"), settings)
            result["final_evaluation_seconds"] = budget_lib.clock() - evaluation_start
    finally:
        best.close()
    if stopped_by:
        result["stopped_by"] = stopped_by
    if budget.enabled:
        result.update(budget_seconds=budget.seconds, run_seconds=budget.elapsed(),
                      final_evaluation_estimate_seconds=budget.estimate)
    writer.close()
    return result


def _reserve_final_evaluation(run: setup.Run, budget: budget_lib.Budget, eval_step: Callable[..., Any],
                              settings: DecodeSettings) -> compiled.Translator | None:
    """Measures what the final evaluation will take (``budget.estimate_final_evaluation``) and keeps that much of
    the budget for it; returns the translator it compiled, for the test split's decoding to reuse."""
    decodes = run.config.task != "lm" and run.config.train.eval_after_training
    translator = compiled.Translator(run.config.infer, run.model, run.state.params) if decodes else None
    carried = model_setup.init_mixer_state(run.config, run.model, run.config.data.eval_batch_size,
                                           model_setup.batch_sharding(run.mesh))
    evaluate = lambda batches: loss_pass.evaluate_loss(eval_step, run.state.params, run.state.apply_fn, batches,  # noqa
                                                       run.mesh, carried)
    budget.estimate = budget_lib.estimate_final_evaluation(run, evaluate, translator, settings)
    budget.reserve = budget_lib.SAFETY_MARGIN * budget.estimate
    left = budget.seconds - budget.elapsed()
    if budget.reserve >= left:
        logger.warning(f"the final evaluation alone is estimated at {budget.estimate:.0f} s, and "
                       f"train.max_minutes={run.config.train.max_minutes:g} has {max(left, 0):.0f} s left: training "
                       "stops now, and the validation and test passes stop at the budget with part of their splits; "
                       f"train.max_minutes={math.ceil((budget.elapsed() + budget.reserve) / 60) + 1} leaves "
                       "training a minute")
    logger.info(f"train.max_minutes={run.config.train.max_minutes:g} covers the final evaluation too: training "
                f"stops {budget.reserve:.0f} s before the budget ends ({budget_lib.SAFETY_MARGIN:g} x the final "
                f"validation and test's {budget.estimate:.0f} s, measured on their first batches)")
    return translator


def _final_evaluation(run: setup.Run, step: int, result: dict[str, Any], score_validation: Callable[[int], Any],
                      eval_step: Callable[..., Any], writer: logs.MetricWriter, budget: budget_lib.Budget,
                      translator: compiled.Translator | None, settings: DecodeSettings) -> str | None:
    """The last validation and the test split's score into ``result``; returns the signal that stopped them, if
    any. The final checkpoint is saved by now, so a SIGTERM (or Ctrl-C) here stops at once and cleanly: the same
    command resumes at this step and evaluates it."""
    # One process stops at once. Several would stop at different points of a collective and leave the others
    # waiting in it: there the signal is only kept from killing the process, and the evaluation completes.
    try:
        with hooks.Preemption(interrupt=jax.process_count() == 1):
            with jax.set_mesh(run.mesh):
                result["validation"] = score_validation(step, budget.deadline())
            if run.config.train.eval_after_training:
                result["test"] = evaluate_test_split(run, eval_step, settings, translator=translator, budget=budget)
                writer.write(step, "test", {k: v for k, v in result["test"].items() if isinstance(v, (int, float))})
    except hooks.Stopped as stop:
        _record_final_evaluation(run.workdir, step)
        logger.info(f"stopping the final evaluation: {stop.signal_name}; the checkpoint of step {step} is saved, and "
                    "the same command evaluates it")
        return stop.signal_name
    _record_final_evaluation(run.workdir, None)
    return None


FINAL_EVALUATION = "final_evaluation_pending.json"  # a stopped final evaluation's step: the rerun runs it alone
PENDING_RECORD_LIMIT = 4096  # bytes: the record is {"step": N}


def pending_final_evaluation(workdir: str) -> int | None:
    """The step whose final evaluation a signal stopped (recorded in the workdir), or None."""
    path = epath.Path(workdir) / FINAL_EVALUATION
    try:
        # A few bytes, checked before it is read: one planted as a huge sparse file was a MemoryError.
        paths.check_file(path, limit=PENDING_RECORD_LIMIT)
        step = json_text.loads(path.read_text())["step"] if path.exists() else None
    except (OSError, ValueError, KeyError, TypeError):  # UserError (check_file's) is a ValueError
        return None  # a damaged record: train as usual
    return step if isinstance(step, int) else None


def _record_final_evaluation(workdir: str, step: int | None) -> None:
    """Records that step ``step``'s final evaluation was stopped (process 0), or, with None, that none is pending."""
    if jax.process_index() != 0:
        return
    path = epath.Path(workdir) / FINAL_EVALUATION
    if step is not None:
        outputs.write_atomically(path, json.dumps({"step": int(step)}))
    elif path.exists():
        path.unlink()


def train(run: setup.Run, ckpt: checkpoints.Checkpointer, writer: logs.MetricWriter,
          score_validation: Callable[[int], Any], budget: budget_lib.Budget,
          early_stop: Callable[[], str | None] = lambda: None) -> tuple[int, str | None]:
    """Steps ``run.state`` to ``train.num_steps``: each step an update, then the hooks (``lconv.train.hooks``: the
    stop, the log, validation, the checkpoint), until one of them stops it. Returns ``(last step, the signal that
    stopped it or None)``. Saves the final checkpoint and closes ``ckpt``."""
    config, mesh = run.config, run.mesh
    sharding = model_setup.batch_sharding(mesh)
    train_step = run.train_step or update.jit_train_step(config, run.lr_schedule, run.state_shardings, mesh)
    step, num_steps, every = int(run.state.step), config.train.num_steps, config.train.stop_check_every
    rate = update.TimeSchedule(budget, config.optim.schedule, config.optim.warmup_fraction,
                               config.optim.decay_fraction, cooldown_fraction=config.optim.cooldown_fraction,
                               num_steps=num_steps)
    preemption = hooks.Preemption()
    progress = logs.Progress(step, num_steps, budget)
    log = hooks.LogHook(writer, progress, hooks.SpikeGuard(config.train.spike_factor, config.train.spike_windows),
                        ckpt, log_every=config.train.log_every, checkpoint_every=config.train.checkpoint_every,
                        num_steps=num_steps)
    checkpoint = hooks.CheckpointHook(ckpt, run)
    after_step: list[hooks.Hook] = [
        hooks.StopHook(preemption, budget, config.train.max_minutes, every,
                       lambda seconds: _log_first_update(run, seconds)),
        log,
        hooks.ValidationHook(score_validation, early_stop, eval_every=config.train.eval_every, num_steps=num_steps),
        checkpoint,
    ]
    previous_sums = None
    try:
        with jax.set_mesh(mesh):
            while step < num_steps:
                lr_factor = np.float32(rate.agreed_factor(step, every))
                batch = model_setup.global_batch(next(run.data.train_iter), sharding)
                run.state, sums = train_step(run.state, batch, lr_factor)
                previous_sums = model_setup.one_step_ahead(previous_sums, sums)
                step += 1
                end = hooks.StepEnd(step, sums)
                for hook in after_step:
                    hook.after_step(end)
                if end.stopping:
                    logger.info(f"stopping at step {step}: {end.stop_reason}")
                    break
    finally:
        preemption.close()
        progress.close()
        ckpt.finish()  # a save still being written when an error stops the run is the last good one: complete it
    checkpoint.final(step, log.spiking)
    # Agreed once more: a signal that came during the last step's save still skips the evaluation on every process.
    return step, preemption.agreed_stop(out_of_time=False)


def _log_first_update(run: setup.Run, seconds: float) -> None:
    """Where the launch's time went before its first update: ``build_run``'s parts, then the train step's compile
    (unless ``lconv.train.early_build`` compiled it beside the data) and first update (with a restored checkpoint,
    its restore too)."""
    parts = ", ".join(f"{name} {t:.1f} s" for name, t in run.setup_seconds.items())
    rest = seconds - sum(run.setup_seconds.values())
    step = ("run the train step (compiled beside the data's preparation, with the state)" if run.train_step else
            "compile the train step and run it")
    logger.info(f"update {int(run.state.step)} done {seconds:.1f} s after the start: {parts}; then {rest:.1f} s to "
                f"{step} (and start up, check the config, restore a checkpoint)")


def evaluate_test_split(run: setup.Run, eval_step: Callable[..., Any] | None, settings: DecodeSettings, *,
                        translator: compiled.Translator | None = None,
                        budget: budget_lib.Budget | None = None) -> dict[str, Any]:
    """The end-of-training score on ``decode.split``: perplexity for an LM, else decoded BLEU / ROUGE by the search
    ``settings`` say (with ``translator``'s programs when given; with one process, the pass stops where ``budget``
    runs out)."""
    config, split = run.config, run.config.decode.split
    deadline = budget.deadline() if budget is not None else None
    if config.task == "lm":
        return loss_pass.score_perplexity(config, run.model, run.state.params, run.data.eval_sets[split], run.workdir,
                                          split, mesh=run.mesh, eval_step=eval_step, deadline=deadline)
    translator = translator and translator.with_params(run.state.params)
    return split_scoring.score_split(config.infer, run.model, run.state.params, run.tokenizer, run.data.eval_sets,
                                        run.workdir, settings, translator=translator, deadline=deadline)
