"""What a study run measures besides its score, in the run's own process (the same machine and load): training tokens/s
(median over log windows, the first left out), the train step's memory (``memory_analysis``) and the peak RSS, LM
decoding speed (greedy generation from BOS), and per-word perplexity (so tokenisers compare). How each is taken:
docs/results.md, "How it is measured"."""
from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from lconv import json_text
from lconv.bench import timing
from lconv.constants import PAD_ID
from lconv.data import paths, sources
from lconv.data.data_config import DataConfig
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError, first_line
from lconv.infer import search
from lconv.run import model_setup, restore, schema
from lconv.train import setup, update

METRICS_LIMIT = 256 << 20  # bytes of a study run's metrics.jsonl: thousands of rows are a few MB


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s rows; a step logged twice (a resumed run) keeps its last row."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    with paths.open_checked(path, limit=METRICS_LIMIT) as f:  # a regular file, bounded
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json_text.loads(line)
            except ValueError as err:
                raise UserError(f"{path}: line {number} is not JSON ({first_line(err, 80)})") from None
            numbers = [v for k, v in row.items() if k not in ("split", "step")] if isinstance(row, dict) else []
            if not (isinstance(row, dict) and isinstance(row.get("split"), str) and _is_number(row.get("step"))
                    and all(isinstance(v, (int, float)) or v is None for v in numbers)):
                raise UserError(f"{path}: line {number} is not a metrics row (a split, a step and numbers)")
            rows[(row["split"], row["step"])] = row
    return sorted(rows.values(), key=lambda r: (r["split"], r["step"]))


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def training_speed(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median training tokens/s over the log windows after the first, and the total target tokens trained on."""
    train = [r for r in rows if r["split"] == "train"]
    if not train:
        return {}
    speeds = [r["tokens_per_s"] for r in train[1:]] or [train[0]["tokens_per_s"]]
    return {"train_tokens_per_s": statistics.median(speeds), "train_tokens": sum(r["tokens"] for r in train),
            "train_windows": len(speeds)}


def train_step_memory(config: Any, vocab_size: int) -> dict[str, Any]:
    """The compiled train step's bytes (``memory_analysis``), compiled for the run's shapes and shardings."""
    config = schema.validate_config(config)
    mesh = model_setup.make_mesh(config.mesh)
    model = model_setup.build_model(config, vocab_size)
    tx, lr = update.build_optimizer(config.optim, config.train.num_steps)
    state, shardings = setup.create_state(config, model, mesh, tx)
    batch = model_setup.dummy_batch(config, config.data.batch_size)
    if config.data.stream:
        batch["document_start"] = np.zeros((config.data.batch_size,), np.int32)
    step = update.jit_train_step(config, lr, shardings, mesh)  # as the training loop jits it
    with jax.set_mesh(mesh):
        compiled = step.lower(state, model_setup.global_batch(batch, model_setup.batch_sharding(mesh)),
                              np.float32(1.0)).compile()
    memory, source = timing.program_memory(compiled)
    return {"train_step_bytes": memory, "train_step_memory_source": source}


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def machine() -> dict[str, str]:
    """What the run was measured on and when, kept so a resumed study says which figures came from where."""
    info = timing.machine_info()
    return {key: info[key] for key in ("cpu", "device", "jax", "date")}


LM_DECODE_REPEATS = 5  # timed calls of the LM generation; their median is reported


def lm_generator(model: Any, decode_config: Any, rows: int, length: int) -> Callable[[Any], jax.Array]:
    """``params -> [rows, length] tokens``, jitted: greedy generation from BOS (the sampling defaults)."""
    settings = DecodeSettings.build(decode_config, max_len=length)
    return jax.jit(lambda params: search.lm_generate(
        model, {"params": params}, batch_size=rows, max_len=settings.max_len, temperature=settings.temperature,
        top_k=settings.top_k, top_p=settings.top_p))


def lm_generation_speed(trained: restore.Trained, rows: int, length: int,
                        repeats: int = LM_DECODE_REPEATS) -> dict[str, float]:
    """Greedy generation of ``rows`` x ``length`` tokens from BOS: tokens/s, the median of ``repeats`` calls."""
    generate, params = lm_generator(trained.model, trained.config.decode, rows, length), trained.params
    start = time.perf_counter()
    tokens = np.asarray(jax.block_until_ready(generate(params)))  # [rows, length]; greedy: every call alike
    compile_s = time.perf_counter() - start
    seconds = timing.summarize(timing.time_calls(lambda: generate(params), repeats, warmup=0))["median_s"]
    generated = int((tokens != PAD_ID).sum())
    return {"decode_tokens_per_s": generated / seconds, "decode_sentences_per_s": rows / seconds,
            "decode_seconds": seconds, "decode_compile_seconds": compile_s, "decode_tokens": generated,
            "decode_repeats": repeats}


def word_count(config: Any, split: str) -> int:
    """Words in an LM split: whitespace-separated words plus one end of document per non-empty document."""
    source, _, key = sources.config_source(DataConfig.from_config(config.data), split)
    total = 0
    for i in range(len(source)):
        value = source[i][key]
        words = len((value.decode() if isinstance(value, bytes) else str(value)).split())
        total += words + 1 if words else 0
    return total


def per_word_perplexity(scores: dict[str, Any], words: int) -> float:
    """``exp(summed token NLL / words)``: the same total log-likelihood, spread over words instead of pieces."""
    total_nll = scores["nll"] * scores["tokens"]
    return float(np.exp(min(total_nll / max(words, 1), 50.0)))


def hypothesis_tokens(workdir: str, split: str, tokenizer: Any) -> int:
    """Tokens (with EOS) of the decoded hypotheses in ``<workdir>/<split>.hyp.txt``."""
    with open(os.path.join(workdir, f"{split}.hyp.txt"), encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    return sum(len(ids) + 1 for ids in tokenizer.encode_batch(lines)) if lines else 0
