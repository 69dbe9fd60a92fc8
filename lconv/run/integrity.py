"""Checkpoint integrity: a SHA-256 manifest written beside each checkpoint and verified before it is restored,
a finiteness check of what was restored, and orbax's failure noise kept out of the terminal.

Orbax writes a checkpoint into a temporary directory and renames it when complete, which catches a crash
mid-write, but nothing checks the bytes afterwards: a flipped block restores "fine" and NaNs show up steps
later. ``lconv_manifest.json`` in each step directory lists every file's size and SHA-256 (written by process 0
once orbax has finished; hashing runs at disk speed, ~1 s per GB). A checkpoint without one (written by an older
lconv, or a crash between orbax's rename and the manifest) is restored unverified and reported as such.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from etils import epath

from lconv import json_text, outputs
from lconv.data import paths
from lconv.errors import UserError
from lconv.run import workdir as workdir_lib

logger = logging.getLogger(__name__)

MANIFEST_FILENAME = "lconv_manifest.json"
ERROR_LOG_FILENAME = "checkpoint_errors.log"
MANIFEST_MAX_BYTES = 64 << 20  # a manifest lists files by name: far smaller than this
METADATA_MAX_BYTES = 256 << 20  # orbax reads its metadata files (all but the arrays' ``d/`` chunks) whole
STEP_METADATA_FILENAME = "_CHECKPOINT_METADATA"  # orbax's, read for every step it lists when a folder is opened
STEP_METADATA_MAX_BYTES = 1 << 20  # orbax writes item handler names and timestamps there: well under a kilobyte


class CorruptCheckpoint(UserError):
    """A checkpoint whose files changed since they were written, or whose values are not finite: set aside."""


class UnreadableCheckpoint(UserError):
    """An unverified checkpoint (no manifest) that orbax cannot read: set aside like a corrupt one."""


class CheckpointMismatch(UserError):
    """A checkpoint of another model (arrays missing or of other shapes): an error, nothing moved."""


class CheckpointReadError(UserError):
    """A verified checkpoint that failed to read even after retries: the storage's fault, nothing moved."""


def _files(step_dir: epath.Path, prefix: str = "", depth: int = 0) -> list[str]:
    """Every file under ``step_dir`` but the manifest, as sorted relative paths (walked level by level: epath's
    remote backends refuse recursive globs). Orbax writes plain files and folders: a symbolic link (which could
    lead out of the checkpoint) or a device, pipe or socket (``/dev/zero`` reads forever) is a ``CorruptCheckpoint``."""
    if depth > paths.MAX_FOLDER_DEPTH:
        raise CorruptCheckpoint(f"checkpoint folder {step_dir} is nested more than {paths.MAX_FOLDER_DEPTH} deep; "
                                "orbax writes a few levels")
    found = []
    for child in step_dir.iterdir():
        relative = f"{prefix}{child.name}"
        if not outputs.is_url(os.fspath(child)) and (os.path.islink(child) or not (child.is_dir() or
                                                                                  os.path.isfile(child))):
            kind = "a symbolic link" if os.path.islink(child) else "not a regular file"
            raise CorruptCheckpoint(f"checkpoint {step_dir}: {relative} is {kind}; a checkpoint holds plain files")
        if child.is_dir():
            found += _files(child, relative + "/", depth + 1)
        elif relative != MANIFEST_FILENAME:
            found.append(relative)
    return sorted(found)


def write_manifest(step_dir: str) -> None:
    """Writes ``<step_dir>/lconv_manifest.json`` (process 0; every process waits for it)."""
    if jax.process_index() == 0:
        root = epath.Path(step_dir)
        manifest = {rel: [(root / rel).stat().length, paths.sha256(root / rel)] for rel in _files(root)}
        temporary = root / f".{MANIFEST_FILENAME}.{os.getpid()}.tmp"
        temporary.write_text(json.dumps({"sha256": manifest}, indent=0, sort_keys=True))
        temporary.replace(root / MANIFEST_FILENAME)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("lconv_checkpoint_manifest")


