"""Guards around building a prepared copy (``tfds_ddtp.prepare``): a full disk as one line, no progress bars, and the
temporary copy removed on SIGTERM, so a failed or stopped preparation leaves nothing half made."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator

import tensorflow_datasets as tfds

from lconv import no_room
from lconv.errors import UserError


@contextlib.contextmanager
def no_room_is_one_line(name: str, copy_dir: str) -> Iterator[None]:
    """A full disk, a quota or ``ulimit -f`` while a copy is built: one line naming the copy, not tfds's traceback
    (the partial copy is removed as the block exits)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - tfds and array_record raise RuntimeErrors that quote the OS error
        why = no_room.reason(err)
        if why is None:
            raise
        raise UserError(f"{why} while preparing {name} in {copy_dir} (nothing of it was kept); free space or "
                        "raise the limit, then run again") from None


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """tfds's progress bars off while a copy is built (lines before and after say so; bars would bury an error)."""
    shown = getattr(tfds.core.utils.tqdm_utils, "_active", True)
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        tfds.display_progress_bar(shown)


@contextlib.contextmanager
def removed_on_sigterm(temp_dir: str) -> Iterator[None]:
    """SIGTERM removes the temporary copy, then ends the process as SIGTERM does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        shutil.rmtree(temp_dir, ignore_errors=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
