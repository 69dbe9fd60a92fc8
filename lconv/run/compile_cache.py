"""JAX's persistent compilation cache as lconv keeps it: this user's own folder, never a workdir's or a folder
other users can write (an entry is native code that JAX runs), used by the CLIs (``lconv.cli.runtime``) and the
benchmarks alike."""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any

COMPILATION_CACHE = "compilation_cache"  # the cache folder's name: this user's, and older runs' in their workdir


def user_compilation_cache() -> str:
    """The default cache folder: this user's (``$XDG_CACHE_HOME/lconv/compilation_cache``, else under
    ``~/.cache``), shared by every run on this machine. Never a workdir's: an entry is native code that JAX runs,
    and a workdir from elsewhere is data."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative path is ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lconv", COMPILATION_CACHE)


def make_private(folder: str) -> str | None:
    """Creates this user's cache ``folder``, writable by its owner only; says why it cannot be trusted to hold code
    (another user could plant an entry), or None."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        status = os.stat(folder)
    except OSError as error:
        return f"cannot be made ({error.strerror})"
    if not hasattr(os, "getuid"):
        return None  # no POSIX owner and mode bits to check
    if status.st_uid != os.getuid():
        return "belongs to another user"
    if status.st_mode & 0o022:
        return f"can be written by other users (chmod go-w {folder})"
    return None


_CACHE_ERRORS = ("Error writing persistent compilation cache entry", "Error reading persistent compilation cache entry")
_reported: list[str] = []  # the cache folder whose failure was said (once per process)
_watching: list[str] = []  # the folder ``report_cache_errors`` watches, once installed


def report_cache_errors(folder: str) -> None:
    """JAX's warning at each cache entry it fails to write or read (a full disk: one per compiled program) becomes
    one lconv warning line per process naming ``folder``; every other warning is shown as before."""
    _watching[:] = [folder]
    if getattr(warnings.showwarning, "lconv_cache_errors", False):
        return
    previous = warnings.showwarning

    def show(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = str(message)
        if not text.startswith(_CACHE_ERRORS):
            previous(message, category, filename, lineno, file, line)
            return
        if not _reported:
            _reported.append(_watching[0])
            reason = text.split("': ", 1)[-1].splitlines()[0][:200]
            logging.getLogger(__name__).warning(
                f"compiled programs cannot be kept in the compilation cache {_watching[0]} ({reason}); the run goes "
                "on, compiling them afresh (free space there, or pass --compilation_cache=none)")

    show.lconv_cache_errors = True
    warnings.showwarning = show
