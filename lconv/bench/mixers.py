"""Suite ``mixers``: time per token and peak memory of every token mixer vs sequence length, at fixed tokens per batch:
raw conv ops (``op`` rows) and the registry's modules (``mixer`` rows). What and how: docs/benchmarks.md, "The mixers
suite"."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lconv import ops
from lconv.bench import external, report, timing
from lconv.errors import UserError
from lconv.nn import mixers
from lconv.ops import pallas_conv

logger = logging.getLogger(__name__)

C, H, K = 512, 8, 31
TOKENS = 8192
T_FULL = (128, 256, 512, 1024, 2048, 4096, 8192)
T_QUICK = (256, 1024)
MAX_CALL_S = 4.0  # skip a configuration whose predicted fwd+bwd time per call is longer (see Config.max_call_s)
MAX_BYTES = 6 * 2**30  # ... or whose predicted peak memory is larger


@dataclasses.dataclass(frozen=True)
class Config:
    name: str  # table row label
    kind: str  # "op" or "mixer"
    build: Callable  # T, B -> (fwd(args), args, differentiable argnums)
    exponent: float  # per-call time ~ T ** exponent at fixed tokens (0 linear, 1 quadratic)
    bytes_at: Callable[[int, int], int] = lambda T, B: 0  # a lower bound on memory, checked before building
    max_call_s: float = MAX_CALL_S
    mixer: str | None = None  # the registry name a "mixer" row measures
    settings: str = ""  # a mixer row's fields, said under the tables (the row is named by the mixer's label)


def pallas_backend() -> bool:
    """Whether ``impl="pallas"`` compiles here (Triton on a GPU); interpret mode on CPU times nothing real."""
    return jax.default_backend() == "gpu"


def op_configs(only_mixers: Sequence[str] = ()) -> list[Config]:
    """``CONFIGS``, with the fused Pallas ops where they compile, then a row for each registered mixer not yet measured
    (plugins); ``only_mixers`` (``--mixers``) replaces the mixer rows."""
    configs = list(CONFIGS)
    if pallas_backend():
        configs = [*OP_ROWS, *(op_config(op_name, impl) for op_name, impl in PALLAS_OPS), *CONFIGS[len(OP_ROWS):]]
    if only_mixers:
        configs = [c for c in configs if c.kind == "op" or c.mixer in only_mixers]
    measured = {c.mixer for c in configs}
    for name in dict.fromkeys(only_mixers or [i.name for i in mixers.importable_infos()]):
        if name not in measured:
            configs.append(_plugin_config(name))
    return configs


def _plugin_config(name: str) -> Config:
    """A row for a mixer without a cost model, built first at a small shape so a broken one is one line up front."""
    info = mixers.info(name)
    causal = "encoder" not in info.sides
    try:
        module = mixers.make_mixer(name, num_heads=H, causal=causal, **info.example_fields)
        x = jax.ShapeDtypeStruct((2, 16, C), jnp.float32)
        variables = jax.eval_shape(module.init, jax.random.key(0), x)
        mixers.check_output(name, x, jax.eval_shape(module.apply, variables, x), "a [2, 16, 512] input")
    except Exception as err:  # noqa: BLE001 (whatever the plugin raises: one line naming it)
        if isinstance(err, UserError) and "returned" in str(err):
            raise
        line = (str(err).strip().splitlines() or [""])[0]
        raise UserError(f"mixer {name!r} fails on a [2, 16, {C}] input ({type(err).__name__}: {line}); "
                        f"lconv.testing.check_mixer({name!r}) names the rule it breaks") from None
    # unknown cost: quadratic, so a slow one is skipped early rather than late
    return _mixer_config(name, 1.0, causal=causal, **info.example_fields)


# Bench-only impl names: the Pallas kernels with another backward (pallas_conv.BACKWARDS), timed beside "pallas".
PALLAS_VARIANTS = {"pallas-fused": "fused"}


def op_config(op_name: str, impl: str, kernel_size: int = K) -> Config:
    """A raw centred conv op with a softmax-normalised random kernel; ``impl``: lconv.ops' or ``PALLAS_VARIANTS``'."""
    dynamic, pad = op_name == "dynamic", kernel_size // 2

    def build(T, B):
        x = timing.random_normal((B, T, C), 0)
        if dynamic:
            w = jax.nn.softmax(timing.random_normal((B, T, H, kernel_size), 1), axis=-1)
        else:
            w = jax.nn.softmax(timing.random_normal((H, kernel_size), 1), axis=-1)
        if impl in PALLAS_VARIANTS:
            conv = pallas_conv.dynamic_conv_pallas if dynamic else pallas_conv.light_conv_pallas
            fn = lambda x, w: conv(x, w, pad, backward=PALLAS_VARIANTS[impl])  # noqa: E731
        elif dynamic:
            fn = lambda x, w: ops.dynamic_conv(x, w, pad, impl=impl)  # noqa: E731
        else:
            fn = lambda x, w: ops.light_conv(x, w, pad, impl=impl)  # noqa: E731
        return fn, (x, w), (0, 1)

    label = {"conv": "XLA conv"}.get(impl, impl)
    # The slow baselines are linear in T (a few s per call), kept at every T for the ratios.
    return Config(f"{'DynamicConv' if dynamic else 'LightConv'} op, {label}", "op", build, 0.0, max_call_s=8.0)


def _mixer_config(registry_name, exponent=0.0, bytes_at=lambda T, B: 0, max_call_s=MAX_CALL_S, causal=False,
                  **fields):
    """A mixer row, named by the mixer's one name (its class's ``label``), whatever the fields it is built with."""
    def build(T, B):
        extra = {k: (v(T) if callable(v) else v) for k, v in fields.items()}
        module = mixers.make_mixer(registry_name, num_heads=H, causal=causal, **extra)
        x = timing.random_normal((B, T, C), 0)
        variables = jax.jit(module.init)(jax.random.key(0), x)
        params, state = {"params": variables["params"]}, {k: v for k, v in variables.items() if k != "params"}
        if state:  # kNN memory: read and write the memory, as in training
            fn = lambda p, x: module.apply({**p, **state}, x, mutable=list(state))[0]  # noqa: E731
        else:
            fn = lambda p, x: module.apply(p, x)  # noqa: E731
        return fn, (params, x), (0, 1)

    settings = ", ".join(f"{k}={'T' if callable(v) else v}" for k, v in fields.items())
    return Config(mixers.info(registry_name).label, "mixer", build, exponent, bytes_at, max_call_s,
                  mixer=registry_name, settings=settings)


def _logits_bytes(T, B):
    return B * H * T * T * 4  # one float32 [B, H, T, T] tensor


# The built-in mixers' cost models and bench fields, by registered name; a mixer without one is timed as a plugin.
COSTS = {
    "lightconv": dict(kernel_size=K),  # the conv blocks, projections included
    "dynamicconv": dict(kernel_size=K),
    "attention": dict(exponent=1.0, bytes_at=_logits_bytes, max_call_s=8.0),  # the main comparison
    "fixed": dict(exponent=1.0, bytes_at=lambda T, B: _logits_bytes(T, B) + H * T * T * 4, max_len=lambda T: T),
    "hadamard": dict(exponent=1.0, bytes_at=lambda T, B: _logits_bytes(T, B) + H * T * T * 4, max_len=lambda T: T),
    "colt5": dict(exponent=1.0, bytes_at=lambda T, B: _logits_bytes(T, B) // 2),
    "knn_memory": dict(exponent=1.0, bytes_at=_logits_bytes, memory_size=1024, num_neighbors=32),
}
# (op, impl) of the op rows; the fused Pallas ones (PALLAS_OPS) join them where they compile
OPS = [("light", "conv"), ("light", "band"), ("light", "shift"), ("light", "unfold"),
       ("dynamic", "band"), ("dynamic", "shift"), ("dynamic", "unfold")]
PALLAS_OPS = [("light", "pallas"), ("dynamic", "pallas")]
OP_ROWS = [op_config(op_name, impl) for op_name, impl in OPS]
# The op rows, then a row for each registered mixer that has a cost model, in registry order.
CONFIGS = OP_ROWS + [_mixer_config(i.name, **COSTS[i.name]) for i in mixers.importable_infos() if i.name in COSTS]
LIGHT, DYNAMIC, ATTENTION = (mixers.info(name).label for name in ("lightconv", "dynamicconv", "attention"))


def fwd_bwd(fn: Callable, argnums: int | tuple[int, ...]) -> Callable:
    """``(*args, g) -> (<fn(*args), g>, its gradients w.r.t. ``argnums``)``: one fwd+bwd call."""
    def loss_and_grads(*args_and_cotangent):
        *args, g = args_and_cotangent
        return jax.value_and_grad(lambda *a: jnp.vdot(fn(*a), g), argnums=argnums)(*args)

    return loss_and_grads


def fwd_bwd_program(config: Config, T: int, B: int, dtype: Any = None) -> tuple[Callable, tuple]:
    """``(fn, args)`` of ``config``'s fwd+bwd at ``[B, T]``: its inputs (an op's cast to ``dtype`` if given) and a
    random cotangent."""
    fn, args, argnums = config.build(T, B)
    if dtype is not None:  # an op row's x and kernel (a mixer row's first input is its params)
        args = tuple(a.astype(dtype) for a in args)
    return fwd_bwd(fn, argnums), (*args, timing.random_normal((B, T, C), 2, dtype or jnp.float32))


def _skipped_rows(base: report.Row, reason: str) -> list[report.Row]:
    return [dict(base, **{"pass": p, "status": f"skipped: {reason}"}) for p in ("fwd", "fwd+bwd")]


def _timed_row(base: report.Row, pass_name: str, m: timing.Measurement) -> report.Row:
    tokens = base["B"] * base["T"]
    return dict(base, **{"pass": pass_name}, status="ok", us_per_token=m.median_s / tokens * 1e6,
                min_us_per_token=m.min_s / tokens * 1e6, runs=m.runs, compile_s=m.compile_s,
                memory_mb=None if m.memory_bytes is None else m.memory_bytes / 2**20, memory_source=m.memory_source)


def run(T_list: Sequence[int], *, budget_s: float = 1.0,
        only_mixers: Sequence[str] = ()) -> list[report.Row]:
    """Measures every configuration at every T, T by T (so the ratios at one T are minutes apart at most)."""
    rows, configs = [], op_configs(only_mixers)
    last = {c.name: {} for c in configs}  # config -> pass -> (T, seconds per call) last measured
    last_bytes = {c.name: None for c in configs}
    for T in T_list:
        B = max(TOKENS // T, 1)
        for config in configs:
            base = dict(kind=config.kind, name=config.name, T=T, B=B)
            skip = _skip_reason(config, T, B, last[config.name], last_bytes[config.name])
            if skip:
                rows += _skipped_rows(base, skip)
                logger.info(f"  {config.name:32s} T={T:5d} skipped: {skip}")
                continue
            fn, args, argnums = config.build(T, B)
            g = timing.random_normal((B, T, C), 2)
            for pass_name, f, f_args in (("fwd", fn, args), ("fwd+bwd", fwd_bwd(fn, argnums), (*args, g))):
                m = timing.measure(f, f_args, budget_s=budget_s)
                last[config.name][pass_name] = (T, m.median_s)
                if pass_name == "fwd+bwd" and m.memory_bytes:
                    last_bytes[config.name] = (T, m.memory_bytes)
                rows.append(_timed_row(base, pass_name, m))
                logger.info(f"  {config.name:32s} T={T:5d} {pass_name:8s} {rows[-1]['us_per_token']:9.2f} us/token "
                            f"(compile {m.compile_s:.1f} s, {m.runs} runs)")
            del fn, args
        rows += external_rows(T, B, last, budget_s=budget_s)
    return rows


def external_rows(T: int, B: int, last: dict, *, budget_s: float) -> list[report.Row]:
    """The PyTorch / fairseq baselines (``lconv.bench.external``) at one T; skipped rows say why."""
    torch, missing = external.torch_or_reason()
    rows = []
    for label, builder, dynamic in external.BASELINES:
        base = dict(kind="op", name=label, T=T, B=B, device=torch and external.device_name(torch))
        history = last.setdefault(label, {})
        skip = missing or _skip_reason(Config(label, "op", None, 0.0, max_call_s=8.0), T, B, history, None)
        built = None
        if not skip:
            try:
                built = external.build(torch, builder, dynamic, B, T, C, H, K)
            except ImportError as err:
                skip = f"{err}"
        if skip:
            rows += _skipped_rows(base, skip)
            continue
        fn, args = built
        for pass_name in ("fwd", "fwd+bwd"):
            m = external.measure(torch, fn, args, backward=pass_name == "fwd+bwd", budget_s=budget_s)
            history[pass_name] = (T, m.median_s)
            rows.append(_timed_row(base, pass_name, m))
            logger.info(f"  {label:32s} T={T:5d} {pass_name:8s} {rows[-1]['us_per_token']:9.2f} us/token "
                        f"({base['device']})")
    return rows


FLATNESS_CONFIGS = ("LightConv op, band", "LightConv op, shift", "DynamicConv op, band", "DynamicConv op, shift",
                    LIGHT, DYNAMIC)


def interleaved_flatness(T_lo: int, T_hi: int, *, rounds: int = 7) -> list[report.Row]:
    """fwd+bwd µs/token at ``T_hi`` over ``T_lo``, the two programs timed in alternation so drifting load hits both."""
    rows = []
    for config in (c for c in CONFIGS if c.name in FLATNESS_CONFIGS):
        calls, tokens = {}, {}
        for T in (T_lo, T_hi):
            B = max(TOKENS // T, 1)
            fn, args = fwd_bwd_program(config, T, B)
            compiled, _ = timing.compile_fn(fn, args)
            calls[T], tokens[T] = functools.partial(compiled, *args), B * T
        times = timing.alternate(calls, rounds)
        lo, hi = (timing.summarize(times[T])["median_s"] / tokens[T] * 1e6 for T in (T_lo, T_hi))
        rows.append(dict(kind="flatness", name=config.name, T=T_hi, T_lo=T_lo, us_per_token=hi, us_per_token_lo=lo,
                         ratio=hi / lo, runs=rounds))
        logger.info(f"  {config.name:32s} interleaved: {hi:.2f} us/token at T={T_hi} / {lo:.2f} at T={T_lo} "
                    f"= {hi / lo:.2f}")
    return rows


def _skip_reason(config, T, B, last, last_bytes):
    predicted = timing.predict_seconds(last.get("fwd+bwd"), T, config.exponent)
    if predicted is not None and predicted > config.max_call_s:
        return f"est. {predicted:.0f} s/call > {config.max_call_s:.0f} s cap"
    floor = config.bytes_at(T, B)
    if last_bytes:
        floor = max(floor, last_bytes[1] * (T / last_bytes[0]) ** config.exponent)
    if floor > MAX_BYTES:
        return f"est. {floor / 2**30:.1f} GiB > {MAX_BYTES / 2**30:.0f} GiB cap"
    return None


# Tables and plots
def _cell(rows, name, T, pass_name, key="us_per_token"):
    for r in rows:
        if r["name"] == name and r["T"] == T and r.get("pass") == pass_name:
            return r.get(key) if r["status"] == "ok" else r["status"]
    return None


def _ratio(rows, num, den, T, pass_name="fwd+bwd"):
    a, b = _cell(rows, num, T, pass_name), _cell(rows, den, T, pass_name)
    return a / b if isinstance(a, float) and isinstance(b, float) else None


RATIOS = [  # (label, slower, faster): how many times faster the second is, measured in the same run
    ("LightConv: band vs XLA conv", "LightConv op, XLA conv", "LightConv op, band"),
    ("LightConv: shift vs XLA conv", "LightConv op, XLA conv", "LightConv op, shift"),
    ("LightConv: shift vs band", "LightConv op, band", "LightConv op, shift"),
    ("LightConv: shift vs unfold", "LightConv op, unfold", "LightConv op, shift"),
    ("DynamicConv: shift vs band", "DynamicConv op, band", "DynamicConv op, shift"),
    ("DynamicConv: shift vs unfold", "DynamicConv op, unfold", "DynamicConv op, shift"),
    ("LightConv: pallas vs band", "LightConv op, band", "LightConv op, pallas"),
    ("DynamicConv: pallas vs band", "DynamicConv op, band", "DynamicConv op, pallas"),
    ("LightConv: pallas vs fairseq CUDA", "LightConv op, fairseq lightconv_cuda", "LightConv op, pallas"),
    ("DynamicConv: pallas vs fairseq CUDA", "DynamicConv op, fairseq dynamicconv_cuda", "DynamicConv op, pallas"),
    ("LightConv: band vs PyTorch conv1d", "LightConv op, PyTorch conv1d", "LightConv op, band"),
    ("LightConv: band vs fairseq CUDA", "LightConv op, fairseq lightconv_cuda", "LightConv op, band"),
    ("DynamicConv: band vs fairseq CUDA", "DynamicConv op, fairseq dynamicconv_cuda", "DynamicConv op, band"),
    (f"{DYNAMIC} vs {ATTENTION}", ATTENTION, DYNAMIC),
    (f"{LIGHT} vs {ATTENTION}", ATTENTION, LIGHT),
]


def section(rows: Sequence[report.Row], T_list: Sequence[int], info: dict[str, str], command: str) -> str:
    names = list(dict.fromkeys(r["name"] for r in rows if r["kind"] != "flatness"))
    header = ["configuration"] + [f"T={T}" for T in T_list]
    parts = [f"### Mixer scaling (`{command}`)\n",
             f"Machine: {timing.describe(info)}. d=C={C}, H={H}, K={K} (centred), B*T={TOKENS} tokens per call, "
             "float32. Medians of several runs after one warm-up; compilation excluded (see the CSV).\n"]
    settings = [f"{c.name}: {c.settings}" for c in CONFIGS if c.kind == "mixer" and c.settings and c.name in names]
    if settings:
        parts.append(f"Mixer rows (each named as the mixer is everywhere) built with: {'; '.join(settings)}.\n")
    devices = sorted({r["device"] for r in rows if r.get("device")})
    if devices:
        parts.append(f"PyTorch and fairseq rows ran on torch's {', '.join(devices)} device; their memory is "
                     "`torch.cuda.max_memory_allocated` (none on CPU).\n")
    for pass_name in ("fwd+bwd", "fwd"):
        parts.append(f"**{pass_name}, µs per token**\n")
        parts.append(report.markdown_table(header, [[n] + [_cell(rows, n, T, pass_name) for T in T_list]
                                                    for n in names]))
    sources = sorted({r["memory_source"] for r in rows if r.get("memory_source")})
    parts.append("**Peak memory of the fwd+bwd program, MiB** (XLA `memory_analysis()`: arguments + outputs + "
                 f"temporaries; source per row in the CSV: {', '.join(sources)})\n")
    parts.append(report.markdown_table(header, [[n] + [_cell(rows, n, T, "fwd+bwd", "memory_mb") for T in T_list]
                                                for n in names]))
    parts.append("**Speed-ups within this run (fwd+bwd time of the first ÷ the second)**\n")
    parts.append(report.markdown_table(["comparison"] + header[1:],
                                       [[label] + [_ratio(rows, a, b, T) for T in T_list] for label, a, b in RATIOS]))
    lo, hi = 256, T_list[-1]
    flat = []
    for n in names:
        a, b = _cell(rows, n, hi, "fwd+bwd"), _cell(rows, n, lo, "fwd+bwd")
        inter = next((r for r in rows if r["kind"] == "flatness" and r["name"] == n), None)
        if isinstance(a, float) and isinstance(b, float) and hi != lo:
            flat.append([n, a / b, inter and inter["ratio"], inter and inter["us_per_token_lo"],
                         inter and inter["us_per_token"]])
    if flat:
        parts.append(f"**Flatness: fwd+bwd µs/token at T={hi} ÷ at T={lo}** (1.0 = linear in T). The first column "
                     "compares the table above (measured minutes apart); the interleaved one times the two programs "
                     "in alternation, so load drifting during the run cancels\n")
        parts.append(report.markdown_table(
            ["configuration", "from the table", "interleaved", f"interleaved µs/token, T={lo}",
             f"interleaved µs/token, T={hi}"], flat))
    compile_rows = [[n, max((r["compile_s"] for r in rows if r["name"] == n and r.get("compile_s")), default=None)]
                    for n in names]
    parts.append("**Compilation, slowest over T (fwd+bwd or fwd), seconds**\n")
    parts.append(report.markdown_table(["configuration", "compile s"], compile_rows))
    parts.append(f"![fwd+bwd time per token]({report.figure('mixers.png')}) "
                 f"![fwd+bwd memory]({report.figure('mixers_memory.png')})\n")
    return "\n\n".join(p.strip() for p in parts)


def plots(rows: Sequence[report.Row], out_dir: str) -> None:
    """``mixers.png`` (fwd+bwd µs/token vs T) and ``mixers_memory.png`` (its program memory) in ``out_dir``."""
    names = list(dict.fromkeys(r["name"] for r in rows if r["kind"] != "flatness"))

    def series(key):
        out = {}
        for n in names:
            pts = [(r["T"], r[key]) for r in rows
                   if r["name"] == n and r.get("pass") == "fwd+bwd" and r["status"] == "ok"]
            out[n] = ([p[0] for p in pts], [p[1] for p in pts])
        return out

    report.plot_lines(f"{out_dir}/mixers.png", series("us_per_token"), title=f"fwd+bwd, B*T={TOKENS}, d={C}",
                      xlabel="sequence length T", ylabel="µs per token")
    report.plot_lines(f"{out_dir}/mixers_memory.png", series("memory_mb"), title="fwd+bwd program memory",
                      xlabel="sequence length T", ylabel="MiB")


def run_suite(opts: argparse.Namespace, info: dict[str, str]) -> list[report.Row]:
    T_list = opts.T or (T_QUICK if opts.quick else T_FULL)
    rows = run(T_list, budget_s=0.5 if opts.quick else 1.0, only_mixers=opts.mixers)
    if 256 in T_list and T_list[-1] != 256:
        rows += interleaved_flatness(256, T_list[-1], rounds=3 if opts.quick else 7)
    report.write_results(opts.out, "mixers", rows, section(rows, T_list, info, opts.command), opts.doc)
    plots(rows, opts.out)
    return rows
