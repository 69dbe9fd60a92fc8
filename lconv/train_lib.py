"""Training: state, optimizer, sharded steps, the loop, evaluation and checkpoints.

One ``jax.sharding.Mesh`` with axes (data, fsdp, tensor); parameters are sharded by their logical axis names
(``config.mesh.rules``), batches along (data, fsdp). Steps are ``jax.jit`` with ``in_shardings`` /
``out_shardings`` and a donated state — today's pjit. The dropout rng is ``fold_in(seed, step)``, so no rng
state is saved; the data iterator's state is checkpointed beside the model, so a resume is exact.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from lconv import checkpoints, memory as memory_lib, metrics, models
from lconv.data import pipeline


class TrainState(train_state.TrainState):
    # The kNN layers' 'memory' collection ([B, ...] leaves, B = the global batch's rows) carried from one
    # window of each row's document stream to the next; {} unless data.stream and the model has kNN layers.
    memory: Any = None


# ----------------------------------------------------------------------------------------------------------------
# Model, optimizer, mesh
# ----------------------------------------------------------------------------------------------------------------
def build_model(config, vocab_size):
    model_cfg = models.ModelConfig.from_config(config.model, vocab_size=vocab_size)
    if config.task == "lm":
        return models.DecoderOnlyLM(model_cfg)
    if config.task in ("translation", "summarization"):
        return models.EncoderDecoder(model_cfg)
    raise ValueError(f"config.task must be translation, summarization or lm; got {config.task!r}")


def learning_rate_schedule(optim, num_steps):
    """Linear warmup from ``warmup_init_lr``, then inverse-sqrt (fairseq), cosine, or constant."""
    peak, warmup, init = optim.learning_rate, max(int(optim.warmup_steps), 0), optim.warmup_init_lr

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = init + (peak - init) * step / max(warmup, 1)
        if optim.schedule == "inverse_sqrt":
            after = peak * jnp.sqrt(max(warmup, 1) / jnp.maximum(step, 1.0))
        elif optim.schedule == "cosine":
            progress = jnp.clip((step - warmup) / max(num_steps - warmup, 1), 0.0, 1.0)
            after = optim.min_lr + 0.5 * (peak - optim.min_lr) * (1 + jnp.cos(math.pi * progress))
        elif optim.schedule == "constant":
            after = jnp.asarray(peak, jnp.float32)
        else:
            raise ValueError(f"config.optim.schedule must be inverse_sqrt, cosine or constant; got {optim.schedule!r}")
        return jnp.where(step < warmup, warm, after)

    schedule(0)  # validates the schedule name eagerly
    return schedule


def build_optimizer(optim, num_steps):
    lr = learning_rate_schedule(optim, num_steps)
    if optim.optimizer == "adam":
        tx = optax.adam(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps)
        if optim.weight_decay:
            tx = optax.chain(optax.add_decayed_weights(optim.weight_decay), tx)  # fairseq's coupled L2
    elif optim.optimizer == "adamw":
        tx = optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
    elif optim.optimizer == "nag":
        tx = optax.chain(optax.add_decayed_weights(optim.weight_decay), optax.sgd(lr, optim.momentum, nesterov=True))
    else:
        raise ValueError(f"config.optim.optimizer must be adam, adamw or nag; got {optim.optimizer!r}")
    if optim.clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(optim.clip_norm), tx)
    return tx, lr  # gradient accumulation happens inside the train step (make_train_step)


def make_mesh(mesh_config, devices=None):
    devices = jax.devices() if devices is None else devices
    shape = list(mesh_config.shape)
    if shape.count(-1) > 1:
        raise ValueError(f"config.mesh.shape may hold one -1; got {tuple(shape)}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise ValueError(f"config.mesh.shape={tuple(mesh_config.shape)} does not use the {len(devices)} devices")
    axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(tuple(shape), tuple(mesh_config.axis_names), axis_types, devices=devices)


def _batch_sharding(mesh):
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(memory_lib.BATCH_MESH_AXES))


def _dummy_batch(config, batch_size=1):
    lengths = {"targets": config.data.max_target_length}
    if config.task != "lm":
        lengths["inputs"] = config.data.max_input_length
    batch = {}
    for key, length in lengths.items():
        batch[key] = np.ones((batch_size, length), np.int32)
        batch[f"{key}_segmentation"] = np.ones((batch_size, length), np.int32)
        batch[f"{key}_position"] = np.broadcast_to(np.arange(length, dtype=np.int32), (batch_size, length))
    return batch


def model_inputs(batch):
    """The keyword arguments of the model's ``__call__`` from a pipeline batch."""
    keys = ("inputs_segmentation", "inputs_position", "targets_segmentation", "targets_position")
    kwargs = {k: batch[k] for k in keys if k in batch}
    args = (batch["inputs"], batch["targets"]) if "inputs" in batch else (batch["targets"],)
    return args, kwargs


