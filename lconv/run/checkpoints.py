"""All orbax use in one place: the train state and the data-iterator state, saved together so resumes are exact.

A checkpoint is ``<workdir>/checkpoints/<step>/`` (the best by validation loss: ``<workdir>/best/<step>/``) with
two items: ``state`` (params, optimizer state, step; restored straight into the target shardings) and ``data``
(JSON). For training, ``data`` holds every process's data-iterator state (``gather_process_states``): orbax
writes a JSON item from process 0 alone, and each process reads its own shard of the data, so each needs its own
position back (``this_process_state``). Orbax writes into a temporary directory and renames it when complete,
so a checkpoint left half-written by a crash is never listed as a step and is ignored on restore.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import math
import os
import re
import time
import weakref
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from lconv import no_room
from lconv.errors import UserError
from lconv.run import integrity
from lconv.run import workdir as workdir_lib

logger = logging.getLogger(__name__)
# What a checkpoint's content, not its storage, makes orbax raise: a JSON file nested too deep or malformed.
# Storage failures come as OSError or tensorstore's ValueError, and are retried.
NOT_STORAGE = (RecursionError, json.JSONDecodeError)

PyTree = Any


class Checkpointer:
    MANY_STEPS = 1000  # step folders past which opening the folder is said to take a while

    def __init__(self, workdir: str, *, keep: int = 5, save_every: int = 1000, subdir: str = "checkpoints",
                 async_save: bool = False, checksums: bool = True, read_only: bool = False) -> None:
        """``read_only``: for restoring params from a workdir that may be read-only; nothing is created, warnings are
        logged."""
        self.directory = str(epath.Path(workdir_lib.resolve(workdir)) / subdir)
        workdir_lib.check_inside(self.directory, workdir_lib.resolve(workdir))
        # Each directory's own barrier names: orbax names an async save's cross-process barriers after the step
        # alone, so the latest and the best checkpoint of one step (both saved at a validation step) would wait at
        # the same barrier. The coordination service pairs arrivals in order, so process 0's "latest" could pass
        # with process 1's "best", commit a step another process is still writing, and hang the run.
        # The steps orbax must not list (``integrity.check_listed_step``), each with its error: kept out of orbax's
        # listing, still listed here, and restoring one raises its error, as any other corrupt step does.
        self.withheld: dict[int, integrity.CorruptCheckpoint] = {}
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=1, create=not read_only, enable_async_checkpointing=async_save,
            multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=f"lconv_{subdir}"),
            step_name_format=_VettedSteps(ocp.step.standard_name_format(), self.withheld),
        )
        if not read_only:
            remove_unfinished(self.directory)
        self.error_log = None if read_only else str(epath.Path(self.directory).parent / integrity.ERROR_LOG_FILENAME)
        self._vet_steps()
        # Orbax reads each step's metadata here and logs a damaged one with its content, raw: to the error log (a
        # read: lconv's debug log), never the terminal; the restore still checks that step.
        with integrity.quiet_orbax(self.error_log):
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))
        self.save_every, self.async_save = save_every, async_save
        self.checksums = checksums
        self.verified = False  # whether the last restore was checked against its manifest
        self.read_attempts, self.retry_seconds = 3, 1.0  # a failed read is tried again after 1 s, then 2 s
        self.unfinished: int | None = None  # an async save still being written, its manifest not yet made

    def latest_step(self) -> int | None:
        return max(self.all_steps(), default=None)

    def all_steps(self) -> list[int]:
        return sorted({*self.manager.all_steps(), *self.withheld})

    def _vet_steps(self) -> None:
        """Fills ``withheld`` with the step folders orbax must not list (``integrity.check_listed_step``)."""
        self.withheld.clear()
        if workdir_lib.is_remote(self.directory) or not os.path.isdir(self.directory):
            return
        steps = 0
        with integrity.quiet_orbax(self.error_log):  # orbax logs a step metadata it cannot parse with its content
            for entry in os.scandir(self.directory):
                if entry.name.isdigit():
                    steps += 1
                    try:
                        integrity.check_listed_step(entry.path, int(entry.name))
                    except integrity.CorruptCheckpoint as err:
                        self.withheld[int(entry.name)] = err
        if steps > self.MANY_STEPS:  # orbax reads every step's metadata before any restore: minutes, said first
            logger.warning(f"{self.directory} holds {steps:,} step folders; orbax reads each one's metadata before "
                           "a checkpoint is restored, which takes a while (move the old steps away to skip it)")

    def check_step(self, step: int) -> None:
        """Checkpoint ``step``'s folder and files, checked as a restore first does but with no file hashed: its step
        metadata, plain files, metadata files within their bound (``CorruptCheckpoint``)."""
        if step in self.withheld:
            raise self.withheld[step]
        integrity.check_plain(self._step_dir(step))

    def read_data(self, step: int) -> Any:
        """The JSON item of checkpoint ``step`` alone (no arrays are read), its files checked first."""
        self.check_step(step)
        try:
            return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
        except RecursionError:  # a hand-written item nested 100,000 deep: Python's JSON reader gives up
            message = (f"checkpoint {self._step_dir(step)}: its JSON item is nested deeper than Python reads, so "
                       "lconv did not write it; move the folder aside")
            raise integrity.CorruptCheckpoint(message) from None

    def save(self, step: int, state: PyTree, data_state: Any, *, force: bool = False) -> bool:
        """Saves at multiples of ``save_every`` (or when forced); returns whether it saved. ``data_state``: JSON-able,
        or a function giving it, called only when saving."""
        if not force and (step % self.save_every):
            return False
        if step in self.all_steps():
            return False
        if callable(data_state):
            data_state = data_state()
        self.finish()
        self.unfinished = step  # from here until ``finish``, a Ctrl-C ends the process at once (``writing``)
        _WRITING.add(self)
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
        except BaseException:
            self.unfinished = None
            raise
        if not self.async_save:
            self.finish()
        return True

    def finish(self) -> None:
        """Waits for an async save to be written, then makes its manifest (hashed by process 0). A crash in between
        leaves a complete checkpoint without a manifest, which restores as "unverified" (still checked finite)."""
        try:
            self.manager.wait_until_finished()
            if self.unfinished is not None and self.checksums:
                integrity.write_manifest(self._step_dir(self.unfinished))
        finally:
            self.unfinished = None

    def _step_dir(self, step: int) -> str:
        return str(epath.Path(self.directory) / str(step))

    def restore(self, abstract_state: PyTree, step: int | None = None) -> tuple[PyTree, Any]:
        """``(state, data_state)`` at ``step`` (default: latest), laid out as ``abstract_state``'s shardings.

        Raises ``integrity.CheckpointMismatch`` (another model), ``CorruptCheckpoint`` (changed bytes, NaN),
        ``UnreadableCheckpoint`` (an unverified one orbax cannot read) or ``CheckpointReadError`` (a verified one
        that still fails to read after retries: a storage problem, not the checkpoint's).
        """
        step = self.latest_step() if step is None else step
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        restored = self._read(step, args, abstract_state, prefix=())
        integrity.check_finite(restored["state"], self._step_dir(step))
        held = getattr(restored["state"], "step", None)
        if held is not None and int(held) != step:  # a folder copied or renamed: orbax then refused every save
            raise integrity.CorruptCheckpoint(f"checkpoint {self._step_dir(step)} holds step {int(held)}'s state; "
                                              "a step's folder is named by its step")
        return restored["state"], restored["data"]

    def restore_params(self, abstract_params: PyTree, step: int, *, also_held: PyTree = None) -> PyTree:
        """The ``params`` of checkpoint ``step`` alone (a partial restore): evaluation needs no optimizer moments.
        ``also_held``: the abstract of the rest the checkpoint holds beside the params' copies (a stream run's
        carried mixer state, which can outweigh the params), counted in what its manifest may list."""
        item = {"params": abstract_params}
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
        params = self._read(step, args, abstract_params, prefix=("params",),
                            held=(abstract_params, also_held))["state"]["params"]
        integrity.check_finite(params, self._step_dir(step))
        return params

    def _read(self, step: int, args: Any, abstract: PyTree, prefix: tuple[str, ...], held: PyTree = None) -> Any:
        where = self._step_dir(step)
        if step in self.withheld:
            raise self.withheld[step]
        bound = integrity.checkpoint_bound(abstract if held is None else held)
        self.verified = integrity.verify_manifest(where, required=False, max_bytes=bound)
        integrity.check_shapes(str(epath.Path(where) / "state"), abstract, where, self.error_log, prefix=prefix)
        for attempt in range(self.read_attempts):
            try:
                with integrity.quiet_orbax(self.error_log) as details:  # sees the failure: read-only, it logs it
                    return self.manager.restore(step, args=args)
            except NOT_STORAGE as err:  # its files parse as no checkpoint: the same at every try, whatever the disk
                raise integrity.UnreadableCheckpoint(
                    f"checkpoint {where} holds files orbax cannot parse ({integrity.first_line(err)}"
                    f"{details.where()}): damaged, or not written by lconv") from None
            except Exception as err:  # noqa: BLE001 (orbax/tensorstore raise many types)
                failure = f"{integrity.first_line(err)}{details.where()}"
            if attempt + 1 < self.read_attempts:
                time.sleep(self.retry_seconds * 2 ** attempt)  # a flaky filesystem or network: try again
        if self.verified:  # its bytes are the ones written: the storage failed, not the checkpoint
            raise integrity.CheckpointReadError(
                f"checkpoint {where} verified but could not be read in {self.read_attempts} attempts ({failure}); "
                "nothing was moved: check the storage and run again")
        raise integrity.UnreadableCheckpoint(f"checkpoint {where} is unreadable ({failure})")

    def restore_latest_readable(self, abstract_state: PyTree) -> tuple[PyTree, Any]:
        """Restores the newest checkpoint that reads. Newer corrupt or unreadable ones (a crash mid-write, a bad
        disk) are moved to ``<dir>_unreadable/`` and reported, so nothing is deleted; a checkpoint of another
        model or a storage failure on a verified one stops here (nothing moved, never an older fallback)."""
        steps = sorted(self.all_steps(), reverse=True)
        errors = []
        for step in steps:
            try:
                restored = self.restore(abstract_state, step)
            except (integrity.CorruptCheckpoint, integrity.UnreadableCheckpoint) as err:
                errors.append((step, err))
                continue
            if errors:
                self._set_aside([s for s, _ in errors])
                logger.info(f"checkpoint(s) {[s for s, _ in errors]} unreadable or corrupt, moved to "
                            f"{self.directory}_unreadable; resuming from step {step} ({errors[0][1]})")
            if not self.verified and self.checksums:
                logger.info(f"checkpoint {step} has no {integrity.MANIFEST_FILENAME} (an older lconv, or a crash "
                            "right after it was written): restored unverified; its values are finite")
            return restored
        raise errors[0][1]

    def _set_aside(self, steps: list[int]) -> None:
        if jax.process_index() == 0:
            aside = epath.Path(self.directory + "_unreadable")
            if aside.exists() and not aside.is_dir():
                raise UserError(f"{aside} is not a folder: the unreadable checkpoint(s) {steps} are moved there "
                                "(remove it, or move them aside yourself)")
            aside.mkdir(parents=True, exist_ok=True)
            for step in steps:
                epath.Path(self._step_dir(step)).rename(aside / f"{step}.{int(time.time())}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("lconv_checkpoints_set_aside")  # every process sees the move
        self._vet_steps()
        self.manager.reload()

    def close(self) -> None:
        self.finish()
        self.manager.close()


class _VettedSteps:
    """Orbax's standard step names, less the ``withheld`` steps: orbax reads the ``_CHECKPOINT_METADATA`` of every
    step it finds, so a step whose file it must not read is one it never finds (``Checkpointer.withheld``)."""

    def __init__(self, standard: Any, withheld: dict[int, integrity.CorruptCheckpoint]) -> None:
        self.standard, self.withheld = standard, withheld

    def build_name(self, step: int) -> str:
        return self.standard.build_name(step)

    def find_all(self, base_path: Any) -> Any:
        return (found for found in self.standard.find_all(base_path) if found.step not in self.withheld)

    def find_step(self, base_path: Any, step: int) -> Any:
        if step in self.withheld:
            raise ValueError(f"step {step} is withheld: {self.withheld[step]}")
        return self.standard.find_step(base_path, step)

    def __getattr__(self, name: str) -> Any:  # the rest of orbax's NameFormat: the standard one's
        return getattr(self.standard, name)


_WRITING: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # checkpointers that have started a save
TMP_SUFFIX = getattr(ocp.utils, "TMP_DIR_SUFFIX", ".orbax-checkpoint-tmp")  # orbax's unfinished step folders


def writing() -> list[str]:
    """The step folders being written now (an async save not yet finished, or a save in progress): a Ctrl-C then
    ends the process at once (``lconv.cli.runtime.on_interrupt``), and ``remove_unfinished`` clears what the write
    left at the next start, instead of a traceback from orbax's threads."""
    return [c._step_dir(c.unfinished) for c in list(_WRITING) if c.unfinished is not None]


