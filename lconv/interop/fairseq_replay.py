"""``python -m lconv.interop.fairseq_replay FOLDER``: does lconv train as fairseq trains? A recorded ``fairseq-train``
run (``lconv.interop.fairseq_recording``; e.g. ../shared/fairseq/train_parity/) is replayed through lconv's own train
step and compared with what fairseq recorded, update by update.

Each quantity's worst difference is printed as a ratio to its tolerance, the float-noise floor times ``--factor``; exit
status 1 when a ratio is above 1 (or a clip decision differs), 2 for a folder it cannot read. The method and figures:
docs/fairseq.md, "Training parity".
"""
from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lconv import console
from lconv.configs import common
from lconv.errors import UserError
from lconv.interop import fairseq, fairseq_workdir
from lconv.interop.fairseq_recording import NoiseFloor, RecordedRun, batch_shape, collate, find_runs
from lconv.run import compilation_cache, model_setup, schema
from lconv.train import setup
from lconv.train import update as update_lib

# The tolerance is the noise floor times this: lconv rounds every operation its own way (docs/fairseq.md).
DEFAULT_FACTOR = 8.0
LR_RTOL = 1e-6  # lconv's schedule runs in float32, fairseq's in float64: a few float32 roundings apart
# Its gradient is mathematically zero (softmax is shift-invariant in the keys): compared absolutely, with the weights.
ZERO_GRADIENT_SUFFIX = "encoder_attn.k_proj.bias"
# After update 1 (steps of ~1e-7) each weight is held to one float32 spacing plus this share of fairseq's step.
STEP_RTOL = 0.05


@dataclasses.dataclass(frozen=True)
class UpdateRow:
    """One update, lconv's figures and fairseq's."""

    update: int
    loss: tuple[float, float]  # (lconv, fairseq) loss sums
    grad_norm: tuple[float, float]
    clip_coef: tuple[float, float]
    lr: tuple[float, float]


@dataclasses.dataclass(frozen=True)
class Replay:
    """What a replay measured: every update's row, and per recorded update each weight's difference from fairseq's."""

    run: str
    rows: tuple[UpdateRow, ...]
    weights: dict[int, dict[str, tuple[float, float]]]
    # lconv against itself with every weight moved one rounding step before each update: its own noise floor
    own_noise_floor: NoiseFloor


def replay_config(run: RecordedRun, vocab_size: int) -> ml_collections.ConfigDict:
    """lconv's config for fairseq's run, with fairseq's semantics; what the replay cannot reproduce is one line."""
    cfg, args = run.cfg, run.model_args
    optim_cfg, schedule, criterion = cfg.get("optimizer", {}), cfg.get("lr_scheduler", {}), cfg.get("criterion", {})
    unsupported = {"optimizer": (optim_cfg.get("_name"), "adam"), "lr_scheduler": (schedule.get("_name"),
                   "inverse_sqrt"), "criterion": (criterion.get("_name"), "label_smoothed_cross_entropy"),
                   "sentence_avg": (bool(criterion.get("sentence_avg")), False), "fp16": (bool(args.get("fp16")),
                   False), "bf16": (bool(args.get("bf16")), False)}
    wrong = [f"{k}={v!r} (replayed: {want!r})" for k, (v, want) in unsupported.items() if v != want]
    if wrong:
        raise UserError(f"run {run.name}: the replay reproduces Adam, inverse_sqrt and label smoothing in float32; "
                        f"not {', '.join(wrong)}")
    config = fairseq_workdir.translation_config(fairseq.model_fields(args, vocab_size))
    config.seed = int(args.get("seed", 1))
    config.mesh.shape = (1, 1, 1)
    b1, b2 = (float(b) for b in str(optim_cfg.get("adam_betas", "(0.9, 0.999)")).strip("()[] ").split(","))
    optimization = cfg.get("optimization", {})
    common.follow_fairseq(config)
    config.optim.update(dict(
        optimizer="adam", b1=b1, b2=b2, eps=float(optim_cfg.get("adam_eps", 1e-8)),
        weight_decay=float(optim_cfg.get("weight_decay", 0.0)), learning_rate=float(optimization["lr"][0]),
        schedule="inverse_sqrt", warmup_steps=int(schedule.get("warmup_updates", 4000)),
        warmup_init_lr=max(float(schedule.get("warmup_init_lr", -1)), 0.0),
        clip_norm=float(optimization.get("clip_norm", 0.0)), label_smoothing=float(criterion["label_smoothing"]),
        grad_accum_steps=int(optimization.get("update_freq", [1])[0])))
    config.train.num_steps = len(run.updates)
    return config