def init_memory(config, model, rows, sharding=None):
    """The zeroed (empty) ``'memory'`` collection for ``rows`` stream rows; ``{}`` unless ``config.data.stream``
    and the model has kNN-memory layers (without a stream there are no past windows to remember).

    ``sharding``: lay the rows out as the batch (created by a jit, so every process builds its shards of one
    global array); None gives plain arrays (or traced ones inside a jit)."""
    if not config.data.get("stream", False):
        return {}
    args, kwargs = model_inputs(_dummy_batch(config, rows))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs)).get("memory", {})
    if not shapes:
        return {}
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731 (init's are zeros)
    return zeros() if sharding is None else jax.jit(zeros, out_shardings=sharding)()


def create_state(config, model, mesh, tx):
    """Initialises the train state directly into its shardings; returns ``(state, state_shardings)``."""
    args, kwargs = model_inputs(_dummy_batch(config))

    def init(rng):
        variables = model.init(rng, *args, **kwargs)
        return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                 memory=init_memory(config, model, config.data.batch_size))

    rng = jax.random.key(config.seed)
    abstract = jax.eval_shape(init, rng)
    logical_specs = nn.get_partition_spec(abstract)
    shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, [tuple(r) for r in config.mesh.rules])
    # Memory rows belong to batch rows: shard them as the batch is, never replicate them.
    shardings = shardings.replace(memory=jax.tree.map(lambda _: _batch_sharding(mesh), abstract.memory))
    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)(rng)
    return state, shardings


def count_params(params):
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(params))))


# ----------------------------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------------------------
def apply_model(apply_fn, params, memory, batch, **kwargs):
    """``(logits, memory after this window)``. With a memory (a stream batch), rows whose ``document_start``
    is set first forget their previous document, then the window reads and extends the memory; ``{}`` passes
    through (a plain apply)."""
    args, model_kwargs = model_inputs(batch)
    if not memory:
        return apply_fn({"params": params}, *args, **model_kwargs, **kwargs), memory
    memory = memory_lib.reset_memory(memory, batch["document_start"] > 0)
    logits, updated = apply_fn({"params": params, "memory": memory}, *args, **model_kwargs, **kwargs,
                               mutable=["memory"])
    return logits, updated["memory"]


def _split_rows(tree, micro):
    """``[B, ...] -> [micro, B / micro, ...]`` with row ``r`` in micro-batch ``r % micro``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, micro, *x.shape[1:]), 0, 1), tree)


def _merge_rows(tree):
    """The inverse of ``_split_rows``."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