def remove_unfinished(directory: str) -> None:
    """Removes the temporary step folders an interrupted save left in ``directory`` (process 0), said in one line:
    orbax never lists them as steps, so they only took space."""
    folder = epath.Path(directory)
    if jax.process_index() != 0 or not folder.is_dir():
        return
    left = sorted(p for p in folder.iterdir() if TMP_SUFFIX in p.name)
    for path in left:
        if path.is_dir():
            path.rmtree(missing_ok=True)
        else:
            path.unlink(missing_ok=True)
    if left:
        logger.info(f"removed {len(left)} unfinished checkpoint folder(s) an interrupted save left in {directory} "
                    f"({', '.join(p.name for p in left[:3])}); the complete checkpoints are kept")


class BestCheckpointer:
    """The state with the best validation score so far: one checkpoint in ``<workdir>/best`` whose JSON item is
    ``{"step", "validation_loss"}``, and ``validation_<metric>`` when another metric (``config.train.best_metric``,
    ``lconv.train.eval_control``) picks it. A resumed run reads the value to beat back from it (none recorded for
    its metric: the first pass sets it)."""

    def __init__(self, workdir: str, *, checksums: bool = True, async_save: bool = False, metric: str = "loss",
                 higher_is_better: bool = False) -> None:
        self.checkpointer = Checkpointer(workdir, keep=1, save_every=1, subdir="best", checksums=checksums,
                                         async_save=async_save)
        self.metric, self.higher_is_better = metric, higher_is_better
        self.key = "validation_loss" if metric == "loss" else f"validation_{metric}"
        step = self.checkpointer.latest_step()
        record = {} if step is None else self.checkpointer.read_data(step)
        value = record.get(self.key) if isinstance(record, dict) else None
        if not isinstance(record, dict) or (self.key in record and not _is_number(value)):
            raise integrity.CorruptCheckpoint(
                f"best checkpoint {self.checkpointer._step_dir(step)}: its record {str(record)[:80]} is not lconv's "
                f"(a {self.key} number); move it aside, and the next validation pass keeps the best from there")
        self.value = float(value) if self.key in record else -math.inf if higher_is_better else math.inf

    def beats(self, value: float) -> bool:
        """Whether ``value`` is better than the best so far."""
        return value > self.value if self.higher_is_better else value < self.value

    def offer(self, step: int, state: PyTree, validation_loss: float, value: float | None = None) -> bool:
        """Saves ``state`` if its ``value`` (by default its loss) beats the best so far; returns whether it did."""
        value = validation_loss if value is None else value
        if not self.beats(value):
            return False
        record = {"step": int(step), "validation_loss": float(validation_loss), self.key: float(value)}
        saved = self.checkpointer.save(step, state, record, force=True)
        if saved:
            self.value = float(value)
        return saved

    def close(self) -> None:
        self.checkpointer.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class DiskFull(UserError):
    """No room to write the run's checkpoints or logs (a full disk, a quota or the file size limit); the finished
    checkpoints stay."""


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` or an exception in its chain is a write that found no room (Python's ENOSPC, EFBIG or
    EDQUOT, or tensorstore's text of them)."""
    return no_room.no_room_cause(err) is not None


def disk_full(err: BaseException, ckpt: Checkpointer, best: BestCheckpointer) -> DiskFull:
    """The one line for a run that filled its disk, naming the last finished checkpoint, once the checkpointers'
    unfinished writes are given up quietly (orbax's threads would print pages of the same failure)."""
    with integrity.quiet_orbax(ckpt.error_log):
        for manager in (ckpt.manager, best.checkpointer.manager):
            with contextlib.suppress(Exception):
                manager.close()
        gc.collect()  # orbax's abandoned tasks report "exception never retrieved" when collected: now, quietly
    integrity.quiet_until_exit(ckpt.error_log)  # writes still failing in tensorstore's threads say it again later
    cause = no_room.no_room_cause(err)
    reason = no_room.reason(err) or no_room.REASONS[errno.ENOSPC]
    path = getattr(cause, "filename", None) or next(iter(re.findall(r'"(/[^"]+)"', str(cause))), None)
    steps = sorted(int(p.name) for p in epath.Path(ckpt.directory).iterdir() if p.name.isdigit()) \
        if epath.Path(ckpt.directory).is_dir() else []
    last = f"step {steps[-1]} ({epath.Path(ckpt.directory) / str(steps[-1])})" if steps else "none (no step finished)"
    return DiskFull(f"{reason}{f' writing {path}' if path else ''}; the last good checkpoint is {last}; free space "
                    "(or raise the limit, or move --workdir) and run the same command to resume from it")


def has_checkpoint(workdir: str) -> bool:
    """Whether ``workdir`` holds a finished checkpoint (latest or best); cheap: lists directories only."""
    for subdir in ("checkpoints", "best"):
        directory = epath.Path(workdir_lib.resolve(workdir)) / subdir
        if directory.is_dir() and any(path.name.isdigit() for path in directory.iterdir()):
            return True
    return False


def gather_process_states(local_state: Any) -> dict[str, Any]:
    """Every process's JSON-able iterator state, the same on every process (a collective: all call it at one step)."""
    if jax.process_count() == 1:
        return {"process_count": 1, "processes": [local_state]}
    from jax.experimental import multihost_utils

    encoded = np.frombuffer(json.dumps(local_state).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(encoded)], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(encoded)] = encoded
    gathered = np.asarray(multihost_utils.process_allgather(padded))  # [P, longest]
    return {"process_count": len(lengths),
            "processes": [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths)]}


def this_process_state(data_item: Any, directory: str = "") -> Any:
    """The iterator state of this process from a checkpoint's ``data`` item (see ``gather_process_states``)."""
    if not isinstance(data_item, dict) or "processes" not in data_item:
        raise UserError(f"checkpoint {directory} has no per-process data-iterator state (an older format); "
                         "use a new --workdir")
    if data_item["process_count"] != jax.process_count():
        raise UserError(f"checkpoint {directory} was written by {data_item['process_count']} processes, this run "
                         f"has {jax.process_count()}; every process reads its own shard of the data, so resume "
                         "with the same number of processes")
    return data_item["processes"][jax.process_index()]


def restore_iterator(iterator: Any, data_item: Any, directory: str = "") -> None:
    """Sets ``iterator`` (the train split's) to this process's state in a checkpoint's ``data`` item; a state the
    iterator cannot take (damaged, or hand-written in a checkpoint without a manifest) is one line naming it."""
    state = this_process_state(data_item, directory)
    try:
        iterator.set_state(state)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
        raise UserError(f"checkpoint {directory}: its data-iterator state is unreadable ({integrity.first_line(err)}); "
                        "the checkpoint is damaged: remove that step to resume from the one before") from None


def abstract_like(tree: PyTree) -> PyTree:
    """Shape/dtype/sharding structs of a (possibly sharded) pytree, the target layout for a restore."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)

