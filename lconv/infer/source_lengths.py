"""Inputs longer than a model takes, by the one rule of every surface: each is cut (in tokens with EOS), with one
warning naming it, and the scores count them."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lconv.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SOURCE_LIMIT = "config.data.eval_max_input_length, EOS included"  # where a source's limit comes from


@dataclasses.dataclass
class SourceLengths:
    """The inputs cut to a limit, the longest one's length and the limit."""

    truncated: list[int]  # indices of the sources longer than ``limit``
    longest: int  # the longest source (0 when there is none)
    limit: int  # config.data.eval_max_input_length
    cut_from: list[int] = dataclasses.field(default_factory=list)  # the lengths of the ``truncated`` ones

    def counts(self) -> dict[str, int]:
        return {"truncated_sources": len(self.truncated), "longest_source_tokens": self.longest,
                "source_token_limit": self.limit}

    def warning(self, name: Callable[[int], str], limit: str, *, keeps: str = "cut to") -> str:
        """E.g. ``1 input cut to 32 tokens (...): sources[3] had 81``; ``name(index)`` names an input, ``limit`` its
        source, ``keeps`` the side kept."""
        count, shown = len(self.truncated), 5
        cut = ", ".join(f"{name(i)} had {n}" for i, n in zip(self.truncated[:shown], self.cut_from))
        more = f" and {count - shown} more" if count > shown else ""
        return f"{count} input{'s' if count != 1 else ''} {keeps} {self.limit} tokens ({limit}): {cut}{more}"

    def log(self, name: Callable[[int], str], limit: str, **kwargs: Any) -> None:
        if self.truncated:
            logger.warning(self.warning(name, limit, **kwargs))


def measure_sources(tokenizer: Tokenizer, sources: Sequence[str], limit: int) -> SourceLengths:
    """Which of ``sources`` decoding cuts to ``limit`` tokens (EOS included), and the longest length."""
    lengths = [len(ids) + 1 for ids in tokenizer.encode_batch(list(sources))] if sources else []
    cut = [i for i, n in enumerate(lengths) if n > limit]
    return SourceLengths(cut, max(lengths, default=0), limit, [lengths[i] for i in cut])
