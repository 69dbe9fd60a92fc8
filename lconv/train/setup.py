"""Building a run, once: the config checked, then the mesh, tokenizer, datasets, model, optimizer and the train
state sharded onto the mesh (``build_run``); or, for evaluation, the model and its parameters alone
(``load_trained``: an orbax partial restore, no optimizer built).

One ``jax.sharding.Mesh`` with axes (data, fsdp, tensor); parameters are sharded by their logical axis names
(``config.mesh.rules``), batches and the kNN memory's rows along ``lconv.constants.BATCH_MESH_AXES``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from etils import epath
from flax.training import train_state

from lconv.configs.schema import validate_config
from lconv.constants import BATCH_MESH_AXES, EXPORT_SIDECAR
from lconv.data import paths, pipeline, sources
from lconv.data import tokenizer as tokenizer_lib
from lconv.data.data_config import DataConfig
from lconv.errors import UserError
from lconv.fields import is_integer
from lconv.nn import common as nn_common
from lconv.nn import mixers, models
from lconv.train import checkpoints
from lconv.train import workdir as workdir_lib

logger = logging.getLogger(__name__)

Config = ml_collections.ConfigDict
PyTree = Any


class TrainState(train_state.TrainState):
    # The kNN layers' 'memory' collection ([B, ...] leaves, B = the global batch's rows) carried from one
    # window of each row's document stream to the next; {} unless data.stream and the model has kNN layers.
    memory: Any = None


@dataclasses.dataclass
class Run:
    """Everything a training run is built from, built once by ``build_run`` and then passed down."""

    config: Config
    workdir: str
    mesh: jax.sharding.Mesh
    tokenizer: tokenizer_lib.Tokenizer
    data: pipeline.Datasets
    model: nn.Module
    lr_schedule: optax.Schedule
    state: TrainState
    state_shardings: PyTree
    # Changes to config.json this launch makes to a run with checkpoints: written once the checkpoint restores.
    config_changes: dict[str, Any] | None = None


@dataclasses.dataclass
class Trained:
    """A trained model for evaluation: its stored config, tokenizer, model and (averaged) parameters."""

    config: Config
    workdir: str
    tokenizer: tokenizer_lib.Tokenizer
    model: nn.Module
    params: PyTree
    steps: list[int]  # the checkpoint steps the parameters come from (averaged when more than one)


# ----------------------------------------------------------------------------------------------------------------
# The config
# ----------------------------------------------------------------------------------------------------------------
def find_run(workdir: str, caller: str = "--workdir") -> str:
    """The resolved workdir (local or an ``etils.epath`` URL) of a run, or a one-line error naming the path as
    ``caller`` was given it (``--workdir=runs/x``, ``lconv.load('runs/x')``) and what is there instead: nothing,
    an export, or a folder without a ``config.json``. ``caller`` may be a config field (``config.train.init_from``)."""
    label = f"{caller}={workdir}" if caller.startswith(("-", "config.")) else f"{caller}({str(workdir)!r})"
    paths.check_url(workdir, caller, label=label)
    resolved = workdir_lib.resolve(workdir)
    root = epath.Path(resolved)
    if (root / workdir_lib.CONFIG_FILENAME).exists():
        return resolved
    where = "" if resolved == str(workdir) else f" ({resolved})"
    if not root.exists():
        raise UserError(f"{label}: no such directory{where}")
    if (root / EXPORT_SIDECAR).exists():
        raise UserError(f"{label} is an export, not a run: load it with lconv.export.load")
    raise UserError(f"{label}: not a run written by train.py (no {workdir_lib.CONFIG_FILENAME} in {resolved})")


def read_config(workdir: str, caller: str = "--workdir") -> Config:
    """The resolved config a run stored in ``<workdir>/config.json``, with the fields lconv added since at their
    defaults; ``caller``: as ``find_run``'s."""
    path = epath.Path(find_run(workdir, caller)) / workdir_lib.CONFIG_FILENAME
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0][:200]
        raise UserError(f"{path}: not a readable JSON config ({reason}); restore it from a copy of the run") from None
    if not isinstance(stored, dict):
        raise UserError(f"{path}: holds a JSON {type(stored).__name__}, not a config object")
    try:  # the fields by the schema's rules, as train.py checked them: a hand-edited value is named here
        config = ml_collections.ConfigDict(stored)
        validate_config(config)  # also fills the fields lconv added since the run was made
    except UserError as err:
        raise UserError(f"{path}: {err}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise UserError(f"{path}: not a config lconv can read ({type(err).__name__}: {err})") from None
    return config


# ----------------------------------------------------------------------------------------------------------------
# Model, optimizer, mesh
# ----------------------------------------------------------------------------------------------------------------
def build_model(config: Config, vocab_size: int) -> nn.Module:
    model_cfg = models.ModelConfig.from_config(config.model, vocab_size=vocab_size, decoder_only=config.task == "lm")
    if config.task == "lm":
        return models.DecoderOnlyLM(model_cfg)
    if config.task in ("translation", "summarization"):
        return models.EncoderDecoder(model_cfg)
    raise UserError(f"config.task must be translation, summarization or lm; got {config.task!r}")


def learning_rate_schedule(optim: Config, num_steps: int) -> optax.Schedule:
    """Linear warmup from ``warmup_init_lr``, then inverse-sqrt (fairseq), cosine, or constant. The cosine falls
    from the peak to ``min_lr`` over ``cosine_period`` updates after warmup (fairseq's ``--lr-period-updates``;
    0 = the rest of the run), and stays at ``min_lr`` after it. ``budget`` is the peak at every step: its shape is
    in time (``lconv.train.budget.TimeSchedule``), a factor the train step multiplies the update by."""
    peak, warmup, init = optim.learning_rate, max(int(optim.warmup_steps), 0), optim.warmup_init_lr
    if optim.schedule not in ("inverse_sqrt", "cosine", "constant", "budget"):
        raise UserError(f"config.optim.schedule must be inverse_sqrt, cosine, constant or budget; got "
                        f"{optim.schedule!r}")
    if optim.schedule == "budget":
        return lambda step: jnp.full((), peak, jnp.float32)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = init + (peak - init) * step / max(warmup, 1)
        if optim.schedule == "inverse_sqrt":
            after = peak * jnp.sqrt(max(warmup, 1) / jnp.maximum(step, 1.0))
        elif optim.schedule == "cosine":
            period = int(optim.cosine_period) or num_steps - warmup
            progress = jnp.clip((step - warmup) / max(period, 1), 0.0, 1.0)
            after = optim.min_lr + 0.5 * (peak - optim.min_lr) * (1 + jnp.cos(math.pi * progress))
        else:
            after = jnp.asarray(peak, jnp.float32)
        return jnp.where(step < warmup, warm, after)

    return schedule


def build_optimizer(optim: Config, num_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """fairseq's optimisers. Weight decay is decoupled as in fairseq (since 2018): ``p -= lr * weight_decay * p``
    beside the update, never added to the gradient that Adam normalises or NAG's momentum accumulates. ``adamw`` is
    the same optimiser as ``adam`` under its PyTorch name."""
    lr = learning_rate_schedule(optim, num_steps)
    if optim.optimizer in ("adam", "adamw"):
        tx = optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
    elif optim.optimizer == "nag":
        tx = optax.chain(optax.trace(decay=optim.momentum, nesterov=True),
                         optax.add_decayed_weights(optim.weight_decay), optax.scale_by_learning_rate(lr))
    else:
        raise UserError(f"config.optim.optimizer must be adam, adamw or nag; got {optim.optimizer!r}")
    if optim.clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(optim.clip_norm), tx)
    return tx, lr  # gradient accumulation happens inside the train step (steps.make_train_step)


def make_mesh(mesh_config: Config, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    devices = jax.devices() if devices is None else devices
    shape = list(mesh_config.shape)
    if shape.count(-1) > 1:
        raise UserError(f"config.mesh.shape may hold one -1; got {tuple(shape)}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise UserError(f"config.mesh.shape={tuple(mesh_config.shape)} does not use the {len(devices)} devices")
    axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(tuple(shape), tuple(mesh_config.axis_names), axis_types, devices=devices)


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """Rows of a global batch (and of the kNN memory) split over the mesh's batch axes."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_MESH_AXES))


def check_batch_divides(config: Config, mesh: jax.sharding.Mesh) -> None:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    accum = int(config.optim.grad_accum_steps)
    if config.data.batch_size % (shards * accum):
        raise UserError(f"config.data.batch_size={config.data.batch_size} must be divisible by the {shards} "
                        f"data-parallel devices (mesh data x fsdp) times optim.grad_accum_steps={accum}")
    if config.data.eval_batch_size % shards:
        raise UserError(f"config.data.eval_batch_size={config.data.eval_batch_size} must be divisible by the "
                        f"{shards} data-parallel devices (mesh data x fsdp)")


# ----------------------------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------------------------
def dummy_batch(config: Config, batch_size: int = 1, length: int | None = None) -> dict[str, np.ndarray]:
    """A batch of ones with the training shapes (``length``: every sequence's, if given): what ``init`` traces."""
    lengths = {"targets": config.data.max_target_length}
    if config.task != "lm":
        lengths["inputs"] = config.data.max_input_length
    batch = {}
    for key, T in lengths.items():
        T = T if length is None else length
        batch[key] = np.ones((batch_size, T), np.int32)
        batch[f"{key}_segmentation"] = np.ones((batch_size, T), np.int32)
        batch[f"{key}_position"] = np.broadcast_to(np.arange(T, dtype=np.int32), (batch_size, T))
    return batch


def model_inputs(batch: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments of the model's ``__call__`` from a pipeline batch."""
    keys = ("inputs_segmentation", "inputs_position", "targets_segmentation", "targets_position")
    kwargs = {k: batch[k] for k in keys if k in batch}
    args = (batch["inputs"], batch["targets"]) if "inputs" in batch else (batch["targets"],)
    return args, kwargs


def init_memory(config: Config, model: nn.Module, rows: int,
                sharding: jax.sharding.Sharding | None = None) -> PyTree:
    """The zeroed (empty) ``'memory'`` collection for ``rows`` stream rows; ``{}`` unless ``config.data.stream``
    and the model has kNN-memory layers (without a stream there are no past windows to remember).

    ``sharding``: lay the rows out as the batch (created by a jit, so every process builds its shards of one
    global array); None gives plain arrays (or traced ones inside a jit)."""
    if not config.data.stream:
        return {}
    args, kwargs = model_inputs(dummy_batch(config, rows))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs)).get("memory", {})
    if not shapes:
        return {}
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731 (init's are zeros)
    return zeros() if sharding is None else jax.jit(zeros, out_shardings=sharding)()


def param_shardings(config: Config, abstract: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """Shardings of a (boxed) pytree from its logical axis names and the config's mesh rules."""
    rules = nn_common.axis_rules(config.mesh.rules)
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, list(rules))


def create_state(config: Config, model: nn.Module, mesh: jax.sharding.Mesh,
                 tx: optax.GradientTransformation) -> tuple[TrainState, PyTree]:
    """Initialises the train state directly into its shardings; returns ``(state, state_shardings)``."""
    args, kwargs = model_inputs(dummy_batch(config))

    def init(rng):
        variables = model.init(rng, *args, **kwargs)
        return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                 memory=init_memory(config, model, config.data.batch_size))

    rng = jax.random.key(config.seed)
    abstract = jax.eval_shape(init, rng)
    shardings = param_shardings(config, abstract, mesh)
    # Memory rows belong to batch rows: shard them as the batch is, never replicate them.
    shardings = shardings.replace(memory=jax.tree.map(lambda _: batch_sharding(mesh), abstract.memory))
    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)(rng)
    return state, shardings


def count_params(params: PyTree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(params))))


