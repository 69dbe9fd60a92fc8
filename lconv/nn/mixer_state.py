"""The state a model's mixers carry from one window of a document to the next: the mixer contract's ``state``.

``MixerState`` holds a model's carried collections with each class's ``reset_state``, so whoever feeds a document stream
threads any mixer's state without naming one (``initial``, then per window ``reset`` and ``apply``). It is a pytree: it
lives in the train state and passes through ``jit`` and ``scan``. The contract: docs/models.md, "A mixer with state".
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import struct

from lconv.errors import UserError
from lconv.nn import mixers
from lconv.nn.model_config import ModelConfig

PyTree = Any
Reset = Callable[[PyTree, Any], PyTree]


@struct.dataclass
class MixerState:
    """``{collection: tree of [B, ...] leaves}`` and each collection's reset hook (static: not a leaf)."""

    collections: dict[str, PyTree]
    resets: tuple[tuple[str, Reset], ...] = struct.field(pytree_node=False, default=())

    def __bool__(self) -> bool:
        return bool(self.collections)

    def reset(self, reset_B: Any) -> MixerState:
        """Rows ``reset_B`` (bool ``[B]``) of every collection back to their start, by the mixers' own hooks."""
        hooks = dict(self.resets)
        return self.replace(collections={c: hooks[c](tree, reset_B) for c, tree in self.collections.items()})

    def apply(self, apply_fn: Callable[..., Any], params: PyTree, *args: Any, update: bool = True,
              **kwargs: Any) -> tuple[Any, MixerState]:
        """``(apply_fn's output, the state after this window)``: read, and with ``update`` as the call left it."""
        variables = {"params": params, **self.collections}
        if not self.collections or not update:
            return apply_fn(variables, *args, **kwargs), self
        out, updated = apply_fn(variables, *args, mutable=list(self.collections), **kwargs)
        return out, self.replace(collections={c: updated[c] for c in self.collections})


def empty() -> MixerState:
    return MixerState({})


def declared(model_config: ModelConfig) -> dict[str, Reset]:
    """``{collection: reset hook}`` over the mixers of every layer ``model_config`` names."""
    return {collection: hook for collection, (hook, _) in _declared(model_config).items()}


def _declared(model_config: ModelConfig) -> dict[str, tuple[Reset, str]]:
    """``{collection: (reset hook, the first mixer that declares it)}``."""
    hooks: dict[str, tuple[Reset, str]] = {}
    for side in mixers.BOTH_SIDES:
        if not getattr(model_config, f"{side}_layers", 0):
            continue
        for name in dict.fromkeys(model_config.layer_mixers(side)):
            info = mixers.info(name)  # its state names none of lconv's own collections (``mixers.info`` checks)
            for collection in info.state:
                hook, owner = hooks.setdefault(collection, (info.reset_state, name))
                if hook is not info.reset_state:
                    raise UserError(f"mixers {owner!r} and {name!r} both carry state collection {collection!r} "
                                    "with different reset_state hooks; give one of them its own collection name")
    return hooks


def initial(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            sharding: jax.sharding.Sharding | None = None) -> MixerState:
    """The state ``model.init(rng, *args, **kwargs)`` creates for its stateful mixers, or the empty state; ``sharding``
    lays every leaf out with the batch's rows (None: plain arrays)."""
    owned = _declared(model.config)
    if not owned:
        return empty()
    check_rules(model, args, kwargs, owned)
    hooks = {collection: hook for collection, (hook, _) in owned.items()}

    def init() -> dict[str, PyTree]:  # only the state leaves are outputs: XLA drops the parameters' init
        variables = model.init(jax.random.key(0), *args, **kwargs)
        return {c: nn.meta.unbox(variables[c]) for c in hooks if c in variables}

    shapes = jax.eval_shape(init)
    if not shapes:
        return empty()
    collections = (jax.jit(init) if sharding is None else jax.jit(init, out_shardings=sharding))()
    return MixerState(collections, tuple((c, hooks[c]) for c in collections))


def check(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``check_rules`` for the stateful mixers ``model`` has (none: nothing to check)."""
    owned = _declared(model.config)
    if owned:
        check_rules(model, args, kwargs, owned)


_checked: set[Any] = set()  # (model, batch shapes) whose state rules held: traced once per process


def check_rules(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                owned: dict[str, tuple[Reset, str]]) -> None:
    """``lconv.testing.check_mixer``'s state rules on a run's model and batch, traced before any data; one line each."""
    key = (model, jax.tree.map(lambda x: (x.shape, x.dtype), (args, kwargs)).__repr__())
    try:
        if key in _checked:
            return
    except TypeError:  # an unhashable module: check every time
        key = None
    rows = args[0].shape[0]

    def window() -> tuple[PyTree, PyTree]:
        variables = model.init(jax.random.key(0), *args, **kwargs)
        state = {c: variables[c] for c in owned if c in variables}
        _, updated = model.apply({"params": variables["params"], **state}, *args, mutable=list(state), **kwargs)
        return nn.meta.unbox(state), nn.meta.unbox(dict(updated))

    initial_state, updated = jax.eval_shape(window)
    for collection, (hook, name) in owned.items():
        where = f"mixer {name!r}, state collection {collection!r}"
        if collection not in initial_state:
            raise UserError(f"{where} (rule state): init made no such collection; a stateful mixer creates it "
                            "when the model is initialised (self.variable(collection, ...))")
        before = jax.tree.map(lambda x: (x.shape, x.dtype), initial_state[collection])
        after = jax.tree.map(lambda x: (x.shape, x.dtype), updated.get(collection, initial_state[collection]))
        if before != after:
            raise UserError(f"{where} (rule state): a window changed its leaves from {_first_diff(before, after)}; "
                            "state keeps its shapes and dtypes from window to window (a growing leaf would "
                            "recompile every window)")
        try:
            reset = jax.eval_shape(hook, initial_state[collection], jax.ShapeDtypeStruct((rows,), bool))
        except Exception as err:  # noqa: BLE001 (the plugin's hook: whatever it raises is one line naming it)
            line = (str(err).strip().splitlines() or [""])[0][:200]
            raise UserError(f"{where} (rule reset): reset_state(tree, reset_B) failed: "
                            f"{type(err).__name__}: {line}") from None
        if jax.tree.map(lambda x: (x.shape, x.dtype), reset) != before:
            raise UserError(f"{where} (rule reset): reset_state returned another tree or shapes than it was given")
    if key is not None:
        _checked.add(key)


def _first_diff(before: PyTree, after: PyTree) -> str:
    """``path shape -> shape`` of the first leaf that differs (or the trees' structures when they differ)."""
    if jax.tree.structure(before, is_leaf=_is_pair) != jax.tree.structure(after, is_leaf=_is_pair):
        return "one tree to another (leaves added or removed)"
    pairs = zip(jax.tree_util.tree_leaves_with_path(before, is_leaf=_is_pair),
                jax.tree.leaves(after, is_leaf=_is_pair))
    for (path, old), new in pairs:
        if old != new:
            return f"{jax.tree_util.keystr(path)} {old[1]}{list(old[0])} to {new[1]}{list(new[0])}"
    return "one tree to another"


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)
