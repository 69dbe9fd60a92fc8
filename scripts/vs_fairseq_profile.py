"""Where a training step's time goes, by op class, in lconv (a ``jax.profiler`` trace) and fairseq (``torch.profiler``).

``scripts/vs_fairseq.py --profile`` calls these in each system's worker after the timed windows, then prints one
table. Both sides put an op in the first class that claims it, in this order:

- ``optimizer``: Adam's update, the gradients' token-mean division and norm (lconv: ops outside the model's
  forward and backward; fairseq: ``Optimizer.step`` and the ops outside the forward and the backward pass);
- ``conv``: everything in the conv module, its filter projection (DynamicConv's ``weight_linear``) and softmax
  included (lconv: ``mixer/conv`` in the op's name; fairseq: ``DynamicConv1dTBC`` / ``LightweightConv1dTBC``);
- ``layer norms``: the ``*_norm`` modules / ``LayerNorm``;
- ``GLU``: the conv block's first linear layer's elementwise work (bias, mask, ``a * sigmoid(b)``) / ``aten::glu``;
- ``matmuls``: every other dot (the linear layers, attention's, the output projection);
- ``softmax/loss``: the output layer's log-softmax and the label-smoothed loss;
- ``copies/transposes``: the remaining copies, transposes, concatenations, pads and slices;
- ``other``: the rest (embeddings and positions, residual adds, attention's softmax and masks, ReLU);
- ``host``: the step's wall time in which no op runs: Python, dispatch, the autograd engine, waits.

A backward op belongs to its forward op's class: lconv's keep their forward module's name under ``transpose(...)``;
fairseq's autograd nodes carry their forward op's sequence number, mapped to the module scope it ran in. lconv's
CPU spans nest (a loop encloses its body's ops), so each op counts its own time less its children's.
"""
from __future__ import annotations

import collections
import glob
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

CLASSES = ("matmuls", "conv", "layer norms", "GLU", "softmax/loss", "optimizer", "copies/transposes", "other",
           "host")
COPY_OPCODES = {"copy", "transpose", "concatenate", "pad", "slice", "dynamic-slice", "dynamic-update-slice",
                "broadcast", "reshape", "bitcast"}
