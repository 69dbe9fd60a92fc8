"""What the study's numbers say: each task's ordering, every mixer against the reference, whether the leader's lead
holds, and the paper's ordered pairs. A gap "exceeds the seed spread" when it is larger than the two mixers' sample
standard deviations summed; with fewer than two seeds of either there is no spread, and nothing is judged."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from lconv.study import plan

Record = dict[str, Any]
# task -> [(record key, column title, higher is better)]; the first is the task's headline metric
METRICS = {
    "translation": [("bleu", "test BLEU", True)],
    "lm": [("ppl", "test ppl/token", False), ("ppl_word", "test ppl/word", False)],
    "summarization": [("rougeL", "ROUGE-L", True), ("rouge1", "ROUGE-1", True), ("rouge2", "ROUGE-2", True)],
}
# The paper's BLEU (Wu et al. 2019, Tables 1 and 3): benchmark -> {mixer: BLEU}
PAPER = {"IWSLT14 De-En": {"transformer": 34.4, "lightconv": 34.8, "dynamic": 35.2},
         "WMT14 En-De": {"transformer": 28.9, "dynamic": 29.7}}


def mean_sd(values: Sequence[float]) -> tuple[float, float, int]:
    """``(mean, sample sd or nan for one value, n)``."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan, 0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan, len(values)


def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def mean_pm(row: Record, key: str, digits: int = 2) -> str:
    if not row["ok"]:
        return "—"
    sd = row.get(f"{key}_sd")
    return fmt(row[key], digits) + (f" ± {fmt(sd, digits)}" if sd is not None and math.isfinite(sd) else "")


def resolved(a: Record, b: Record, key: str) -> bool | None:
    """Whether ``b[key] - a[key]`` exceeds the sum of their seed sds; None without two seeds of each."""
    if min(a["ok"], b["ok"]) < 2:
        return None
    return abs(b[key] - a[key]) > a[f"{key}_sd"] + b[f"{key}_sd"]


ORDER_KEY = "between neighbours: > a gap beyond the seed spread, ≈ within it, ? fewer than two seeds of either"
_ORDER_MARKS = {True: ">", False: "≈", None: "?"}


def ordering(rows: Sequence[Record], task: str) -> str:
    """A task's mixers best first; between neighbours ``>`` where the gap exceeds the seed spread, ``≈`` where it does
    not, ``?`` where either has fewer than two seeds (no spread to judge by). ``≈`` does not chain: two mixers apart
    in the chain may differ beyond the spread (``versus_reference`` and ``leader`` say which)."""
    key = METRICS[task][0][0]
    done = _best_first(rows, task)
    if not done:
        return "no finished runs"
    text = f"{done[0]['label']} ({fmt(done[0][key])})"
    for a, b in zip(done, done[1:]):
        text += f" {_ORDER_MARKS[resolved(b, a, key)]} {b['label']} ({fmt(b[key])})"
    return text


def _best_first(rows: Sequence[Record], task: str) -> list[Record]:
    """A task's finished mixers, best first by its headline metric."""
    key, _, higher = METRICS[task][0]
    return sorted((r for r in rows if r["ok"]), key=lambda r: r[key], reverse=higher)


def _sides(rows: Sequence[Record], pivot: Record, task: str) -> dict[str, list[tuple[str, float]]]:
    """Every other finished mixer by where it stands against ``pivot``: ahead or behind beyond the seed spread,
    within it, or without a spread (fewer than two seeds); each ``(label, gap in the metric's own sign)``."""
    key, _, higher = METRICS[task][0]
    sides: dict[str, list[tuple[str, float]]] = {"ahead": [], "behind": [], "within": [], "unjudged": []}
    for row in _best_first(rows, task):
        if row is pivot:
            continue
        gap = row[key] - pivot[key]
        verdict = resolved(pivot, row, key)
        side = ("unjudged" if verdict is None else "within" if not verdict else
                "ahead" if (gap > 0) == higher else "behind")
        sides[side].append((row["label"], gap))
    return sides