def make_train_step(config, lr_schedule):
    """``(state, batch) -> (state, sums)``: one optimizer update from a global batch.

    With ``optim.grad_accum_steps = n`` (fairseq's update-freq) the batch's rows are split into ``n`` micro-batches
    (row ``r`` goes to micro-batch ``r % n``, so every data shard contributes to each) whose summed gradients are
    scanned, then divided by the batch's total target tokens: the update equals the unsplit batch's, with a
    ``1/n`` activation footprint.
    """
    smoothing = config.optim.label_smoothing
    micro = int(config.optim.grad_accum_steps)

    def train_step(state, batch):
        def loss_sums(params, memory, batch, dropout_rng):
            logits, memory = apply_model(state.apply_fn, params, memory, batch, deterministic=False,
                                         rngs={"dropout": dropout_rng})
            sums = metrics.label_smoothed_loss(logits, batch["targets"], batch["targets_segmentation"] > 0,
                                               smoothing)
            return sums["loss"], (sums, memory)

        grad_sums = jax.grad(loss_sums, has_aux=True)  # gradient of the summed (not averaged) loss
        dropout_rng = jax.random.fold_in(jax.random.key(config.seed), state.step)
        if micro == 1:
            grads, (sums, memory) = grad_sums(state.params, state.memory, batch, dropout_rng)
        else:
            def accumulate(total, index_memory_batch):
                index, micro_memory, micro_batch = index_memory_batch
                grads, (sums, micro_memory) = grad_sums(state.params, micro_memory, micro_batch,
                                                        jax.random.fold_in(dropout_rng, index))
                return jax.tree.map(jnp.add, total, (grads, sums)), micro_memory

            split_batch, split_memory = _split_rows(batch, micro), _split_rows(state.memory, micro)
            first = jax.tree.map(lambda x: x[0], (split_memory, split_batch))
            grads_and_sums = jax.eval_shape(grad_sums, state.params, *first, dropout_rng)
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (grads_and_sums[0], grads_and_sums[1][0]))
            (grads, sums), split_memory = jax.lax.scan(accumulate, zeros,
                                                       (jnp.arange(micro), split_memory, split_batch))
            memory = _merge_rows(split_memory)
        grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)  # token-weighted mean
        sums["grad_norm"] = optax.tree.norm(grads)
        sums["lr"] = lr_schedule(state.step)
        return state.apply_gradients(grads=grads, memory=memory), sums

    return train_step


def make_eval_step(config):
    """``(params, apply_fn, batch, memory) -> (sums, memory)``; ``memory`` is ``{}`` except on streams."""
    def eval_step(params, apply_fn, batch, memory):
        logits, memory = apply_model(apply_fn, params, memory, batch, deterministic=True)
        weights = (batch["targets_segmentation"] > 0) & (batch["example_weight"][:, None] > 0)
        return metrics.label_smoothed_loss(logits, batch["targets"], weights, config.optim.label_smoothing), memory

    return eval_step


def jit_eval_step(config, mesh):
    """``make_eval_step`` jitted once per run. The memory it returns keeps the batch's sharding, so the next
    window's call hits the same compilation (left to XLA it comes back as an equivalent but different spec,
    and every pass would compile twice)."""
    return jax.jit(make_eval_step(config), static_argnums=1, out_shardings=(None, _batch_sharding(mesh)))


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------
class _Preemption:
    """SIGTERM sets a flag; the loop saves a checkpoint and exits cleanly at the next step."""

    def __init__(self):
        self.requested = False
        try:
            signal.signal(signal.SIGTERM, self._handler)
        except ValueError:  # not the main thread (e.g. in a notebook worker)
            pass

    def _handler(self, signum, frame):
        del signum, frame
        self.requested = True


