"""The numbers a study record must hold as numbers: what the report reads from records it did not write (an
archive entry, a handed-over output folder), checked in one place (docs/security.md)."""
from __future__ import annotations

import json
import math
from typing import Any

from lconv.errors import UserError

# The figures the report reads from a restored record, by kind or task: each a finite number in the entry.
_FIGURES = {"tune": ("validation_nll",), "translation": ("bleu",), "lm": ("ppl", "ppl_word"),
            "summarization": ("rouge1", "rouge2", "rougeL")}
# Numbers wherever a record holds them (the report's tables and lines format them as numbers).
NUMBERS = ("step", "params", "validation_nll", "validation_loss", "bleu", "ppl", "ppl_word", "rouge1", "rouge2",
           "rougeL", "train_tokens_per_s", "train_tokens", "decode_sentences_per_s", "decode_tokens_per_s",
           "train_step_bytes", "peak_rss_bytes", "train_seconds", "evaluate_seconds", "wall_seconds")


def check_figures(found: dict[str, Any], record: dict[str, Any], where: str) -> None:
    """The figures a run of ``record``'s kind reports are finite numbers in ``found``, and so is every other
    number the report reads that ``found`` holds; else one line naming ``where``."""
    kind = record["task"] if record.get("kind") in (None, "seed") else record["kind"]
    figures = {name: found.get(name) for name in _FIGURES.get(kind, ())}
    if kind == "lenpen":
        scores = found.get("scores")
        figures = {f"scores[{p:g}]": (scores or {}).get(f"{p:g}") if isinstance(scores, dict) else None
                   for p in record["lenpens"]}
    figures.update({name: found[name] for name in NUMBERS if found.get(name) is not None and name not in figures})
    for name, value in figures.items():
        if not is_number(value):
            raise UserError(f"{where}: its record's {name} is {json.dumps(value)[:40]}, where a finite number belongs")
    machine = found.get("machine", {})
    if not (isinstance(machine, dict) and all(isinstance(v, str) for v in machine.values())):
        raise UserError(f"{where}: its record's machine is {json.dumps(machine)[:40]}, where an object of names "
                        "belongs")


def is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
