"""Building a training run, once: the config checked, then the mesh, tokenizer, datasets, model, optimizer and the
train state sharded onto the mesh (``build_run``). The model, mesh and shardings are ``lconv.run.model_setup``'s, as
every surface builds them; a trained run read back for evaluation is ``lconv.run.restore.load_trained``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from etils import epath
from flax.training import train_state

from lconv import outputs
from lconv.data import pipeline, sources
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError
from lconv.nn import mixer_state, mixers
from lconv.run import checkpoints, model_setup
from lconv.run import workdir as workdir_lib
from lconv.run.schema import RunConfig, validate_config
from lconv.train import budget as budget_lib
from lconv.train import early_build, update

logger = logging.getLogger(__name__)

PyTree = Any


class TrainState(train_state.TrainState):
    # What stateful mixers carry between a row's stream windows (``MixerState``); empty unless data.stream.
    mixer_state: Any = None


@dataclasses.dataclass
class Run:
    """Everything a training run is built from, built once by ``build_run`` and then passed down."""

    config: RunConfig
    workdir: str
    mesh: jax.sharding.Mesh
    tokenizer: tokenizer_lib.Tokenizer
    data: pipeline.Datasets
    model: nn.Module
    lr_schedule: optax.Schedule
    state: TrainState
    state_shardings: PyTree
    record: dict[str, Any]  # the config as config.json stores it (``CheckedConfig.record``)
    # Changes to config.json this launch makes to a run with checkpoints: written once the checkpoint restores.
    config_changes: dict[str, Any] | None = None
    # Seconds ``build_run`` spent in each part (tokenizer, data, state), logged and returned.
    setup_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # The train step compiled while the data was prepared (``early_build``); None: jit it at the start.
    train_step: early_build.PreparedStep | None = None


# The batch's split
def check_batch_divides(config: RunConfig, mesh: jax.sharding.Mesh) -> None:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    accum = int(config.optim.grad_accum_steps)
    if config.data.batch_size % (shards * accum):
        raise UserError(f"config.data.batch_size={config.data.batch_size} must be divisible by the {shards} "
                        f"data-parallel devices (mesh data x fsdp) times optim.grad_accum_steps={accum}")
    if config.data.eval_batch_size % shards:
        raise UserError(f"config.data.eval_batch_size={config.data.eval_batch_size} must be divisible by the "
                        f"{shards} data-parallel devices (mesh data x fsdp)")


# State


def create_state(config: RunConfig, model: nn.Module, mesh: jax.sharding.Mesh,
                 tx: optax.GradientTransformation) -> tuple[TrainState, PyTree]:
    """Initialises the train state directly into its shardings; returns ``(state, state_shardings)``."""
    initialise, _, shardings = plan_state(config, model, mesh, tx)
    return initialise(), shardings


def plan_state(config: RunConfig, model: nn.Module, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation
               ) -> tuple[Callable[[], TrainState], TrainState, PyTree]:
    """``(initialise, layout, shardings)``: the fresh state's initialiser traced into its shardings, and the
    state's shapes, dtypes and shardings, known before ``initialise()`` compiles and runs anything."""
    args, kwargs = model_setup.model_inputs(model_setup.dummy_batch(config))

    def init(rng):
        variables = model.init(rng, *args, **kwargs)
        return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                 mixer_state=model_setup.init_mixer_state(config, model, config.data.batch_size))

    rng = jax.random.key(config.seed)
    abstract = jax.eval_shape(init, rng)
    shardings = model_setup.param_shardings(config, abstract, mesh)
    # State rows belong to batch rows: shard them as the batch is, never replicate them.
    shardings = shardings.replace(mixer_state=jax.tree.map(lambda _: model_setup.batch_sharding(mesh),
                                                           abstract.mixer_state))
    with jax.set_mesh(mesh):
        traced = jax.jit(init, out_shardings=shardings).trace(rng)

    def initialise() -> TrainState:
        with jax.set_mesh(mesh):
            return traced.lower().compile()(rng)

    return initialise, traced.out_info, shardings


# Building a run
@dataclasses.dataclass(frozen=True)
class CheckedConfig:
    """What ``check_config`` found: the typed config, its mesh, and the config as config.json stores it."""

    config: RunConfig
    mesh: jax.sharding.Mesh
    record: dict[str, Any]


def check_config(config: Any, devices: Sequence[jax.Device]) -> CheckedConfig:
    """Every check that needs no data (fields, the dataset's name and folder, mesh, batch split, a plugin's
    trace); what ``build_run`` takes."""
    checked = validate_config(config)
    sources.check_before_writing(checked.data)
    mesh = model_setup.make_mesh(checked.mesh, devices)
    check_batch_divides(checked, mesh)
    check_plugins_trace(checked)
    check_state_rules(checked)
    return CheckedConfig(checked, mesh, workdir_lib.as_record(config))


def check_state_rules(config: RunConfig) -> None:
    """A stream's stateful mixers keep the state rules, traced abstractly before any data is prepared."""
    if not config.data.stream:
        return  # nothing is carried between batches: init_mixer_state makes no state
    model = model_setup.build_model(config)
    mixer_state.check(model, *model_setup.model_inputs(model_setup.dummy_batch(config, config.data.batch_size)))


