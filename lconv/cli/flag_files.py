"""``--flagfile``: a file of command-line flags, read by lconv once, checked, and put in its place on the command line
before absl or ml_collections see it. They would read whatever is named, whole (``/dev/zero`` took the host's
memory), by name again after any check (another user's link flipped in between), and ml_collections does so while a
program defines its flags, before any error of lconv's can name it. A flag file's flags are the command line's own,
so it is held to a config file's rules for who may have written it (docs/security.md)."""
from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from lconv import shared_folders
from lconv.errors import UserError

LIMIT_BYTES = 1 << 20  # far past any command line's flags
LIMIT_FLAGS = 1 << 16  # in all, nested files expanded: a file named 3,000 times in one named 3,000 times is not one
_DIRECTIVES = ("--flagfile", "-flagfile")
_WHY = "a flag file's flags are your command line's"


def expand(argv: Sequence[str]) -> list[str]:
    """``argv`` (``argv[0]`` is the program) with each ``--flagfile=F`` (or ``-flagfile``, or ``--flagfile F``)
    replaced by F's flags as absl reads them (a line each; blank lines and ``#`` or ``//`` comments left out), the
    flag files they name in turn expanded in place, a file already being expanded skipped; the command line's
    ``--`` ends the flags. Each file is a regular file of this user's (or root's), at most ``LIMIT_BYTES`` of UTF-8
    text, reached by no other user's link; else one ``UserError`` line naming it."""
    texts: dict[str, str] = {}  # each file read once, however often it is named
    return [*argv[:1], *_expand(list(argv[1:]), (), texts)]


def _expand(args: list[str], reading: tuple[str, ...], texts: dict[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        if len(out) > LIMIT_FLAGS:
            where = f"--flagfile={reading[-1]}" if reading else "the command line"
            raise UserError(f"{where}: more than {LIMIT_FLAGS:,} flags with the flag files it names; name each "
                            "flag file once")
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        name, equals, value = arg.partition("=")
        if name not in _DIRECTIVES:
            out.append(arg)
            i += 1
            continue
        if not equals and i + 1 == len(args):
            raise UserError(f"{name}: name the flag file, {name}=FILE")
        path = os.path.expanduser((value if equals else args[i + 1]).strip())
        i += 1 if equals else 2
        real = os.path.realpath(path)
        if path and real not in reading:  # absl skips a file named again inside itself
            if real not in texts:
                texts[real] = _read(path)
            out += _expand(_lines(texts[real]), (*reading, real), texts)
    return out


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.startswith(("#", "//"))]


def _read(path: str) -> str:
    """The text of one flag file, read through the one descriptor its checks were made on."""
    label = f"--flagfile={path}"
    shared_folders.check_way(os.path.dirname(os.path.abspath(path)), f"{label} ({_WHY})")
    if os.path.islink(path):  # the name itself: a link another user could point elsewhere
        shared_folders.check_owner(path, _WHY)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a pipe: no wait for a writer
    except FileNotFoundError:
        raise UserError(f"{label}: no such file") from None
    except OSError as err:
        raise UserError(f"{label}: cannot read it ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{label}: not a regular file (a pipe or device is refused)")
        if not shared_folders.trusted_owner(path, info.st_uid):
            raise UserError(f"{label}: belongs to another user (uid {info.st_uid}); {_WHY} (set "
                            f"{shared_folders.OPT_IN}=1 to accept that risk)")
        if info.st_size > LIMIT_BYTES:
            raise UserError(f"{label}: {info.st_size:,} bytes, more than the {LIMIT_BYTES:,} a flag file may hold")
        data = f.read(LIMIT_BYTES + 1)
    if len(data) > LIMIT_BYTES:
        raise UserError(f"{label}: grew past {LIMIT_BYTES:,} bytes while it was read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{label}: byte offset {err.start} is not UTF-8 text; a flag file holds flags, one a "
                        "line") from None
