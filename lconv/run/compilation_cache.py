"""This user's folder for JAX's persistent compilation cache: what train.py, eval.py, ``lconv.load`` and the benchmarks
use; a failure to write an entry is one warning line. Never a workdir's folder: a cache entry is native code that JAX
runs, and a workdir from elsewhere is data."""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from lconv import shared_folders
from lconv.data import paths

logger = logging.getLogger(__name__)

FOLDER_NAME = "compilation_cache"  # this user's cache folder's name (and older runs' in their workdir)


def user_folder() -> str:
    """The default cache folder: ``$XDG_CACHE_HOME/lconv/compilation_cache``, else under ``~/.cache``."""
    return paths.user_cache_folder(FOLDER_NAME)


def check_chosen() -> bool:
    """The cache folder this process was given (``$JAX_COMPILATION_CACHE_DIR``), unless another user could fill it:
    then one warning and the cache off, since an entry is code. Whether a folder is in use."""
    import jax

    chosen = jax.config.jax_compilation_cache_dir
    if not (chosen and jax.config.jax_enable_compilation_cache):
        return False
    if chosen != paths.expand(chosen):  # JAX would take "~" as a folder of that name: checked and used expanded
        chosen = paths.expand(chosen)
        jax.config.update("jax_compilation_cache_dir", chosen)
    problem = shared(chosen)
    if problem:
        logger.warning(f"compiled programs are not kept: {chosen} {problem}")
        turn_off()
        return False
    return True


def turn_off() -> None:
    """No compiled program kept or read from here on, even where the process compiled before: JAX decides at its
    first compile whether the cache is used and keeps that answer until it is reset."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()


def use_user_folder() -> str | None:
    """For the API: this user's folder as JAX's cache unless the process chose otherwise; the folder, or None."""
    import jax

    if not jax.config.jax_enable_compilation_cache:
        return None
    chosen = jax.config.jax_compilation_cache_dir  # $JAX_COMPILATION_CACHE_DIR, or set by this process
    if chosen:
        return chosen if check_chosen() else None
    folder = user_folder()
    problem = unusable(folder) or make_private(folder) or shared(folder)
    if problem:
        logger.info(f"compiled programs are not kept: {folder} {problem}")
        return None
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()  # a program compiled before without a folder marked the cache unused: look again
    return folder


def unusable(folder: str) -> str | None:
    """Why a local cache ``folder`` cannot hold JAX's entries (JAX would warn at every compile), or None."""
    if paths.is_url(folder):
        return None
    existing = folder
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep)) or "."
    if not os.path.isdir(existing):
        return f"is not a folder ({existing} is a file)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be written ({existing}: permission denied)"
    return None


def make_private(folder: str) -> str | None:
    """Creates this user's cache ``folder``, owner-writable only; why it cannot be trusted, or None (the rule every
    folder of this user's cache follows: ``paths.private_cache_problem``)."""
    return paths.private_cache_problem(folder)


def shared(folder: str) -> str | None:
    """Why another user could change the cache ``folder`` (``lconv.shared_folders``; an entry is code), or None.
    The folder is made first (owner-only), so nobody can make it between this check and JAX's first entry."""
    found = shared_folders.make_checked(folder)
    return f"is not yours alone: {found[0]} (another user could plant compiled code there)" if found else None


_CACHE_ERRORS = ("Error writing persistent compilation cache entry", "Error reading persistent compilation cache entry")
_reported: list[str] = []  # the cache folder whose failure was said (once per process)
_watching: list[str] = []  # the folder ``report_cache_errors`` watches, once installed


def report_cache_errors(folder: str) -> None:
    """JAX's warnings for cache entries it fails to write or read become one lconv line per process."""
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
            logger.warning(
                f"compiled programs cannot be kept in the compilation cache {_watching[0]} ({reason}); the run goes "
                "on, compiling them afresh (free space there, or pass --compilation_cache=none)")

    show.lconv_cache_errors = True
    warnings.showwarning = show
