"""Evaluation caps: the first ``n`` examples of an evaluation split (``config.data.max_validation_examples``,
``max_test_examples``), so a quick run's evaluations take seconds; the same prefix every time, and the log says so."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lconv.data.data_config import DataConfig

logger = logging.getLogger(__name__)

VALIDATION = "validation"  # the split training reports its loss on and keeps the best checkpoint by


class CappedSource:
    """The first ``count`` examples of a random-access ``source`` (``lconv.data.sources.Source``)."""

    def __init__(self, source: Any, count: int):
        self.source, self.count = source, min(count, len(source))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        if not -self.count <= index < self.count:
            raise IndexError(f"example {index} of a split capped at {self.count}")
        return self.source[index % self.count]


def cap_field(split: str) -> str:
    """The ``config.data`` field that caps ``split``."""
    return "max_validation_examples" if split == VALIDATION else "max_test_examples"


def capped(source: Any, split: str, config: DataConfig) -> Any:
    """``source`` cut to the cap ``config`` (a ``DataConfig``) sets for ``split`` (0 = no cap), logged when it cuts."""
    field = cap_field(split)
    cap = getattr(config, field)
    total = len(source)
    if not cap or cap >= total:
        return source
    logger.info(f"the {split} split is capped at its first {cap:,} of {total:,} examples ({total - cap:,} left out; "
                f"config.data.{field}={cap}): its scores are of those alone")
    return CappedSource(source, cap)
