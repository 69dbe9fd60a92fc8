"""The error type of mistakes a user can fix: a config field, a flag, a file, a checkpoint.

lconv's own checks raise ``UserError`` with one line naming what is wrong and, where there is one, the fix.
The entry points print a ``UserError`` as that one line (exit 2) and let every other exception, JAX's own
shape errors included, keep its traceback: those are bugs to report, not inputs to fix.
"""
from __future__ import annotations


class UserError(ValueError):
    """A bad input, reported in one line. A ``ValueError`` so that callers catching those keep working."""


class Diverged(UserError, FloatingPointError):
    """Training diverged; the message names the step and the last good checkpoint, which is kept."""


class NonFiniteLoss(Diverged):
    """A NaN or inf loss."""


class LossSpike(Diverged):
    """A finite loss far above its running median for several log windows in a row (``train.spike_factor``)."""
