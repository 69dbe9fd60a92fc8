"""The token-mixer registry: one name -> one Flax linen module, one call signature for all. Open to plugins.

A name is a registered one or a ``"package.module:Class"`` imported on first use; ``register_mixer`` and the
``lconv.mixers`` entry-point group add names, and FFNs have a registry with the same rules. The contract:
docs/models.md, "The mixer contract" (``lconv.testing.check_mixer`` checks it).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import re
import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lconv.errors import UserError

BOTH_SIDES = ("encoder", "decoder")
LAYER_VALUES = ("causal", "kernel_size")  # model values a layer fills itself; the rest come from ModelConfig
ENTRY_POINT_GROUP = "lconv.mixers"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")

# Registered name -> a class, or a "module:Class" string imported on first use (no import cycles at load time).
_MIXERS: dict[str, type[nn.Module] | str] = {
    "lightconv": "lconv.nn.conv:LightConvBlock",  # conv_type='lightweight' is the block's default
    "dynamicconv": "lconv.nn.conv:DynamicConvBlock",
    "attention": "lconv.nn.attention:SelfAttention",
    "fixed": "lconv.nn.attention:FixedAttention",
    "hadamard": "lconv.nn.attention:HadamardAttention",
    "colt5": "lconv.nn.colt5:CoLT5Attention",
    "knn_memory": "lconv.nn.knn_memory:KNNMemoryAttention",
}
_FFNS: dict[str, type[nn.Module] | str] = {
    "dense": "lconv.nn.models:FeedForward",
    "colt5": "lconv.nn.colt5:CoLT5FeedForward",  # routed light/heavy FFN; encoder layers only
}
_entry_points_loaded = False
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MixerInfo:
    """What lconv knows about a mixer, read from its class (docs/models.md lists the attributes)."""

    name: Any  # the registered name, the "module:Class" string it was named by, or the class itself
    cls: type[nn.Module]
    model_fields: dict[str, str]
    sides: tuple[str, ...]
    side_reason: str
    label: str
    variant: str
    example_fields: dict[str, Any]
    state: tuple[str, ...]
    reset_state: Callable[[Any, Any], Any]  # (one collection's tree, reset_B [B] bool) -> the tree, rows reset
    layout: tuple[int, ...] | None  # the layers it takes on a side (Python indices); None: every layer
    layout_others: str  # the mixer of the layers it does not take
    fields: frozenset[str]  # its constructor fields

    @property
    def both_sides(self) -> bool:
        return set(BOTH_SIDES) <= set(self.sides)


# ---------------------------------------------------------------------------------------------------- registering
def register_mixer(name: str, mixer: type[nn.Module] | str | None = None, *, replace: bool = False) -> Any:
    """Adds mixer ``name``: a ``flax.linen.Module`` class or a ``"package.module:Class"`` string (imported on first
    use). A taken name is refused unless ``replace=True``. Without ``mixer`` it is a class decorator::

        @lconv.register_mixer("mean_pool")
        class MeanPool(nn.Module): ...
    """
    if mixer is None:
        return lambda cls: register_mixer(name, cls, replace=replace)
    _register(_MIXERS, "mixer", name, mixer, replace)
    return mixer


def register_ffn(name: str, ffn: type[nn.Module] | str | None = None, *, replace: bool = False) -> Any:
    """Adds feed-forward sublayer ``name`` (``config.model.ffn_type``), as ``register_mixer`` does mixers."""
    if ffn is None:
        return lambda cls: register_ffn(name, cls, replace=replace)
    _register(_FFNS, "ffn", name, ffn, replace)
    return ffn


def _register(table: dict, kind: str, name: str, target: Any, replace: bool) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(f"{kind} name {name!r}: must be a Python identifier (letters, digits, '_'); "
                        f"a 'module:Class' string is already accepted wherever a {kind} is named")
    if isinstance(target, str):
        _split_spec(target, kind)
    elif not (isinstance(target, type) and issubclass(target, nn.Module)):
        raise UserError(f"{kind} {name!r}: {target!r} is not a flax.linen.Module class or a 'module:Class' string")
    _load_entry_points()
    if name in table and not replace and table[name] is not target:
        raise UserError(f"{kind} {name!r} is already registered ({_describe(table[name])}); pass replace=True to "
                        f"replace it")
    if kind == "mixer":
        _check_words(name, target)
    table[name] = target


def _check_words(name: str, target: Any) -> None:
    """Refuses a new mixer whose name or ``variant`` word already picks another: ``:WORD`` could never pick it."""
    taken = {word: owner for word, owner in variants().items() if owner != name}
    word = vars(target).get("variant", name) if isinstance(target, type) else name
    for what, value in (("name", name), ("variant word", word)):
        if value in taken:
            raise UserError(f"mixer {name!r}: its {what} {value!r} already picks mixer {taken[value]!r} in "
                            f"--config=file.py:{value}; choose another")


def _load_entry_points() -> None:
    """Mixers that installed packages declare (``[project.entry-points."lconv.mixers"]``), once per process."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in _MIXERS:
            logger.warning("entry point %s = %s ignored: mixer %r is already registered", entry.name, entry.value,
                        entry.name)
        else:
            _MIXERS[entry.name] = entry.value