def check_plugins_trace(config: RunConfig) -> None:
    """A model with a plugin mixer or FFN is traced once, abstractly, before any data: a misfit fails now."""
    model_cfg = config.model
    model = model_setup.build_model(config, model_cfg.vocab_size)
    sides = ("decoder",) if config.task == "lm" else ("encoder", "decoder")
    names = [name for side in sides for name in model_cfg.layer_mixers(side)]
    plugins = sorted({name for name in names if not mixers.mixer_class(name).__module__.startswith("lconv.")})
    if not mixers.ffn_class(model_cfg.ffn_type).__module__.startswith("lconv."):
        plugins.append(f"ffn_type={model_cfg.ffn_type}")
    if not plugins:
        return
    args, kwargs = model_setup.model_inputs(model_setup.dummy_batch(config, length=8))
    try:
        jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 (the plugin's own code failed: one line naming it and the checker)
        line = (str(err).strip().splitlines() or [""])[0]
        raise UserError(f"the model with plugin(s) {', '.join(plugins)} fails to trace ({type(err).__name__}: "
                        f"{line}); lconv.testing.check_mixer names the rule a mixer breaks") from None


def build_run(config: Any, workdir: str, devices: Sequence[jax.Device] | None = None, *,
              accept_config_changes: bool = False, checked: CheckedConfig | None = None) -> Run:
    """Checks ``config``, then builds the mesh, tokenizer, datasets, model and fresh train state for ``workdir`` (the
    caller restores a checkpoint and holds the lock); ``checked``: ``check_config``'s result, if already run."""
    devices = jax.devices() if devices is None else list(devices)
    checked = check_config(config, devices) if checked is None else checked
    mesh, config = checked.mesh, checked.config
    workdir = workdir_lib.make_workdir(workdir)
    has_checkpoint = checkpoints.has_checkpoint(workdir)
    config_changes = workdir_lib.check_config_change(checked.record, workdir, has_checkpoint=has_checkpoint,
                                                     accept_changes=accept_config_changes)
    if not has_checkpoint:  # nothing to restore: the config is this launch's (a failed launch pins nothing)
        workdir_lib.write_config(checked.record, workdir, config_changes, has_checkpoint=False)
        config_changes = None
    seconds, mark = {}, budget_lib.clock()  # the budget's clock: first_update_seconds is on it too

    def phase_done(name: str) -> None:
        nonlocal mark
        seconds[name], mark = budget_lib.clock() - mark, budget_lib.clock()

    build_state = functools.partial(_build_state, config, mesh)
    early = None
    # State and step build beside the data only where a tokenizer is still to make (else nothing slow to overlap).
    builds_early = jax.process_count() == 1 and not epath.Path(tokenizer_lib.tokenizer_path(workdir)).exists()
    tokenizer_first = builds_early and early_build.tokenizer_first(config.data)
    if builds_early and not tokenizer_first:
        early = early_build.EarlyBuild(config, mesh, config.data.vocab_size, build_state)
    try:
        tokenizer = pipeline.load_or_train_tokenizer(config.data, workdir)  # the data prepared first, if it is not
        phase_done("data and tokenizer")
        if tokenizer_first:
            early = early_build.EarlyBuild(config, mesh, tokenizer.vocab_size, build_state)
        data = pipeline.make_datasets(config.data, tokenizer)
    except BaseException:
        if early is not None:
            early.cancel()  # the error is printed at once; the process exits once the build's stage ends
        raise
    _report_data_source(data.source_report, workdir)
    phase_done("datasets")
    built = early.result_for(tokenizer.vocab_size) if early is not None else None
    parts, train_step = built if built is not None else (build_state(tokenizer.vocab_size).build(), None)
    phase_done("model and optimizer state")  # early: the wait for it and the train step's compilation
    logger.info(f"model: {model_setup.count_params(parts.state.params):,} parameters; mesh {dict(mesh.shape)}; "
                f"devices {len(devices)} x {devices[0].platform}")
    return Run(config, workdir, mesh, tokenizer, data, parts.model, parts.lr_schedule, parts.state,
               parts.state_shardings, checked.record, config_changes, seconds, train_step)


def _build_state(config: RunConfig, mesh: jax.sharding.Mesh, vocab_size: int) -> early_build.StatePlan:
    """The model for ``vocab_size``, the optimizer, and the plan of the fresh state in its shardings."""
    model = model_setup.build_model(config, vocab_size)
    tx, lr_schedule = update.build_optimizer(config.optim, config.train.num_steps)
    return early_build.StatePlan(model, lr_schedule, *plan_state(config, model, mesh, tx))


def _report_data_source(report: dict[str, Any], workdir: str) -> None:
    """What the prepared data was built from and what was skipped: logged and written to ``data_report.json``."""
    if not report or jax.process_index() != 0:
        return
    for line in sources.describe_report(report):
        logger.info(line)
    outputs.write_atomically(epath.Path(workdir) / "data_report.json", json.dumps(report, indent=1, sort_keys=True))


