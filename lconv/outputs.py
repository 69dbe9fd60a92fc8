"""Which command owns which output: one rule for every lconv command that writes.

A command writes only into a directory that is new or empty, or that already holds its own kind of output, and
never over a file that another command produced, over an input it reads, or over an lconv checkout's committed
``docs/`` (those are written only by the commands' defaults, run from the checkout's root). Every refusal is one
``UserError`` line naming the flag and the path, raised before any work.

Each kind of output directory is recognised by its marker (``.lconv-output.json``, written by the command that
claims it) or, for one made before markers, by a file only that kind writes (``KIND_SIGNATURES``). Inside a
workdir, the entries that make it a run (``WORKDIR_CORE``: the config, tokenizer, checkpoints, ...) are written by
train.py and the fairseq importer alone; eval.py writes its outputs beside them.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterable
from typing import Any

from etils import epath

from lconv import console, json_text, shared_folders
from lconv.errors import UserError

MARKER = ".lconv-output.json"
PREPARED_DIRNAME = "lconv_prepared"  # under a data_dir: lconv's prepared copies and kept tokenizers
KIND_NAMES = {"workdir": "a training workdir", "export": "an exported model", "bench": "benchmark results",
              "study": "a study's runs"}
KIND_SIGNATURES = {  # any one of these files marks a folder made before markers
    "workdir": ("config.json",), "export": ("lconv_export.json",), "study": ("records.json",),
    "bench": tuple(f"{suite}.csv" for suite in ("mixers", "limits", "decode", "beam", "train"))}
# The entries of a workdir that only train.py / the importer write (eval.py's outputs go beside them).
WORKDIR_CORE = ("config.json", "spm.model", "pieces.json", "checkpoints", "best", "metrics.jsonl", "tensorboard",
                "train.lock", "compilation_cache", "checkpoint_errors.log", "final_evaluation_pending.json", MARKER)
EVAL_OUTPUTS = (".hyp.txt", ".scores.json", "output.txt")  # what eval.py writes into a workdir by default


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """The one writer of lconv's output files: a temporary file of a unique name beside ``path``, then a rename
    over it, so a failed write (a full disk, a crash) leaves the earlier file whole and no half file (on an object
    store the rename is a copy, still never a partial object). A local ``path`` that is a symbolic link is refused:
    an output never lands in whatever file a link planted in a workdir points at. Failures are one line."""
    if not is_url(path) and _names_a_folder(os.fspath(path)):  # a path would drop the slash and write a file
        raise UserError(f"{path}: names a folder; give the output a file name")
    target = epath.Path(path)
    refuse_link(path, "lconv writes no output through a link (remove it, or write elsewhere)")
    if _special(path):  # a device the user named (--output_file=/dev/null): written into, never renamed over
        _write_into_device(path, data)
        return
    replaces = not is_url(path) and os.path.isfile(path)
    if replaces:
        shared_folders.check_owner(os.fspath(path), "lconv replaces no other user's file with its output")
    temporary = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    payload = data if isinstance(data, bytes) else data.encode("utf-8")
    try:
        if is_url(path):
            temporary.write_bytes(payload)
        else:
            # made owner-only before a byte is written when it replaces a file: made with the umask's 0644 and
            # narrowed after, a private file's new contents could be opened by another user meanwhile
            kept_mode = stat.S_IMODE(os.stat(path).st_mode) & _KEPT_MODE if replaces else None
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o666 if kept_mode is None else 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            if kept_mode is not None:  # the file replaced keeps its permissions, never setuid or others' write
                os.chmod(temporary, kept_mode)
        temporary.replace(target)
    except OSError as err:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise UserError(f"cannot write {path}: {err.strerror or err}; an earlier file there is unchanged") from None


_KEPT_MODE = 0o755  # of the replaced file's mode: read and run bits, the owner's write; no setuid/setgid/sticky
IN_WORKDIR = "lconv writes only regular files in a workdir (remove the link)"


def write_figure(fig: Any, path: str | os.PathLike, **savefig_options: Any) -> None:
    """A matplotlib figure saved through ``write_atomically``, in the format its name ends in."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=os.path.splitext(os.fspath(path))[1].lstrip(".") or "png", **savefig_options)
    write_atomically(path, buffer.getvalue())


