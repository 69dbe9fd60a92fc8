"""The error type of mistakes a user can fix (a config field, a flag, a file, a checkpoint): one line naming what is
wrong and the fix, printed by the entry points with exit code 2; every other exception keeps its traceback."""
from __future__ import annotations


class UserError(ValueError):
    """A bad input, reported in one line. A ``ValueError`` so that callers catching those keep working."""


class Diverged(UserError, FloatingPointError):
    """Training diverged; the message names the step and the last good checkpoint, which is kept."""


class NonFiniteLoss(Diverged):
    """A NaN or inf loss."""


class LossSpike(Diverged):
    """A finite loss far above its running median for several log windows in a row (``train.spike_factor``)."""


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of ``err``'s message (at most ``limit`` characters), or its type's name when it has none: what
    a one-line error quotes of a library's exception."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]
