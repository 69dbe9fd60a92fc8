"""Whether a failed write found no room: a full disk, a quota or the file size limit. Checkpoints and data preparation
each turn such a failure, however deep in orbax, tensorstore or tfds it surfaced, into one line."""
from __future__ import annotations

import errno

# errno -> what the user reads. A file size limit (``ulimit -f``: Python ignores SIGXFSZ, so writes fail with EFBIG)
# and a quota stop writes as a full disk does, and the libraries' threads fail as loudly for each.
REASONS = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "the file size limit (ulimit -f) was reached",
           errno.EDQUOT: "the disk quota is exceeded"}
_TEXTS = {"No space left on device": errno.ENOSPC, "File too large": errno.EFBIG, "Disk quota exceeded": errno.EDQUOT}


def no_room_errno(err: BaseException) -> int | None:
    """ENOSPC, EFBIG or EDQUOT when ``err`` itself says so (Python's OSError, or a library's text of it)."""
    if isinstance(err, OSError) and err.errno in REASONS:
        return err.errno
    text = str(err)
    for code in REASONS:  # tensorstore's errors are ValueErrors that quote the OS error
        if f"os_error_code='{code}'" in text:
            return code
    return next((code for phrase, code in _TEXTS.items() if phrase in text), None)


def no_room_cause(err: BaseException | None) -> BaseException | None:
    """The exception in ``err``'s chain that found no room; None when none did."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if no_room_errno(err) is not None:
            return err
        err = err.__cause__ or err.__context__
    return None


def reason(err: BaseException) -> str | None:
    """What the user reads for a write that found no room ("no space left on the device", ...); None otherwise."""
    cause = no_room_cause(err)
    return None if cause is None else REASONS[no_room_errno(cause)]