# ---------------------------------------------------------------------------------------------------- resolving
def mixer_names() -> list[str]:
    """The registered names, built-in mixers first in their canonical order, then plugins as registered."""
    _load_entry_points()
    return list(_MIXERS)


def ffn_names() -> list[str]:
    return list(_FFNS)


LAYER_SPEC = "a mixer name, a comma list, or a list of names, one per layer"


def is_layer_spec(value: Any) -> bool:
    """Whether ``value`` can be a mixer field: a string or a list of strings. Anything else (a JSON object in a stored
    config) is refused before ``list()`` could resolve, and import, its keys past the trust check."""
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))


def is_spec(name: Any) -> bool:
    """Whether ``name`` is a ``"package.module:Class"`` string rather than a registered name."""
    return isinstance(name, str) and ":" in name


def mixer_class(name: str) -> type[nn.Module]:
    """The module class registered under ``name`` or named by ``"module:Class"``; a one-line error otherwise."""
    return _resolve("mixer", name)


def ffn_class(name: str) -> type[nn.Module]:
    return _resolve("ffn", name)


def _resolve(kind: str, name: Any) -> type[nn.Module]:
    if isinstance(name, type) and issubclass(name, nn.Module):  # a class in hand (lconv.testing, notebooks)
        return name
    if not isinstance(name, str):
        raise UserError(f"{kind} {name!r}: must be a registered name or a 'module:Class' string")
    _load_entry_points()
    table = _MIXERS if kind == "mixer" else _FFNS
    target = table.get(name, name if is_spec(name) else None)
    if target is None:
        raise UserError(f"unknown {kind} {name!r}; choose one of {list(table)} or name a class as "
                        f"'package.module:Class'")
    return _import(kind, name, target) if isinstance(target, str) else target


@functools.cache  # a failure is not cached: the user may fix PYTHONPATH and try again in the same session
def _import(kind: str, name: str, target: str) -> type[nn.Module]:
    """The class a ``"module:Class"`` string names, imported once."""
    module_name, class_name = _split_spec(target, kind)
    module = import_plugin_module(module_name, f"{kind} {name!r}")
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        found = "nothing" if cls is None else type(cls).__name__
        raise UserError(f"{kind} {name!r}: {module_name}.{class_name} is {found}, not a flax.linen.Module class")
    return cls


def import_plugin_module(module_name: str, what: str) -> Any:
    """The plugin module ``module_name``; whatever its import raises is one line naming where it failed."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the module itself, not one it imports
            raise UserError(f"{what}: no module named {module_name!r}; is its folder on PYTHONPATH?") from None
        raise UserError(f"{what}: importing module {module_name!r} failed: {_error_line(e)}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 (whatever a plugin raises on import: one line)
        raise UserError(f"{what}: importing module {module_name!r} failed: {_error_line(e)}") from None


def runs_no_new_code(kind: str, spec: str) -> bool:
    """Whether resolving ``spec`` ("module:Class") imports nothing new (else ``trust_plugins`` is needed)."""
    _load_entry_points()
    table = _MIXERS if kind == "mixer" else _FFNS
    if any(spec == _describe(target) for target in table.values()):
        return True
    return spec.partition(":")[0] in sys.modules


def _error_line(error: BaseException) -> str:
    """``Type: first line of the message (file:line)``: where in the user's module it went wrong."""
    import traceback

    text = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} ({error.filename}:{error.lineno})"
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if "importlib" not in f.filename]
    where = f" ({own[-1].filename}:{own[-1].lineno})" if own else ""
    return f"{type(error).__name__}: {text}{where}"


def _split_spec(spec: str, kind: str) -> tuple[str, str]:
    module_name, sep, class_name = spec.partition(":")
    if not (sep and module_name and class_name.isidentifier()
            and all(p.isidentifier() for p in module_name.split("."))):
        raise UserError(f"{kind} {spec!r}: a class is named as 'package.module:Class'")
    return module_name, class_name


def _describe(target: Any) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


