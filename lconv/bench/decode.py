"""Suite ``decode``: incremental decoding time per token and cache size vs output length.

A small ``DecoderOnlyLM`` (``LAYERS`` layers, d=512, FFN 2048, H=8, conv K=31) decodes greedily one token per
step on its ``'cache'`` (``decode=True``), batch 1, for output lengths up to 4096. Steps run in jitted windows of
``WINDOW`` steps (a ``fori_loop``, the cache donated), so Python dispatch is amortised as in ``lconv.decode``;
every window is timed, which gives the per-token time at every position of the output. The cache is created
for the whole output length up front (as ``lconv.decode`` does): a Transformer's KV cache is ``[L, d]`` per
layer, and its attention reads all of it at every step; a conv's cache is its last ``K - 1`` inputs.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from lconv import models
from lconv.bench import report, timing

MIXERS = {"LightConv": "lightconv", "DynamicConv": "dynamicconv", "Transformer": "attention"}
D_MODEL, FFN, HEADS, K, LAYERS, VOCAB = 512, 2048, 8, 31, 2, 8000
WINDOW = 32
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


def run(lengths, log=print):
    rows = []
    for label, mixer in MIXERS.items():
        params = None
        for N in lengths:
            model = decoder(mixer, N)
            if params is None:
                params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 1), jnp.int32))["params"]
            _, variables = model.apply({"params": params}, jnp.zeros((1, N), jnp.int32), decode=True, shift=False,
                                       mutable=["cache"])
            cache = variables["cache"]
            cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
            token = jnp.ones((1, 1), jnp.int32)
            window, compile_s = timing.compile_fn(functools.partial(_window, model), (params, cache, token),
                                                  donate_argnums=(1,))
            per_token = []
            for _ in range(N // WINDOW):
                start = time.perf_counter()
                cache, token = window(params, cache, token)
                token.block_until_ready()
                per_token.append((time.perf_counter() - start) / WINDOW)
            windows = len(per_token)
            for i, seconds in enumerate(per_token):
                rows.append(dict(model=label, output_length=N, position=(i + 1) * WINDOW, us_per_token=seconds * 1e6,
                                 cache_bytes=cache_bytes, compile_s=compile_s, windows=windows))
            median = timing.summarize(per_token[1:] or per_token)["median_s"]  # the first window warms up
            log(f"  {label:12s} length {N:5d}: {median * 1e6:8.1f} us/token (median), cache {cache_bytes / 2**20:.2f} "
                f"MiB, compile {compile_s:.1f} s")
            del cache
    return rows


def _median_at(rows, label, N, lo=None, hi=None):
    """Median per-token time of the windows of one run whose last position is in ``(lo, hi]``."""
    values = [r["us_per_token"] for r in rows if r["model"] == label and r["output_length"] == N
              and r["position"] > WINDOW and (lo is None or r["position"] > lo) and (hi is None or r["position"] <= hi)]
    return timing.summarize(values)["median_s"] if values else None


def section(rows, lengths, info, command):
    labels = list(MIXERS)
    N = lengths[-1]
    marks = [p for p in (64, 256, 1024, 4096) if p <= N]
    bands = list(zip([WINDOW] + marks[:-1], marks))
    parts = [f"### Incremental decoding (`{command}`)\n",
             f"Machine: {timing.describe(info)}. DecoderOnlyLM, {LAYERS} layers, d={D_MODEL}, FFN {FFN}, H={HEADS}, "
             f"K={K}, vocab {VOCAB}, batch 1, greedy, float32; windows of {WINDOW} steps in one jitted loop "
             "(the first window is warm-up and left out). The cache is created for the whole output length.\n",
             "**Median µs per token over the whole output, by output length**\n",
             report.markdown_table(["model"] + [f"length {n}" for n in lengths],
                                   [[lab] + [_median_at(rows, lab, n) for n in lengths] for lab in labels]),
             f"**µs per token by position, in the length-{N} run** (median of the windows ending in the range)\n",
             report.markdown_table(["model"] + [f"positions {a}-{b}" for a, b in bands],
                                   [[lab] + [_median_at(rows, lab, N, a, b) for a, b in bands] for lab in labels]),
             "**Cache bytes per sequence, by output length**\n",
             report.markdown_table(["model"] + [f"length {n}" for n in lengths],
                                   [[lab] + [next((r["cache_bytes"] for r in rows if r["model"] == lab
                                                   and r["output_length"] == n), None) for n in lengths]
                                    for lab in labels])]
    ratio_rows = []
    for lab in labels:
        first, last = _median_at(rows, lab, N, WINDOW, 2 * marks[0]), _median_at(rows, lab, N, N - N // 8)
        vs_tf = [_median_at(rows, "Transformer", n) / _median_at(rows, lab, n)
                 if _median_at(rows, lab, n) else None for n in lengths]
        ratio_rows.append([lab, last / first if first and last else None] + vs_tf)
    parts += ["**Within-run ratios**: flatness = per-token time in the last eighth of the longest output ÷ in its "
              "first positions; then Transformer time ÷ this model's, by output length\n",
              report.markdown_table(["model", f"flatness (length {N})"] + [f"speed-up vs Transformer, {n}"
                                                                        for n in lengths], ratio_rows),
              "![decode time per token by position](bench/decode.png)\n"]
    return "\n\n".join(p.strip() for p in parts)


def run_suite(opts, info, log=print):
    lengths = LENGTHS_QUICK if opts.quick else LENGTHS_FULL
    rows = run(lengths, log=log)
    report.write_results(opts.out, "decode", rows, section(rows, lengths, info, opts.command), opts.doc)
    N = lengths[-1]
    series = {}
    for lab in MIXERS:
        pts = [(r["position"], r["us_per_token"]) for r in rows if r["model"] == lab and r["output_length"] == N
               and r["position"] > WINDOW]
        series[lab] = ([p for p, _ in pts], [v for _, v in pts])
    report.plot_lines(f"{opts.out}/decode.png", series, title=f"greedy decoding, output length {N}, batch 1",
                      xlabel="position", ylabel="µs per token")
    return rows