# ----------------------------------------------------------------------------------------------------------------
# Building a run; loading a trained one
# ----------------------------------------------------------------------------------------------------------------
def check_config(config: Config, devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """Every check that needs no data: the fields (``lconv.configs.schema``), the mesh and the batch's split over it.
    Returns the mesh."""
    validate_config(config)
    mesh = make_mesh(config.mesh, devices)
    check_batch_divides(config, mesh)
    check_plugins_trace(config)
    return mesh


def check_plugins_trace(config: Config) -> None:
    """A model with a mixer or FFN from outside lconv is traced once, abstractly and at a short length, before any
    data is prepared: a plugin whose output does not fit (``lconv.nn.mixers.check_output``) fails now, in one line
    naming it, rather than after data preparation."""
    model = build_model(config, int(config.data.vocab_size))
    model_cfg = model.config
    sides = ("decoder",) if config.task == "lm" else ("encoder", "decoder")
    names = [name for side in sides for name in model_cfg.layer_mixers(side)]
    plugins = sorted({name for name in names if not mixers.mixer_class(name).__module__.startswith("lconv.")})
    if not mixers.ffn_class(model_cfg.ffn_type).__module__.startswith("lconv."):
        plugins.append(f"ffn_type={model_cfg.ffn_type}")
    if not plugins:
        return
    args, kwargs = model_inputs(dummy_batch(config, length=8))
    try:
        jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 (the plugin's own code failed: one line naming it and the checker)
        line = (str(err).strip().splitlines() or [""])[0]
        raise UserError(f"the model with plugin(s) {', '.join(plugins)} fails to trace ({type(err).__name__}: "
                        f"{line}); lconv.testing.check_mixer names the rule a mixer breaks") from None


def build_run(config: Config, workdir: str, devices: Sequence[jax.Device] | None = None, *,
              accept_config_changes: bool = False, mesh: jax.sharding.Mesh | None = None) -> Run:
    """Checks ``config``, then builds the mesh, tokenizer, datasets, model and fresh train state for ``workdir``
    (the caller restores a checkpoint into it when one exists, and holds the workdir's lock). ``mesh``: the one
    ``check_config`` returned, when the caller checked already."""
    devices = jax.devices() if devices is None else list(devices)
    mesh = check_config(config, devices) if mesh is None else mesh
    workdir = workdir_lib.make_workdir(workdir)
    has_checkpoint = checkpoints.has_checkpoint(workdir)
    config_changes = workdir_lib.check_config_change(config, workdir, has_checkpoint=has_checkpoint,
                                                     accept_changes=accept_config_changes)
    if not has_checkpoint:  # nothing to restore: the config is this launch's (a failed launch pins nothing)
        workdir_lib.write_config(config, workdir, config_changes, has_checkpoint=False)
        config_changes = None
    data_cfg = DataConfig.from_config(config.data)  # parsed once, for the tokenizer and the datasets
    tokenizer = pipeline.load_or_train_tokenizer(data_cfg, workdir)
    data = pipeline.make_datasets(data_cfg, tokenizer)
    _report_data_source(data.source_report, workdir)
    model = build_model(config, tokenizer.vocab_size)
    tx, lr_schedule = build_optimizer(config.optim, config.train.num_steps)
    state, state_shardings = create_state(config, model, mesh, tx)
    logger.info(f"model: {count_params(state.params):,} parameters; mesh {dict(mesh.shape)}; "
                f"devices {len(devices)} x {devices[0].platform}")
    return Run(config, workdir, mesh, tokenizer, data, model, lr_schedule, state, state_shardings, config_changes)


def _report_data_source(report: dict[str, Any], workdir: str) -> None:
    """What the prepared data was built from and how many records were skipped or altered, and why: logged and
    written to ``<workdir>/data_report.json`` (process 0)."""
    if not report or jax.process_index() != 0:
        return
    for line in sources.describe_report(report):
        logger.info(line)
    (epath.Path(workdir) / "data_report.json").write_text(json.dumps(report, indent=1, sort_keys=True))


def abstract_params(config: Config, model: nn.Module, mesh: jax.sharding.Mesh) -> PyTree:
    """Shape/dtype/sharding structs of the model's (boxed) params: the target of a params-only restore."""
    args, kwargs = model_inputs(dummy_batch(config))
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs)["params"])
    shardings = param_shardings(config, abstract, mesh)  # one per box: the tree of the unboxed params

    def place(sharding, leaf):
        boxed = isinstance(leaf, nn.meta.AxisMetadata)
        value = leaf.unbox() if boxed else leaf
        struct = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
        return leaf.replace_boxed(struct) if boxed else struct

    return jax.tree.map(place, shardings, abstract, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def check_checkpoint_choice(average_last: int, checkpoint: str,
                            spell: Callable[[str], str] = lambda name: f"--{name}") -> None:
    """Which checkpoints ``load_trained`` may average: one-line errors named as eval.py's flags (``spell=str``: as
    the API's arguments)."""
    if not isinstance(checkpoint, str) or checkpoint not in ("latest", "best"):
        raise UserError(f"{spell('checkpoint')}={checkpoint!r}: must be latest or best")
    if not is_integer(average_last) or average_last < 1:
        raise UserError(f"{spell('average_last')}={average_last!r}: must be >= 1, an integer (the number of latest "
                        "checkpoints to average)")
    if checkpoint == "best" and average_last > 1:
        raise UserError(f"{spell('average_last')} averages the latest checkpoints; it does not combine with "
                        f"{spell('checkpoint')}=best")


def load_trained(workdir: str, *, average_last: int = 1, checkpoint: str = "latest",
                 overrides: Callable[[Config], None] | None = None, caller: str = "--workdir",
                 devices: Sequence[jax.Device] | None = None) -> Trained:
    """The model of a trained ``workdir`` (local or a URL: ``gs://...``) with the params of its latest checkpoint,
    the mean of the last ``average_last`` (the paper's practice), or, with ``checkpoint="best"``, of the best by
    validation loss. ``caller``: how the path was given, for errors (``find_run``).

    Only the params are read (orbax partial restore): no optimizer is built and no moments are loaded, and
    nothing is written into the workdir, which may be read-only. ``overrides`` may change the stored config
    (decoding fields, say) before the model is built. ``devices``: the mesh's (``config.mesh``; default all)."""
    spell = str if caller == "lconv.load" else lambda name: f"--{name}"  # the API's arguments, or the flags
    check_checkpoint_choice(average_last, checkpoint, spell)
    config = read_config(workdir, caller)
    if overrides is not None:
        overrides(config)
    workdir = workdir_lib.resolve(workdir)
    tokenizer = tokenizer_lib.load_tokenizer(workdir)
    model = build_model(config, tokenizer.vocab_size)
    ckpt = checkpoints.Checkpointer(workdir, subdir="checkpoints" if checkpoint == "latest" else "best",
                                    read_only=True)
    steps = sorted(ckpt.all_steps())
    if not steps:
        raise UserError(f"no checkpoint in {ckpt.directory}; train first with train.py --workdir={workdir}")
    if average_last > len(steps):  # fewer would be averaged without a word
        raise UserError(f"{spell('average_last')}={average_last}: {ckpt.directory} holds {len(steps)} checkpoint"
                        f"{'s' if len(steps) != 1 else ''} (steps {', '.join(map(str, steps))}); average at most "
                        f"{len(steps)}")
    target = abstract_params(config, model, make_mesh(config.mesh, devices))
    chosen = steps[-average_last:]
    total = None
    for step in chosen:
        params = ckpt.restore_params(target, step)
        total = params if total is None else jax.tree.map(jnp.add, total, params)
    ckpt.close()
    return Trained(config, workdir, tokenizer, model,
                   jax.tree.map(lambda x: x / len(chosen), total), chosen)
