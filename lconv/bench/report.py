"""Writing results: CSV rows, markdown tables, plots, and a suite's section of docs/benchmarks.md (between ``<!--
bench:NAME -->`` and ``<!-- /bench:NAME -->``, so the text around it is kept)."""
from __future__ import annotations

import csv
import io
import os
import stat
from collections.abc import Iterable, Sequence
from typing import Any

from lconv import outputs, shared_folders
from lconv.errors import UserError

Row = dict[str, Any]  # one result row of a suite (a CSV line)


def fmt(value: Any, digits: int = 3) -> str:
    """Compact cell text: ``None`` -> ``-``, floats to ``digits`` significant digits, strings as they are."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row has {len(row)} cells for {len(header)} columns: {row}")
        lines.append("| " + " | ".join(fmt(c) for c in row) + " |")
    return "\n".join(lines)


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    """CSV of dict rows; the columns are the union of the rows' keys in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def replace_section(document: str, name: str, body: str) -> str:
    """``document`` with the ``name`` section's body replaced (or the section appended if absent)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in document and end in document:
        head, rest = document.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return document.rstrip("\n") + "\n\n" + block + "\n"


def figure(name: str) -> str:
    """A suite's PNG as its committed doc links it (``lconv.bench.__main__.committed_paths``)."""
    from lconv.bench import timing  # imports jax, which writing CSV and markdown does not need

    backend = timing.backend()
    return f"bench/{name}" if backend == "cpu" else f"bench/{backend}/{name}"


def write_results(out_dir: str, name: str, rows: Sequence[dict[str, Any]], section: str, doc_path: str) -> str:
    """Writes ``out_dir/NAME.csv`` and the suite's section of ``doc_path``; returns the CSV path."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, f"{name}.csv")
    outputs.write_atomically(csv_path, csv_text(rows))
    document = _read_doc(doc_path)
    outputs.write_atomically(doc_path, replace_section(document, name, section))
    return csv_path


_DOC_MAX_BYTES = 16 << 20  # a markdown page of tables


def _read_doc(doc_path: str) -> str:
    """The doc's text (a new doc's heading if there is none), read through one descriptor opened without following
    a link (checked, then opened by name, a link swapped in between had another file read and written out): a
    regular file of this user's or root's, of a page's size. docs/security.md."""
    refusal = f"--doc={doc_path}: the benchmarks read and rewrite only a plain file of their own"
    try:
        fd = os.open(doc_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return "# Benchmarks\n"
    except OSError as err:
        raise UserError(f"{refusal}, and it cannot be opened as one ({err.strerror}: a link?)") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{refusal}, and it is not a regular file")
        if info.st_size > _DOC_MAX_BYTES:
            raise UserError(f"{refusal}, and it is over {_DOC_MAX_BYTES >> 20} MB")
        if not shared_folders.trusted_owner(doc_path, info.st_uid):
            raise UserError(f"{refusal}, and it belongs to another user (uid {info.st_uid})")
        return f.read(_DOC_MAX_BYTES + 1).decode("utf-8", errors="replace")


def plot_lines(path: str, series: dict[str, tuple[Sequence[float], Sequence[float]]], *, title: str,
               xlabel: str, ylabel: str) -> None:
    """One line per series (``label -> (xs, ys)``) on log-log axes, saved as a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.6, 4.2), dpi=80)
    colors = plt.get_cmap("tab10" if len(series) <= 10 else "tab20").colors
    for i, (label, (xs, ys)) in enumerate(series.items()):
        if xs:  # past 10 lines, 20 colours and the second half dashed
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=label, color=colors[i % len(colors)],
                    linestyle="-" if i < 10 else "--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    outputs.write_figure(fig, path)
    plt.close(fig)


def plot_bars(path: str, labels: Sequence[str], groups: dict[str, Sequence[float]], *, title: str,
              ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per ``groups`` entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=80)
    width = 0.8 / max(len(groups), 1)
    for i, (name, values) in enumerate(groups.items()):
        ax.bar([j + i * width for j in range(len(labels))], values, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=7, rotation=20)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    outputs.write_figure(fig, path)
    plt.close(fig)
