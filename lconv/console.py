"""Where lconv's log reaches the terminal: modules log under the ``lconv`` logger and each program calls ``show_log``
once; as a library lconv configures no handler (a notebook calls ``show_log()`` itself)."""
from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import Any, NoReturn

ROOT_LOGGER = "lconv"


def line(record: logging.LogRecord) -> str:
    """A record as the programs print it: its message, after ``warning: `` for a warning; control characters shown
    as escapes, since a message may name a file or a config value from elsewhere."""
    message = printable(record.getMessage())
    return f"warning: {message}" if record.levelno == logging.WARNING else message


class _LineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return line(record)


class _MessageHandler(logging.StreamHandler):
    """Each record's message alone, flushed, on the current ``sys.stdout`` / ``sys.stderr`` (captures work)."""

    def __init__(self, stream_name: str) -> None:
        super().__init__(getattr(sys, stream_name))
        self.stream_name = stream_name
        self.setFormatter(_LineFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = getattr(sys, self.stream_name)
        super().emit(record)


def show_log(stream: str = "stdout") -> None:
    """lconv's log from INFO up, one plain message a line on ``stream``, shown once (no propagation)."""
    if stream not in ("stdout", "stderr"):
        raise ValueError(f"stream must be 'stdout' or 'stderr'; got {stream!r}")
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _MessageHandler)]:
        logger.removeHandler(handler)
    logger.addHandler(_MessageHandler(stream))
    logger.setLevel(logging.INFO)
    logger.propagate = False


STDOUT_NAMES = ("-", "/dev/stdout")  # an output file named so is printed (eval.py --output_file)
# C0 controls but tab and newline, DEL and C1 controls: ESC, BEL and CSI drive the terminal (title, screen, colour).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\x1b``), for the terminal: a file name or a
    text from a run's data then shows as itself rather than setting the title, clearing the screen or colouring."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream: not a terminal
        return False


def pass_bar(total: int | None, desc: str, unit: str) -> Any:
    """A progress bar with ETA for an evaluation pass of ``total`` ``unit``s (None: a count), on a terminal, process 0.
    """
    import jax
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=2.0, leave=False,
                disable=jax.process_index() != 0 or not is_terminal(sys.stderr))


def exit_with(line: str) -> NoReturn:
    """A command's one-line error: ``error: <line>`` on stderr (controls escaped, whitespace runs as one space),
    exit status 2."""
    print(f"error: {printable(' '.join(line.split()))}", file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors as one ``exit_with`` line, as every entry point reports a user error."""

    def error(self, message: str) -> NoReturn:
        exit_with(message)
