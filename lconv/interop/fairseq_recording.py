"""A recorded ``fairseq-train`` run read for a replay, and its batches converted to lconv's collation.

A recording is a folder per run beside a ``meta.json``: weights before and after some updates, every micro-batch, and
each update's figures. ``collate`` / ``to_fairseq`` convert exactly between fairseq's batches and lconv's. The layout:
docs/fairseq.md, "A recorded fairseq-train run".
"""
from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from typing import Any

import numpy as np
from etils import epath

from lconv import shared_folders
from lconv.constants import PAD_ID
from lconv.data import paths
from lconv.errors import UserError, first_line
from lconv.interop import fairseq_vocab

FAIRSEQ_PAD, FAIRSEQ_EOS = 1, 2
STATES = ("state_update000.npz", "state_update001.npz", "state_update040.npz")
RUN_FILES = (*STATES, "batches.npz", "updates.jsonl")
NOISE_FLOOR = "float_noise_floor_replay_grad_divided"  # meta.json: runs.<name>.sanity.<this>


@dataclasses.dataclass(frozen=True)
class NoiseFloor:
    """How far fairseq moves from itself under a one-rounding-step gradient perturbation (its own measurement)."""

    loss_rel: float  # loss sum, relative, worst over the updates
    grad_norm_rel: float  # gradient norm before clipping, relative, worst over the updates
    weights_abs: float  # the last update's weights, max abs difference


@dataclasses.dataclass(frozen=True)
class RecordedRun:
    """One run of a recording: where it is, fairseq's arguments, and what fairseq recorded per update."""

    name: str
    folder: epath.Path
    model_args: dict[str, Any]
    cfg: dict[str, Any]
    updates: tuple[dict[str, Any], ...]
    noise_floor: NoiseFloor

    def batches(self) -> dict[str, np.ndarray]:
        return read_npz(self.folder / "batches.npz")

    def state(self, update: int) -> dict[str, np.ndarray]:
        """fairseq's weights after ``update`` updates (0, 1 or the last), float32, fairseq's names."""
        arrays = read_npz(self.folder / f"state_update{update:03d}.npz")
        state = {k: np.asarray(v, np.float32) for k, v in arrays.items()}
        shared = "decoder.embed_tokens.weight"  # not stored when tied: the encoder's tensor itself
        if self.model_args.get("share_all_embeddings") and shared not in state:
            state[shared] = state["encoder.embed_tokens.weight"]
        return state

    def micro_batches(self, batches: dict[str, np.ndarray], update: int) -> list[dict[str, np.ndarray]]:
        """Update ``update``'s (1-based) micro-batches, each ``{src_tokens, prev_output_tokens, target, ...}``."""
        try:
            count = int(batches["n_micro"][update - 1])
            return [{key: batches[f"u{update:03d}_m{m}_{key}"] for key in
                     ("src_tokens", "src_lengths", "prev_output_tokens", "target")} for m in range(count)]
        except (KeyError, IndexError) as err:
            raise UserError(f"{self.folder / 'batches.npz'} lacks update {update}'s batch ({err}): the recording is "
                            "incomplete") from None


NPZ_COPIES = 3  # a recording's arrays are held about this many times over while a replay reads them
NPZ_MAX_BYTES = 2 << 30  # one file's arrays: a recorded model's weights (4 bytes a parameter), far above the fixtures'


