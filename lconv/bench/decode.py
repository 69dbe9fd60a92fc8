"""Suite ``decode``: incremental decoding time per token and cache size vs output length, for a small LM per mixer
decoding greedily on its cache. The method: docs/benchmarks.md, "The decode suite"."""
from __future__ import annotations

import argparse
import functools
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from lconv.bench import report, timing
from lconv.nn import models

logger = logging.getLogger(__name__)

MIXERS = timing.labelled(("lightconv", "dynamicconv", "attention"))  # label -> registered name
D_MODEL, FFN, HEADS, K, LAYERS, VOCAB = 512, 2048, 8, 31, 2, 8000
WINDOW = 32
MIN_WINDOWS = 8  # timed windows per output length at least (a short output is decoded several times)
LENGTHS_FULL = (64, 256, 1024, 4096)
LENGTHS_QUICK = (64, 256)


def decoder(mixer: str, max_len: int) -> models.DecoderOnlyLM:
    cfg = models.ModelConfig(vocab_size=VOCAB, d_model=D_MODEL, ffn_dim=FFN, num_heads=HEADS, decoder_layers=LAYERS,
                             decoder_mixer=mixer, decoder_kernel_sizes=(K,), dropout=0.0, weight_dropout=0.0,
                             max_len=max_len)
    return models.DecoderOnlyLM(cfg)


def _window(model, params, cache, token_B1):
    """``WINDOW`` greedy steps from ``token``; returns the new cache and the last token."""

    def step(_, carry):
        cache, token_B1 = carry
        logits_B1V, mutated = model.apply({"params": params, "cache": cache}, token_B1, decode=True, shift=False,
                                          mutable=["cache"])
        return mutated["cache"], jnp.argmax(logits_B1V[:, -1], -1).astype(jnp.int32)[:, None]

    return jax.lax.fori_loop(0, WINDOW, step, (cache, token_B1))


def run(lengths: Sequence[int]) -> list[report.Row]:
    """Greedy decoding of each model at every output length, timed window by window."""
    rows = []
    for label, mixer in MIXERS.items():
        params = None
        for L in lengths:
            model = decoder(mixer, L)
            if params is None:
                params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 1), jnp.int32))["params"]
            window = compile_s = None
            per_token = []
            for attempt in range(-(-MIN_WINDOWS * WINDOW // L)):  # short outputs are decoded several times
                _, variables = model.apply({"params": params}, jnp.zeros((1, L), jnp.int32), decode=True,
                                           shift=False, mutable=["cache"])
                cache, token = variables["cache"], jnp.ones((1, 1), jnp.int32)
                cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
                if window is None:
                    window, compile_s = timing.compile_fn(functools.partial(_window, model), (params, cache, token),
                                                          donate_argnums=(1,))
                for i in range(L // WINDOW):
                    start = time.perf_counter()
                    cache, token = window(params, cache, token)
                    token.block_until_ready()
                    seconds = (time.perf_counter() - start) / WINDOW
                    per_token.append(seconds)
                    rows.append(dict(model=label, output_length=L, attempt=attempt, position=(i + 1) * WINDOW,
                                     us_per_token=seconds * 1e6, cache_bytes=cache_bytes, compile_s=compile_s,
                                     warm_up=attempt == 0 and i == 0))
                del cache
            median = timing.summarize(per_token[1:] or per_token)["median_s"]
            logger.info(f"  {label:12s} length {L:5d}: {median * 1e6:8.1f} us/token (median of "
                        f"{len(per_token) - 1} windows), cache {cache_bytes / 2**20:.2f} MiB, "
                        f"compile {compile_s:.1f} s")
    return rows


def _median_at(rows, label, L, lo=0, hi=None):
    """Median per-token time of the windows of the length-``L`` runs ending at a position in ``(lo, hi]``."""
    values = [r["us_per_token"] for r in rows if r["model"] == label and r["output_length"] == L
              and not r["warm_up"] and r["position"] > lo and (hi is None or r["position"] <= hi)]
    return timing.summarize(values)["median_s"] if values else None


def section(rows: Sequence[report.Row], lengths: Sequence[int], info: dict[str, str], command: str) -> str:
    labels = list(MIXERS)
    L = lengths[-1]
    marks = [p for p in (64, 256, 1024, 4096) if p <= L]
    bands = list(zip([WINDOW] + marks[:-1], marks))
    parts = [f"### Incremental decoding (`{command}`)\n",
             f"Machine: {timing.describe(info)}. DecoderOnlyLM, {LAYERS} layers, d={D_MODEL}, FFN {FFN}, H={HEADS}, "
             f"K={K}, vocab {VOCAB}, batch 1, greedy, float32; windows of {WINDOW} steps in one jitted loop "
             f"(the first window is warm-up and left out; outputs shorter than {MIN_WINDOWS} windows are decoded "
             "several times). The cache is created for the whole output length, as `lconv.infer.search` does; lconv's "
             "attention reads all of its cache (masked) at every step, so its cost follows the cache length, "
             "not the position.\n",
             "**Median µs per token over the whole output, by output length**\n",
             report.markdown_table(["model"] + [f"length {n}" for n in lengths],
                                   [[lab] + [_median_at(rows, lab, n) for n in lengths] for lab in labels]),
             f"**µs per token by position, in the length-{L} run** (median of the windows ending in the range)\n",
             report.markdown_table(["model"] + [f"positions {a}-{b}" for a, b in bands],
                                   [[lab] + [_median_at(rows, lab, L, a, b) for a, b in bands] for lab in labels]),
             "**Cache bytes per sequence, by output length**\n",
             report.markdown_table(["model"] + [f"length {n}" for n in lengths],
                                   [[lab] + [next((r["cache_bytes"] for r in rows if r["model"] == lab
                                                   and r["output_length"] == n), None) for n in lengths]
                                    for lab in labels])]
    ratio_rows, early_end = [], max(L // 8, 4 * WINDOW)
    for lab in labels:
        early, late = _median_at(rows, lab, L, 2 * WINDOW, early_end), _median_at(rows, lab, L, L // 2)
        vs_tf = [_median_at(rows, timing.REFERENCE, n) / _median_at(rows, lab, n) for n in lengths]
        ratio_rows.append([lab, late / early if early and late else None] + vs_tf)
    parts += [f"**Within-run ratios**: flatness = median per-token time at positions {L // 2 + 1}-{L} ÷ at "
              f"{2 * WINDOW + 1}-{early_end} of the length-{L} run (1.0 = flat); then the Transformer's per-token time "
              "÷ this model's, by output length\n",
              report.markdown_table(["model", f"flatness (length {L})"] + [f"speed-up vs Transformer, {n}"
                                                                        for n in lengths], ratio_rows),
              f"![decode time per token by position]({report.figure('decode.png')})\n"]
    return "\n\n".join(p.strip() for p in parts)


def run_suite(opts: argparse.Namespace, info: dict[str, str]) -> list[report.Row]:
    lengths = LENGTHS_QUICK if opts.quick else LENGTHS_FULL
    rows = run(lengths)
    report.write_results(opts.out, "decode", rows, section(rows, lengths, info, opts.command), opts.doc)
    L = lengths[-1]
    series = {}
    for lab in MIXERS:
        pts = [(r["position"], r["us_per_token"]) for r in rows if r["model"] == lab and r["output_length"] == L
               and not r["warm_up"]]
        series[lab] = ([p for p, _ in pts], [v for _, v in pts])
    report.plot_lines(f"{opts.out}/decode.png", series, title=f"greedy decoding, output length {L}, batch 1",
                      xlabel="position", ylabel="µs per token")
    return rows