def replay(run: RecordedRun, updates: int | None = None,
           on_update: Callable[[UpdateRow], None] | None = None, *, own_floor: bool = True) -> Replay:
    """Replays ``run``'s first ``updates`` updates (all by default) through lconv's train step, calling ``on_update``
    with each row; with ``own_floor``, again with weights nudged one rounding step per update."""
    count = len(run.updates) if updates is None else min(updates, len(run.updates))
    prepared = Prepared.build(run, count)
    saved = {u for u in (1, count) if (run.folder / f"state_update{u:03d}.npz").exists()}
    start = run.state(0)
    second = prepared.copied_state() if own_floor else None  # before the first step donates the state
    sums, params = prepared.run_updates(prepared.state, count, saved, on_update=lambda update, s: on_update(
        prepared.row(update, s)) if on_update is not None else None)
    rows = tuple(prepared.row(update, s) for update, s in enumerate(sums, 1))
    weights = {u: prepared.weight_difference(params[u], run.state(u), start) for u in sorted(saved)}
    if not own_floor:
        return Replay(run.name, rows, weights, NoiseFloor(0.0, 0.0, 0.0))
    own_sums, own_params = prepared.run_updates(second, count, {count}, nudge=np.random.default_rng(0))
    last = max(saved) if saved else None
    own = NoiseFloor(
        max(_relative((float(b["loss"]), float(a["loss"]))) for a, b in zip(sums, own_sums)),
        max(_relative((float(b["grad_norm"]), float(a["grad_norm"]))) for a, b in zip(sums, own_sums)),
        0.0 if last != count else max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
                                      zip(jax.tree.leaves(params[count]), jax.tree.leaves(own_params[count]))))
    return Replay(run.name, rows, weights, own)