def validate_config(config):
    """Fails fast, before any data or compilation, with one line naming the bad field."""
    rules = [
        ("task", lambda v: v in ("translation", "summarization", "lm"), "translation, summarization or lm"),
        ("optim.optimizer", lambda v: v in ("adam", "adamw", "nag"), "adam, adamw or nag"),
        ("optim.schedule", lambda v: v in ("inverse_sqrt", "cosine", "constant"), "inverse_sqrt, cosine or constant"),
        ("optim.learning_rate", lambda v: v > 0, "> 0"),
        ("optim.warmup_steps", lambda v: v >= 0, ">= 0"),
        ("optim.label_smoothing", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("optim.clip_norm", lambda v: v >= 0, ">= 0 (0 = off)"),
        ("train.max_minutes", lambda v: v >= 0, ">= 0 (0 = no limit)"),
        *[(field, lambda v: v >= 1, ">= 1") for field in (
            "optim.grad_accum_steps", "train.num_steps", "train.log_every", "train.eval_every",
            "train.checkpoint_every", "train.keep_checkpoints", "decode.beam_size", "data.batch_size")],
        *[(field, lambda v: v >= 2, ">= 2") for field in ("data.max_input_length", "data.max_target_length")],
    ]
    for dotted, ok, requirement in rules:
        value = config
        for part in dotted.split("."):
            value = value[part]
        if not ok(value):
            raise ValueError(f"config.{dotted}={value!r}: must be {requirement}")
    if config.data.get("stream", False) and config.task != "lm":
        raise ValueError(f"config.data.stream=True feeds document streams to a language model; it needs task=lm, "
                         f"not {config.task!r}")
    models.ModelConfig.from_config(config.model, vocab_size=max(int(config.data.vocab_size), 8))


def _check_batch_divides(config, mesh):
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    accum = int(config.optim.grad_accum_steps)
    if config.data.batch_size % (shards * accum):
        raise ValueError(f"config.data.batch_size={config.data.batch_size} must be divisible by the {shards} "
                         f"data-parallel devices (mesh data x fsdp) times optim.grad_accum_steps={accum}")
    if config.data.eval_batch_size % shards:
        raise ValueError(f"config.data.eval_batch_size={config.data.eval_batch_size} must be divisible by the "
                         f"{shards} data-parallel devices (mesh data x fsdp)")


def _global_batch(batch, sharding):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def _check_finite(sums, step, ckpt):
    """Raises on a non-finite loss in ``sums`` (a window of steps ending at ``step``); returns the summary."""
    summary = metrics.summarize(sums)
    if not np.isfinite(summary["loss"]):
        raise FloatingPointError(
            f"non-finite loss ({summary['loss']}) by step {step}; the last good checkpoint is kept "
            f"(step {ckpt.latest_step()}); lower config.optim.learning_rate or set optim.clip_norm")
    return summary


def train_and_evaluate(config, workdir, *, devices=None, log=print):
    """Trains ``config`` in ``workdir`` (resuming from its latest checkpoint), then evaluates. Returns metrics.

    ``devices``: the devices of the mesh (default: all). Checkpoints go to ``<workdir>/checkpoints`` (the last
    ``train.keep_checkpoints``) and the best by validation loss to ``<workdir>/best``.
    """
    from lconv import logging_utils

    devices = jax.devices() if devices is None else list(devices)
    validate_config(config)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    os.makedirs(workdir, exist_ok=True)
    mesh = make_mesh(config.mesh, devices)
    _check_batch_divides(config, mesh)
    logging_utils.save_config(config, workdir)
    tokenizer = pipeline.load_or_train_tokenizer(config.data, workdir)
    data = pipeline.make_datasets(config.data, tokenizer)
    model = build_model(config, tokenizer.vocab_size)
    tx, lr_schedule = build_optimizer(config.optim, config.train.num_steps)
    state, state_shardings = create_state(config, model, mesh, tx)
    log(f"model: {count_params(state.params):,} parameters; mesh {dict(mesh.shape)}; "
        f"devices {len(devices)} x {devices[0].platform}")

    ckpt = checkpoints.Checkpointer(workdir, keep=config.train.keep_checkpoints,
                                    save_every=config.train.checkpoint_every)
    best = checkpoints.BestCheckpointer(workdir)
    if ckpt.latest_step() is not None:
        state, data_item = ckpt.restore_latest_readable(checkpoints.abstract_like(state), log=log)
        data.train_iter.set_state(checkpoints.this_process_state(data_item, ckpt.directory))
        log(f"resumed from step {int(state.step)}")

    batch_sharding = _batch_sharding(mesh)
    train_step = jax.jit(make_train_step(config, lr_schedule), in_shardings=(state_shardings, batch_sharding),
                         out_shardings=(state_shardings, None), donate_argnums=0)
    eval_step = jit_eval_step(config, mesh)
    writer = logging_utils.MetricWriter(workdir)
    eval_memory = init_memory(config, model, config.data.eval_batch_size, _batch_sharding(mesh))

    def validate(step):
        scores = evaluate_loss(eval_step, state, data.eval_sets["validation"], mesh, eval_memory)
        writer.write(step, "validation", scores)
        best.offer(step, state, scores["loss"])
        return scores

    preemption = _Preemption()
    data_item = lambda: checkpoints.gather_process_states(data.train_iter.get_state())  # noqa: E731
    start_step, num_steps = int(state.step), config.train.num_steps
    t0, window_sums, window_start = time.time(), None, time.time()
    progress = logging_utils.progress(start_step, num_steps)
    step = start_step
    with jax.set_mesh(mesh):
        while step < num_steps:
            batch = _global_batch(next(data.train_iter), batch_sharding)
            state, sums = train_step(state, batch)
            step += 1
            window_sums = sums if window_sums is None else jax.tree.map(jnp.add, window_sums, sums)
            progress.update(1)
            out_of_time = config.train.max_minutes and (time.time() - t0) / 60 >= config.train.max_minutes
            stopping = bool(out_of_time or preemption.requested)
            saving = stopping or step % config.train.checkpoint_every == 0
            if step % config.train.log_every == 0 or step == num_steps or saving:
                summary = _check_finite(window_sums, step, ckpt)  # never checkpoint a diverged state
                elapsed = time.time() - window_start
                summary.update(lr=float(sums["lr"]), grad_norm=float(sums["grad_norm"]),
                               tokens_per_s=summary["tokens"] / max(elapsed, 1e-9))
                writer.write(step, "train", summary)
                progress.set_postfix(loss=f"{summary['loss']:.3f}", ppl=f"{summary['ppl']:.1f}",
                                     tok_s=f"{summary['tokens_per_s']:.0f}")
                window_sums, window_start = None, time.time()
            if step % config.train.eval_every == 0 and step < num_steps:
                validate(step)
            ckpt.save(step, state, data_item, force=stopping)
            if stopping:
                log(f"stopping at step {step}: " + ("SIGTERM" if preemption.requested else "train.max_minutes"))
                break
    progress.close()
    ckpt.save(step, state, data_item, force=True)
    ckpt.close()
    result = {"step": step, "train_minutes": (time.time() - t0) / 60}
    if preemption.requested:
        best.close()
        return result
    with jax.set_mesh(mesh):
        result["validation"] = validate(step)
    best.close()
    if config.train.eval_after_training:
        from lconv import evaluate

        if config.task == "lm":
            result["test"] = evaluate.score_perplexity(config, model, state.params, data.eval_sets[config.decode.split],
                                                       workdir, config.decode.split, log)
        else:
            result["test"] = evaluate.score_split(config, model, state.params, tokenizer, data.eval_sets, workdir,
                                                  log=log)
        writer.write(step, "test", {k: v for k, v in result["test"].items() if isinstance(v, (int, float))})
    writer.close()
    return result


def evaluate_loss(eval_step, state, eval_set, mesh, memory=None):
    """Validation loss / perplexity / accuracy over every example (padding rows weigh zero).

    ``eval_step`` is ``jit_eval_step(config, mesh)``, built once per run so periodic
    evaluations reuse its compilation. ``memory``: on a stream eval set, the empty memory (``init_memory`` for
    the eval batch's rows, sharded as the batch) that the pass threads from window to window; ``None`` or ``{}``
    otherwise.
    """
    sharding = _batch_sharding(mesh)
    total, memory = None, memory or {}
    with jax.set_mesh(mesh):
        for batch in eval_set:
            batch = {k: v for k, v in batch.items() if k != "example_index"}
            sums, memory = eval_step(state.params, state.apply_fn, _global_batch(batch, sharding), memory)
            total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    return metrics.summarize(total)


def load_config_json(workdir) -> dict[str, Any]:
    with open(os.path.join(workdir, "config.json")) as f:
        return json.load(f)
