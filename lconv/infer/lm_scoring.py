"""A language model's teacher-forced scores of given texts: each token's log-prob, per text. ``continuation_scores``
scores continuations of prompts, ``text_perplexities`` each text alone from BOS; one pass per batch, in ``compiled``'s
shape buckets."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from lconv.constants import EOS_ID, PAD_ID
from lconv.infer import compiled
from lconv.infer.infer_config import InferConfig

if TYPE_CHECKING:
    import flax.linen as nn

LogProbs = Callable[[Any, np.ndarray], Any]  # (params, targets [B, T]) -> [B, T] log p of each target token


def token_log_probs(model: nn.Module, params: Any, targets_BT: jax.Array) -> jax.Array:
    """``[B, T]`` float32: log p(target t | BOS, targets before t) under a ``DecoderOnlyLM`` (or an ensemble)."""
    logits_BTV = model.apply({"params": params}, targets_BT,
                             targets_segmentation=(targets_BT != PAD_ID).astype(jnp.int32))
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)  # [B, T, V]
    return jnp.take_along_axis(logp_BTV, targets_BT[:, :, None], axis=-1)[:, :, 0]  # [B, T]


def continuation_scores(config: InferConfig, log_probs: LogProbs, params: Any, prompts: Sequence[np.ndarray],
                        continuations: Sequence[np.ndarray]) -> list[dict[str, Any]]:
    """Per pair ``{"score", "token_scores"}``: log p of each continuation token and EOS given BOS and the prompt; too
    long a pair keeps the prompt's last tokens (and the continuation's first ``max_len - 1``)."""
    positions = int(config.max_positions)
    rows_of = []
    for prompt, continuation in zip(prompts, continuations):
        continuation = np.append(continuation[:positions - 1], EOS_ID)
        prompt = prompt[len(prompt) - (positions - len(continuation)):] if len(prompt) + len(continuation) > \
            positions else prompt
        rows_of.append((np.concatenate([prompt, continuation]).astype(np.int32), len(prompt)))
    return [{"score": float(np.sum(scores, dtype=np.float64)), "token_scores": scores.tolist()}
            for scores in _scored(config, log_probs, params, rows_of, positions)]


def text_perplexities(config: InferConfig, log_probs: LogProbs, params: Any,
                      texts: Sequence[np.ndarray]) -> list[dict[str, float]]:
    """Per text ``{"ppl", "nll", "tokens"}``: the text and EOS from BOS, cut as ``perplexity`` cuts it."""
    limit = int(config.max_target_length)
    rows_of = [(np.append(ids[:limit - 1], EOS_ID).astype(np.int32), 0) for ids in texts]
    out = []
    for scores in _scored(config, log_probs, params, rows_of, limit):
        nll = -float(np.sum(scores, dtype=np.float64)) / len(scores)
        out.append({"ppl": math.exp(min(nll, 50.0)), "nll": nll, "tokens": float(len(scores))})
    return out


def _scored(config: InferConfig, log_probs: LogProbs, params: Any, rows_of: list[tuple[np.ndarray, int]],
            limit: int) -> list[np.ndarray]:
    """Each ``(targets, first scored position)``'s token log-probs from that position on, in bucketed batches."""
    rows = compiled.row_bucket(len(rows_of), config.eval_batch_size)
    out = []
    for start in range(0, len(rows_of), rows):
        chunk = rows_of[start:start + rows]
        width = compiled.width_bucket(max(len(targets) for targets, _ in chunk), limit)
        targets_BT = compiled.pad_rows([targets for targets, _ in chunk], rows, width)
        logp_BT = np.asarray(log_probs(params, targets_BT))
        out += [logp_BT[row, first:len(targets)] for row, (targets, first) in enumerate(chunk)]
    return out
