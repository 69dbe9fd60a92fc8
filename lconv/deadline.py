"""A deadline: the time a pass over a split stops at, and what set it (named in the pass's warning)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Deadline:
    """``at`` on ``clock`` (seconds); ``name`` says what set it, e.g. ``"train.max_minutes"``."""

    at: float
    name: str
    clock: Callable[[], float] = time.monotonic

    def passed(self) -> bool:
        return self.clock() >= self.at
