"""Suite ``limits``: the machine's float32 matmul rate and copy bandwidth, and how close the convs get to them
(docs/benchmarks.md, "The limits suite")."""
from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import jax

from lconv import ops
from lconv.bench import mixers, report, timing

logger = logging.getLogger(__name__)

K_SWEEP, T_SWEEP = (3, 7, 15, 31), (64, 1024)  # the evidence behind ops.choose_impl (impl="auto")


def run(T_list: Sequence[int], *, quick: bool = False) -> list[report.Row]:
    """The machine's limits, then each conv op's fwd+bwd at every T against them."""
    limits = {**timing.matmul_flops_per_s(2048, repeats=5 if quick else 10),
              **timing.copy_bytes_per_s(64 if quick else 256, repeats=5 if quick else 10)}
    logger.info(f"  matmul {limits['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s; "
                f"copy {limits['copy_bytes_per_s'] / 1e9:.1f} GB/s in place, "
                f"{limits['copy_fresh_bytes_per_s'] / 1e9:.1f} GB/s into fresh memory")
    rows = [dict(kind="limit", name="matmul", T=None, value=limits["matmul_flops_per_s"], unit="FLOP/s",
                 note=f"float32 [{limits['matmul_n']}]^2 @ [{limits['matmul_n']}]^2"),
            dict(kind="limit", name="copy (in place)", T=None, value=limits["copy_bytes_per_s"], unit="B/s",
                 note=f"x + 1 on {limits['copy_mb']} MiB, donated; read + write bytes"),
            dict(kind="limit", name="copy (fresh output)", T=None, value=limits["copy_fresh_bytes_per_s"],
                 unit="B/s", note="same, a new output buffer per call (first-touch page faults)")]
    for op_name, impl in mixers.OPS + (mixers.PALLAS_OPS if mixers.pallas_backend() else []):
        config = mixers.op_config(op_name, impl)
        dynamic = op_name == "dynamic"
        for T in T_list:
            B = max(mixers.TOKENS // T, 1)
            m = timing.measure(*mixers.fwd_bwd_program(config, T, B), budget_s=0.5 if quick else 1.0)
            s_per_token = m.median_s / (B * T)
            moved = timing.conv_bytes_per_token(mixers.C, mixers.H, mixers.K, dynamic=dynamic, backward=True)
            flops = timing.conv_flops_per_token(mixers.C, mixers.K, backward=True)
            rows.append(dict(kind="conv", name=config.name, T=T, us_per_token=s_per_token * 1e6,
                             bytes_per_token=moved, flops_per_token=flops,
                             copy_fraction=moved / s_per_token / limits["copy_bytes_per_s"],
                             bound_us_per_token=moved / limits["copy_bytes_per_s"] * 1e6,
                             matmul_fraction=flops / s_per_token / limits["matmul_flops_per_s"],
                             compile_s=m.compile_s, runs=m.runs))
            logger.info(f"  {config.name:28s} T={T:5d} {s_per_token * 1e6:8.2f} us/token = "
                        f"{rows[-1]['copy_fraction']:.3f} of copy bandwidth")
    return rows


def impl_choice(*, quick: bool = False) -> list[report.Row]:
    """fwd+bwd of each conv impl ``auto`` chooses between, over kernel sizes and lengths: ``ops.choose_impl``."""
    rows = []
    for K in K_SWEEP[-1:] if quick else K_SWEEP:
        for T in T_SWEEP[-1:] if quick else T_SWEEP:
            B = max(mixers.TOKENS // T, 1)
            impls = ("band", "shift") + (("pallas",) if mixers.pallas_backend() else ())
            for op_name in ("light", "dynamic"):
                for impl in impls:
                    program = mixers.fwd_bwd_program(mixers.op_config(op_name, impl, kernel_size=K), T, B)
                    m = timing.measure(*program, budget_s=0.5)
                    rows.append(dict(kind="impl_choice", name=f"{op_name} {impl}", K=K, T=T,
                                     us_per_token=m.median_s / (B * T) * 1e6, runs=m.runs, compile_s=m.compile_s))
            latest = rows[-2 * len(impls):]
            logger.info(f"  K={K:2d} T={T:5d}: " + ", ".join(f"{r['name']} {r['us_per_token']:.2f}" for r in latest))
    return rows


def section(rows: Sequence[report.Row], info: dict[str, str], command: str) -> str:
    lim = {r["name"]: r["value"] for r in rows if r["kind"] == "limit"}
    convs = [r for r in rows if r["kind"] == "conv"]
    table = report.markdown_table(
        ["conv op (fwd+bwd)", "T", "µs/token", "bytes/token", "floor µs/token (bytes ÷ copy)",
         "time ÷ floor", "fraction of copy bandwidth", "fraction of matmul FLOP/s"],
        [[r["name"], r["T"], r["us_per_token"], r["bytes_per_token"], r["bound_us_per_token"],
          r["us_per_token"] / r["bound_us_per_token"], r["copy_fraction"], r["matmul_fraction"]] for r in convs])
    return "\n\n".join(p.strip() for p in [
        f"### Limits of the machine (`{command}`)\n",
        f"Machine: {timing.describe(info)}.\n",
        f"- float32 matmul: **{lim['matmul'] / 1e9:.0f} GFLOP/s**\n"
        f"- elementwise copy, in place: **{lim['copy (in place)'] / 1e9:.1f} GB/s** (read + write); into a fresh "
        f"buffer every call: {lim['copy (fresh output)'] / 1e9:.1f} GB/s — the difference is the first-touch page "
        "faults a program pays for its temporaries on this machine.\n",
        "Bytes moved per token, fwd+bwd, float32: LightConv `5C` floats (read x, write y; read dy and x, write "
        "dx), DynamicConv `5C + 3HK` (plus read the kernel twice and write its gradient): "
        f"{timing.conv_bytes_per_token(mixers.C, mixers.H, mixers.K, dynamic=False, backward=True)} and "
        f"{timing.conv_bytes_per_token(mixers.C, mixers.H, mixers.K, dynamic=True, backward=True)} bytes at "
        f"C={mixers.C}, H={mixers.H}, K={mixers.K}. FLOPs per token: `6KC` (forward, dx, dw).\n",
        table,
        f"![fraction of copy bandwidth]({report.figure('limits.png')})\n",
        f"**The `impl=\"auto\"` rule**: fwd+bwd µs/token of the candidates, B*T={mixers.TOKENS}, C={mixers.C}, "
        f"H={mixers.H}, centred kernels; `ops.choose_impl` picks `{ops.choose_impl()}` on "
        f"this backend ({jax.default_backend()}).\n",
        _choice_table(rows),
    ])


def _choice_table(rows):
    """µs/token of each candidate impl per (K, T) and op, the fastest named: the evidence for ``choose_impl``."""
    choice = [r for r in rows if r["kind"] == "impl_choice"]
    get = {(r["name"], r["K"], r["T"]): r["us_per_token"] for r in choice}
    impls = list(dict.fromkeys(r["name"].split()[1] for r in choice))
    table = []
    for K, T in dict.fromkeys((r["K"], r["T"]) for r in choice):
        row = [K, T]
        for op_name in ("light", "dynamic"):
            times = {impl: get[(f"{op_name} {impl}", K, T)] for impl in impls}
            row += [*times.values(), min(times, key=times.get)]
        table.append(row)
    header = ["K", "T"] + [f"{op_name} {column}" for op_name in ("light", "dynamic") for column in impls + ["fastest"]]
    return report.markdown_table(header, table)


def run_suite(opts: argparse.Namespace, info: dict[str, str]) -> list[report.Row]:
    T_list = (256, 4096) if not opts.quick else (256,)
    rows = run(T_list, quick=opts.quick)
    rows += impl_choice(quick=opts.quick)
    report.write_results(opts.out, "limits", rows, section(rows, info, opts.command), opts.doc)
    convs = [r for r in rows if r["kind"] == "conv"]
    names = list(dict.fromkeys(r["name"] for r in convs))
    report.plot_bars(f"{opts.out}/limits.png", names,
                     {f"T={T}": [next((r["copy_fraction"] for r in convs if r["name"] == n and r["T"] == T), 0)
                                 for n in names] for T in T_list},
                     title="conv fwd+bwd: bytes moved ÷ time, fraction of copy bandwidth", ylabel="fraction")
    return rows