def versus_reference(rows: Sequence[Record], task: str, reference: str) -> str:
    """Where each mixer stands against the reference mixer: the comparison a reader acts on, pair by pair (the
    ordering's chain compares neighbours only)."""
    ref = next((r for r in rows if r["mixer"] == reference and r["ok"]), None)
    if ref is None:
        return f"{plan.label(reference)} has no finished run: nothing to set the others against"
    key = METRICS[task][0][0]
    sides = _sides(rows, ref, task)
    words = {"ahead": "ahead beyond the spread", "behind": "behind beyond the spread", "within": "within the spread",
             "unjudged": "fewer than two seeds, no spread to judge by"}
    parts = [f"{words[side]}: {', '.join(f'{label} ({gap:+.2f})' for label, gap in found)}"
             for side, found in sides.items() if found]
    head = f"Against {ref['label']} ({mean_pm(ref, key)}, n {ref['ok']})"
    return f"{head}: {'; '.join(parts)}" if parts else f"{head}: no other finished mixer"


def leader(rows: Sequence[Record], task: str) -> str:
    """Whether the first mixer's lead holds beyond the seed spread against each other one."""
    done = _best_first(rows, task)
    if len(done) < 2:
        return ""
    sides = _sides(done, done[0], task)
    if sides["unjudged"]:
        return f"{done[0]['label']} is first; with fewer than two seeds of some mixers, its lead is not yet judged"
    if not sides["within"]:
        return f"{done[0]['label']} is first, beyond the spread of every other mixer"
    names = ", ".join(label for label, _ in sides["within"])
    return f"{done[0]['label']} is first, but within the spread of {names}"


def compare_with_paper(rows: Sequence[Record]) -> list[str]:
    """Sentences on each ordered pair of the paper's BLEU, from our translation means and sds."""
    ours = {r["mixer"]: r for r in rows if r["task"] == "translation" and r["ok"]}
    lines = []
    for bench, scores in PAPER.items():
        order = sorted(scores, key=scores.get)
        for i, a in enumerate(order):
            for b in order[i + 1:]:
                paper = f"{bench}: {plan.label(a)} {scores[a]} < {plan.label(b)} {scores[b]}"
                if a not in ours or b not in ours:
                    lines.append(f"- {paper}. Not compared: the study has no finished translation runs of both.")
                    continue
                lines.append(f"- {paper}. {_pair_sentence(ours[a], ours[b])}")
    return lines


def _pair_sentence(a: Record, b: Record) -> str:
    diff = b["bleu"] - a["bleu"]
    here = (f"Here {a['label']} {fmt(a['bleu'])} ± {fmt(a['bleu_sd'])} and {b['label']} {fmt(b['bleu'])} ± "
            f"{fmt(b['bleu_sd'])} (n = {a['ok']}, {b['ok']}): ")
    same = diff > 0
    verdict = resolved(a, b, "bleu")
    if diff == 0:
        return here + "equal means: no order either way."
    if verdict is None:
        return here + (f"{'the same' if same else 'the opposite'} order ({diff:+.2f}), but with fewer than two "
                       "seeds there is no spread to judge it by: no evidence either way.")
    if same and verdict:
        return here + (f"the same order, and the gap ({diff:+.2f}) exceeds the seed spread: at this scale the data "
                       "agree with the paper.")
    if same:
        return here + (f"the same order, but the gap ({diff:+.2f}) is within the seed spread: consistent with the "
                       "paper, not evidence for it.")
    if verdict:
        return here + (f"the opposite order, and the gap ({-diff:.2f} in {a['label']}'s favour) exceeds the seed "
                       "spread: at this scale the paper's ordering does not hold.")
    return here + (f"the opposite order ({-diff:.2f} in {a['label']}'s favour), within the seed spread: no "
                   "evidence either way.")