# ---------------------------------------------------------------------------------------------------- metadata
def info(name: str | type[nn.Module]) -> MixerInfo:
    """Mixer ``name``'s metadata (a registered name, ``"module:Class"`` or a class), from its class attributes."""
    cls = mixer_class(name)
    sides = tuple(getattr(cls, "sides", BOTH_SIDES))
    bad = sorted(set(sides) - set(BOTH_SIDES))
    if bad or not sides:
        raise UserError(f"mixer {name!r}: sides={sides!r} must name 'encoder' and/or 'decoder'")
    if not isinstance(name, str):
        name = cls
    short = cls.__name__ if not isinstance(name, str) else name.rpartition(":")[2] if is_spec(name) else name
    own = vars(cls)  # a subclass names itself: an inherited label or variant word would name its parent
    return MixerInfo(
        name=name, cls=cls, model_fields=dict(getattr(cls, "model_fields", {})), sides=sides,
        side_reason=str(getattr(cls, "side_reason", "")), label=str(own.get("label", short)),
        variant=str(own.get("variant", short)), example_fields=dict(getattr(cls, "example_fields", {})),
        state=_state(name, getattr(cls, "state", ())), reset_state=_reset_state(name, cls),
        layout=_layout(name, getattr(cls, "layout", None)),
        layout_others=str(getattr(cls, "layout_others", "attention")),
        fields=frozenset(constructor_fields(cls)))


RESERVED_COLLECTIONS = ("params", "cache", "intermediates")  # lconv's own: a mixer's state is never one of them


def _state(name: Any, state: Any) -> tuple[str, ...]:
    """A class's ``state``, checked: a tuple of collection names of its own, none that lconv fills itself."""
    if not (isinstance(state, (tuple, list)) and all(isinstance(c, str) and c.isidentifier() for c in state)):
        raise UserError(f"mixer {name!r}: state={state!r} must be a tuple of collection names, e.g. ('memory',)")
    taken = [c for c in state if c in RESERVED_COLLECTIONS]
    if taken:
        raise UserError(f"mixer {name!r}: state names {taken[0]!r}, a collection lconv fills itself "
                        f"({', '.join(RESERVED_COLLECTIONS)}); name the carried state's collection otherwise")
    return tuple(state)


def _reset_state(name: Any, cls: type) -> Callable[[Any, Any], Any]:
    """A class's ``reset_state`` (default ``zero_rows``): it must be callable as ``reset_state(tree, reset_B)``."""
    reset = getattr(cls, "reset_state", zero_rows)
    if not callable(reset):
        raise UserError(f"mixer {name!r}: reset_state={reset!r} is not callable; define it as a staticmethod "
                        "reset_state(tree, reset_B)")
    return reset


def _layout(name: Any, layout: Any) -> tuple[int, ...] | None:
    if layout is None:
        return None
    if not (isinstance(layout, (tuple, list)) and layout and all(isinstance(i, int) for i in layout)):
        raise UserError(f"mixer {name!r}: layout={layout!r} must be a non-empty tuple of layer indices (e.g. (-2,))")
    return tuple(layout)


def zero_rows(tree: Any, reset_B: Any) -> Any:
    """The default ``reset_state``: rows ``reset_B`` of every ``[B, ...]`` leaf of ``tree`` zeroed, the others kept."""
    reset_B = jnp.asarray(reset_B, bool)
    if reset_B.ndim != 1:
        raise UserError(f"reset_B must be [batch] bool, got shape {reset_B.shape}")

    def reset(path: Any, leaf: Any) -> Any:
        if leaf.shape[:1] != reset_B.shape:
            raise UserError(f"reset_B has batch {reset_B.shape[0]} but state leaf {jax.tree_util.keystr(path)} "
                            f"has shape {leaf.shape}")
        keep = ~reset_B.reshape(reset_B.shape + (1,) * (leaf.ndim - 1))
        return jnp.where(keep, leaf, jnp.zeros((), leaf.dtype))

    return jax.tree_util.tree_map_with_path(reset, tree)


def layer_layout(name: str, num_layers: int) -> str:
    """The ``{side}_mixer`` value that gives ``num_layers`` layers mixer ``name`` by its ``layout`` rule."""
    i = info(name)
    if i.layout is None or num_layers < 1:
        return name
    layers = [i.layout_others] * num_layers
    for index in i.layout:
        layers[min(max(index, -num_layers), num_layers - 1)] = name
    return ",".join(layers)


def model_fields(name: str) -> dict[str, str]:
    """``{constructor field: model value}`` that a model layer passes to mixer ``name``."""
    return info(name).model_fields


def sides(name: str) -> tuple[str, ...]:
    """Where mixer ``name`` may sit: ``"encoder"``, ``"decoder"`` or both."""
    return info(name).sides


def variants() -> dict[str, str]:
    """``{variant word: registered name}``: the words that pick each mixer, besides its name."""
    words = {name: name for name in mixer_names()}
    for i in importable_infos():
        if words.setdefault(i.variant, i.name) != i.name:
            _warn_once(f"mixer {i.name!r}: its variant word {i.variant!r} already picks mixer {words[i.variant]!r}; "
                       f"only {i.name!r} picks it")
    return words


