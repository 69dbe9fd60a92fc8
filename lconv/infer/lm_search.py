"""A language model's scored hypotheses for prompts of different lengths: beams or samples continuing each prompt.

Each prompt is a forced prefix (``search.Prefix``) of its row, so prompts of any lengths share one program per width
bucket. A hypothesis is the continuation alone (at most ``max_len`` tokens with EOS), scored ``sum(token_scores) /
len**lenpen`` over it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

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
    B, P = prompt_BP.shape
    N, total = beam_size, P + max_len
    tokens_to_logits, cache = search.lm_decoder(model, variables, B, total)
    prompt = search.Prefix(prompt_BP, prompt_len_B)
    limit_B = prompt_len_B + max_len  # [B] the prompt and at most max_len new tokens, EOS included
    start = model.config.decoder_start_id
    if not temperature:
        found = search.beam_search(tokens_to_logits, cache, B, N, total, lenpen=lenpen, bos_id=start,
                                   max_len_per_row=limit_B, stop=stop, with_token_scores=True, prefix=prompt,
                                   prefix_scored=False, guards=guards)
        return search.Hypotheses(_after_prompt(found.tokens, prompt_len_B, max_len), found.scores,
                                 _after_prompt(found.token_scores, prompt_len_B, max_len))
    return search.sampled_hypotheses(tokens_to_logits, cache, search.row_keys(rng, prompt_BP), N, total,
                                     lenpen=lenpen, limit_B=limit_B, temperature=temperature, top_k=top_k,
                                     top_p=top_p, bos_id=start, prefix=prompt, guards=guards,
                                     output_start_B=prompt_len_B,
                                     scored=lambda x_BNT: _after_prompt(x_BNT, prompt_len_B, max_len))


def _after_prompt(x_BNT: Array, prompt_len_B: Array, max_len: int) -> Array:
    """``[B, N, P + max_len] -> [B, N, max_len]``: row b's ``max_len`` positions after its prompt."""
    index_BNL = (prompt_len_B[:, None, None] + jnp.arange(max_len)[None, None, :])  # [B, 1, max_len]
    index_BNL = jnp.broadcast_to(index_BNL, (*x_BNT.shape[:2], max_len))  # [B, N, max_len]
    return jnp.take_along_axis(x_BNT, index_BNL, axis=2)
