"""lconv's log messages in a test, as the programs print them (one message a line), for tests that assert on
them. Tests use pytest's ``caplog`` through the ``lconv_log`` fixture (conftest.py); a module-scoped fixture,
which cannot have ``caplog``, collects with ``Collect``."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class Collect(logging.Handler):
    """Keeps each record's message in ``messages``."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        from lconv import console

        self.messages.append(console.line(record))


@contextlib.contextmanager
def attached(handler: logging.Handler) -> Iterator[None]:
    """``handler`` on the ``lconv`` logger itself, INFO and up, while the block runs. On the logger rather than
    the root: a program run earlier in this process (``lconv.console.show_log``) stops lconv's records from
    propagating to the root, where caplog listens by default."""
    logger = logging.getLogger("lconv")
    saved = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the handler sees each record once, whether or not the root has it too
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
