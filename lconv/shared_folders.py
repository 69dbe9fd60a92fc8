"""Working folders no other user can change while lconv works in them.

lconv checks a run's files, then reads and writes them by path: orbax, tfds and the study's writers all open by
path. Another user who can write into such a folder could swap a checked folder for a link between the check and
the use (a workdir's ``checkpoints/``, a study's folders). Rather than guard every open, lconv refuses to work in
a folder another user can change, as ``ssh`` refuses a key in a folder others can write; the one-line refusal
names the folder and the fix. ``LCONV_ALLOW_SHARED_FOLDERS=1`` accepts the risk. Details: docs/security.md.
"""
from __future__ import annotations

import os
import stat

from lconv.errors import UserError

OPT_IN = "LCONV_ALLOW_SHARED_FOLDERS"
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def enforced(folder: str) -> bool:
    """Whether ``folder`` is checked: a local path on a system with owners and mode bits, and no opt-in set."""
    return "://" not in str(folder) and hasattr(os, "getuid") and os.environ.get(OPT_IN, "") != "1"


def check(folder: str, label: str) -> None:
    """A one-line ``UserError`` (``label``: the flag or call that named it) when another user could change
    ``folder`` while lconv works in it: a folder on the way to it that others can write (sticky ones such as /tmp
    excepted) or that another user owns, or anything inside it that another user owns or can write."""
    if not enforced(folder):
        return
    problem, fix = _problem(os.path.abspath(os.path.expanduser(str(folder))))
    if problem:
        raise UserError(f"{label}: {problem}, so another user could swap what lconv checked there while it works; "
                        f"{fix}, or set {OPT_IN}=1 to accept that risk (docs/security.md)")


def keep_private() -> None:
    """Adds group and others' write to the process's umask, so the folders lconv and orbax make while writing a
    checked folder pass ``check`` when the run is read again (a umask of 002 would make them group-writable)."""
    old = os.umask(0o022)
    os.umask(old | 0o022)


def _problem(folder: str) -> tuple[str | None, str]:
    """What another user could change on the way to ``folder`` or inside it, and how to fix it."""
    for chain in dict.fromkeys((folder, os.path.realpath(folder))):  # a linked folder: both ways to it
        for above in _ancestors(chain):
            problem = _unsafe_on_the_way(above)
            if problem:
                return f"{above} {problem}", "work in a folder only you can write"
    for path in _tree(folder):
        problem = _unsafe_inside(path)
        if problem:
            return f"{path} {problem}", (f"chmod -R go-w {folder}" if "written" in problem else
                                         f"chown -R {os.getuid()} {folder}")
    return None, ""


def _ancestors(folder: str) -> list[str]:
    """The folders in which ``folder``'s path is looked up, from the root down to its parent."""
    out, path = [], os.path.dirname(folder)
    while True:
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return out[::-1]
        path = parent


def _tree(folder: str):
    """``folder`` and every entry below it, links named but never followed."""
    yield folder
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in (*dirs, *files):
            yield os.path.join(top, name)


def _trusted(uid: int) -> bool:
    return uid in (os.getuid(), 0)


def _unsafe_on_the_way(path: str) -> str | None:
    try:
        status = os.stat(path)
    except OSError:
        return None  # not there or not ours to look into: the command's own checks name it
    if not _trusted(status.st_uid):
        return f"belongs to another user (uid {status.st_uid})"
    if status.st_mode & _OTHERS_WRITE and not status.st_mode & stat.S_ISVTX:
        return f"can be written by other users (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def _unsafe_inside(path: str) -> str | None:
    try:
        status = os.lstat(path)
    except OSError:
        return None  # removed while walked: nothing left to swap
    if not _trusted(status.st_uid):
        return f"belongs to another user (uid {status.st_uid})"
    if not stat.S_ISLNK(status.st_mode) and status.st_mode & _OTHERS_WRITE:  # a link's own mode means nothing
        return f"can be written by other users (mode {stat.S_IMODE(status.st_mode):o})"
    return None