def variant_words(side: str | None = None, both_sides: bool = False) -> list[str]:
    """The word that picks each registered mixer, in registry order; only those that fit ``side`` / both sides."""
    words = variants()
    return [i.variant if words[i.variant] == i.name else i.name for i in importable_infos()
            if (side is None or side in i.sides) and (i.both_sides or not both_sides)]


def importable_infos() -> list[MixerInfo]:
    """``info`` of each registered mixer; one that cannot be imported is left out with a warning."""
    out = []
    for name in mixer_names():
        try:
            out.append(info(name))
        except UserError as e:
            _warn_once(f"mixer {name!r} is registered but cannot be used: {e}")
    return out


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def constructor_fields(cls: type[nn.Module]) -> set[str]:
    """The fields ``cls(...)`` takes: its dataclass fields, without the ``ClassVar`` attributes flax lists too."""
    if not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls) if f.name not in ("parent", "name")}


def required_fields(cls: type[nn.Module]) -> set[str]:
    """The constructor fields ``cls(...)`` cannot do without: those with no default."""
    if not dataclasses.is_dataclass(cls):
        return set()
    return {f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")
            and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


# The keywords a model layer calls each kind with (docs/models.md, "The mixer contract").
CALL_KEYWORDS = {"mixer": ("segment_ids", "positions", "deterministic", "decode"),
                 "ffn": ("segment_ids", "deterministic")}


def contract_problem(kind: str, cls: type[nn.Module], given: Iterable[str]) -> str | None:
    """What keeps ``cls`` from being built with the fields ``given`` and called as a model layer calls a ``kind``
    (a class such as ``flax.linen:Dense`` failed in flax's own traceback); None when nothing does."""
    missing = sorted(required_fields(cls) - set(given))
    if missing:
        return (f"{_describe(cls)} needs field(s) {missing}, which a layer does not give (it gives the class's "
                f"model_fields and config.model.{kind}_kwargs)")
    try:
        inspect.signature(cls.__call__).bind(None, None, **dict.fromkeys(CALL_KEYWORDS[kind]))
    except TypeError as err:
        keywords = ", ".join(f"{k}=..." for k in CALL_KEYWORDS[kind])
        return f"{_describe(cls)} cannot take a layer's call {kind}(x, {keywords}): {err}"
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        pass
    return None


# ---------------------------------------------------------------------------------------------------- building
def make_mixer(mixer_name: str, /, **kwargs: Any) -> nn.Module:
    """Builds mixer ``mixer_name`` with its constructor fields (plus flax's ``name``); unknown fields fail clearly."""
    return _build("mixer", mixer_class(mixer_name), mixer_name, kwargs)


def make_ffn(ffn_name: str, /, **kwargs: Any) -> nn.Module:
    return _build("ffn", ffn_class(ffn_name), ffn_name, kwargs)


def _build(kind: str, cls: type[nn.Module], name: str, kwargs: dict[str, Any]) -> nn.Module:
    fields = constructor_fields(cls)
    unknown = sorted(set(kwargs) - fields - {"name"})
    if unknown:
        raise UserError(f"{kind} {name!r} has no field(s) {unknown}; its fields are {sorted(fields)}")
    return cls(**kwargs)


def check_output(name: Any, x: Any, y: Any, where: str) -> None:
    """The checker's 'output' rule, applied as a model traces each mixer: a wrong output is one line."""
    if not (hasattr(y, "shape") and hasattr(y, "dtype")) or (y.shape, y.dtype) != (x.shape, x.dtype):
        raise UserError(f"mixer {_describe(name) if not isinstance(name, str) else name!r} ({where}) returned "
                        f"{describe_output(y)} for x {x.dtype}{list(x.shape)}: a mixer returns one array of x's shape "
                        "and dtype (lconv.testing.check_mixer checks the whole contract)")


def describe_output(out: Any) -> str:
    """What a mixer returned, abstractly: ``a tuple of 2 (float32[2, 13, 12], ...)``, ``float32[2, 13, 24]``."""
    def one(leaf: Any) -> str:
        return f"{leaf.dtype}{list(leaf.shape)}" if hasattr(leaf, "shape") else type(leaf).__name__

    if isinstance(out, (tuple, list, dict)):
        leaves = [one(leaf) for leaf in (out.values() if isinstance(out, dict) else out)]
        return f"a {type(out).__name__} of {len(out)} ({', '.join(leaves[:3])}{', ...' * (len(leaves) > 3)})"
    return one(out)


def ffn_for_side(name: str, side: str) -> str:
    """The FFN a ``side`` layer uses for ``name``: one that cannot sit there (CoLT5's) leaves the dense one."""
    return name if side in getattr(ffn_class(name), "sides", BOTH_SIDES) else "dense"

