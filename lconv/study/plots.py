"""The study's figures (matplotlib, Agg): quality vs training speed (marker area ∝ parameters) per task, and
training curves from each run's ``metrics.jsonl``."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lconv import outputs
from lconv.study import measure, plan

Record = dict[str, Any]


def write_plots(records: Sequence[Record], rows: Sequence[Record], output_dir: str, results_dir: str,
                metrics: Mapping[str, Sequence[tuple[str, str, bool]]], measured: Record | None = None) -> list[str]:
    """Writes ``quality_vs_speed.png`` and ``training_curves.png`` into ``results_dir``; returns their paths. The
    speeds are ``measured``'s (the one-process table, ``lconv.study.speed``) where it has them."""
    import matplotlib

    matplotlib.use("Agg")
    tasks = list(dict.fromkeys(r["task"] for r in records))
    if not tasks:
        return []
    speeds = {(r["task"], r["mixer"]): r["train_tokens_per_s"] for r in (measured or {}).get("rows", [])}
    return [quality_vs_speed(rows, tasks, metrics, os.path.join(results_dir, "quality_vs_speed.png"), speeds),
            training_curves(records, tasks, output_dir, os.path.join(results_dir, "training_curves.png"))]


def _colors(mixers: Sequence[str]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    cycle = plt.get_cmap("tab10")
    return {m: cycle(i % 10) for i, m in enumerate(dict.fromkeys(mixers))}  # first place wins: stable colours


def quality_vs_speed(rows: Sequence[Record], tasks: Sequence[str],
                     metrics: Mapping[str, Sequence[tuple[str, str, bool]]], path: str,
                     speeds: Mapping[tuple[str, str], float] | None = None) -> str:
    """Per task: headline metric (mean ± sd over seeds) against training tokens/s, from ``speeds`` (one process,
    side by side) where it has the task's every mixer, else each mixer's runs as they ran; marker area ∝
    parameters."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.2), squeeze=False)
    colors = _colors(plan.known_words() + [r["mixer"] for r in rows])
    for ax, task in zip(axes[0], tasks):
        key, title, higher = metrics[task][0]
        done = [r for r in rows if r["task"] == task and r["ok"]]
        largest = max([r["params"] for r in done if r["params"]] + [1])
        side_by_side = bool(done) and all((task, r["mixer"]) in (speeds or {}) for r in done)
        for r in done:
            sd = r.get(f"{key}_sd")
            x = speeds[(task, r["mixer"])] if side_by_side else r["train_tokens_per_s"]
            ax.errorbar(x, r[key], yerr=sd if sd is not None and math.isfinite(sd) else None,
                        fmt="o", color=colors[r["mixer"]], markersize=4 + 10 * (r["params"] or 0) / largest,
                        capsize=3, label=f"{r['label']} ({(r['params'] or 0) / 1e6:.2f}M)")
        where = "one process, side by side" if side_by_side else "as each run ran"
        better = "higher" if higher else "lower"
        _label_axes(ax, f"training target tokens/s ({where})", f"{title} ({better} is better)", task,
                    legend=bool(done))
    return _save(fig, "quality vs training speed (marker area ∝ parameters; bars: ± sd over seeds)", path)


def training_curves(records: Sequence[Record], tasks: Sequence[str], output_dir: str, path: str) -> str:
    """Per task: training loss against updates, one line per run (colour = mixer)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.2), squeeze=False)
    colors = _colors(plan.known_words() + [r["mixer"] for r in records])
    for ax, task in zip(axes[0], tasks):
        labelled = set()
        for r in records:
            if r["task"] != task or r["status"] != "ok":
                continue
            train = [row for row in measure.read_metrics(os.path.join(output_dir, r["workdir"]))
                     if row["split"] == "train"]
            if not train:
                continue
            label = None if r["mixer"] in labelled else r["label"]
            labelled.add(r["mixer"])
            ax.plot([row["step"] for row in train], [row["loss"] for row in train], color=colors[r["mixer"]],
                    alpha=0.8, linewidth=1, label=label)
        _label_axes(ax, "update", "training loss (label-smoothed, per token)", task, legend=bool(labelled))
    return _save(fig, "training curves (one line per seed)", path)


def _label_axes(ax: Any, xlabel: str, ylabel: str, title: str, *, legend: bool) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


def _save(fig: Any, title: str, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    outputs.write_figure(fig, path, dpi=110)
    plt.close(fig)
    return path