def read_npz(path: epath.Path) -> dict[str, np.ndarray]:
    """The arrays of a recording's ``.npz``, or one line naming it: refused before anything is decompressed when
    its zip directory declares more bytes than memory can hold (a small file of zeros that inflates to gigabytes)."""
    limit = min(paths.memory_read_limit(NPZ_COPIES), NPZ_MAX_BYTES)
    data = paths.read_bytes(path, "missing: the recording is incomplete", limit=limit)
    try:
        _, declared = paths.npz_directory(data)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise UserError(f"{path}: not a readable .npz of arrays ({first_line(err, 120)})") from None
    if declared > limit:
        raise UserError(f"{path}: its arrays decompress to {declared:,} bytes (the zip directory says), more "
                        f"than the {limit:,} this host can hold for them")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return {name: arrays[name] for name in arrays.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise UserError(f"{path}: not a readable .npz of arrays ({first_line(err, 120)})") from None


def find_runs(folder: str) -> list[RecordedRun]:
    """The runs of a recording (``folder``: the recording or one run folder); another layout is one line."""
    path = epath.Path(folder)
    if not path.is_dir():
        raise UserError(f"{folder} is not a folder (a fairseq training recording, as ../shared/fairseq/"
                        "train_parity/, or one run folder of it)")
    shared_folders.check(str(path), folder)  # a recording another user could change would decide the verdict
    if (path / "meta.json").exists():
        meta, names = _meta(path / "meta.json"), None
    elif (path.parent / "meta.json").exists():
        meta, names, path = _meta(path.parent / "meta.json"), [path.name], path.parent
    else:
        raise UserError(f"{folder} has no meta.json (nor its parent): not a fairseq training recording")
    runs = meta.get("runs")
    if not isinstance(runs, dict) or not runs:
        raise UserError(f"{path / 'meta.json'} lists no runs ('runs': {{folder: ...}})")
    names = sorted(runs) if names is None else names
    return [_read_run(path / name, runs.get(name)) for name in names]


def _meta(path: epath.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path} as JSON: {err}") from None


def _read_run(folder: epath.Path, meta: dict[str, Any] | None) -> RecordedRun:
    if meta is None:
        raise UserError(f"{folder.parent / 'meta.json'} does not list the run {folder.name!r}")
    missing = [name for name in RUN_FILES if not (folder / name).exists()]
    if missing:
        raise UserError(f"{folder} lacks {', '.join(missing)}: not a run folder of a fairseq training recording")
    for key in ("model_args", "cfg"):
        if not isinstance(meta.get(key), dict):
            raise UserError(f"meta.json's runs.{folder.name} has no {key!r}: fairseq's arguments are needed")
    floor = (meta.get("sanity") or {}).get(NOISE_FLOOR) or {}
    worst = floor.get("worst_rel_diffs_over_40_updates") or {}
    try:
        noise = NoiseFloor(float(worst["loss_sum_rel"]), float(worst["grad_norm_rel"]),
                           float(floor["update40_max_abs_diff_vs_fixture"]))
    except (KeyError, TypeError, ValueError):
        raise UserError(f"meta.json's runs.{folder.name}.sanity has no {NOISE_FLOOR} (loss, gradient norm and "
                        "weights): the tolerance a replay is held to") from None
    try:
        updates = tuple(json.loads(line) for line in (folder / "updates.jsonl").read_text().splitlines() if line)
    except ValueError as err:
        raise UserError(f"{folder / 'updates.jsonl'}: not one JSON object a line ({err})") from None
    if [u.get("update") for u in updates] != list(range(1, len(updates) + 1)):
        raise UserError(f"{folder / 'updates.jsonl'}: the updates must be numbered 1, 2, ... in order")
    return RecordedRun(folder.name, folder, meta["model_args"], meta["cfg"], updates, noise)


# fairseq's batches <-> lconv's collation
def renumbered(ids: np.ndarray, to_lconv: bool = True) -> np.ndarray:
    """fairseq ids -> lconv ids, or back (a joined dictionary: only the four specials are re-numbered)."""
    out = np.array(ids, np.int32)
    for fairseq_id, lconv_id in fairseq_vocab.FAIRSEQ_TO_LCONV.items():
        out[ids == (fairseq_id if to_lconv else lconv_id)] = lconv_id if to_lconv else fairseq_id
    return out


def batch_shape(micro_batches: list[list[dict[str, np.ndarray]]]) -> tuple[int, int, int]:
    """``(rows per micro-batch, source length, target length)`` holding every micro-batch given: one compiled shape."""
    micros = [m for update in micro_batches for m in update]
    return (max(m["src_tokens"].shape[0] for m in micros), max(m["src_tokens"].shape[1] for m in micros),
            max(m["target"].shape[1] for m in micros))


def collate(micro_batches: list[dict[str, np.ndarray]], shape: tuple[int, int, int]) -> dict[str, np.ndarray]:
    """An update's fairseq micro-batches as one lconv batch: row ``r`` is row ``r // n`` of micro-batch ``r % n`` (as
    ``lconv.train.update`` splits it), sources right-padded, targets in lconv's ids."""
    rows, S, T = shape
    n = len(micro_batches)
    inputs, targets = np.full((n * rows, S), PAD_ID, np.int32), np.full((n * rows, T), PAD_ID, np.int32)
    for m, micro in enumerate(micro_batches):
        _check_conventions(micro)
        for i, (source, target) in enumerate(zip(micro["src_tokens"], micro["target"])):
            source, target = source[source != FAIRSEQ_PAD], target[target != FAIRSEQ_PAD]
            inputs[i * n + m, :len(source)] = renumbered(source)
            targets[i * n + m, :len(target)] = renumbered(target)
    batch = {"inputs": inputs, "targets": targets}
    for key in ("inputs", "targets"):
        length = batch[key].shape[1]
        batch[f"{key}_segmentation"] = (batch[key] != PAD_ID).astype(np.int32)
        batch[f"{key}_position"] = np.broadcast_to(np.arange(length, dtype=np.int32), batch[key].shape).copy()
    return batch


def _check_conventions(micro: dict[str, np.ndarray]) -> None:
    """fairseq's padding as the recording's README states it; anything else would be collated wrongly."""
    source, target, previous = micro["src_tokens"], micro["target"], micro["prev_output_tokens"]
    lengths = (source != FAIRSEQ_PAD).sum(1)
    shifted = np.concatenate([np.full((len(target), 1), FAIRSEQ_EOS), target[:, :-1]], axis=1)
    real = target != FAIRSEQ_PAD
    if not (np.array_equal(lengths, micro["src_lengths"]) and np.all(source[:, -1] == FAIRSEQ_EOS)
            and np.array_equal(np.where(real, shifted, FAIRSEQ_PAD), previous)
            and np.all(np.diff(real.astype(int), axis=1) <= 0)):
        raise UserError("a recorded batch is not fairseq's collation (left-padded sources ending in EOS, "
                        "right-padded targets, prev_output_tokens = EOS + target[:-1])")


def to_fairseq(batch: dict[str, np.ndarray], n: int, rows: list[int], source_length: list[int],
               target_length: list[int]) -> list[dict[str, np.ndarray]]:
    """The inverse of ``collate``: micro-batch ``m`` has ``rows[m]`` rows, in fairseq's collation."""
    out = []
    for m in range(n):
        inputs, targets = batch["inputs"][m::n][:rows[m]], batch["targets"][m::n][:rows[m]]
        source = np.full((rows[m], source_length[m]), FAIRSEQ_PAD, np.int32)
        target = np.full((rows[m], target_length[m]), FAIRSEQ_PAD, np.int32)
        previous = target.copy()
        for i in range(rows[m]):
            s, t = (renumbered(x[x != PAD_ID], to_lconv=False) for x in (inputs[i], targets[i]))
            source[i, source_length[m] - len(s):] = s
            target[i, :len(t)] = t
            previous[i, :len(t)] = np.append(FAIRSEQ_EOS, t[:-1])
        out.append({"src_tokens": source, "src_lengths": (source != FAIRSEQ_PAD).sum(1).astype(np.int32),
                    "prev_output_tokens": previous, "target": target})
    return out
