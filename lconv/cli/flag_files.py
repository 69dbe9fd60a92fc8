"""``--flagfile``: a file of command-line flags, checked before absl or ml_collections reads it. They read whatever
is named, whole (``/dev/zero`` took the host's memory), and ml_collections does so while a program defines its
flags, before any error of lconv's can name it. A flag file's flags are the command line's own, so it is held to a
config file's rules for who may have written it (docs/security.md)."""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from lconv import shared_folders
from lconv.data import paths
from lconv.errors import UserError

LIMIT_BYTES = 1 << 20  # far past any command line's flags
_DIRECTIVES = ("--flagfile", "-flagfile")


def check(argv: Sequence[str]) -> None:
    """Every flag file ``argv`` names (``argv[0]`` is the program), and every one they name in turn: a regular file
    of this user's (or root's), at most ``LIMIT_BYTES`` of UTF-8 text, reached by no other user's link; else one
    ``UserError`` line naming it."""
    pending, seen = list(_named(argv[1:], on_command_line=True)), set()
    while pending:
        path = pending.pop()
        real = os.path.realpath(path)
        if real in seen:  # absl skips a file named again inside itself
            continue
        seen.add(real)
        pending += _named(_read(path).splitlines(), on_command_line=False)


def _named(args: Iterable[str], *, on_command_line: bool) -> list[str]:
    """The flag files ``args`` name, as absl finds them: ``--flagfile=F`` (or one dash), and on the command line
    also ``--flagfile F``; the command line's ``--`` ends the flags."""
    named, args = [], list(args)
    for i, arg in enumerate(args):
        arg = arg.strip() if not on_command_line else arg
        if on_command_line and arg == "--":
            break
        name, equals, value = arg.partition("=")
        if name not in _DIRECTIVES:
            continue
        if equals:
            named.append(value.strip())
        elif on_command_line and i + 1 < len(args):
            named.append(args[i + 1])
    return [os.path.expanduser(path) for path in named if path]


def _read(path: str) -> str:
    """The text of one flag file, once it passes ``check``'s rules."""
    label = f"--flagfile={path}"
    why = "a flag file's flags are your command line's"
    shared_folders.check_way(os.path.dirname(os.path.abspath(path)), f"{label} ({why})")
    if not os.path.lexists(path):  # missing now, another user could add it before absl reads it: never left to it
        raise UserError(f"{label}: no such file")
    real = os.path.realpath(path)
    if os.path.exists(real) and not os.path.isfile(real):
        raise UserError(f"{label}: not a regular file ({real}; a pipe or device is refused)")
    shared_folders.check_owner(real, why)
    try:
        data = paths.read_bytes(path, "no such file", limit=LIMIT_BYTES)
    except UserError as err:  # its message starts with the path
        raise UserError(f"--flagfile={err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{label}: byte offset {err.start} is not UTF-8 text; a flag file holds flags, one a "
                        "line") from None
