"""The training loop: resume, step, log, validate, checkpoint, stop cleanly; then the final evaluation.

``train_and_evaluate`` builds the run once (``setup.build_run``), restores its latest readable checkpoint
(state and data-iterator position, so a resume is exact), trains until ``train.num_steps``,
``train.max_minutes`` or SIGTERM, and then scores the test split (BLEU / ROUGE, or perplexity for LMs).
"""
from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lconv.errors import NonFiniteLoss
from lconv.infer import evaluate
from lconv.train import checkpoints, logs, metrics, setup, steps


class Preemption:
    """SIGTERM sets a flag; the loop saves a checkpoint and exits cleanly at the next step."""

    def __init__(self) -> None:
        self.requested = False
        try:
            signal.signal(signal.SIGTERM, self._handler)
        except ValueError:  # not the main thread (e.g. in a notebook worker)
            pass

    def _handler(self, signum, frame) -> None:
        del signum, frame
        self.requested = True


def check_finite(sums: dict[str, Any], step: int, ckpt: checkpoints.Checkpointer) -> dict[str, float]:
    """Raises on a non-finite loss in ``sums`` (a window of steps ending at ``step``); returns the summary."""
    summary = metrics.summarize(sums)
    if not math.isfinite(summary["loss"]):
        raise NonFiniteLoss(
            f"non-finite loss ({summary['loss']}) by step {step}; the last good checkpoint is kept "
            f"(step {ckpt.latest_step()}); lower config.optim.learning_rate or set optim.clip_norm")
    return summary


def train_and_evaluate(config: Any, workdir: str, *, devices: Sequence[jax.Device] | None = None,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains ``config`` in ``workdir`` (resuming from its latest checkpoint), then evaluates. Returns metrics.

    ``devices``: the devices of the mesh (default: all). Checkpoints go to ``<workdir>/checkpoints`` (the last
    ``train.keep_checkpoints``) and the best by validation loss to ``<workdir>/best``.
    """
    run = setup.build_run(config, workdir, devices, log)
    ckpt = checkpoints.Checkpointer(run.workdir, keep=config.train.keep_checkpoints,
                                    save_every=config.train.checkpoint_every)
    best = checkpoints.BestCheckpointer(run.workdir)
    if ckpt.latest_step() is not None:
        run.state, data_item = ckpt.restore_latest_readable(checkpoints.abstract_like(run.state), log=log)
        run.data.train_iter.set_state(checkpoints.this_process_state(data_item, ckpt.directory))
        log(f"resumed from step {int(run.state.step)}")
    writer = logs.MetricWriter(run.workdir)
    eval_step = steps.jit_eval_step(config, run.mesh)
    eval_memory = setup.init_memory(config, run.model, config.data.eval_batch_size, setup.batch_sharding(run.mesh))

    def validate(step: int) -> dict[str, float]:
        scores = steps.evaluate_loss(eval_step, run.state.params, run.state.apply_fn, run.data.eval_sets["validation"],
                                     run.mesh, eval_memory)
        writer.write(step, "validation", scores)
        best.offer(step, run.state, scores["loss"])
        return scores

    t0 = time.time()
    step, preempted = train(run, ckpt, writer, validate, log)
    result = {"step": step, "train_minutes": (time.time() - t0) / 60}
    if not preempted:
        with jax.set_mesh(run.mesh):
            result["validation"] = validate(step)
    best.close()
    if not preempted and config.train.eval_after_training:
        result["test"] = evaluate_test_split(run, log)
        writer.write(step, "test", {k: v for k, v in result["test"].items() if isinstance(v, (int, float))})
    writer.close()
    return result


def train(run: setup.Run, ckpt: checkpoints.Checkpointer, writer: logs.MetricWriter,
          validate: Callable[[int], Any], log: Callable[[str], None] = print) -> tuple[int, bool]:
    """Steps ``run.state`` to ``train.num_steps`` (or ``train.max_minutes``, or SIGTERM); returns
    ``(last step, whether SIGTERM stopped it)``. Saves the final checkpoint and closes ``ckpt``."""
    config, mesh = run.config, run.mesh
    sharding = setup.batch_sharding(mesh)
    train_step = jax.jit(steps.make_train_step(config, run.lr_schedule),
                         in_shardings=(run.state_shardings, sharding), out_shardings=(run.state_shardings, None),
                         donate_argnums=0)
    preemption = Preemption()
    data_item = lambda: checkpoints.gather_process_states(run.data.train_iter.get_state())  # noqa: E731
    step, num_steps = int(run.state.step), config.train.num_steps
    t0, window_sums, window_start = time.time(), None, time.time()
    progress = logs.progress(step, num_steps)
    with jax.set_mesh(mesh):
        while step < num_steps:
            run.state, sums = train_step(run.state, steps.global_batch(next(run.data.train_iter), sharding))
            step += 1
            window_sums = sums if window_sums is None else jax.tree.map(jnp.add, window_sums, sums)
            progress.update(1)
            out_of_time = config.train.max_minutes and (time.time() - t0) / 60 >= config.train.max_minutes
            stopping = bool(out_of_time or preemption.requested)
            saving = stopping or step % config.train.checkpoint_every == 0
            if step % config.train.log_every == 0 or step == num_steps or saving:
                summary = check_finite(window_sums, step, ckpt)  # never checkpoint a diverged state
                summary.update(lr=float(sums["lr"]), grad_norm=float(sums["grad_norm"]),
                               tokens_per_s=summary["tokens"] / max(time.time() - window_start, 1e-9))
                writer.write(step, "train", summary)
                progress.set_postfix(loss=f"{summary['loss']:.3f}", ppl=f"{summary['ppl']:.1f}",
                                     tok_s=f"{summary['tokens_per_s']:.0f}")
                window_sums, window_start = None, time.time()
            if step % config.train.eval_every == 0 and step < num_steps:
                validate(step)
            ckpt.save(step, run.state, data_item, force=stopping)
            if stopping:
                log(f"stopping at step {step}: " + ("SIGTERM" if preemption.requested else "train.max_minutes"))
                break
    progress.close()
    ckpt.save(step, run.state, data_item, force=True)
    ckpt.close()
    return step, preemption.requested


def evaluate_test_split(run: setup.Run, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The end-of-training score on ``decode.split``: perplexity for an LM, else decoded BLEU / ROUGE."""
    config, split = run.config, run.config.decode.split
    if config.task == "lm":
        return steps.score_perplexity(config, run.model, run.state.params, run.data.eval_sets[split], run.workdir,
                                      split, log)
    return evaluate.score_split(config, run.model, run.state.params, run.tokenizer, run.data.eval_sets,
                                run.workdir, log=log)
