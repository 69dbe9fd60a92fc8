"""A ``jax.profiler`` trace of a few steps reduced to a table of time per kernel name.

``trace`` writes the trace and ``kernel_times`` sums the complete events (``"ph": "X"``) of the device's work by name: a
GPU's stream threads (the kernels: CUDA graphs hide XLA's op names), or on CPU the XLA executor threads less the
profiler's ``BOOKKEEPING`` (CPU spans may still nest).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax

from lconv.bench import report

# The CPU client's own markers and the executor's spans that enclose the ops it runs, not work of their own
BOOKKEEPING = ("ThreadpoolListener::", "ThunkExecutor::", "end: ")
HOST_THREADS = ("python",)  # the dispatching thread: Python frames and PjRt calls, not the device's work


def trace(step: Callable[[], Any], steps: int, logdir: str) -> str:
    """Runs ``step`` once, then ``steps`` times under ``jax.profiler.trace``; the trace's JSON copy's path."""
    jax.block_until_ready(step())
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(step())
    found = sorted(glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not found:
        raise FileNotFoundError(f"jax.profiler.trace wrote no perfetto_trace.json.gz under {logdir}")
    return found[-1]


def read_events(path: str) -> list[dict[str, Any]]:
    """The trace's events (a ``.json`` or ``.json.gz`` file: a list, or an object with ``traceEvents``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_times(events: Sequence[dict[str, Any]], steps: int = 1) -> list[report.Row]:
    """``[{kernel, ms_per_step, calls_per_step, share}]`` of the device's work, longest first, divided by ``steps``."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    streams = {key for key, name in threads.items() if key[0] in devices and name.startswith("Stream")}

    def is_work(e: dict[str, Any]) -> bool:
        key = (e.get("pid"), e.get("tid"))
        if devices:
            return key in streams if streams else key[0] in devices
        return threads.get(key) not in HOST_THREADS and not e["name"].startswith(BOOKKEEPING)

    total_us, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and is_work(e):
            total_us[e["name"]] += float(e.get("dur", 0.0))
            calls[e["name"]] += 1
    whole = sum(total_us.values()) or 1.0
    return [dict(kernel=name, ms_per_step=us / 1e3 / steps, calls_per_step=calls[name] / steps, share=us / whole)
            for name, us in total_us.most_common()]


def section(rows: Sequence[report.Row], what: str, top: int = 25) -> str:
    """A markdown section of the ``top`` kernels of ``kernel_times``; the rest summed in one line."""
    shown, rest = list(rows[:top]), rows[top:]
    table = [[r["kernel"][:100], r["ms_per_step"], r["calls_per_step"], r["share"]] for r in shown]
    if rest:
        table.append([f"{len(rest)} other kernels", sum(r["ms_per_step"] for r in rest),
                      sum(r["calls_per_step"] for r in rest), sum(r["share"] for r in rest)])
    total = sum(r["ms_per_step"] for r in rows)
    return "\n\n".join([f"### Where a train step goes: {what}\n",
                        f"A `jax.profiler` trace reduced to time per kernel name (`lconv.bench.profile`): "
                        f"{total:.2f} ms of device work a step.",
                        report.markdown_table(["kernel", "ms per step", "calls per step", "share"], table)])
