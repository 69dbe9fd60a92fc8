"""Files that are part of a command: a ``--config`` file (code lconv runs) and ``--flagfile`` files (flags lconv
takes as the command line's). Each must be what this user wrote: a regular file of theirs (or root's), reached by a
way no other user can change, checked on the one file that is then read. docs/security.md lists the cases."""
from __future__ import annotations

import os
import stat

from lconv import shared_folders
from lconv.errors import UserError


def read_checked(path: str, label: str, why: str, limit: int, *, code: bool = False) -> tuple[str, bytes]:
    """``(resolved path, bytes)`` of the command file ``path``, or one ``UserError`` line naming ``label``. Every
    folder a name is looked up in on the way, links followed, and every link there is this user's or root's, so
    the resolved path names this file for as long as the command runs; its folder takes no new name from another
    user (with ``code``, holds no ``__pycache__`` of theirs either: Python would load it). The file is read through the
    descriptor of the checked file, whole: a file whose size is not what it holds (``/proc``'s, owned by root but
    written by whoever runs the process) is refused."""
    not_regular = UserError(f"{label}: not a regular file ({why}; a pipe or device is refused)")
    try:
        if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):  # /dev/stdin: its resolved path is none
            raise not_regular
        shared_folders.raise_problem(shared_folders.problem(path, whole_tree=False), f"{label} ({why})")
        real = os.path.realpath(path)
        if code:
            shared_folders.check_code_folder(os.path.dirname(real), f"{label} ({why})")
        else:  # a name another user put there (a hard link to a file of root's) would be taken as yours
            shared_folders.check_closed_folder(os.path.dirname(real), f"{label} ({why})",
                                               "a file another user put there would be read as yours")
        try:
            checked = os.stat(real)
        except FileNotFoundError:
            raise UserError(f"{label}: no such file" + (f" ({path} leads to {real})" if real != os.path.abspath(path)
                                                        else "")) from None
        if not stat.S_ISREG(checked.st_mode):
            raise not_regular
        if not shared_folders.trusted_owner(real, checked.st_uid):
            raise UserError(f"{label}: {real} belongs to another user (uid {checked.st_uid}); {why} (or set "
                            f"{shared_folders.OPT_IN}=1 to accept that risk)")
        if checked.st_size > limit:
            raise UserError(f"{label}: {checked.st_size:,} bytes, more than the {limit:,} it may hold")
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            opened = os.fstat(fd)
            data = f.read(limit + 1)
    except OSError as err:  # a name gone or swapped while it was resolved, opened or read
        raise UserError(f"{label}: changed while it was checked ({err.strerror or err}); name it when nothing "
                        "changes it") from None
    if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino) or len(data) != checked.st_size:
        raise UserError(f"{label}: changed while it was checked, or holds other than its size says; {why}")
    return real, data
