"""The token-mixer contract (docs/models.md, "The mixer contract") as an executable checker, for your own mixers.

    import lconv.testing
    lconv.testing.check_mixer("my_mixers:MeanPool")            # or a registered name, or the class itself
    lconv.testing.check_mixer("fixed", factorized_rank=2)      # constructor fields on top of example_fields

Each rule of ``RULES`` is checked on a short packed batch, for every side the mixer may sit on, at exact float32 dots; a
broken rule raises ``AssertionError`` whose first line names it. A few seconds per mixer on a CPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lconv.nn import mixers
from lconv.nn.common import axis_rules
from lconv.run import compilation_cache

RULES = {
    "fields": "the model can build it: model_fields name constructor fields and model values, and a mixer that "
              "may sit in a decoder takes `causal` from the model",
    "runs": "init (with a 'params' rng) and a call return without raising",
    "output": "y is one array of x's shape and dtype, finite for a finite x",
    "deterministic": "deterministic=True runs with no 'dropout' rng (and deterministic=False runs with one)",
    "logical_axes": "every parameter carries logical axis names, one per dimension, that the default mesh rules "
                    "can map (no name twice)",
    "segments": "nothing crosses segments: each packed example's output equals its output alone",
    "padding": "padding does not leak: what padded positions hold changes no real token's output",
    "causality": "a causal mixer never reads the future",
    "decoding": "incremental decoding over chunks of several sizes equals the full causal pass (with a carried "
                "state too, which decoding reads and leaves)",
    "state": "the collections a stateful mixer declares (`state`) are made by init, one [B, ...] leaf per row, and "
             "keep their shapes and dtypes through a call that updates them",
    "carry": "the state carried from one window changes the next window's output, row by row (a row's state "
             "changes only its own row), and a call without the state equals one with init's",
    "reset": "reset_state returns a row to init's state: a reset row's next window equals a fresh document's, the "
             "other rows keep theirs",
    "decode_refusal": "a non-causal mixer refuses decode=True with a one-line ValueError",
    "gradients": "gradients with respect to the parameters and the input are finite",
}

B, T, C, H = 2, 13, 12, 3
# Row 0: two packed examples (7 + 4 tokens) and 2 padding; row 1: one example of 10 and 3 padding.
SEGMENTS_BT = np.array([[1] * 7 + [2] * 4 + [0] * 2, [1] * 10 + [0] * 3], np.int32)
POSITIONS_BT = np.array([list(range(7)) + list(range(4)) + [0, 0], list(range(10)) + [0] * 3], np.int32)
DECODE_CHUNKS = (1, 1, 5, 1, 5)  # chunks of one and of several new positions, T in all


class _Broken(AssertionError):
    def __init__(self, rule: str, detail: str):
        super().__init__(rule, detail)
        self.rule, self.detail = rule, detail


def check_mixer(mixer: str | type[nn.Module], **fields: Any) -> None:
    """Checks every rule of ``RULES`` for ``mixer`` (a registered name, ``"package.module:Class"`` or a class), built
    with its ``example_fields`` and ``fields``, on each side it may sit on (or only at ``causal``)."""
    compilation_cache.check_chosen()  # it compiles: never from a folder another user could fill with code
    info = mixers.info(mixer)
    causal_settings = [fields.pop("causal")] if "causal" in fields else _causal_settings(info)
    for causal in causal_settings:
        label = f"{info.label} (causal={causal})" if causal is not None else info.label
        try:
            _check_fields(info)
            _Checker(info, _fields(info, fields, causal), causal).run()
        except _Broken as broken:
            raise AssertionError(f"rule {broken.rule!r} broken by {label}: {RULES[broken.rule]}\n"
                                 f"{broken.detail}") from None


def _causal_settings(info: mixers.MixerInfo) -> list[bool | None]:
    if "causal" not in info.fields:
        return [None]
    return [side == "decoder" for side in mixers.BOTH_SIDES if side in info.sides]


def _fields(info: mixers.MixerInfo, given: dict[str, Any], causal: bool | None) -> dict[str, Any]:
    out = dict(info.example_fields)
    if "num_heads" in info.fields:
        out["num_heads"] = H
    if "matmul_precision" in info.fields:
        out["matmul_precision"] = "highest"
    for field in info.fields:
        if "dropout" in field:
            out[field] = 0.1
    if causal is not None:
        out["causal"] = causal
    return {**out, **given}


def _check_fields(info: mixers.MixerInfo) -> None:
    from lconv.nn.model_config import ModelConfig

    model_values = set(ModelConfig.__dataclass_fields__) | set(mixers.LAYER_VALUES)
    for field, source in info.model_fields.items():
        if field not in info.fields:
            raise _Broken("fields", f"model_fields names {field!r}, which is not a constructor field of "
                                    f"{info.cls.__name__} (its fields: {sorted(info.fields)})")
        if source not in model_values:
            raise _Broken("fields", f"model_fields maps {field!r} to {source!r}, which the model does not have")
    if "decoder" in info.sides and info.model_fields.get("causal") != "causal":
        raise _Broken("fields", "it may sit in a decoder but model_fields has no 'causal': 'causal', so a decoder "
                                "layer could not make it causal")


@dataclasses.dataclass
class _Checker:
    info: mixers.MixerInfo
    fields: dict[str, Any]
    causal: bool | None

    def run(self) -> None:
        self.module = mixers.make_mixer(self.info.name, **self.fields)
        self.x = jax.random.normal(jax.random.key(0), (B, T, C), jnp.float32)
        variables = self._init()
        self._check_logical_axes(variables)
        variables = nn.meta.unbox(variables)
        self.params = variables.get("params", {})  # a mixer may have no parameters
        self.state = {k: v for k, v in variables.items() if k not in ("params", "cache")}
        self._apply = jax.jit(self._pass)
        self._check_output_and_determinism()
        self._check_padding()
        self._check_segments()
        if self.causal:
            self._check_causality()
            self._check_decoding()
        else:
            self._check_decode_refusal()
        self._check_gradients()
        if self.info.state:
            self._check_state()
            if self.causal:
                self._check_decoding(self.carried, "with the state carried from a first window")

    # ------------------------------------------------------------------------------------------------ helpers
    def _init(self) -> dict[str, Any]:
        init = lambda rngs: self.module.init(rngs, self.x)  # noqa: E731
        try:
            return jax.jit(lambda: init({"params": jax.random.key(1)}))()
        except Exception as e:  # noqa: BLE001 - the checker reports any failure as the rule it broke
            # Only a mixer that runs once it is given a 'dropout' rng breaks 'deterministic'; the rest fail anyway.
            rule = "deterministic" if _succeeds(lambda: init({"params": jax.random.key(1),
                                                               "dropout": jax.random.key(2)})) else "runs"
            raise _Broken(rule, f"init with only a 'params' rng failed: {_first_line(e)}") from None

    def _pass(self, params, x, segment_ids, positions, dropout_rng=None, deterministic=None, state=None):
        variables = {"params": params, **(self.state if state is None else state)}
        rngs = None if dropout_rng is None else {"dropout": dropout_rng}
        deterministic = dropout_rng is None if deterministic is None else deterministic
        return self.module.apply(variables, x, segment_ids=segment_ids, positions=positions,
                                 deterministic=deterministic, rngs=rngs)

    def _run(self, x: Any, segment_ids: Any = None, positions: Any = None, rule: str = "output",
             state: dict[str, Any] | None = None) -> np.ndarray:
        segment_ids = np.ones((B, T), np.int32) if segment_ids is None else segment_ids
        positions = np.tile(np.arange(T, dtype=np.int32), (B, 1)) if positions is None else positions
        try:
            return np.asarray(self._apply(self.params, x, segment_ids, positions, state=state), np.float64)
        except Exception as e:  # noqa: BLE001
            raise _Broken(rule, f"a deterministic call without rngs failed: {_first_line(e)}") from None

    def _close(self, rule: str, got: np.ndarray, want: np.ndarray, where: str) -> None:
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        err = float(np.abs(got - want).max(initial=0.0))
        if not err <= 1e-5 * scale:  # exact float32 dots: only the order of additions may differ
            raise _Broken(rule, f"{where}: max |difference| {err:.3g} (allowed {1e-5 * scale:.3g})")

    # ------------------------------------------------------------------------------------------------ rules
    def _check_logical_axes(self, variables: dict[str, Any]) -> None:
        from lconv.run.schema import MeshConfig

        rules = axis_rules(MeshConfig().rules)  # the base config's, as a training run maps them
        leaves = jax.tree_util.tree_leaves_with_path(variables.get("params", {}),
                                                     is_leaf=lambda v: isinstance(v, nn.Partitioned))
        for path, leaf in leaves:
            where = jax.tree_util.keystr(path)
            if not isinstance(leaf, nn.Partitioned):
                raise _Broken("logical_axes", f"parameter {where} has no logical axis names: create it with "
                                              f"nn.with_logical_partitioning(init, names)")
            if len(leaf.names) != np.ndim(leaf.value):
                raise _Broken("logical_axes", f"parameter {where} of shape {np.shape(leaf.value)} has names "
                                              f"{leaf.names}: one per dimension")
            try:
                nn.logical_to_mesh_axes(leaf.names, rules)
            except ValueError as e:
                raise _Broken("logical_axes", f"parameter {where}'s names {leaf.names} cannot be mapped to the "
                                              f"mesh: {_first_line(e)}") from None

    def _check_output_and_determinism(self) -> None:
        try:
            out = jax.eval_shape(self._apply, self.params, self.x, SEGMENTS_BT, POSITIONS_BT)
        except Exception as e:  # noqa: BLE001
            with_rng = lambda: jax.eval_shape(  # noqa: E731
                lambda p, x, rng: self._pass(p, x, SEGMENTS_BT, POSITIONS_BT, rng, deterministic=True),
                self.params, self.x, jax.random.key(2))
            rule = "deterministic" if _succeeds(with_rng) else "runs"
            raise _Broken(rule, f"a deterministic call without rngs failed: {_first_line(e)}") from None
        if not isinstance(out, jax.ShapeDtypeStruct):
            raise _Broken("output", f"x {self.x.shape} {self.x.dtype} gave {mixers.describe_output(out)}")
        if out.shape != self.x.shape or out.dtype != self.x.dtype:
            raise _Broken("output", f"x {self.x.shape} {self.x.dtype} gave y {out.shape} {out.dtype}")
        if not np.all(np.isfinite(self._run(self.x, rule="output"))):
            raise _Broken("output", "y holds NaN or inf for a finite x (one segment, no padding)")
        if "dtype" in self.info.fields:  # bfloat16 computation: y keeps the input's dtype
            half = mixers.make_mixer(self.info.name, **{**self.fields, "dtype": jnp.bfloat16})
            x16 = jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16)
            y16 = jax.eval_shape(lambda p, x: half.apply({"params": p, **self.state}, x), self.params, x16)
            if y16.shape != x16.shape or y16.dtype != x16.dtype:
                raise _Broken("output", f"dtype=bfloat16 on a bfloat16 x gave y {y16.shape} {y16.dtype}")

    def _check_padding(self) -> None:
        x = np.asarray(self.x)
        packed = self._run(x, SEGMENTS_BT, POSITIONS_BT, rule="padding")
        padded = x.copy()
        padded[SEGMENTS_BT == 0] = _noise(3, x.shape)[SEGMENTS_BT == 0]
        real = SEGMENTS_BT > 0
        self._close("padding", self._run(padded, SEGMENTS_BT, POSITIONS_BT, rule="padding")[real], packed[real],
                    "real tokens when only the padding changes")

    def _check_segments(self) -> None:
        x = np.asarray(self.x)
        packed = self._run(x, SEGMENTS_BT, POSITIONS_BT, rule="segments")
        other = x.copy()
        other[0, :7] = _noise(3, x.shape)[0, :7]  # another first example: the second one must not notice
        self._close("segments", self._run(other, SEGMENTS_BT, POSITIONS_BT, rule="segments")[0, 7:11],
                    packed[0, 7:11], "row 0's second example when only the first one changes")
        alone_x, alone_seg = np.zeros_like(x), np.zeros_like(SEGMENTS_BT)  # each example at the start of a row
        alone_x[0, :7], alone_x[1, :4] = x[0, :7], x[0, 7:11]
        alone_seg[0, :7], alone_seg[1, :4] = 1, 1
        alone_pos = np.tile(np.arange(T, dtype=np.int32), (B, 1)) * (alone_seg > 0)
        alone = self._run(alone_x, alone_seg, alone_pos, rule="segments")
        self._close("segments", packed[0, :7], alone[0, :7], "row 0's first example, packed vs alone")
        self._close("segments", packed[0, 7:11], alone[1, :4], "row 0's second example, packed vs alone")

    def _check_causality(self) -> None:
        x = np.asarray(self.x)
        base = self._run(x, rule="causality")
        for t in (0, 5, T - 2):
            future = x.copy()
            future[:, t + 1:] = _noise(4 + t, x.shape)[:, t + 1:]
            self._close("causality", self._run(future, rule="causality")[:, :t + 1], base[:, :t + 1],
                        f"positions 0..{t} when only positions after {t} change")

    def _check_decoding(self, state: dict[str, Any] | None = None, where: str = "") -> None:
        state = self.state if state is None else state
        full = self._run(self.x, rule="decoding", state=state)
        try:
            cache = jax.jit(lambda: self.module.init({"params": jax.random.key(1)}, self.x, decode=True))()["cache"]
        except Exception as e:  # noqa: BLE001
            raise _Broken("decoding", f"the cache init (decode=True on a full-length x) failed: {_first_line(e)}") \
                from None
        step = jax.jit(lambda cache, x, positions: self.module.apply(
            {"params": self.params, **state, "cache": cache}, x, positions=positions, decode=True,
            mutable=["cache"]))
        outs, start = [], 0
        for size in DECODE_CHUNKS:
            positions = np.tile(np.arange(start, start + size, dtype=np.int32), (B, 1))
            try:
                y, updated = step(cache, self.x[:, start:start + size], positions)
            except Exception as e:  # noqa: BLE001
                raise _Broken("decoding", f"decoding positions {start}..{start + size - 1} failed: "
                                          f"{_first_line(e)}") from None
            cache, start = updated["cache"], start + size
            outs.append(np.asarray(y, np.float64))
        decoded = np.concatenate(outs, axis=1)
        for lo, hi in zip(np.cumsum((0,) + DECODE_CHUNKS[:-1]), np.cumsum(DECODE_CHUNKS)):
            self._close("decoding", decoded[:, lo:hi], full[:, lo:hi],
                        f"positions {lo}..{hi - 1} decoded in chunks {DECODE_CHUNKS} vs the full causal pass"
                        f"{' ' + where if where else ''}")

    def _check_state(self) -> None:
        """The carried-state rules: a document fed as two windows of one segment per row."""
        shapes = lambda tree: jax.tree.map(lambda a: (np.shape(a), np.dtype(a.dtype)), tree)  # noqa: E731
        for collection in self.info.state:
            leaves = jax.tree.leaves(self.state.get(collection, {}))
            if not leaves:
                raise _Broken("state", f"init made no {collection!r} collection (its variables: {sorted(self.state)})")
            if any(np.shape(leaf)[:1] != (B,) for leaf in leaves):
                raise _Broken("state", f"{collection!r} has leaves of shapes {[np.shape(v) for v in leaves]} for a "
                                       f"batch of {B} rows: each leaf is [B, ...], a row per document")
        mutable = list(self.info.state)
        step = jax.jit(lambda state, x: self.module.apply({"params": self.params, **state}, x, mutable=mutable))
        try:
            _, carried = step(self.state, self.x)
        except Exception as e:  # noqa: BLE001
            raise _Broken("state", f"a call with {mutable} mutable failed: {_first_line(e)}") from None
        carried = {**self.state, **carried}
        if shapes(carried) != shapes(self.state):
            raise _Broken("state", f"after a window the state is {shapes(carried)}, init made {shapes(self.state)}")
        self.carried = carried
        x2 = _noise(6, (B, T, C)) / 3  # the second window
        fresh, kept = self._run(x2, rule="carry"), self._run(x2, rule="carry", state=carried)
        if float(np.abs(kept - fresh).max()) <= 1e-6:
            raise _Broken("carry", "the next window's output is the same with the carried state as with init's: "
                                   "the state it declares is not read")
        without = np.asarray(jax.jit(lambda p, x: self.module.apply({"params": p}, x))(self.params, x2), np.float64)
        self._close("carry", without, fresh, "the next window called without the state vs with init's")
        reset_B = np.arange(B) == 0
        try:
            once = {c: self.info.reset_state(carried[c], reset_B) for c in self.info.state}
            every = {c: self.info.reset_state(carried[c], np.ones(B, bool)) for c in self.info.state}
        except Exception as e:  # noqa: BLE001
            raise _Broken("reset", f"reset_state failed: {_first_line(e)}") from None
        for path, got in jax.tree_util.tree_leaves_with_path(every):
            want = _leaf(self.state, path)
            if not np.array_equal(np.asarray(got), np.asarray(want)):
                raise _Broken("reset", f"reset_state of every row left {jax.tree_util.keystr(path)} unlike init's")
        after = self._run(x2, rule="reset", state={**carried, **once})
        self._close("reset", after[0], fresh[0], "row 0's next window after its reset vs a fresh document")
        self._close("carry", after[1:], kept[1:], "the other rows' next window when only row 0 was reset")

    def _check_decode_refusal(self) -> None:
        try:
            jax.eval_shape(lambda: self.module.init({"params": jax.random.key(1)}, self.x, decode=True))
        except ValueError as e:
            if "\n" in str(e).strip():
                raise _Broken("decode_refusal", f"the refusal is several lines: {str(e)[:200]!r}") from None
            return
        except Exception as e:  # noqa: BLE001
            raise _Broken("decode_refusal", f"it raised {type(e).__name__}, not ValueError: {_first_line(e)}") \
                from None
        raise _Broken("decode_refusal", "decode=True was accepted by a non-causal mixer")

    def _check_gradients(self) -> None:
        """In training mode (deterministic=False with a 'dropout' rng), as gradients are used."""
        cotangent = jax.random.normal(jax.random.key(5), (B, T, C), jnp.float32)

        def loss(params, x):
            y = self._pass(params, x, SEGMENTS_BT, POSITIONS_BT, jax.random.key(2))
            if y.shape != x.shape:
                raise _Broken("output", f"deterministic=False gave y {y.shape}")
            return jnp.vdot(y.astype(jnp.float32), cotangent)

        try:
            grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(self.params, self.x)
        except _Broken:
            raise
        except Exception as e:  # noqa: BLE001
            raise _Broken("deterministic", f"deterministic=False with a 'dropout' rng failed: {_first_line(e)}") \
                from None
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            if not np.all(np.isfinite(np.asarray(g))):
                what = "the input x" if path[0].idx == 1 else f"parameter {jax.tree_util.keystr(path[1:])}"
                raise _Broken("gradients", f"the gradient for {what} is not finite (with padding and packing)")


def _leaf(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key.key]
    return tree


def _noise(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Inputs far from the test's own (3 sigma): a leak of them cannot hide under the tolerance."""
    return 3.0 * np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32)


def _succeeds(thunk: Any) -> bool:
    try:
        thunk()
    except Exception:  # noqa: BLE001
        return False
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
