"""Suite ``train``: tokens/s of a full training step, and model FLOPs utilisation.

Same-size decoder-only LMs, one per compared mixer, trained with lconv's own step on random tokens at T=512 and 4096; a
vocabulary sweep compares the fused output layer and loss with materialised logits. Details: docs/benchmarks.md, "The
train suite".
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lconv.bench import report, timing
from lconv.configs import common
from lconv.nn import mixers
from lconv.nn.model_config import ModelConfig
from lconv.ops import flash
from lconv.run import model_setup, schema
from lconv.train import setup, update

logger = logging.getLogger(__name__)

MODELS = timing.labelled(("attention", "lightconv", "dynamicconv"))  # label -> registered name
D_MODEL, FFN, HEADS, K, LAYERS, VOCAB = 512, 2048, 8, 31, 3, 8000


@dataclasses.dataclass(frozen=True)
class LMSize:
    """The benchmark LM's shape: the suite's (``FULL``) or a smoke test's (``SMOKE``, seconds to compile on CPU)."""

    d_model: int = D_MODEL
    ffn: int = FFN
    heads: int = HEADS
    kernel: int = K
    layers: int = LAYERS
    tokens: int | None = None  # per batch; None: tokens_per_batch()


FULL, SMOKE = LMSize(), LMSize(d_model=32, ffn=64, heads=2, kernel=3, layers=1, tokens=256)
T_FULL, T_QUICK = (512, 4096), (512,)
VOCABS = (8000, 32000)  # the vocabulary sweep: the bench LM's, and WMT's / lm1b's joint BPE
LOSSES = {"fused": True, "logits": False}  # config.optim.fused_loss


def accelerator() -> bool:
    return jax.default_backend() != "cpu"


def tokens_per_batch() -> int:
    return 65_536 if accelerator() else 4096


def dtypes() -> tuple[str, ...]:
    """Compute dtypes measured: bfloat16 too on an accelerator (on CPU it is emulated, so slower, not faster)."""
    return ("float32", "bfloat16") if accelerator() else ("float32",)