def _names_a_folder(path: str) -> bool:
    """``dir/``, ``dir/.`` or ``dir/..``: a folder whatever is there (``dir/new/.`` was written as a file ``new``)."""
    return path.endswith(os.sep) or os.path.basename(path) in (".", "..")


def refuse_link(path: str | os.PathLike, reason: str = IN_WORKDIR) -> None:
    """One line naming ``path`` if it is a local symbolic link (an object store has none): a file lconv writes never
    lands in whatever file a link planted there points at (a workdir handed over, shared, or tampered with)."""
    if not is_url(path) and os.path.islink(path):
        raise UserError(f"{path} is a symbolic link; {reason}")


def refuse_special(path: str | os.PathLike, reason: str = "lconv writes only regular files in a workdir") -> None:
    """One line naming ``path`` and what it is if it is a pipe, socket or device: a file lconv writes is a regular
    file (opening a planted pipe would wait for a reader for ever)."""
    kind = special_kind(path)
    if kind is not None:
        raise UserError(f"{path} is a {kind}, not a regular file; {reason} (remove it)")


def refuse_links_within(directory: str | os.PathLike, flag: str, *, max_depth: int = 64) -> None:
    """One line naming the first symbolic link, pipe, socket or device anywhere below a local ``directory`` that a
    command writes and reads whole (a study's folders): a link planted in a sub-folder had files written and read
    where it led. Links to folders are listed, never followed; folders nested past ``max_depth`` are refused."""
    root = os.path.expanduser(os.fspath(directory))
    if is_url(root) or not os.path.isdir(root):
        return
    for folder, subfolders, files in os.walk(root):
        if os.path.relpath(folder, root).count(os.sep) >= max_depth:
            raise UserError(f"{folder}: folders nested deeper than {max_depth} in {flag}={directory}")
        for name in sorted(subfolders + files):
            path = os.path.join(folder, name)
            refuse_link(path, f"{flag} holds real folders and files alone (remove it)")
            refuse_special(path, f"{flag} holds regular files alone")


def check_targets(directory: str | os.PathLike, names: Iterable[str], flag: str) -> None:
    """Refuses, before anything is written, any of the files a command will write into ``directory`` that is a
    symbolic link or a pipe, socket or device: a refusal found at the write left the files written before it."""
    for name in names:
        path = os.path.join(os.path.expanduser(os.fspath(directory)), name)
        refuse_link(path, f"lconv writes no output through a link ({flag}: remove it, or write elsewhere)")
        refuse_special(path, f"{flag} holds regular files alone")


SPECIAL_KINDS = {stat.S_ISFIFO: "named pipe (FIFO)", stat.S_ISSOCK: "socket", stat.S_ISBLK: "block device",
                 stat.S_ISCHR: "character device"}


def special_kind(path: str | os.PathLike, *, follow_links: bool = False) -> str | None:
    """What a local ``path`` is when it is none of a regular file, a folder or a link (``SPECIAL_KINDS``), else
    None."""
    if is_url(path):
        return None
    try:
        mode = (os.stat if follow_links else os.lstat)(path).st_mode
    except OSError:
        return None
    return next((name for test, name in SPECIAL_KINDS.items() if test(mode)), None)


def _special(path: str | os.PathLike) -> bool:
    return special_kind(path) is not None


def _write_into_device(path: str | os.PathLike, data: str | bytes) -> None:
    """Writes into a character device (``/dev/null``, a terminal: shown with control characters escaped); a pipe or
    any other special file is one line (a pipe with no reader would block forever)."""
    if not stat.S_ISCHR(os.lstat(path).st_mode):
        raise UserError(f"cannot write {path}: it is a pipe, socket or block device, not a file; name a file")
    try:
        with open(path, "wb") as device:
            if device.isatty():  # a run's text could hold escape sequences (set the title, clear the screen)
                text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
                data = console.printable(text)
            device.write(data if isinstance(data, bytes) else data.encode("utf-8"))
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}") from None


