"""A run's workdir: one training process at a time (``lock``, an OS file lock on ``<workdir>/train.lock``) and a
``config.json`` that matches its checkpoints (``check_config_change``, ``write_config``): after the first checkpoint
only ``RUN_FIELDS`` and fields new to lconv change without ``accept_changes``. The rules: docs/training.md,
"Checkpoints, preemption and failures"."""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import jax
from etils import epath

from lconv import json_text, outputs
from lconv.data import paths
from lconv.errors import UserError
from lconv.run import schema

logger = logging.getLogger(__name__)

CONFIG_FILENAME = "config.json"
LOCK_FILENAME = "train.lock"
# The files train.py writes or appends to at a workdir's top: none may be a symbolic link (``make_workdir``).
OWN_FILES = (CONFIG_FILENAME, LOCK_FILENAME, "spm.model", "pieces.json", "metrics.jsonl", "checkpoint_errors.log",
             "config_changes.jsonl", "final_evaluation_pending.json", "data_report.json", outputs.MARKER)
CHECKPOINT_FOLDERS = ("checkpoints", "best")  # lconv.run.checkpoints' folders in a workdir
# Fields a resumed run may change freely: they steer the run, not what its checkpoints hold.
RUN_FIELDS = ("train.", "decode.", "mesh.", "data.data_dir", "data.eval_batch_size", "data.read_threads")


def is_remote(path: str) -> bool:
    """A URL (gs://, s3://, ...) rather than a local path: read and written through ``etils.epath``."""
    return paths.is_url(path)


def resolve(workdir: str) -> str:
    """The workdir as every module names it: absolute when local, unchanged when a URL."""
    return str(workdir) if is_remote(workdir) else os.path.abspath(os.path.expanduser(workdir))


def make_workdir(workdir: str) -> str:
    """The resolved workdir, created; a folder holding something else or an unwritable place is a one-line error."""
    outputs.claim_directory(str(workdir), "workdir", "--workdir")
    path = resolve(workdir)
    try:
        epath.Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--workdir={workdir}: cannot create it ({err.strerror or err})") from None
    if not is_remote(path):  # before anything is written: a link planted in a resumed workdir is named first
        for name in OWN_FILES:
            outputs.refuse_link(os.path.join(path, name))
            outputs.refuse_special(os.path.join(path, name))
        for name in (*CHECKPOINT_FOLDERS, "tensorboard"):
            check_inside(os.path.join(path, name), path)
        check_apart([os.path.join(path, name) for name in (*CHECKPOINT_FOLDERS, "tensorboard")])
        for name in CHECKPOINT_FOLDERS:
            check_plain_steps(os.path.join(path, name))
    return path


def check_plain_steps(directory: str) -> None:
    """A checkpoint folder's entries are plain folders: a step that is a link is one line before training, not an
    orbax traceback when the run deletes the step it no longer keeps."""
    if not os.path.isdir(directory):
        return
    for entry in os.scandir(directory):
        if entry.is_symlink():
            raise UserError(f"{entry.path} is a symbolic link (to {os.path.realpath(entry.path)}); a run's "
                            "checkpoints are plain folders in its workdir: move the checkpoint there")


def check_apart(folders: list[str]) -> None:
    """One line if two of a workdir's folders are one (``best`` linked to ``checkpoints``): two checkpoint managers
    writing one folder fail, and a run would hang in them."""
    real = {folder: os.path.realpath(folder) for folder in folders if os.path.lexists(folder)}
    for folder, target in real.items():
        for other, other_target in real.items():
            if folder != other and os.path.commonpath([target, other_target]) == other_target:
                raise UserError(f"{folder} leads into {other} (a symbolic link to {target}); each of a run's "
                                "folders is its own: remove the link")


def check_inside(directory: str, workdir: str) -> None:
    """A workdir's checkpoint or tensorboard folder that is a symbolic link leading out of the workdir is one line."""
    if is_remote(directory):
        return
    for folder in (directory, directory + "_unreadable"):
        real, root = os.path.realpath(folder), os.path.realpath(workdir)
        if os.path.islink(folder) and os.path.commonpath([real, root]) != root:
            raise UserError(f"{folder} leads out of the workdir (a symbolic link to {real}); lconv reads and writes "
                            "a run's files inside its workdir only: move the folder there")


