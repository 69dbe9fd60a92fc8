"""A language model's scored hypotheses for prompts of different lengths: beams or samples continuing each prompt.

Each prompt is a forced prefix (``search.Prefix``) of its row, so prompts of any lengths share one program per width
bucket. A hypothesis is the continuation alone (at most ``max_len`` tokens with EOS), scored ``sum(token_scores) /
len**lenpen`` over it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from lconv.constants import PAD_ID
from lconv.infer import guards as guards_lib
from lconv.infer import search

if TYPE_CHECKING:
    import flax.linen as nn

Array = jax.Array


def lm_hypotheses(model: nn.Module, variables: Any, prompt_BP: Array, prompt_len_B: Array, *, max_len: int,
                  beam_size: int, lenpen: Array | float, stop: str, temperature: float, top_k: int, top_p: float,
                  rng: Array | None = None, guards: guards_lib.Guards | None = None) -> search.Hypotheses:
    """``beam_size`` continuations per right-padded prompt (``prompt_len_B`` tokens), best first, ``[B, N, max_len]``:
    beams or, with ``temperature > 0``, samples; ``guards`` count ``min_len`` in continuation tokens."""
    variables = {name: v for name, v in variables.items() if name != "cache"}
    B, P = prompt_BP.shape
    N, total = beam_size, P + max_len

    def tokens_to_logits(tokens_BT, cache):
        logits_BTV, mutated = model.apply({**variables, "cache": cache}, tokens_BT, decode=True, shift=False,
                                          mutable=["cache"])
        return logits_BTV, mutated["cache"]

    _, cache = tokens_to_logits(jnp.zeros((B, total), jnp.int32), {})  # a cache of ``total`` positions
    prompt = search.Prefix(prompt_BP, prompt_len_B)
    limit_B = prompt_len_B + max_len  # [B] the prompt and at most max_len new tokens, EOS included
    start = model.config.decoder_start_id
    if not temperature:
        found = search.beam_search(tokens_to_logits, cache, B, N, total, lenpen=lenpen, bos_id=start,
                                   max_len_per_row=limit_B, stop=stop, with_token_scores=True, prefix=prompt,
                                   prefix_scored=False, guards=guards)
        return search.Hypotheses(_after_prompt(found.tokens, prompt_len_B, max_len), found.scores,
                                 _after_prompt(found.token_scores, prompt_len_B, max_len))
    fold_n = lambda key: jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(N))  # noqa: E731  [N]
    keys = jax.vmap(fold_n)(search.row_keys(rng, prompt_BP)).reshape(B * N)  # [B*N]: row b*N + n
    tokens, token_scores = search.sample(tokens_to_logits, search.tile_cache(cache, B, N), B * N, total, keys,
                                         temperature=temperature, top_k=top_k, top_p=top_p, bos_id=start,
                                         max_len_per_row=jnp.repeat(limit_B, N), with_token_scores=True,
                                         prefix=prompt.repeat(N), guards=guards,
                                         output_start_B=jnp.repeat(prompt_len_B, N))
    tokens_BNL = _after_prompt(tokens.reshape(B, N, total), prompt_len_B, max_len)  # [B, N, max_len]
    token_scores_BNL = _after_prompt(token_scores.reshape(B, N, total), prompt_len_B, max_len)
    length_BN = jnp.sum(tokens_BNL != PAD_ID, axis=-1).astype(jnp.float32)  # [B, N] EOS included
    scores_BN = jnp.sum(token_scores_BNL, axis=-1) / jnp.power(length_BN, jnp.float32(lenpen))  # [B, N]
    order_BN = jnp.argsort(-scores_BN, axis=1)  # [B, N] best first
    best_first = lambda x_BNL: jnp.take_along_axis(x_BNL, order_BN[:, :, None], axis=1)  # noqa: E731
    return search.Hypotheses(best_first(tokens_BNL), jnp.take_along_axis(scores_BN, order_BN, axis=1),
                             best_first(token_scores_BNL))


def _after_prompt(x_BNT: Array, prompt_len_B: Array, max_len: int) -> Array:
    """``[B, N, P + max_len] -> [B, N, max_len]``: row b's ``max_len`` positions after its prompt."""
    index_BNL = (prompt_len_B[:, None, None] + jnp.arange(max_len)[None, None, :])  # [B, 1, max_len]
    index_BNL = jnp.broadcast_to(index_BNL, (*x_BNT.shape[:2], max_len))  # [B, N, max_len]
    return jnp.take_along_axis(x_BNT, index_BNL, axis=2)
