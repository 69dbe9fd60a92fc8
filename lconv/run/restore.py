"""A trained run read back from its workdir: its stored config (checked by the schema, the fields lconv added since
filled in), then its model and parameters (``load_trained``: an orbax partial restore, no optimizer built, nothing
written). What eval.py, ``lconv.load``, export, the study and ``init_from`` read a run through.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from etils import epath

from lconv import json_text, shared_folders
from lconv.constants import EXPORT_SIDECAR
from lconv.data import paths
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError, first_line
from lconv.fields import is_integer, one_line
from lconv.nn import mixers
from lconv.run import checkpoints, model_setup
from lconv.run import workdir as workdir_lib
from lconv.run.schema import EVAL_LIMITS, RunConfig, complete, validate_config

PyTree = Any
logger = logging.getLogger(__name__)

TRUST_HINT = ("pass --trust_plugins (train.py, eval.py, python -m lconv.export) or trust_plugins=True (lconv.load), "
              "or import the module yourself first")
_trust_plugins = contextvars.ContextVar("trust_plugins", default=False)  # the CLIs' --trust_plugins


@contextlib.contextmanager
def trusting_plugins(trust: bool = True) -> Any:
    """Within it, a stored config may name plugin modules not imported yet (the programs' ``--trust_plugins``)."""
    token = _trust_plugins.set(bool(trust))
    try:
        yield
    finally:
        _trust_plugins.reset(token)


def check_plugins(stored: dict, path: Any, trust_plugins: bool | None = None) -> None:
    """A config read from a run someone handed over is data: a ``"module:Class"`` mixer or FFN it names would
    import that module and run its code. Refused (one line naming the module and the opt-in) unless trusted, or
    the registry already has it, or the module is imported already; lconv's own mixers need nothing. A mixer or FFN
    field that is not a string (or a list of strings) is refused first, trusted or not: nothing could be checked."""
    model = stored.get("model")
    if not isinstance(model, dict):
        return
    for name, valid, requirement in (("encoder_mixer", mixers.is_layer_spec, mixers.LAYER_SPEC),
                                     ("decoder_mixer", mixers.is_layer_spec, mixers.LAYER_SPEC),
                                     ("ffn_type", lambda v: isinstance(v, str), "a feed-forward name")):
        if name in model and not valid(model[name]):  # e.g. {"module:X": 1}: its keys would be resolved
            raise UserError(f"{path}: config.model.{name}={one_line(model[name])}: must be {requirement}")
    if trust_plugins if trust_plugins is not None else _trust_plugins.get():
        return
    for kind, field, spec in named_classes(model):
        if not mixers.runs_no_new_code(kind, spec):
            raise UserError(f"{path}: config.model.{field} names plugin {kind} {spec!r}, which would import module "
                            f"{spec.partition(':')[0]!r} and run its code; if you trust this run, {TRUST_HINT}")


def named_classes(model: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(kind, field, "module:Class")`` of every class a config's model section names: its mixers (each side's
    layers and ``mixer_kwargs``' keys) and its FFN."""
    named: list[tuple[str, str, Any]] = []  # (kind, field, value)
    for side in ("encoder_mixer", "decoder_mixer"):
        value = model.get(side, "")
        parts = value.split(",") if isinstance(value, str) else value
        named += [("mixer", side, part.strip() if isinstance(part, str) else part) for part in parts]
    if isinstance(model.get("mixer_kwargs"), dict):
        named += [("mixer", "mixer_kwargs", key) for key in model["mixer_kwargs"]]
    named.append(("ffn", "ffn_type", model.get("ffn_type")))
    return [(kind, field, spec) for kind, field, spec in named if mixers.is_spec(spec)]


@dataclasses.dataclass
class Trained:
    """A trained model for evaluation: its stored config, tokenizer, model and (averaged) parameters."""

    config: RunConfig
    workdir: str
    tokenizer: tokenizer_lib.Tokenizer
    model: nn.Module
    params: PyTree
    steps: list[int]  # the checkpoint steps the parameters come from (averaged when more than one)


def find_run(workdir: str, caller: str = "--workdir") -> str:
    """The resolved workdir (local or an ``etils.epath`` URL) of a run, or a one-line error naming the path as
    ``caller`` was given it (``--workdir=runs/x``, ``lconv.load('runs/x')``) and what is there instead: nothing,
    an export, or a folder without a ``config.json``. ``caller`` may be a config field (``config.train.init_from``)."""
    label = f"{caller}={workdir}" if caller.startswith(("-", "config.")) else f"{caller}({str(workdir)!r})"
    paths.check_url(workdir, caller, label=label)
    resolved = workdir_lib.resolve(workdir)
    root = epath.Path(resolved)
    if (root / workdir_lib.CONFIG_FILENAME).exists():
        shared_folders.check(str(workdir), label)  # as given: a '..' after a link is refused, not resolved away
        return resolved
    where = "" if resolved == str(workdir) else f" ({resolved})"
    if not root.exists():
        raise UserError(f"{label}: no such directory{where}")
    if (root / EXPORT_SIDECAR).exists():
        raise UserError(f"{label} is an export, not a run: load it with lconv.export.load")
    raise UserError(f"{label}: not a run written by train.py (no {workdir_lib.CONFIG_FILENAME} in {resolved})")


@dataclasses.dataclass(frozen=True)
class StoredConfig:
    """A run's ``config.json`` as ``read_stored`` read it: the stored dict with the fields lconv added since at
    their defaults, and the typed config parsed from it once."""

    record: dict[str, Any]
    config: RunConfig


def read_stored(workdir: str, caller: str = "--workdir", trust_plugins: bool | None = None) -> StoredConfig:
    """The resolved config a run stored in ``<workdir>/config.json``, checked by the schema's rules as train.py
    checked it (a hand-edited value is named here); ``caller``: as ``find_run``'s. A plugin it names is imported
    only when trusted (``check_plugins``; None: as ``trusting_plugins`` says)."""
    root = find_run(workdir, caller)
    path = epath.Path(root) / workdir_lib.CONFIG_FILENAME
    try:
        stored = json_text.loads(workdir_lib.read_config_bytes(path, root))
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0][:200]
        raise UserError(f"{path}: not a readable JSON config ({reason}); restore it from a copy of the run") from None
    if not isinstance(stored, dict):
        raise UserError(f"{path}: holds a JSON {type(stored).__name__}, not a config object")
    check_plugins(stored, path, trust_plugins)
    try:
        _fit_eval_limits(complete(stored), path)  # fills, in place, the fields lconv added since
        config = validate_config(stored)
        return StoredConfig(stored, config)
    except UserError as err:
        raise UserError(f"{path}: {err}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise UserError(f"{path}: not a config lconv can read ({type(err).__name__}: {err})") from None


def _fit_eval_limits(stored: dict[str, Any], path: Any) -> None:
    """A seq2seq run stored before its evaluation limits had to fit its positions (the schema's
    ``_check_eval_lengths``) reads with them lowered to ``model.max_len``, said once, instead of failing to load."""
    data, model = stored["data"], stored["model"]
    positions = model.get("max_len") if isinstance(model, dict) else None
    if stored.get("task") == "lm" or not isinstance(data, dict) or not is_integer(positions) or positions < 1:
        return  # an LM scores in windows; a malformed value is the schema's to name
    for name in EVAL_LIMITS:
        if is_integer(data.get(name)) and data[name] > positions:
            logger.warning(f"{path}: config.data.{name} {data[name]} -> {positions} (config.model.max_len, the "
                           "model's positions)")
            data[name] = positions


def _traced_params(config: RunConfig, model: nn.Module, mesh: Any) -> Any:
    """The model's abstract params, traced once. A class the stored config names (``module:Class``) that passes the
    config's checks but fails to trace (``flax.linen:Module`` as a mixer) is one line naming it, not flax's
    traceback; lconv's own mixers failing is lconv's bug, and its traceback is kept."""
    try:
        return model_setup.abstract_params(config, model, mesh)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 (anything a class from elsewhere raises while it is traced)
        named = sorted({spec for _, _, spec in named_classes(config.as_config()["model"])})
        if not named:
            raise
        raise UserError(f"the model of config.model naming {', '.join(named)} cannot be built: "
                        f"{type(err).__name__}: {first_line(err, 200)}") from None


def read_config(workdir: str, caller: str = "--workdir", trust_plugins: bool | None = None) -> RunConfig:
    """``read_stored``'s config alone."""
    return read_stored(workdir, caller, trust_plugins).config


def as_flag(name: str) -> str:
    """An option as the programs' flags spell it (``--average_last``), so errors name what the user typed."""
    return f"--{name}"


def check_checkpoint_choice(average_last: int, checkpoint: str, spell: Callable[[str], str] = as_flag) -> None:
    """Which checkpoints ``load_trained`` may average; errors named as ``spell`` spells the options."""
    if not isinstance(checkpoint, str) or checkpoint not in ("latest", "best"):
        raise UserError(f"{spell('checkpoint')}={checkpoint!r}: must be latest or best")
    if not is_integer(average_last) or average_last < 1:
        raise UserError(f"{spell('average_last')}={average_last!r}: must be >= 1, an integer (the number of latest "
                        "checkpoints to average)")
    if checkpoint == "best" and average_last > 1:
        raise UserError(f"{spell('average_last')} averages the latest checkpoints; it does not combine with "
                        f"{spell('checkpoint')}=best")


def load_trained(workdir: str, *, average_last: int = 1, checkpoint: str = "latest",
                 overrides: dict[str, dict[str, Any]] | None = None, caller: str = "--workdir",
                 spell: Callable[[str], str] = as_flag, devices: Sequence[jax.Device] | None = None,
                 stored: StoredConfig | None = None, trust_plugins: bool | None = None) -> Trained:
    """The model of a trained ``workdir`` (local or a URL) with the params of its latest checkpoint, the mean of
    the last ``average_last``, or with ``checkpoint="best"`` the best by validation loss. Reads the params only,
    writes nothing (the workdir may be read-only). ``overrides`` (``{section: {field: value}}``) change the stored
    config before the model is built (``RunConfig.replace``: checked again); ``caller`` and ``spell`` name the
    arguments in errors; ``stored``: ``read_stored``'s."""
    check_checkpoint_choice(average_last, checkpoint, spell)
    stored = read_stored(workdir, caller, trust_plugins) if stored is None else stored
    config = stored.config
    if overrides:
        limit = overrides.get("data", {}).get("eval_max_input_length")
        if limit is not None and limit > config.model.max_len:
            raise UserError(f"{spell('max_input_length')}={limit}: at most the model's config.model.max_len="
                            f"{config.model.max_len} positions")
        config = config.replace(**overrides)
    workdir = workdir_lib.resolve(workdir)
    tokenizer = tokenizer_lib.load_tokenizer(workdir)
    model = model_setup.build_model(config, tokenizer.vocab_size)
    ckpt = checkpoints.Checkpointer(workdir, subdir="checkpoints" if checkpoint == "latest" else "best",
                                    read_only=True)
    steps = sorted(ckpt.all_steps())
    if not steps:
        raise UserError(f"no checkpoint in {ckpt.directory}; train first with train.py --workdir={workdir}")
    if average_last > len(steps):  # fewer would be averaged without a word
        raise UserError(f"{spell('average_last')}={average_last}: {ckpt.directory} holds {len(steps)} checkpoint"
                        f"{'s' if len(steps) != 1 else ''} (steps {', '.join(map(str, steps))}); average at most "
                        f"{len(steps)}")
    target = _traced_params(config, model, model_setup.make_mesh(config.mesh, devices))
    carried = model_setup.abstract_mixer_state(config, model)  # held beside the params by a stream run's steps
    chosen = steps[-average_last:]
    total = None
    for step in chosen:
        params = ckpt.restore_params(target, step, also_held=carried)
        total = params if total is None else jax.tree.map(jnp.add, total, params)
    ckpt.close()
    return Trained(config, workdir, tokenizer, model,
                   jax.tree.map(lambda x: x / len(chosen), total), chosen)
