"""Paths of data_dir, raw_dir and workdir: local folders or any ``etils.epath`` URL (``gs://bucket/tfds``, ...), with a
safe alternative for URLs to what object stores lack (renames, links). Details: docs/data.md."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import stat
import uuid
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from etils import epath

from lconv import outputs, shared_folders
from lconv.errors import UserError

CACHE_ENV = "LCONV_DATA_CACHE"  # where copies prepared under a URL data_dir are mirrored for reading


is_url = outputs.is_url  # ``scheme://...``, not a local path: one definition, in the bottom layer
check_url = outputs.check_url


def scheme(path: str | os.PathLike) -> str | None:
    return os.fspath(path).split("://", 1)[0] if is_url(path) else None


def normalize(path: str | os.PathLike) -> str:
    """A local path made absolute (``~`` expanded); a URL with no trailing slash (``os.path`` would mangle it)."""
    path = os.fspath(path)
    return path.rstrip("/") if is_url(path) else os.path.abspath(os.path.expanduser(path))


def expand(path: str | os.PathLike) -> str:
    """``~`` expanded in a local path; a URL as it is."""
    path = os.fspath(path)
    return path if is_url(path) else os.path.expanduser(path)


def join(base: str | os.PathLike, *parts: str) -> str:
    """``os.path.join`` for local paths (unchanged behaviour), ``/``-joined for URLs."""
    base = os.fspath(base)
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def basename(path: str | os.PathLike) -> str:
    return posixpath.basename(os.fspath(path).rstrip("/"))


def user_cache_folder(name: str) -> str:
    """``$XDG_CACHE_HOME/lconv/<name>``, else under ``~/.cache``: this user's own, never the shared temporary folder,
    where anyone may plant a link or a file that lconv would then write through or read."""
    return os.path.join(_cache_base()[0], "lconv", name)


def _cache_base() -> tuple[str, str]:
    """The folder holding lconv's cache folders, and how to name it in a message (the variable that set it)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(base):  # the XDG spec: a relative path is ignored
        return base, f"$XDG_CACHE_HOME={base}"
    base = os.path.join(os.path.expanduser("~"), ".cache")
    return base, base


def private_cache_problem(folder: str) -> str | None:
    """Makes ``folder`` (a ``user_cache_folder`` or a folder below one) this user's alone; why it is not, or None.
    Every folder from ``lconv/`` down must be a real folder this user owns and no other user can write: else another
    user could plant a link or a file there for lconv to write through, read, or run (a compiled program)."""
    base, named = _cache_base()
    root = os.path.join(base, "lconv")
    below = os.path.relpath(folder, root)
    if below == os.pardir or below.startswith(os.pardir + os.sep):
        raise ValueError(f"{folder} is not under {root}")
    if os.path.lexists(base) and not os.path.isdir(base):
        return f"is inside {named}, which is not a folder"
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
    except OSError as err:
        return f"is inside {named}, which cannot be made ({err.strerror})"
    path = root
    for part in [] if below == os.curdir else below.split(os.sep):
        problem = _not_private(path)
        if problem:
            return f"is inside {path}, which {problem}"
        path = os.path.join(path, part)
    return _not_private(path)


def _not_private(folder: str) -> str | None:
    """Makes ``folder`` (owner-only) if missing; why it is not this user's alone (a link, a file, another user's
    or writable by other users), or None. ``lstat``: a link is named, never followed."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as err:
        return f"cannot be made ({err.strerror})"
    status = os.lstat(folder)
    if stat.S_ISLNK(status.st_mode):
        return f"is a link (to {os.path.realpath(folder)})"
    if not stat.S_ISDIR(status.st_mode):
        return "is not a folder"
    if not hasattr(os, "getuid"):
        return None  # no POSIX owner and mode bits to check
    if status.st_uid != os.getuid():
        return "belongs to another user"
    if status.st_mode & 0o022:
        return f"can be written by other users (chmod go-w {folder})"
    return None


def size(path: str) -> int:
    """A local file's or a URL's size in bytes."""
    return epath.Path(path).stat().length if is_url(path) else os.path.getsize(path)


def sha256(path: epath.Path | str, *, within: epath.Path | str | None = None) -> str:
    """The file's SHA-256 in hex, read in blocks (a local file or a URL) as ``open_checked`` opens it."""
    digest = hashlib.sha256()
    with open_checked(path, within=within, limit=None) as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def local_cache_dir() -> str:
    """The local mirror of copies under a URL data_dir: ``$LCONV_DATA_CACHE``, else ``user_cache_folder``'s. What is
    staged there is read back by path and uploaded as the stored copy, so it is made owner-only and must be this
    user's alone (``private_folder``)."""
    chosen = os.environ.get(CACHE_ENV)
    where = f"${CACHE_ENV}" if chosen else f"this user's cache; ${CACHE_ENV} names another"
    return private_folder(chosen or user_cache_folder("data_cache"), f"the local mirror of a URL data_dir ({where})")