def verify_manifest(step_dir: str, *, required: bool = False, max_bytes: int | None = None) -> bool:
    """Checks every file of a checkpoint against its manifest; returns False when there is no manifest (an error
    if ``required``). A missing, resized or changed file is a ``CorruptCheckpoint``, and so is a manifest listing
    more than ``max_bytes`` in all (what the model's checkpoint can hold: a sparse file of terabytes, listed with its
    true digest, was hashed for hours at every load)."""
    root = epath.Path(step_dir)
    path = root / MANIFEST_FILENAME
    if not path.exists():
        if required:
            raise CorruptCheckpoint(f"checkpoint {step_dir} has no {MANIFEST_FILENAME}")
        check_plain(step_dir)
        return False
    expected = _read_manifest(path, step_dir)
    listed = sum(size for size, _ in expected.values())
    if max_bytes is not None and listed > max_bytes:
        raise CorruptCheckpoint(f"checkpoint {step_dir}: its {MANIFEST_FILENAME} lists {listed:,} bytes, more than "
                                f"the {max_bytes:,} a checkpoint of this model holds")
    present = set(check_plain(step_dir) or _files(root))
    for rel, (size, digest) in expected.items():
        file = root / rel
        if rel.startswith(("/", "\\")) or any(part in ("", ".", "..") for part in rel.replace("\\", "/").split("/")):
            raise CorruptCheckpoint(f"checkpoint {step_dir}: its {MANIFEST_FILENAME} names {rel!r}, a path outside "
                                    "the checkpoint")
        if rel not in present:
            raise CorruptCheckpoint(f"checkpoint {step_dir}: {rel} is missing")
        if file.stat().length != size or paths.sha256(file) != digest:
            raise CorruptCheckpoint(f"checkpoint {step_dir}: {rel} changed since it was written (SHA-256 mismatch)")
    extra = sorted(present - set(expected))
    if extra:
        raise CorruptCheckpoint(f"checkpoint {step_dir}: {extra[0]} was not part of it when it was written")
    return True


def checkpoint_bound(abstract: Any) -> int:
    """The most bytes a checkpoint holding ``abstract`` (the state, or the params of it) can take: its arrays
    ``CHECKPOINT_COPIES`` times over (the params, the optimizer's moments, an average), and the metadata files."""
    arrays = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                 for leaf in jax.tree.leaves(abstract) if hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
    return CHECKPOINT_COPIES * arrays + METADATA_MAX_BYTES


CHECKPOINT_COPIES = 8  # Adam keeps two moments beside the params, an EMA a third copy: twice that, for slack


def check_plain(step_dir: str) -> list[str] | None:
    """What orbax will read of a local checkpoint, checked before it does, with or without a manifest: a plain
    folder of plain files (``_files``; a pipe as ``state/_METADATA`` hung eval.py), and its metadata files
    (``state/_METADATA``, ``data/metadata``, ...: all but the arrays' chunks under ``d/``), which orbax reads whole,
    of at most ``METADATA_MAX_BYTES`` (one linked to /dev/zero ran out of memory). Each failure is a
    ``CorruptCheckpoint``; returns the files (None for a URL, which has no links or devices, or no folder)."""
    if outputs.is_url(step_dir) or not os.path.lexists(step_dir):
        return None  # a missing checkpoint: its reader says so
    if os.path.islink(step_dir):
        raise CorruptCheckpoint(f"checkpoint {step_dir} is a symbolic link; a checkpoint is a plain folder")
    root = epath.Path(step_dir)
    files = _files(root)
    for rel in files:
        if "d" in rel.split("/")[:-1]:
            continue
        size = os.path.getsize(root / rel)
        if size > METADATA_MAX_BYTES:
            raise CorruptCheckpoint(f"checkpoint {root}: {rel} is {size:,} bytes, more than the {METADATA_MAX_BYTES:,} "
                                    "a checkpoint's metadata file holds")
    return files


