"""``json.loads`` for text lconv did not write: nesting too deep for Python's reader is a ``JSONDecodeError`` (a
``ValueError``, as any other malformed text), which each reader already turns into its one line, not a
``RecursionError`` traceback."""
from __future__ import annotations

import json
from typing import Any

NESTED_TOO_DEEP = "nested deeper than lconv reads"  # the JSONDecodeError's msg for that case


def loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(NESTED_TOO_DEEP, text if isinstance(text, str) else "", 0) from None