def private_folder(folder: str, label: str) -> str:
    """``folder``, made owner-only if new; a one-line ``UserError`` (led by ``label``) when another user could change
    it (``shared_folders.make_checked``)."""
    shared_folders.raise_problem(shared_folders.make_checked(folder), label)
    return folder


def upload_tree(local_dir: str, remote_dir: str, commit_last: Iterable[str]) -> None:
    """Copies every file under ``local_dir`` to ``remote_dir``, the ``commit_last`` files last."""
    commit_last = set(commit_last)
    files = []
    for root, _, names in os.walk(local_dir):
        files += [os.path.relpath(os.path.join(root, name), local_dir) for name in names]
    files.sort(key=lambda rel: (os.path.basename(rel) in commit_last, rel))
    for rel in files:
        target = epath.Path(remote_dir).joinpath(*rel.split(os.sep))
        target.parent.mkdir(parents=True, exist_ok=True)  # a no-op on object stores
        target.write_bytes(_read_local(os.path.join(local_dir, rel)))


def download_tree(remote_dir: str, local_dir: str) -> None:
    """Copies every file under ``remote_dir`` (any epath URL) into ``local_dir`` (which must not exist yet)."""
    def copy(source: epath.Path, target: str) -> None:
        os.makedirs(target, exist_ok=True)
        for child in source.iterdir():  # listdir + join: fsspec's walk would drop the URL scheme
            if child.is_dir():
                copy(child, os.path.join(target, child.name))
            else:
                with open(os.path.join(target, child.name), "wb") as f:
                    f.write(child.read_bytes())

    copy(epath.Path(remote_dir), local_dir)


def unique_temp(path: str) -> str:
    """``<path>.tmp-<uuid>``: a name of this process's own next to ``path`` (processes never share one)."""
    return f"{path}.tmp-{uuid.uuid4().hex}"


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