def check_listed_step(step_dir: str, step: int) -> None:
    """What orbax reads of a local step when it lists it (at each open of a checkpoint folder, before any step is
    chosen), checked before it does: a link (to a file outside, whose content orbax logs, or to /dev/zero), a pipe, a
    huge file, JSON nested too deep for Python's reader (a ``RecursionError``) or of types orbax refuses (a
    ``ValueError``) as ``_CHECKPOINT_METADATA``, or a ``metrics`` item (lconv writes none), ended eval.py in a hang or
    a traceback. Each is a ``CorruptCheckpoint``. Text that is not JSON orbax does without (it logs it, to the error
    log); the step's files are verified at its restore as any other's."""
    if outputs.is_url(step_dir):
        return
    if os.path.islink(step_dir):
        raise CorruptCheckpoint(f"checkpoint {step_dir} is a symbolic link; a checkpoint is a plain folder")
    if os.path.lexists(os.path.join(step_dir, "metrics")):
        raise CorruptCheckpoint(f"checkpoint {step_dir} holds a metrics item, which lconv never writes")
    path = os.path.join(step_dir, STEP_METADATA_FILENAME)
    if not os.path.lexists(path):
        return  # orbax reads a step without one
    if os.path.islink(path) or not os.path.isfile(path):
        kind = "a symbolic link" if os.path.islink(path) else "not a regular file"
        raise CorruptCheckpoint(f"checkpoint {step_dir}: {STEP_METADATA_FILENAME} is {kind}; a checkpoint holds "
                                "plain files")
    size = os.path.getsize(path)
    if size > STEP_METADATA_MAX_BYTES:
        raise CorruptCheckpoint(f"checkpoint {step_dir}: {STEP_METADATA_FILENAME} is {size:,} bytes, more than the "
                                f"{STEP_METADATA_MAX_BYTES:,} orbax's step metadata holds")
    try:
        with open(path, "rb") as f:
            json_text.loads(f.read())
    except json.JSONDecodeError as err:
        if err.msg == json_text.NESTED_TOO_DEEP:  # what orbax's own json.loads dies of, a RecursionError
            raise CorruptCheckpoint(f"checkpoint {step_dir}: {STEP_METADATA_FILENAME} is JSON {err.msg}; orbax "
                                    "writes a flat record there") from None
    except (UnicodeDecodeError, OSError):
        pass  # orbax logs what it cannot read and does without
    import orbax.checkpoint as ocp

    try:  # the read orbax makes at each open, now that it can neither hang nor recurse
        ocp.step.Metadata(step=step, path=epath.Path(step_dir)).commit_timestamp  # noqa: B018 (read for its errors)
    except Exception as err:  # noqa: BLE001 (orbax raises ValueError, TypeError, OverflowError...)
        raise CorruptCheckpoint(f"checkpoint {step_dir}: {STEP_METADATA_FILENAME} is not orbax's step metadata "
                                f"({first_line(err)})") from None


def first_line(err: BaseException) -> str:
    """``Type: the first line of its message`` (at most 200 characters), for the end of a one-line error."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _read_manifest(path: epath.Path, step_dir: str) -> dict[str, list]:
    """The manifest's ``{relative path: [size, sha256]}``: a small JSON file of that shape, else one line."""
    try:
        if not outputs.is_url(os.fspath(path)) and (os.path.islink(path) or not os.path.isfile(path)
                                                    or os.path.getsize(path) > MANIFEST_MAX_BYTES):
            raise ValueError("not a plain file of at most 64 MB")
        expected = json_text.loads(path.read_text())["sha256"]
        if not (isinstance(expected, dict) and all(
                isinstance(rel, str) and isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and entry[0] >= 0 and isinstance(entry[1], str) for rel, entry in expected.items())):
            raise ValueError('not {"sha256": {path: [size, sha256]}}')
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpoint(f"checkpoint {step_dir}: its {MANIFEST_FILENAME} is unreadable "
                                f"({str(err).splitlines()[0][:200] if str(err) else type(err).__name__})") from None
    return expected


