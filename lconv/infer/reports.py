"""What an evaluation writes: ``<name>.hyp.txt``, ``<name>.scores.json`` and the report printed after it."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from etils import epath

from lconv import console, outputs


def write_outputs(workdir: str, name: str, hypotheses: Sequence[str] | None, scores: Mapping[str, Any]) -> None:
    """``<workdir>/<name>.hyp.txt`` (unless None) and ``<name>.scores.json``, local or a URL; process 0 only."""
    if jax.process_index() != 0:
        return
    directory = epath.Path(workdir)
    if hypotheses is not None:
        outputs.write_atomically(directory / f"{name}.hyp.txt", lines_text(hypotheses))
    outputs.write_atomically(directory / f"{name}.scores.json", json.dumps(scores, indent=2))


def lines_text(texts: Sequence[str]) -> str:
    """One text per line: a newline inside a text becomes a space, so line i stays example i's."""
    return "".join(h.replace("\n", " ") + "\n" for h in texts)


def format_report(scores: Mapping[str, Any], sources: Sequence[str], references: Sequence[str],
                  hypotheses: Sequence[str], num_print: int) -> str:
    """The first ``num_print`` (source, reference, hypothesis) triples, then the scores on one line."""
    if not hypotheses:
        return f"{scores['split']}: no examples, nothing to score"
    lines = []
    for i in range(min(num_print, len(hypotheses))):  # a text with escape sequences shows them, never runs them
        lines += [f"  source:     {console.printable(sources[i][:300])}",
                  f"  reference:  {console.printable(references[i][:300])}",
                  f"  hypothesis: {console.printable(hypotheses[i][:300])}", ""]
    if "bleu" in scores:
        head = f"{scores['split']}: sacreBLEU {scores['bleu']:.2f}  ({scores['bleu_signature']})"
    else:
        head = f"{scores['split']}: " + "  ".join(f"{k} {scores[k]:.2f}" for k in ("rouge1", "rouge2", "rougeL"))
    head += f"  on {scores['examples']} examples, {scores['sentences_per_s']:.1f} sentences/s"
    return "\n".join(["sample outputs:"] + lines + [head])