BOOKKEEPING = ("ThreadpoolListener::", "ThunkExecutor::", "end: ", "SlinkyThreadPool::")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\((.*)$", re.M)
COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", re.M | re.S)


# ----------------------------------------------------------------------------------------------------------------
# lconv
# ----------------------------------------------------------------------------------------------------------------
def hlo_classes(hlo_text: str) -> dict[str, str]:
    """Each instruction's class, by name, from a compiled program's text."""
    bodies = {name: body for name, body in COMPUTATION.findall(hlo_text)}
    has_dot = {name: bool(re.search(r" (dot|convolution)\(", body)) for name, body in bodies.items()}
    classes = {}
    for name, opcode, rest in INSTRUCTION.findall(hlo_text):
        op_name = (re.search(r'op_name="([^"]*)"', rest) or [None, ""])[1]
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        dot = opcode in ("dot", "convolution") or bool(called and has_dot.get(called.group(1)))
        classes[name] = lconv_class(op_name, opcode, name, dot)
    return classes


def lconv_class(op_name: str, opcode: str, name: str, dot: bool) -> str:
    model = "jvp(" in op_name or "transpose(" in op_name
    if op_name.startswith("jit(") and not model:
        return "optimizer"
    if "/mixer/conv/" in op_name:
        return "conv"
    if re.search(r"_norm/", op_name):
        return "layer norms"
    if "/mixer/linear1/" in op_name and not dot:
        return "GLU"
    if dot:
        return "matmuls"
    if model and "EncoderDecoder" not in op_name:  # the loss's custom VJP (no module in its names)
        return "softmax/loss"
    if opcode in COPY_OPCODES or "copy" in name or "transpose" in name:
        return "copies/transposes"
    return "other"


def self_times(events: list[dict[str, Any]]) -> dict[tuple, float]:
    """``{(thread, name, start): own microseconds}``: each span less the spans nested in it, per thread."""
    out, by_thread = {}, collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    for thread, spans in by_thread.items():
        spans.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        stack: list[tuple[tuple, float]] = []
        for e in spans:
            end = e["ts"] + e.get("dur", 0.0)
            while stack and stack[-1][1] <= e["ts"]:
                stack.pop()
            key = (thread, e["name"], e["ts"])
            out[key] = e.get("dur", 0.0)
            if stack:
                out[stack[-1][0]] -= e.get("dur", 0.0)
            stack.append((key, end))
    return out


def busy_us(events: list[dict[str, Any]]) -> float:
    """Microseconds in which at least one of ``events`` runs (the union of their spans)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def lconv_profile(step: Callable[[], Any], compiled, steps: int) -> dict[str, Any]:
    """``{"wall_ms": per step, "classes": {class: ms per step}}`` of ``steps`` traced calls of ``step``."""
    import jax

    from lconv.bench import profile

    classes = hlo_classes(compiled.as_text())
    step()
    logdir = tempfile.mkdtemp(prefix="vs_fairseq_trace_")
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        start = time.perf_counter()  # inside: the profiler's own start and stop are not the step's
        for _ in range(steps):
            step()
        wall_us = (time.perf_counter() - start) * 1e6
    path = glob.glob(f"{logdir}/**/perfetto_trace.json.gz", recursive=True)[-1]
    events = profile.read_events(path)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    work = [e for e in events if e.get("ph") == "X" and threads.get((e["pid"], e["tid"])) != "python"
            and not e["name"].startswith(BOOKKEEPING)]
    totals = collections.Counter()
    for (_, name, _), us in self_times(work).items():
        totals[classes.get(name, "other")] += us
    totals["host"] = max(wall_us - busy_us(work), 0.0)
    return dict(wall_ms=wall_us / 1e3 / steps, classes={k: v / 1e3 / steps for k, v in totals.items()})


# ----------------------------------------------------------------------------------------------------------------
# fairseq
# ----------------------------------------------------------------------------------------------------------------
SCOPES = {"DynamicConv1dTBC": "conv", "LightweightConv1dTBC": "conv", "DynamicConv": "conv",
          "LightweightConv": "conv", "LayerNorm": "layer norms", "FusedLayerNorm": "layer norms"}
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::baddbmm", "aten::addbmm")
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::transpose", "aten::permute",
            "aten::constant_pad_nd", "aten::index_select", "aten::narrow", "aten::slice")


def scope_modules(model, criterion) -> None:
    """Wraps the forward of each module ``SCOPES`` names, of the model and of the criterion (which calls the model)
    in a profiler scope ``vs::<class>``."""
    import torch

    def wrap(module, label):
        forward = module.forward

        def scoped(*args, **kwargs):
            with torch.profiler.record_function(f"vs::{label}"):
                return forward(*args, **kwargs)

        module.forward = scoped

    for module in model.modules():
        if type(module).__name__ in SCOPES:
            wrap(module, SCOPES[type(module).__name__])
    wrap(model, "model")
    wrap(criterion, "loss")


def ancestors(e) -> list:
    out, node = [], e.cpu_parent
    while node is not None:
        out.append(node)
        node = node.cpu_parent
    return out


def forward_scope(e, names: list[str]) -> str:
    """The class of a forward op: its module scope, the model's other work, the criterion's, or neither."""
    inner = next((n[4:] for n in names if n.startswith("vs::") and n not in ("vs::model", "vs::loss")), None)
    if inner:
        return inner
    if "glu" in e.name.lower():
        return "GLU"
    if "vs::model" in names:
        return "model"
    return "loss" if "vs::loss" in names else "optimizer"  # outside both: the trainer's work on the gradients


def fairseq_class(e, forward_class: dict[int, str]) -> str:
    """The class of an ``aten::`` event ``e`` (see the module docstring)."""
    scopes = ancestors(e)
    names = [s.name for s in scopes]
    if any(n.startswith("Optimizer.step") for n in names):
        return "optimizer"
    backward = next((s for s in scopes if s.name.startswith("autograd::engine::evaluate_function")), None)
    owner = forward_class.get(backward.sequence_nr, "model") if backward else forward_scope(e, names)
    if owner in ("conv", "layer norms", "GLU", "optimizer"):
        return owner
    if e.name in MATMUL_OPS:
        return "matmuls"
    if owner == "loss":
        return "softmax/loss"
    if e.name.startswith(COPY_OPS):
        return "copies/transposes"
    return "other"


def fairseq_profile(step: Callable[[], Any], model, criterion, steps: int) -> dict[str, Any]:
    """``{"wall_ms": per step, "classes": {class: ms per step}}`` of ``steps`` profiled calls of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    scope_modules(model, criterion)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()  # inside: the profiler's own start and stop are not the step's
        for _ in range(steps):
            step()
        wall_us = (time.perf_counter() - start) * 1e6
    events = prof.events()
    forward_class = {}  # autograd node (sequence number) -> the class of the forward op that made it
    for e in events:
        if e.sequence_nr >= 0 and e.name.startswith("aten::") and not any(
                a.name.startswith("autograd::") for a in ancestors(e)):
            forward_class.setdefault(e.sequence_nr, forward_scope(e, [a.name for a in ancestors(e)]))
    totals = collections.Counter()
    for e in events:
        if e.name.startswith("aten::"):
            totals[fairseq_class(e, forward_class)] += e.self_cpu_time_total
    totals["host"] = max(wall_us - sum(totals.values()), 0.0)
    return dict(wall_ms=wall_us / 1e3 / steps, classes={k: v / 1e3 / steps for k, v in totals.items()})


# ----------------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------------
def table(found: dict[str, dict[str, Any]], settings) -> str:
    """One markdown table per class and system: ms per step and share of the step's op time; then the op time, the
    wall time and the host's share of it."""
    names = list(found)
    head = (f"**Where a training step goes, by op class** (`--profile`: {settings.profile_steps} profiled steps "
            "each, after the timed windows; ms per step, summed over threads where ops run in parallel, and share "
            "of the op time; host: the wall time in which no op runs, and its share of the wall time; a profiler "
            "slows both)")
    rows = ["| class | " + " | ".join(f"{n} ms | {n} share" for n in names) + " |",
            "|---" * (2 * len(names) + 1) + "|"]
    op_ms = {n: sum(v for k, v in found[n]["classes"].items() if k != "host") for n in names}
    for cls in CLASSES[:-1]:
        cells = []
        for n in names:
            ms = found[n]["classes"].get(cls, 0.0)
            cells += [f"{ms:,.1f}", f"{ms / op_ms[n]:.0%}"]
        rows.append(f"| {cls} | " + " | ".join(cells) + " |")
    rows.append("| op time | " + " | ".join(f"{op_ms[n]:,.1f} | 100%" for n in names) + " |")
    host = {n: found[n]["classes"].get("host", 0.0) for n in names}
    rows.append("| host (no op running), share of wall | " + " | ".join(
        f"{host[n]:,.1f} | {host[n] / found[n]['wall_ms']:.0%}" for n in names) + " |")
    rows.append("| step (wall) | " + " | ".join(f"{found[n]['wall_ms']:,.1f} | " for n in names) + " |")
    return "\n".join([head, ""] + rows)