@dataclasses.dataclass
class Prepared:
    """A run ready to replay: its config, the compiled train step, the start state, and the batches."""

    run: RecordedRun
    config: schema.RunConfig
    step: Callable[..., Any]
    state: Any
    shape: tuple[int, int, int]
    batches: dict[str, np.ndarray]
    mesh: jax.sharding.Mesh
    fields: dict[str, Any]

    @classmethod
    def build(cls, run: RecordedRun, count: int, shape: tuple[int, int, int] | None = None) -> Prepared:
        """``shape``: the batch shape to compile for (``batch_shape`` of the ``count`` updates by default)."""
        weights = run.state(0)
        vocab_size = weights["encoder.embed_tokens.weight"].shape[0]
        config = replay_config(run, vocab_size)
        batches = run.batches()
        shape = shape or batch_shape([run.micro_batches(batches, u) for u in range(1, count + 1)])
        config.data.batch_size = shape[0] * config.optim.grad_accum_steps
        config.data.max_input_length, config.data.max_target_length = shape[1], shape[2]
        config = schema.validate_config(config)
        fields = fairseq.model_fields(run.model_args, vocab_size)
        params = jax.tree.map(jnp.asarray, fairseq.lconv_params(weights, fields))
        mesh = model_setup.make_mesh(config.mesh, jax.devices()[:1])
        model = model_setup.build_model(config, vocab_size)
        tx, lr_schedule = update_lib.build_optimizer(config.optim, config.train.num_steps)
        state = setup.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        shardings = jax.tree.map(lambda _: replicated, state)
        train_step = update_lib.jit_train_step(config, lr_schedule, shardings, mesh)

        def step(state, batch):
            with jax.set_mesh(mesh):
                return train_step(state, batch, jnp.float32(1.0))

        return cls(run, config, step, jax.device_put(state, shardings), shape, batches, mesh, fields)

    def copied_state(self) -> Any:
        """A copy of the start state, whose buffers the first step of a replay from ``state`` would donate."""
        return jax.tree.map(jnp.copy, self.state)

    @staticmethod
    def nudged(state: Any, rng: np.random.Generator) -> Any:
        """``state`` with every weight moved one float32 spacing up or down (``rng``): one rounding step."""
        leaves, tree = jax.tree.flatten(jax.device_get(state.params))
        towards = lambda x: np.where(rng.random(x.shape) < 0.5, -np.inf, np.inf).astype(np.float32)  # noqa: E731
        moved = [np.nextafter(x, towards(x)) for x in (np.asarray(x, np.float32) for x in leaves)]
        shardings = jax.tree.map(lambda x: x.sharding, state.params)
        return state.replace(params=jax.device_put(jax.tree.unflatten(tree, moved), shardings))

    def run_updates(self, state: Any, count: int, keep: set[int], on_update: Callable[[int, dict], None] | None = None,
                    nudge: np.random.Generator | None = None) -> tuple[list[dict], dict[int, Any]]:
        """Updates 1..``count`` from ``state``: each update's sums, and the params after the updates in ``keep``;
        ``nudge``: every weight moved one rounding step before each update."""
        sums, params = [], {}
        for update in range(1, count + 1):
            if nudge is not None:
                state = self.nudged(state, nudge)
            state, update_sums = self.step(state, self.batch(update))
            sums.append(jax.device_get(update_sums))
            if on_update is not None:
                on_update(update, sums[-1])
            if update in keep:
                params[update] = jax.device_get(state.params)
        return sums, params

    def batch(self, update: int) -> dict[str, np.ndarray]:
        return collate(self.run.micro_batches(self.batches, update), self.shape)

    def row(self, update: int, sums: dict[str, Any]) -> UpdateRow:
        """lconv's figures for ``update`` (its train step's sums) beside fairseq's recorded ones."""
        recorded = self.run.updates[update - 1]
        optim = self.config.optim
        norm = float(sums["grad_norm"])
        coef = float(update_lib.clip_coefficient(jnp.float32(norm), optim.clip_norm, optim.clip_form))
        theirs_coef = recorded.get("clip_coef")
        return UpdateRow(update, (float(sums["loss"]), float(recorded["loss_sum"])),
                         (norm, float(recorded["grad_norm"])),
                         (coef, 1.0 if theirs_coef is None else float(theirs_coef)),
                         (float(sums["lr"]), float(recorded["lr"])))

    def weight_difference(self, params: Any, recorded: dict[str, np.ndarray],
                          start: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
        """Per fairseq key, the max abs difference of lconv's params from fairseq's weights and its worst ratio to one
        float32 spacing plus ``STEP_RTOL`` of fairseq's step from ``start``."""
        theirs, before = fairseq.lconv_params(recorded, self.fields), fairseq.lconv_params(start, self.fields)
        names = key_names(recorded, self.fields)
        out = {}
        for path, ours in jax.tree_util.tree_flatten_with_path(params)[0]:
            want = _at(theirs, path)
            diff = np.abs(np.asarray(ours, np.float64) - want)
            allowed = np.spacing(np.abs(want)) + STEP_RTOL * np.abs(want - _at(before, path))
            out[names[jax.tree_util.keystr(path)]] = (float(diff.max()), float((diff / allowed).max()))
        return out


def _at(tree: Any, path: tuple) -> np.ndarray:
    for entry in path:
        tree = tree[entry.key]
    return np.asarray(tree)


def key_names(weights: dict[str, np.ndarray], fields: dict[str, Any]) -> dict[str, str]:
    """``{lconv parameter path: fairseq key}``, found by importing each tensor filled with its own index."""
    keys = sorted(weights)
    marked = {k: np.full(weights[k].shape, i, np.float32) for i, k in enumerate(keys)}
    for key in keys:  # a tied copy stays a copy
        original = "encoder.embed_tokens.weight"
        if key != original and key.endswith((".embed_tokens.weight", "output_projection.weight", ".embed_out")) \
                and original in weights and weights[key] is weights[original]:
            marked[key] = marked[original]
    tree = fairseq.lconv_params(marked, fields)
    return {jax.tree_util.keystr(p): keys[int(np.asarray(x).flat[0])]
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# Judging and printing a replay
@dataclasses.dataclass(frozen=True)
class Verdict:
    """Each quantity's worst ratio to its tolerance (above 1 fails) and the updates whose clip decision differs."""

    ratios: dict[str, tuple[float, str, float]]  # name -> (ratio, where, the difference itself)
    clip_differs: tuple[int, ...]

    @property
    def passed(self) -> bool:
        return not self.clip_differs and all(ratio <= 1.0 for ratio, _, _ in self.ratios.values())


def _relative(pair: tuple[float, float]) -> float:
    ours, theirs = pair
    return abs(ours - theirs) / max(abs(theirs), 1e-30)


def judge(result: Replay, floor: NoiseFloor, factor: float = DEFAULT_FACTOR) -> Verdict:
    """``result`` against the larger of the recording's and lconv's own noise floor times ``factor``, the rate against
    ``LR_RTOL``, the first update's weights against one spacing plus ``STEP_RTOL`` of fairseq's step."""
    floor = NoiseFloor(*(max(a, b) for a, b in zip(dataclasses.astuple(floor),
                                                   dataclasses.astuple(result.own_noise_floor))))

    def worst(values: dict[str, float]) -> tuple[float, str]:
        where = max(values, key=values.get)
        return values[where], where

    ratios = {}
    for name, pick, tolerance in (("loss sum", lambda r: r.loss, floor.loss_rel * factor),
                                  ("gradient norm", lambda r: r.grad_norm, floor.grad_norm_rel * factor),
                                  ("learning rate", lambda r: r.lr, LR_RTOL)):
        value, where = worst({f"update {r.update}": _relative(pick(r)) for r in result.rows})
        ratios[name] = (value / tolerance, where, value)
    absolute = floor.weights_abs * factor
    for update, keys in sorted(result.weights.items()):
        if update == 1:  # each weight to its own step; one that has no gradient (it moves by noise) absolutely
            ratio, where = worst({k: v[0] / absolute if k.endswith(ZERO_GRADIENT_SUFFIX) else v[1]
                                  for k, v in keys.items()})
            ratios["weights after update 1"] = (ratio, where, keys[where][0])
        else:
            value, where = worst({k: v[0] for k, v in keys.items()})
            ratios[f"weights after update {update}"] = (value / absolute, where, value)
    clip_differs = tuple(r.update for r in result.rows if (r.clip_coef[0] < 1) != (r.clip_coef[1] < 1))
    return Verdict(ratios, clip_differs)


HEADER = (f"{'update':>6} | {'loss sum (lconv / fairseq)':>30} | {'grad norm (lconv / fairseq)':>30} | "
          f"{'clip coef':>17} | {'lr (lconv / fairseq)':>25}")


def format_row(row: UpdateRow) -> str:
    return (f"{row.update:>6} | {row.loss[0]:>14.7g} {row.loss[1]:>14.7g}  | {row.grad_norm[0]:>14.7g} "
            f"{row.grad_norm[1]:>14.7g}  | {row.clip_coef[0]:>8.5g} {row.clip_coef[1]:>8.5g} | "
            f"{row.lr[0]:>12.6g} {row.lr[1]:>12.6g}")


def format_verdict(run: str, verdict: Verdict, factor: float, result: Replay | None = None,
                   floor: NoiseFloor | None = None) -> list[str]:
    lines = []
    if result is not None and floor is not None:
        own = result.own_noise_floor
        lines.append(f"{run}: noise floor (loss rel, grad norm rel, weights abs): recording {floor.loss_rel:.2g}, "
                     f"{floor.grad_norm_rel:.2g}, {floor.weights_abs:.2g}; lconv's own {own.loss_rel:.2g}, "
                     f"{own.grad_norm_rel:.2g}, {own.weights_abs:.2g}")
    lines.append(f"{run}: worst difference / tolerance (the larger noise floor x {factor:g}; > 1 fails):")
    for name, (ratio, where, value) in verdict.ratios.items():
        kind = "max abs" if name.startswith("weights") else "relative"
        lines.append(f"  {name:<26} {ratio:8.3f}  ({where}: {value:.2g} {kind})")
    lines.append("  clip decisions             " + ("all equal" if not verdict.clip_differs else
                                                    f"differ at updates {list(verdict.clip_differs)}"))
    lines.append(f"  {'PASS' if verdict.passed else 'FAIL'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """The command: replays every run of the folder; exit 0 within tolerance, 1 outside, 2 unreadable."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lconv.interop.fairseq_replay", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("folder", help="a fairseq training recording (../shared/fairseq/train_parity/) or one of "
                        "its run folders")
    parser.add_argument("--updates", type=int, default=None, help="replay only the first N updates")
    parser.add_argument("--factor", type=float, default=DEFAULT_FACTOR, help="the tolerance: the recording's "
                        "noise floor times this")
    args = parser.parse_args(argv)
    try:
        if args.updates is not None and args.updates < 1:
            raise UserError(f"--updates={args.updates}: must be at least 1")
        if not (math.isfinite(args.factor) and args.factor > 0):
            raise UserError(f"--factor={args.factor}: must be a number above 0 (the tolerance's multiple of the "
                            "noise floor)")
        compilation_cache.check_chosen()  # an entry is code: never one from a folder another user could fill
        runs = find_runs(args.folder)
        passed = True
        for run in runs:
            updates = min(args.updates or len(run.updates), len(run.updates))
            print(console.printable(f"{run.name}: replaying {updates} of {len(run.updates)} updates"))
            print(HEADER)
            result = replay(run, updates, lambda row: print(format_row(row), flush=True))
            verdict = judge(result, run.noise_floor, args.factor)
            lines = format_verdict(run.name, verdict, args.factor, result, run.noise_floor)
            print(console.printable("\n".join(lines)), flush=True)  # a run's name is the recording's text
            passed = passed and verdict.passed
    except UserError as err:
        print(console.printable(f"error: {err}"), file=sys.stderr)
        return 2
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