@contextlib.contextmanager
def lock(workdir: str) -> Iterator[None]:
    """Holds ``<workdir>/train.lock`` for the body (process 0); a second run fails at once, naming the owner."""
    if jax.process_index() != 0:
        yield
        return
    if is_remote(workdir):  # object stores have no file locks
        logger.warning(f"{workdir} is remote: nothing stops a second train.py on it (file locks are local "
                       "only)")
        yield
        return
    import fcntl

    path = os.path.join(workdir, LOCK_FILENAME)
    try:
        fd = outputs.open_regular(path, os.O_RDWR | os.O_CREAT)  # a link would be emptied at the end
    except OSError as err:
        raise UserError(f"--workdir={workdir} (its lock file {path}) is not writable ({err.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):  # e.g. ENOLCK: this filesystem has no locks
                logger.warning(f"{path}: file locks are not supported here ({err.strerror}); nothing "
                               "stops a second train.py on this workdir")
            else:
                raise UserError(f"--workdir={workdir} is in use by another train.py ({_owner(fd)}); wait for it "
                                "to finish, stop it, or use another --workdir") from None
        previous = _owner(fd)
        if previous != "owner unknown":
            logger.info(f"took over {path} from a run that is gone ({previous})")
        _write_owner(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # an empty lock file: the run ended cleanly
        os.close(fd)  # releases the flock


def _owner(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        owner = json_text.loads(os.read(fd, 4096).decode() or "null")
    except (ValueError, UnicodeDecodeError):
        owner = None
    if not isinstance(owner, dict):
        return "owner unknown"
    return f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}"


def _write_owner(fd: int) -> None:
    owner = {"pid": os.getpid(), "host": socket.gethostname(),
             "started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(owner).encode())


def _flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(values, dict) or prefix.endswith(("mixer_kwargs.", "ffn_kwargs.")):
        return {prefix.rstrip("."): values}
    flat = {}
    for key, value in values.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def as_record(config: Any) -> dict[str, Any]:
    """A config (a ConfigDict or a dict) as ``config.json`` stores it: plain JSON values."""
    if hasattr(config, "to_json_best_effort"):
        return json.loads(config.to_json_best_effort(sort_keys=True))
    return json.loads(json.dumps(config, sort_keys=True))


def config_changes(stored: dict[str, Any], record: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted field: (stored value, new value)}`` of every field that differs (``record``: ``as_record``'s)."""
    old, new = _flatten(stored), _flatten(record)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def fields_added_at_their_defaults(stored: dict[str, Any], changes: dict[str, tuple[Any, Any]]) -> set[str]:
    """The changed fields the stored config lacks, set to their defaults: new to lconv, no ``accept_changes``."""
    stored_fields, defaults = _flatten(stored), _flatten(as_record(schema.base_config()))
    return {k for k, (_, new) in changes.items() if k not in stored_fields and k in defaults and new == defaults[k]}


def check_config_change(record: dict[str, Any], workdir: str, *, has_checkpoint: bool,
                        accept_changes: bool = False) -> dict[str, tuple[Any, Any]] | None:
    """The changes this launch makes to ``config.json`` (None: none); raises when a checkpointed run changes a field
    outside ``RUN_FIELDS`` without ``accept_changes``."""
    path = epath.Path(workdir) / CONFIG_FILENAME
    if not path.exists():
        return {}
    try:
        stored = json_text.loads(read_config_bytes(path, workdir))
    except ValueError as err:
        raise UserError(f"{path} is unreadable ({err}); restore it or use a new --workdir") from None
    changes = config_changes(stored, record)
    added = fields_added_at_their_defaults(stored, changes)
    fixed = [k for k in changes if not k.startswith(RUN_FIELDS) and k not in added]
    if has_checkpoint and fixed and not accept_changes:
        shown = "; ".join(f"config.{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in fixed[:3])
        more = f" and {len(fixed) - 3} more" if len(fixed) > 3 else ""
        raise UserError(f"this launch changes the config its checkpoints were trained with ({shown}{more}); drop "
                        "the override(s), use a new --workdir, or pass --accept_config_changes to change it on "
                        "purpose")
    return changes or None


CONFIG_MAX_BYTES = 64 << 20  # a config is a few kB of JSON; far more is not one


def read_config_bytes(path: epath.Path, workdir: str) -> bytes:
    """The bytes of a run's ``config.json``: a regular file inside ``workdir`` of a sane size, else one line."""
    return paths.read_bytes(path, "missing; restore it from a copy of the run", within=workdir,
                            limit=CONFIG_MAX_BYTES)


def write_config(record: dict[str, Any], workdir: str, changes: dict[str, tuple[Any, Any]] | None, *,
                 has_checkpoint: bool) -> None:
    """Writes ``config.json`` (process 0) once a resumed run has restored; changes go to ``config_changes.jsonl``."""
    if changes is None or jax.process_index() != 0:
        return
    if changes:
        line = json.dumps({"time": datetime.datetime.now().isoformat(timespec="seconds"),
                           "after_checkpoint": has_checkpoint,
                           "changes": {k: list(v) for k, v in changes.items()}}) + "\n"
        append_text(epath.Path(workdir) / "config_changes.jsonl", line)
    write_atomically(epath.Path(workdir) / CONFIG_FILENAME, json.dumps(record, indent=2, sort_keys=True))
    if changes:  # said once both files are written, never before a write that fails
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:5])
        logger.info(f"config.json updated ({listed}{' ...' if len(changes) > 5 else ''})")


def append_text(path: epath.Path, text: str) -> None:
    """Appends ``text``: a real append locally (never through a symbolic link), a rewrite on an object store."""
    if not is_remote(path):
        with outputs.open_append(path) as f:
            f.write(text)
    else:
        path.write_text((path.read_text() if path.exists() else "") + text)


write_atomically = outputs.write_atomically  # the one atomic writer, in the bottom layer
