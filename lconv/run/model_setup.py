"""A run's model, built from its config: the module, the mesh and the shardings its params and batches take, the batch
``init`` traces, and the model applied to a batch (the mixers' carried state threaded through). Every surface builds its
model here, so each builds the same one. One mesh with axes (data, fsdp, tensor); params are sharded by logical axis
names (``config.mesh.rules``), batches along ``BATCH_MESH_AXES``."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from lconv.constants import BATCH_MESH_AXES
from lconv.errors import UserError
from lconv.nn import common as nn_common
from lconv.nn import mixer_state, models
from lconv.run.schema import MeshConfig, RunConfig

PyTree = Any
Batch = dict[str, Any]


def build_model(config: RunConfig, vocab_size: int | None = None) -> nn.Module:
    """The model of ``config.task`` at ``vocab_size`` (the tokenizer's; None: ``config.data.vocab_size``)."""
    lm, model_cfg = config.task == "lm", config.model
    if vocab_size is not None and model_cfg.vocab_size != vocab_size:
        model_cfg = models.ModelConfig.from_config(model_cfg, vocab_size=vocab_size, decoder_only=lm)
    return models.DecoderOnlyLM(model_cfg) if lm else models.EncoderDecoder(model_cfg)  # the schema checked the task


def make_mesh(mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
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
    """Rows of a global batch (and of the mixers' carried state) split over the mesh's batch axes."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_MESH_AXES))


def dummy_batch(config: RunConfig, batch_size: int = 1, length: int | None = None) -> dict[str, np.ndarray]:
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


def init_mixer_state(config: RunConfig, model: nn.Module, rows: int,
                     sharding: jax.sharding.Sharding | None = None) -> mixer_state.MixerState:
    """The state the model's stateful mixers start a stream of ``rows`` rows with (empty unless ``config.data.stream``);
    ``sharding`` lays the rows out as the batch (None: plain arrays)."""
    if not config.data.stream:
        return mixer_state.empty()
    args, kwargs = model_inputs(dummy_batch(config, rows))
    return mixer_state.initial(model, args, kwargs, sharding)


def abstract_mixer_state(config: RunConfig, model: nn.Module) -> mixer_state.MixerState:
    """The shapes of the state a training stream carries (``init_mixer_state`` of a train batch), computed without
    allocating it: part of what a stream run's checkpoint holds."""
    if not config.data.stream:
        return mixer_state.empty()
    return jax.eval_shape(lambda: init_mixer_state(config, model, config.data.batch_size))


def param_shardings(config: RunConfig, abstract: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """Shardings of a (boxed) pytree from its logical axis names and the config's mesh rules."""
    rules = nn_common.axis_rules(config.mesh.rules)
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, list(rules))


def abstract_params(config: RunConfig, model: nn.Module, mesh: jax.sharding.Mesh) -> PyTree:
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


def count_params(params: PyTree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(params))))


def apply_model(apply_fn: Callable, params: PyTree, carried: mixer_state.MixerState, batch: Batch,
                **kwargs: Any) -> tuple[jax.Array, mixer_state.MixerState]:
    """``(logits, the mixers' state after this window)`` (``logits=False``: the ``OutputLayer``); rows with
    ``document_start`` set start over first. No state is a plain apply."""
    args, model_kwargs = model_inputs(batch)
    if not carried:
        return apply_fn({"params": params}, *args, **model_kwargs, **kwargs), carried
    carried = carried.reset(batch["document_start"] > 0)
    return carried.apply(apply_fn, params, *args, **model_kwargs, **kwargs)


def global_batch(batch: Batch, sharding: jax.sharding.Sharding) -> Batch:
    """This process's rows -> global arrays laid out by ``sharding``."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)


def one_step_ahead(previous: PyTree, current: PyTree) -> PyTree:
    """Waits for ``previous`` and returns ``current``: one step dispatched ahead at most (docs/training.md)."""
    jax.block_until_ready(previous)
    return current