def open_regular(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` of a local regular file that is not a symbolic link (``O_NOFOLLOW``: no window
    between a check and the open; ``O_NONBLOCK``: a pipe planted in its place is refused, not waited on for
    ever); a link or a special file is one line. A file with other hard links (a run copied with ``cp -al``, or
    a link planted to a file outside) is first made this path's own copy, so what is written here lands nowhere
    else."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError:
        if os.path.islink(path):
            refuse_link(path)
        refuse_special(path)
        if os.path.isdir(path):  # a folder in a file's place was an IsADirectoryError traceback
            raise UserError(f"{path} is a folder; lconv writes a regular file there (move the folder away)") from None
        raise
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise UserError(f"{path} is not a regular file; lconv writes only regular files in a workdir (remove it)")
    if status.st_nlink > 1:
        os.close(fd)
        _unshare(path)
        return open_regular(path, flags, mode)
    os.set_blocking(fd, True)
    return fd


def _unshare(path: str | os.PathLike) -> None:
    """Replaces a hard-linked file by a copy of its own (a rename, so the other links keep their content), with the
    file's permissions from before its first byte: a private file's copy is never readable by others meanwhile."""
    copy = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.unshared"
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as source:
        if not stat.S_ISREG(os.fstat(source.fileno()).st_mode):  # swapped since it was opened to append
            raise UserError(f"{path} is not a regular file; lconv writes only regular files in a workdir (remove it)")
        mode = stat.S_IMODE(os.fstat(source.fileno()).st_mode) & _KEPT_MODE
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as destination:
                shutil.copyfileobj(source, destination)
            os.chmod(copy, mode)
            os.replace(copy, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(copy)
            raise


def open_append(path: str | os.PathLike) -> Any:
    """A local text file opened to append (created if need be), refusing a symbolic link (``open_regular``)."""
    return os.fdopen(open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def is_url(path: str | os.PathLike) -> bool:
    """True for ``scheme://...`` (read and written through an epath/fsspec backend), False for a local path. The
    one test of it in lconv (``lconv.data.paths`` and the CLIs use this one), kept in this bottom layer."""
    return "://" in (os.fspath(path) if isinstance(path, os.PathLike) else str(path))


def check_url(path: str | os.PathLike, flag: str, *, label: str | None = None) -> None:
    """A one-line UserError (led by ``label``) when ``path`` is a URL Python cannot reach here."""
    if not is_url(path):
        return
    shown = label or f"{flag}={os.fspath(path)!r}"
    try:
        epath.Path(path).exists()
    except ImportError as e:
        package = _FS_PACKAGES.get(_scheme(path), "its fsspec implementation")
        raise UserError(f"{shown} is on {_scheme(path)}://, which needs {package} here: pip install {package}") from e
    except (KeyError, NotImplementedError) as e:  # epath knows no such scheme
        raise UserError(f"{shown}: etils.epath has no {_scheme(path)}:// file system; use a local path or gs:// "
                        "(s3://, az://, hf://)") from e


def _scheme(path: str | os.PathLike) -> str:
    return os.fspath(path).split("://", 1)[0]


_FS_PACKAGES = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}


def _absolute(path: str) -> str:
    if is_url(path):
        return path
    try:
        return os.path.realpath(os.path.expanduser(path))
    except OSError:  # a link changing while it is resolved: the path as text (each check of it still runs)
        return os.path.abspath(os.path.expanduser(path))


def kind_of(directory: str) -> str | None:
    """The kind of output ``directory`` holds (its marker, else its signature file), or None."""
    root = epath.Path(directory)
    try:
        text = _small_text(root / MARKER, _MARKER_MAX_BYTES, owned=True)
        if text is not None:
            kind = json_text.loads(text).get("kind")
            if isinstance(kind, str) and kind in KIND_NAMES:  # a hand-written {"kind": {...}} is no kind
                return kind
        for kind, files in KIND_SIGNATURES.items():
            if any(_signature(root / name) for name in files):
                return kind
    except (OSError, ValueError, AttributeError):
        return None
    return None


def _signature(path: epath.Path) -> bool:
    """Whether a command's signature file is there, and (locally, where ``shared_folders`` is enforced) this
    user's or root's: another user's ``lconv_export.json`` in /tmp refused every output below /tmp."""
    if is_url(path):
        return path.exists()
    try:
        owner = os.lstat(path).st_uid
    except OSError:
        return False
    return shared_folders.trusted_owner(os.fspath(path), owner)


def checkout_docs(path: str) -> str | None:
    """The ``docs/`` folder of the lconv checkout that ``path`` lies in, or None."""
    if is_url(path):
        return None
    path = _absolute(path)
    parent = path
    while True:
        parent, child = os.path.dirname(parent), parent
        if parent == child:
            return None
        if _is_lconv_checkout(parent):
            docs = os.path.join(parent, "docs")
            return docs if path == docs or path.startswith(docs + os.sep) else None


def _is_lconv_checkout(directory: str) -> bool:
    text = _small_text(os.path.join(directory, "pyproject.toml"), _PYPROJECT_MAX_BYTES, owned=True)
    return text is not None and 'name = "lconv"' in text and os.path.isdir(os.path.join(directory, "lconv"))


_MARKER_MAX_BYTES = 1 << 16  # a marker is one line of JSON
_PYPROJECT_MAX_BYTES = 1 << 20


def _small_text(path: str | os.PathLike, limit: int, *, owned: bool = False) -> str | None:
    """The text of ``path`` when it is a regular file of at most ``limit`` bytes (and with ``owned``, this user's or
    root's, where ``shared_folders`` is enforced), else None: lconv looks at these files in folders it does not own
    (each folder above an output), where a pipe would be waited on for ever, a link to /dev/zero read without end, and
    another user's marker in /tmp would claim every output below it."""
    if is_url(path):
        target = epath.Path(path)
        return target.read_text() if target.exists() else None
    try:
        # no link followed (another user's, to a device whose open acts, or to one of this user's own markers)
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        if owned and not shared_folders.trusted_owner(os.fspath(path), info.st_uid):
            return None
        return f.read(limit + 1).decode("utf-8", errors="replace")


def _refuse_committed_docs(path: str, flag: str) -> None:
    docs = checkout_docs(path)
    if docs:
        raise UserError(f"{flag}={path} is inside the lconv checkout's committed {docs}: only the command's own "
                        f"default, run from the checkout's root, writes there; choose another folder")


def check_directory(path: str, kind: str, flag: str, *, committed_ok: str | None = None) -> bool:
    """Refuses ``path`` unless it may hold ``kind`` output: new, empty, or already of that kind. Writes nothing.
    ``committed_ok``: the one path inside a checkout's docs/ this command may write (its default from the
    checkout's root); returns True for it (it is not marked)."""
    if not path or not str(path).strip():
        raise UserError(f"{flag} is empty: name a folder for {KIND_NAMES[kind]}")
    path = str(path)
    check_url(path, flag)
    if committed_ok and _absolute(committed_ok) == _absolute(path) and checkout_docs(path):
        return True  # the command's own committed results, by its default from the checkout's root
    _refuse_committed_docs(path, flag)
    check_outside_outputs(path, flag)
    root = _path(path)
    try:
        if root.exists() and not root.is_dir():
            what = "a pipe, socket or device" if _special(os.path.expanduser(path)) else "a file"
            raise UserError(f"{flag}={path} is {what}; {KIND_NAMES[kind]} is a folder")
        entries = [entry.name for entry in root.iterdir()] if root.exists() else []
    except OSError as err:
        raise UserError(f"{flag}={path}: cannot read it ({err.strerror or err})") from None
    if entries:
        found = kind_of(path)
        if found is None and all(_made_by(kind, name) for name in entries):
            found = kind  # made before markers, or a run's pieces put there first (a shared tokenizer)
        if found is None:
            raise UserError(f"{flag}={path} is a folder with other files and no lconv output in it; "
                            f"{KIND_NAMES[kind]} goes into a new or empty folder")
        if found != kind:
            raise UserError(f"{flag}={path} holds {KIND_NAMES[found]}, not {KIND_NAMES[kind]}; choose another folder")
    return False


def check_outside_outputs(path: str, flag: str) -> None:
    """Refuses a folder lconv writes into (an output, prepared data, a compilation cache) that lies among a
    workdir's own entries (a checkpoint step: it would fail its manifest after) or inside an export."""
    owner = _nearest_owner(_absolute(str(path)))
    if owner is not None and (owner[0] == "export" or (owner[0] == "workdir" and owner[2] in WORKDIR_CORE)):
        raise UserError(f"{flag}={path} is inside {KIND_NAMES[owner[0]]} ({owner[1]}), among its own files; choose "
                        "a folder outside it")
    _refuse_prepared_data(_absolute(str(path)), path, flag)


def _refuse_prepared_data(target: str, path: str, flag: str) -> None:
    """Refuses an output among prepared data copies and kept tokenizers (``PREPARED_DIRNAME``): a file written
    there left the copy unreadable."""
    parts = target.replace("\\", "/").split("/")
    if PREPARED_DIRNAME in parts[:-1] or parts[-1] == PREPARED_DIRNAME:
        folder = "/".join(parts[:parts.index(PREPARED_DIRNAME) + 1])
        raise UserError(f"{flag}={path} is inside {folder}, lconv's prepared data copies and kept tokenizers; "
                        "write the output elsewhere")


def claim_directory(path: str, kind: str, flag: str, *, committed_ok: str | None = None) -> str:
    """``check_directory``, then creates ``path`` and marks it as ``kind``'s; returns it. Another user must not be
    able to change it while the command writes (``shared_folders``), and what the command makes stays so."""
    shared_folders.check(str(path), f"{flag}={path}", made_here=True)  # checked again once made, below
    if check_directory(path, kind, flag, committed_ok=committed_ok):
        return str(path)
    root = _path(str(path))
    try:
        root.mkdir(parents=True, exist_ok=True)
        shared_folders.check(str(path), f"{flag}={path}")  # made now: its own mode bits
        if not (root / MARKER).exists():
            write_atomically(root / MARKER, json.dumps({"kind": kind}) + "\n")
    except OSError as err:
        raise UserError(f"{flag}={path}: cannot create it ({err.strerror or err})") from None
    return str(path)


def _path(path: str) -> epath.Path:
    return epath.Path(path if is_url(path) else os.path.expanduser(path))


# What each command writes at the top of its folder (a folder holding only such entries is that command's).
_ENTRIES = {"export": ("lconv_export.json", "params.npz", "spm.model", "pieces.json"),
            "study": ("tokenizers", "runs", "records.json"),
            "bench": ("benchmarks.md",)}


def _made_by(kind: str, name: str) -> bool:
    if name.startswith("."):
        return True
    if kind == "workdir":
        return name in WORKDIR_CORE or name.endswith(EVAL_OUTPUTS)
    if kind == "bench":
        return name.endswith((".csv", ".png")) or name in _ENTRIES["bench"]
    return name in _ENTRIES[kind] or (kind == "export" and name.endswith(".jax"))


def check_output_file(path: str, flag: str, *, inputs: Iterable[tuple[str, str | None]] = (),
                      own_kind: str | None = None, committed_ok: str | None = None) -> None:
    """Refuses a file output that is one of ``inputs`` (``(flag, path)`` pairs), lies in an lconv checkout's
    committed docs/ (but for ``committed_ok``, the command's default), or is part of another command's output: a
    workdir's core entries (``WORKDIR_CORE``) or anything in an export, a study or benchmark folder (but for the
    writer's ``own_kind``)."""
    if not path or not str(path).strip():
        raise UserError(f"{flag} is empty: name a file")
    check_url(path, flag)
    if not is_url(path) and _names_a_folder(str(path)):
        raise UserError(f"{flag}={path} names a folder; give the output a file name")
    target = _absolute(str(path))
    for input_flag, input_path in inputs:
        if input_path and _absolute(str(input_path)) == target:
            raise UserError(f"{flag}={path} is the file {input_flag} reads; write the output elsewhere")
    if committed_ok and _absolute(committed_ok) == target and checkout_docs(target):
        return
    _refuse_committed_docs(str(path), flag)
    _refuse_prepared_data(target, str(path), flag)
    owner = _nearest_owner(target)
    if owner is not None:  # the nearest owner decides (a study's runs are workdirs inside its folder)
        kind, parent, first = owner
        if kind != own_kind and (kind != "workdir" or first in WORKDIR_CORE):
            raise UserError(f"{flag}={path} would overwrite part of {KIND_NAMES[kind]} ({parent}); write the "
                            f"output elsewhere")


def _nearest_owner(target: str) -> tuple[str, str, str] | None:
    """``(kind, folder, first entry below it on the way to target)`` of the nearest lconv output folder above
    ``target`` (an absolute path), or None."""
    parent = os.path.dirname(target) if not is_url(target) else target.rsplit("/", 1)[0]
    for _ in range(64):  # each folder above, up to the root
        kind = kind_of(parent)
        if kind is not None:
            return kind, parent, (target[len(parent):].lstrip("/" + os.sep).replace(os.sep, "/").split("/") or [""])[0]
        up = os.path.dirname(parent) if not is_url(parent) else parent.rsplit("/", 1)[0]
        if up == parent or not up or up.endswith(":/"):
            return None
        parent = up
    return None