def lm_config(mixer: str, T: int, dtype: str = "float32", fused_loss: bool = True,
              size: LMSize = FULL) -> setup.Config:
    """``configs.common``'s base config as a ``mixer`` decoder-only LM of ``size`` at length ``T``."""
    c = common.base_config()
    c.optim.fused_loss = fused_loss
    c.task = "lm"
    c.model.dtype = dtype
    c.data.max_target_length = T
    c.data.batch_size = max((size.tokens or tokens_per_batch()) // T, 1)
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = size.d_model, size.ffn, size.heads
    c.model.decoder_layers = size.layers
    c.model.decoder_mixer = mixer
    c.model.decoder_kernel_sizes = (size.kernel,)
    c.model.max_len = T
    if mixer == "attention":
        c.model.weight_dropout = 0.0  # as configs.common.set_mixer does for the Transformer baseline
    c.mesh.shape = (1, 1, 1)
    return c


def model_flops_per_token(mixer: str, T: int, vocab: int = VOCAB, size: LMSize = FULL) -> float:
    """Analytic fwd+bwd FLOPs per token (docs/benchmarks.md, "How the suites measure")."""
    d, K = size.d_model, size.kernel
    mixer_weights = {"attention": 4 * d * d, "lightconv": 3 * d * d, "dynamicconv": 3 * d * d + d * size.heads * K}
    per_layer = 6 * (mixer_weights[mixer] + 2 * d * size.ffn)
    per_layer += 12 * T * d if mixer == "attention" else 6 * K * d
    return size.layers * per_layer + 6 * d * vocab


def _batch(config, vocab, seed=0):
    B, T = config.data.batch_size, config.data.max_target_length
    rng = np.random.default_rng(seed)
    return {"targets": rng.integers(4, vocab, (B, T), dtype=np.int32),
            "targets_segmentation": np.ones((B, T), np.int32),
            "targets_position": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()}


def attention_kernel(config: setup.Config) -> str | None:
    """The attention kernel the Transformer LM's ``"auto"`` runs on this backend (None for other mixers)."""
    if config.model.decoder_mixer != "attention":
        return None
    decoder = ModelConfig.from_config(config.model, vocab_size=VOCAB).side("decoder")
    B, T, H = config.data.batch_size, config.data.max_target_length, decoder.num_heads
    shape = (B, T, H, decoder.d_model // H)
    platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    return flash.auto_impl(platform, shape, shape, jnp.dtype(config.model.dtype), segmented=True, causal=True,
                           dropout=config.model.attention_dropout > 0)


def _lowered_trainer(mixer, T, dtype, vocab=VOCAB, fused_loss=True, size=FULL):
    """The ``mixer`` LM's train step at ``T`` lowered (not yet compiled), with its state and one batch."""
    config = schema.validate_config(lm_config(mixer, T, dtype, fused_loss, size))
    model = model_setup.build_model(config, vocab)
    tx, lr = update.build_optimizer(config.optim, config.train.num_steps)
    state, _ = setup.create_state(config, model, model_setup.make_mesh(config.mesh, jax.devices()[:1]), tx)
    batch, lr_factor = _batch(config, vocab), np.float32(1.0)  # the learning-rate factor, as the training loop
    lowered = jax.jit(update.make_train_step(config, lr), donate_argnums=(0,)).lower(state, batch, lr_factor)
    holder = {"state": state, "params": model_setup.count_params(state.params), "attention": attention_kernel(config)}
    return lowered, holder, batch, lr_factor, config.data.batch_size


def trainers(settings: dict[str, tuple]) -> dict[str, tuple]:
    """``{label: (step, compiled, compile_s, holder, B)}`` of the trainers ``settings`` names, compiled at once."""
    lowered = {label: _lowered_trainer(*args) for label, args in settings.items()}
    programs = timing.compile_many([parts[0] for parts in lowered.values()], len(lowered))
    made = {}
    for (label, (_, holder, batch, lr_factor, B)), (compiled, compile_s) in zip(lowered.items(), programs):
        if isinstance(compiled, Exception):
            raise compiled
        memory = compiled.memory_analysis()
        holder["temp_bytes"] = None if memory is None else memory.temp_size_in_bytes

        def step(compiled=compiled, holder=holder, batch=batch, lr_factor=lr_factor):
            holder["state"], sums = compiled(holder["state"], batch, lr_factor)
            return sums["loss"]

        made[label] = (step, compiled, compile_s, holder, B)
    return made


def run(T_list: Sequence[int], *, repeats: int, dtype_list: Sequence[str] | None = None,
        vocabs: Sequence[int] = VOCABS, size: LMSize = FULL) -> list[report.Row]:
    """At each (T, dtype) the models' steps alternate, so drifting load does not skew their ratio."""
    dtype_list = dtypes() if dtype_list is None else tuple(dtype_list)
    matmul_rates = [timing.matmul_flops_per_s(2048, repeats=5)["matmul_flops_per_s"]]
    rows = []
    for T in T_list:
        for dtype in dtype_list:
            rows += _alternate({label: (mixer, T, dtype, VOCAB, True, size) for label, mixer in MODELS.items()},
                               repeats)
        matmul_rates.append(timing.matmul_flops_per_s(2048, repeats=5)["matmul_flops_per_s"])
    swept = mixers.info("dynamicconv").label
    for vocab in vocabs:
        for dtype in dtype_list:
            rows += _alternate({f"{swept}, {loss} loss": ("dynamicconv", T_QUICK[0], dtype, vocab, fused, size)
                                for loss, fused in LOSSES.items()}, repeats)
    matmul = max(matmul_rates)
    logger.info(f"  matmul {', '.join(f'{r / 1e9:.0f}' for r in matmul_rates)} GFLOP/s; MFU uses the best")
    for row in rows:
        row.update(matmul_flops_per_s=matmul, mfu=row["model_flops_per_token"] * row["tokens_per_s"] / matmul)
    return rows


def _alternate(settings: dict[str, tuple], repeats: int) -> list[report.Row]:
    """Rows of the trainers ``settings`` names (``trainers``' settings), their steps in alternation."""
    made = trainers(settings)
    times = timing.alternate({label: step for label, (step, *_rest) in made.items()}, repeats)
    rows = []
    for label, (_, compiled, compile_s, holder, B) in made.items():
        mixer, T, dtype, vocab, fused, size = settings[label]
        median = timing.summarize(times[label])["median_s"]
        tokens = B * T
        rows.append(dict(model=label, T=T, dtype=dtype, vocab=vocab, loss="fused" if fused else "logits",
                         attention=holder["attention"], B=B, params=holder["params"], step_s=median,
                         tokens_per_s=tokens / median,
                         model_flops_per_token=model_flops_per_token(mixer, T, vocab, size),
                         xla_flops_per_token=(timing.xla_flops(compiled) or 0) / tokens, compile_s=compile_s,
                         temp_mib=None if holder["temp_bytes"] is None else holder["temp_bytes"] / 2**20,
                         logits_mib=tokens * vocab * 4 / 2**20, runs=repeats, d_model=size.d_model,
                         layers=size.layers))
        attention = f", attention {holder['attention']}" if holder["attention"] else ""
        logger.info(f"  {label:24s} T={T:5d} {dtype:8s} V={vocab}: {rows[-1]['tokens_per_s']:8.0f} tokens/s, "
                    f"step {median:.2f} s, temporaries {rows[-1]['temp_mib'] or 0:.0f} MiB, compile "
                    f"{compile_s:.1f} s{attention}")
    return rows


def section(rows: Sequence[report.Row], T_list: Sequence[int], info: dict[str, str], command: str) -> str:
    models = [r for r in rows if r["model"] in MODELS]
    sweep = [r for r in rows if r["model"] not in MODELS]

    runs = list(dict.fromkeys((r["T"], r["dtype"]) for r in models))
    parts = [f"### Training step (`{command}`)\n",
             f"Machine: {timing.describe(info)}. DecoderOnlyLM, {_size_text(models[0])}; "
             f"{models[0]['B'] * models[0]['T']:,} tokens per batch; `update.make_train_step` "
             f"(dropout 0.1, label smoothing, Adam; the fused output layer and loss), state donated; compute in "
             f"{' and '.join(dict.fromkeys(r['dtype'] for r in models))} (params float32); the three models' "
             "steps alternate, median of the rounds. "
             f"The Transformer's attention kernel is `attention_impl=\"auto\"`'s choice, named per row. Matmul "
             f"rate, best of the measurements in this run: {rows[0]['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s "
             "(float32). MFU uses analytic model FLOPs; temporaries are XLA's (`memory_analysis()`).\n",
             report.markdown_table(
                 ["model", "T", "dtype", "attention", "params", "tokens/s", "step s", "model GFLOP/token",
                  "XLA GFLOP/token", "MFU", "temporaries MiB", "compile s"],
                 [[r["model"], r["T"], r["dtype"], r["attention"], r["params"], r["tokens_per_s"], r["step_s"],
                   r["model_flops_per_token"] / 1e9, r["xla_flops_per_token"] / 1e9, r["mfu"], r.get("temp_mib"),
                   r["compile_s"]] for r in models]),
             "**Tokens/s relative to the Transformer, same run**, beside the FLOP model's ideal (the Transformer's "
             "model FLOPs per token over the model's: the speed-up were every step as fast per FLOP)\n",
             speed_up_table(models, runs)]
    if sweep:
        parts += [f"**The output layer and loss by vocabulary** (DynamicConv, T={sweep[0]['T']}; the fused loss, "
                  "`config.optim.fused_loss=True`, against a log-softmax over materialised float32 logits, their "
                  "steps alternating)\n", _sweep_table(sweep)]
    parts.append(f"![training tokens/s]({report.figure('train.png')})\n")
    return "\n\n".join(p.strip() for p in parts)


def ideal_speed_up(rows: Sequence[report.Row], label: str, T: int, dtype: str) -> float | None:
    """The FLOP model's speed-up of ``label`` over the reference at ``T``: the measured ratio's ceiling."""
    def flops(model):
        return next((r["model_flops_per_token"] for r in rows
                     if (r["model"], r["T"], r["dtype"]) == (model, T, dtype)), None)

    ours, transformer = flops(label), flops(timing.REFERENCE)
    return transformer / ours if ours and transformer else None


def speed_up_table(rows: Sequence[report.Row], runs: Sequence[tuple[int, str]]) -> str:
    """Each model's tokens/s over the Transformer's at the same ``(T, dtype)``, then its FLOP model's speed-up per T."""
    def measured(label, T, dtype):
        speed = {r["model"]: r["tokens_per_s"] for r in rows if (r["T"], r["dtype"]) == (T, dtype)}
        reference = speed.get(timing.REFERENCE)
        return speed[label] / reference if label in speed and reference else None

    ideal_at = {T: dtype for T, dtype in runs}  # one column per T
    header = ["model"] + [f"T={T} {dt}" for T, dt in runs] + [f"FLOP model T={T}" for T in ideal_at]
    return report.markdown_table(header, [[lab] + [measured(lab, T, dt) for T, dt in runs]
                                          + [ideal_speed_up(rows, lab, T, dt) for T, dt in ideal_at.items()]
                                          for lab in MODELS])


def _size_text(row: report.Row) -> str:
    if row.get("d_model", D_MODEL) == D_MODEL:
        return f"{LAYERS} layers, d={D_MODEL}, FFN {FFN}, H={HEADS}, vocab {VOCAB}, conv K={K}"
    return f"a smoke test's size: {row['layers']} layer(s), d={row['d_model']}, vocab {VOCAB}"


def _sweep_table(sweep: Sequence[report.Row]) -> str:
    """Per vocabulary and dtype: each loss's tokens/s and temporaries, against one float32 logits array."""
    def speed_up(r):
        other = next(o for o in sweep if (o["vocab"], o["dtype"], o["loss"]) == (r["vocab"], r["dtype"], "logits"))
        return r["tokens_per_s"] / other["tokens_per_s"]

    return report.markdown_table(
        ["vocab", "dtype", "loss", "tokens/s", "vs logits", "temporaries MiB", "one f32 logits array MiB",
         "temporaries / logits array"],
        [[r["vocab"], r["dtype"], r["loss"], r["tokens_per_s"], speed_up(r), r["temp_mib"], r["logits_mib"],
          None if r["temp_mib"] is None else r["temp_mib"] / r["logits_mib"]] for r in sweep])


def run_suite(opts: argparse.Namespace, info: dict[str, str]) -> list[report.Row]:
    T_list = T_QUICK if opts.quick else T_FULL
    rows = run(T_list, repeats=2 if opts.quick else 3)
    report.write_results(opts.out, "train", rows, section(rows, T_list, info, opts.command), opts.doc)
    plot(rows, f"{opts.out}/train.png")
    return rows


def plot(rows: Sequence[report.Row], path: str) -> None:
    """Tokens/s of the three models, a bar group per (T, dtype)."""
    runs = list(dict.fromkeys((r["T"], r["dtype"]) for r in rows if r["model"] in MODELS))
    report.plot_bars(path, [f"T={T} {dtype}" for T, dtype in runs],
                     {lab: [next(r["tokens_per_s"] for r in rows if (r["model"], r["T"], r["dtype"]) == (lab, T, dt))
                            for T, dt in runs] for lab in MODELS},
                     title=f"training tokens/s, {rows[0].get('layers', LAYERS)}-layer LM, "
                           f"d={rows[0].get('d_model', D_MODEL)}", ylabel="tokens/s")