def check_finite(tree: Any, where: str) -> None:
    """A restored state with a NaN or inf anywhere (params, optimizer moments) is a ``CorruptCheckpoint``."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype,
                                                                                               jax.numpy.inexact)]
    if not leaves:
        return
    all_finite = jax.jit(lambda xs: jax.numpy.all(jax.numpy.stack([jax.numpy.isfinite(x).all() for x in xs])))
    if not bool(np.asarray(all_finite(leaves))):  # one device pass; the host's search only names the array
        raise CorruptCheckpoint(f"checkpoint {where} holds non-finite values (first in {first_non_finite(tree)})")


def first_non_finite(tree: Any) -> str | None:
    """The key path of the first floating array in ``tree`` holding a NaN or inf, or None."""
    return next((jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(tree)
                 if hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
                 and not bool(np.isfinite(np.asarray(x)).all())), None)


def _path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A pytree key path as plain names, the same for a train state and orbax's metadata of it."""
    return tuple(str(next(getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a))) for k in path)


def _display(path: tuple[str, ...]) -> str:
    return "/".join(k for k in path if k != "value")  # "value": the box of a logically partitioned param


def check_shapes(item_dir: str, abstract: Any, where: str, error_log: str | None, prefix: tuple[str, ...] = ()) -> None:
    """Compares the array shapes stored in an orbax item (its metadata: no array is read) with ``abstract``'s,
    so a checkpoint of another model is one clear line naming the first missing or differing array, before orbax
    tries (and fails noisily) to read it. Unreadable metadata is left to the restore to report."""
    import orbax.checkpoint as ocp

    try:
        with quiet_orbax(error_log), ocp.StandardCheckpointer() as reader:
            stored_tree = reader.metadata(item_dir).item_metadata
    except Exception:  # noqa: BLE001 (unreadable metadata: the restore itself reports it)
        return
    stored = {_path_names(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_leaves_with_path(stored_tree)
              if hasattr(leaf, "shape")}
    wanted = {prefix + _path_names(p): tuple(leaf.shape)
              for p, leaf in jax.tree_util.tree_leaves_with_path(abstract) if hasattr(leaf, "shape")}
    if not stored or not wanted:
        return
    missing = [k for k in wanted if k not in stored]
    if missing:
        raise CheckpointMismatch(
            f"checkpoint {where} does not fit this config's model: it has no {_display(missing[0])} ({len(missing)} "
            "of this model's arrays are not in it); use the config stored with it or a new --workdir")
    differing = [k for k in wanted if wanted[k] != stored[k]]
    if differing:
        name = _display(differing[0])
        raise CheckpointMismatch(
            f"checkpoint {where} does not fit this config's model: {name} is {stored[differing[0]]} there and "
            f"{wanted[differing[0]]} here ({len(differing)} arrays differ); use the config stored with it or a new "
            "--workdir")


class _Details:
    def __init__(self, path: str | None) -> None:
        self.path, self.records = path, []

    def where(self) -> str:
        """`` (orbax's details: <log>)`` once anything was captured, for the end of the one-line error."""
        if not self.records:
            return ""
        return f" (orbax's details: {self.path})" if self.path else " (orbax's details: in the log above)"


class _Collector(io.TextIOBase):
    def __init__(self, buffer: list[str]) -> None:
        self.buffer = buffer

    def write(self, text: str) -> int:
        if text.strip():
            self.buffer.append(text.rstrip("\n"))
        return len(text)


@contextlib.contextmanager
def quiet_orbax(error_log: str | None) -> Iterator[_Details]:
    """Inside this block orbax's and tensorstore's records of a failed restore (many, with worker threads'
    tracebacks) go to ``error_log`` (the workdir's ``checkpoint_errors.log``), so the user sees lconv's one line.
    ``error_log=None`` (a read) writes nothing into the workdir: the records go to lconv's log instead."""
    details = _Details(error_log)
    buffer = details.records

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            buffer.append(self.format(record))

    handler = Collect(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio", "orbax", "tensorstore")]
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    thread_hook, unraisable_hook, stderr = threading.excepthook, sys.unraisablehook, sys.stderr
    for lg in loggers:
        lg.handlers, lg.propagate = [handler], False
    threading.excepthook = lambda args: buffer.append(f"thread {args.thread}: {args.exc_type.__name__}: "
                                                      f"{args.exc_value}")
    sys.unraisablehook = lambda args: buffer.append(f"unraisable: {args.exc_type.__name__}: {args.exc_value}")
    sys.stderr = _Collector(buffer)  # tracebacks printed from tensorstore's callback threads
    failed = True
    try:
        yield details
        failed = False
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate
        threading.excepthook, sys.unraisablehook, sys.stderr = thread_hook, unraisable_hook, stderr
        if failed and not isinstance(sys.stderr, ForeignThreadStderr):
            # tensorstore's threads go on calling orbax's closed event loop, each printing a traceback
            sys.stderr = ForeignThreadStderr(sys.stderr, details.path)
        if buffer and details.path is None:
            for line in buffer:
                logger.log(logging.WARNING if failed else logging.DEBUG, line)
        elif buffer:
            with contextlib.suppress(OSError):
                workdir_lib.append_text(epath.Path(details.path), "\n".join(buffer) + "\n")


_FORMAT = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
_QUIET_UNTIL_EXIT: list[str] = []  # the error logs ``quiet_until_exit`` was given: once set, for the process


def _append(error_log: str, text: str) -> None:
    with contextlib.suppress(OSError):  # no room for the details either, when the disk is full
        workdir_lib.append_text(epath.Path(error_log), text)


class ForeignThreadStderr(io.TextIOBase):
    """``sys.stderr`` for a run, or after a failed restore: what Python's threads print (the progress bar, warnings,
    errors) goes through; what threads started outside Python print (tensorstore's callbacks print tracebacks once
    orbax's event loop has closed) goes to ``error_log``, or to lconv's debug log where there is none (a read)."""

    def __init__(self, stream: Any, error_log: str | None) -> None:
        self.stream, self.error_log = stream, error_log

    def write(self, text: str) -> int:
        # A thread Python did not start is a "dummy" to the threading module (its class is private: by name).
        if type(threading.current_thread()).__name__ != "_DummyThread":
            return self.stream.write(text)
        if self.error_log:
            _append(self.error_log, text)
        elif text.strip():
            logger.debug("%s", text.rstrip("\n"))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding...: the real stream's
        return getattr(self.stream, name)


class _OrbaxToFile(logging.Filter):
    """On the ``absl`` logger: orbax's warnings and errors go to ``error_log`` rather than the terminal."""

    def __init__(self, error_log: str) -> None:
        super().__init__()
        self.error_log = error_log

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname or record.levelno < logging.WARNING:
            return True
        _append(self.error_log, _FORMAT.format(record) + "\n")
        return False


@contextlib.contextmanager
def orbax_errors_to_file(error_log: str) -> Iterator[None]:
    """For a whole run: orbax's warnings and errors from its background save threads, and what threads started
    outside Python print, go to ``error_log``; a failed save surfaces in the main thread as one error, instead of a
    full disk printing pages of the same failure from every thread."""
    diverted, absl_logger, stderr = _OrbaxToFile(error_log), logging.getLogger("absl"), sys.stderr
    absl_logger.addFilter(diverted)
    sys.stderr = ForeignThreadStderr(stderr, error_log)
    try:
        yield
    finally:
        absl_logger.removeFilter(diverted)
        if not _QUIET_UNTIL_EXIT:
            sys.stderr = stderr


def quiet_until_exit(error_log: str) -> None:
    """After a full disk, which ends the run, the failures still repeating in foreign threads, orbax's exit tasks and
    tensorboard's close go to ``error_log`` for the rest of the process; Python's own output is untouched."""
    _QUIET_UNTIL_EXIT.append(error_log)

    def about_orbax(record: logging.LogRecord) -> bool:
        text = record.getMessage() + ("".join(traceback.format_exception(*record.exc_info)) if record.exc_info else "")
        return "orbax" not in text

    logging.getLogger("asyncio").addFilter(about_orbax)
    logging.getLogger("absl").addFilter(_OrbaxToFile(error_log))
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)  # orbax's, collected at exit
    sys.unraisablehook = lambda args: _append(error_log, f"unraisable: {args.exc_type.__name__}: {args.exc_value}\n")
    if not isinstance(sys.stderr, ForeignThreadStderr):
        sys.stderr = ForeignThreadStderr(sys.stderr, error_log)