MAX_FOLDER_DEPTH = 64  # folders lconv writes (a prepared copy, a checkpoint) nest a few deep; Python 3.11's
# os.walk recurses, so a planted deep tree was a RecursionError traceback
READ_LIMIT = 16 << 30  # bytes: no file lconv reads whole (a tokenizer, params, a program) comes near it
# (limit, usage) files of a container's memory cgroup, v2 then v1: /proc/meminfo tells the host's memory, not its own
_CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's ``MemAvailable``, within its container's memory limit;
    None where neither is known (not Linux)."""
    found = []
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo", encoding="ascii") as f:
            found.append(1024 * int(next(line.split()[1] for line in f if line.startswith("MemAvailable:"))))
    for limit_file, usage_file in _CGROUP_MEMORY:
        with contextlib.suppress(OSError, ValueError):
            with open(limit_file, encoding="ascii") as limit, open(usage_file, encoding="ascii") as usage:
                found.append(int(limit.read()) - int(usage.read()))  # "max" (no limit) is a ValueError: skipped
            break
    return max(0, min(found)) if found else None


def memory_read_limit(copies: int) -> int:
    """The most bytes lconv reads whole where the data is held ``copies`` times over while it is parsed: a share of
    the memory available now, never over ``READ_LIMIT``."""
    available = available_memory()
    return READ_LIMIT if available is None else min(READ_LIMIT, available // copies)


def check_file(path: epath.Path | str, *, within: epath.Path | str | None = None,
               limit: int | None = READ_LIMIT) -> None:
    """A local ``path`` lconv reads whole: a regular file of at most ``limit`` bytes (None: any size), inside
    ``within``."""
    if is_url(path) or not os.path.lexists(path):
        return
    try:
        real = os.path.realpath(path)
        _check_inside(path, real, within)
        if not os.path.isfile(real):
            raise UserError(f"{path}: not a regular file ({real}); lconv reads only plain files here")
        size = os.path.getsize(real)
    except OSError as err:  # a link swapped for a file (or gone) while its path was resolved
        raise UserError(f"{path}: changed while it was checked ({err.strerror or err}); read it when nothing "
                        "writes it") from None
    if limit is not None and size > limit:
        raise UserError(f"{path}: {size:,} bytes, more than the {limit:,} lconv reads here")


def _check_inside(path: epath.Path | str, real: str, within: epath.Path | str | None) -> None:
    """``path``, which really is ``real``, lies inside a local ``within`` (None: anywhere)."""
    if within is not None and not is_url(within):
        root = os.path.realpath(within)
        if os.path.commonpath([root, real]) != root:
            raise UserError(f"{path}: leads out of {within} (to {real}); a file it names must be inside it")


def read_bytes(path: epath.Path, missing: str, *, within: epath.Path | str | None = None,
               limit: int = READ_LIMIT) -> bytes:
    """The bytes of ``path``; a missing, unreadable or refused file is one ``UserError`` line naming it."""
    try:
        with open_checked(path, within=within, limit=limit) as f:
            if is_url(path):
                return f.read()
            size = os.fstat(f.fileno()).st_size  # at most limit (checked); a buffer of limit bytes would be taken
            data = f.read(size + 1)
    except FileNotFoundError:
        raise UserError(f"{path}: {missing}") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read it ({err.strerror or err})") from None
    if len(data) > size:
        raise UserError(f"{path}: grew while it was read; read it again when nothing writes it")
    return data


@contextlib.contextmanager
def open_checked(path: epath.Path | str, *, within: epath.Path | str | None = None,
                 limit: int | None = READ_LIMIT) -> Iterator[BinaryIO]:
    """``path`` open for reading under ``check_file``'s rules (``limit=None``: any size), checked again on the file
    that was opened: a name swapped for a link out or a pipe between a check and an open by name was read."""
    check_file(path, within=within, limit=limit)
    if is_url(path):
        with epath.Path(path).open("rb") as f:
            yield f
        return
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a pipe swapped in: no wait
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: not a regular file; lconv reads only plain files here")
        if limit is not None and info.st_size > limit:
            raise UserError(f"{path}: {info.st_size:,} bytes, more than the {limit:,} lconv reads here")
        opened = _opened_path(fd)
        if opened is not None:
            _check_inside(path, opened, within)
        yield f


def is_within(path: str, folder: str) -> bool:
    """Whether local ``path`` is ``folder`` or below it, by their absolute names (no link resolved)."""
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def open_folder_below(root: str, folder: str) -> int:
    """``folder`` open as a directory descriptor the caller closes, reached from ``root`` one folder at a time
    without following a link: a folder swapped for a link after a check by path is refused, never entered."""
    relative = os.path.relpath(folder, root)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        raise UserError(f"{folder}: outside {root}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [] if relative == os.curdir else relative.split(os.sep):
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = inner
    except OSError as err:
        os.close(fd)
        raise UserError(f"{folder}: cannot be entered from {root} without following a link ({err.strerror}); "
                        "lconv reads plain folders here") from None
    return fd


def open_in_folder(folder_fd: int, name: str, shown: str) -> int:
    """The regular file ``name`` directly in the open folder, as a descriptor the caller closes (no link followed,
    no wait on a pipe); ``shown``: its path, for the one line a refusal gives."""
    if not name or os.sep in name or name in (os.curdir, os.pardir):
        raise UserError(f"{shown}: not a file directly in its folder")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
    except OSError as err:
        if err.errno in (errno.EMFILE, errno.ENFILE):  # the process's limit, not the file: the caller says which
            raise
        raise UserError(f"{shown}: cannot be opened as a plain file ({err.strerror}); lconv reads only plain files "
                        "here") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{shown}: not a regular file; lconv reads only plain files here")
    return fd


def _opened_path(fd: int) -> str | None:
    """Where the file open as ``fd`` is (Linux's ``/proc``); None where the system does not say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def npz_directory(data: bytes) -> tuple[int, int]:
    """``(arrays, bytes they decompress to)`` of an ``.npz``, as its zip directory declares them, once each member's
    header is found to claim no more values than the member holds; ``ValueError`` or ``zipfile.BadZipFile``
    otherwise. Only the headers are decompressed, so a caller can refuse a zip bomb before loading it."""
    import io
    import zipfile

    import numpy as np

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
        for member in members:
            if member.flag_bits & 0x1:  # zipfile's own message starts with the member's whole repr
                raise ValueError(f"{member.filename}: encrypted; an .npz lconv reads holds plain arrays")
            try:
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, _, dtype = read_header(f)
            except (RuntimeError, NotImplementedError) as err:  # zipfile's words for an unknown method
                raise ValueError(f"{member.filename}: {err}") from None
            if int(np.prod(shape)) * dtype.itemsize > member.file_size:
                raise ValueError(f"{member.filename}: its header claims {shape} {dtype}, more than the member holds")
    return len(members), sum(m.file_size for m in members)
