"""``--flagfile``: a file of command-line flags, read by lconv once, checked, and put in its place on the command line
before absl or ml_collections see it. They would read whatever is named, whole (``/dev/zero`` took the host's
memory), by name again after any check (another user's link flipped in between), and ml_collections does so while a
program defines its flags, before any error of lconv's can name it. A flag file's flags are the command line's own,
so it is held to a config file's rules for who may have written it (docs/security.md)."""
from __future__ import annotations

import os
from collections.abc import Sequence

from lconv import command_files
from lconv.errors import UserError

LIMIT_BYTES = 1 << 20  # far past any command line's flags
LIMIT_FLAGS = 1 << 16  # flags and flag files named, in all: files named many times in files named many times multiply
LIMIT_DEPTH = 64  # flag files inside flag files
LIMIT_EXPANDED_BYTES = 1 << 24  # the text of every file expanded, a file named twice counted twice
_DIRECTIVES = ("--flagfile", "-flagfile")
_WHY = "a flag file's flags are your command line's"


def expand(argv: Sequence[str]) -> list[str]:
    """``argv`` (``argv[0]`` is the program) with each ``--flagfile=F`` (or ``-flagfile``, or ``--flagfile F``)
    replaced by F's flags as absl reads them (a line each; blank lines and ``#`` or ``//`` comments left out), the
    flag files they name in turn expanded in place, a file already being expanded skipped; the command line's
    ``--`` ends the flags. Each file is a regular file of this user's (or root's), at most ``LIMIT_BYTES`` of UTF-8
    text, reached by no other user's link; else one ``UserError`` line naming it."""
    texts: dict[str, str] = {}  # each file read once, however often it is named
    return [*argv[:1], *_expand(list(argv[1:]), (), texts, [0, 0])]


def _expand(args: list[str], reading: tuple[str, ...], texts: dict[str, str], taken: list[int]) -> list[str]:
    """``args`` expanded; ``reading``: the files being expanded, outermost first; ``taken``: the arguments taken so
    far, flags and flag files, and the bytes of the files expanded, in all (shared by every level)."""
    where = f"--flagfile={reading[-1]}" if reading else "the command line"
    if len(reading) > LIMIT_DEPTH:
        raise UserError(f"{where}: flag files nested more than {LIMIT_DEPTH} deep")
    out, i = [], 0
    while i < len(args):
        taken[0] += 1
        if taken[0] > LIMIT_FLAGS:
            raise UserError(f"{where}: more than {LIMIT_FLAGS:,} flags and flag files in all; name each flag file "
                            "once")
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
        real = path and _resolved(path)
        if path and real not in reading:  # absl skips a file named again inside itself
            if real not in texts:
                texts[real] = _read(path)
            taken[1] += len(texts[real])
            if taken[1] > LIMIT_EXPANDED_BYTES:
                raise UserError(f"--flagfile={path}: the flag files named take more than {LIMIT_EXPANDED_BYTES:,} "
                                "bytes in all; name each flag file once")
            out += _expand(_lines(texts[real]), (*reading, real), texts, taken)
    return out


def _resolved(path: str) -> str:
    try:
        return os.path.realpath(path)
    except OSError as err:  # a link gone while it was followed
        raise UserError(f"--flagfile={path}: changed while it was read ({err.strerror or err})") from None


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.startswith(("#", "//"))]


def _read(path: str) -> str:
    """The text of one flag file, read once it passes ``command_files.read_checked``."""
    label = f"--flagfile={path}"
    _, data = command_files.read_checked(path, label, _WHY, LIMIT_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{label}: byte offset {err.start} is not UTF-8 text; a flag file holds flags, one a "
                        "line") from None
