"""Autoregressive decoding on incremental caches: greedy, beam search (fairseq's scoring), sampling.

Everything here is model agnostic and jit-able: the token loop is a ``jax.lax.while_loop`` over one step
function, the **``tokens_to_logits`` contract**::

    logits_BSV, new_cache = tokens_to_logits(tokens_BS, cache)

``tokens_BS`` is a chunk of ``S >= 1`` new decoder inputs per row (the search functions feed ``S = 1``; ``sample``
feeds ``[BOS, prompt...]`` as one first chunk); ``logits_BSV`` are the next-token logits of every position in the
chunk (only the last is used); ``cache`` is the Flax ``'cache'`` collection (any pytree). Cache leaves have the
batch as leading dim, except scalar counters (``position``, ``cache_index``), which are never tiled or reordered.

Token ids follow ``lconv.models``: ``PAD = 0`` (never generated; finished rows emit it after ``EOS``), ``EOS = 1``,
``BOS = 3`` (the first decoder input). Outputs hold the generated tokens only, ``[..., max_len]``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PAD_ID, EOS_ID, BOS_ID = 0, 1, 3
NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------------------------------------------
# Cache helpers
# ----------------------------------------------------------------------------------------------------------------
BEAM_INVARIANT_PREFIX = "beam_invariant_"  # cache entries equal on every beam of a row (e.g. projected encoder keys)


def tile_cache(cache, batch_size, beam_size):
    """Repeats every batch leaf ``[B, ...] -> [B*beam, ...]`` (row ``b*beam + k`` = beam k of row b).

    Scalars (counters shared by all rows) and ``beam_invariant_*`` entries (the same for every beam of a row;
    their module folds the beams into its queries) stay as they are.
    """
    def tile(path, x):
        if x.ndim == 0 or _beam_invariant(path):
            return x
        if x.shape[0] != batch_size:
            raise ValueError(f"cache leaf of shape {x.shape} has no leading batch dim {batch_size}; "
                             "cache leaves must be [batch, ...] or scalars")
        return jnp.repeat(x, beam_size, axis=0)  # [B*beam, ...]
    return jax.tree_util.tree_map_with_path(tile, cache)


def _beam_invariant(path):
    return bool(path) and str(getattr(path[-1], "key", "")).startswith(BEAM_INVARIANT_PREFIX)


def gather_beams(cache, beam_idx_Bk):
    """Reorders a tiled cache: new beam k of row b takes old beam ``beam_idx[b, k]``.

    Scalars are kept, and so are ``beam_invariant_*`` entries (see ``tile_cache``): reordering the beams of a row
    leaves them unchanged.
    """
    B, k = beam_idx_Bk.shape
    flat_idx = (jnp.arange(B)[:, None] * k + beam_idx_Bk).reshape(-1)  # [B*beam]

    def gather(path, x):
        if x.ndim == 0 or _beam_invariant(path):
            return x
        return jnp.take(x, flat_idx, axis=0)

    return jax.tree_util.tree_map_with_path(gather, cache)


def _last_logits(tokens_to_logits, tokens_BS, cache):
    logits_BSV, cache = tokens_to_logits(tokens_BS, cache)
    return logits_BSV[:, -1].astype(jnp.float32), cache  # [B, V]


def _mask_pad(logits_XV, pad_id):
    return logits_XV.at[..., pad_id].set(NEG_INF)  # PAD is never generated


# ----------------------------------------------------------------------------------------------------------------
# Greedy and sampling
# ----------------------------------------------------------------------------------------------------------------
def greedy_search(tokens_to_logits, cache, batch_size, max_len, *, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID):
    """Argmax decoding, ``[B, max_len]``; stops when every row has emitted EOS (rows without one are cut)."""
    return sample(tokens_to_logits, cache, batch_size, max_len, None, temperature=0.0, bos_id=bos_id,
                  eos_id=eos_id, pad_id=pad_id)


def filter_logits(logits_BV, *, temperature=1.0, top_k=0, top_p=1.0):
    """Temperature, then top-k, then nucleus (smallest set whose mass reaches ``top_p``); the rest get -inf."""
    logits_BV = logits_BV / temperature  # [B, V]
    if top_k:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]  # [B, 1]
        logits_BV = jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)  # [B, V]
    if top_p < 1.0:
        sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # [B, V] descending
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)  # [B, V]
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # [B, V]; the top token always stays
        keep_BV = mass_before_BV < top_p  # [B, V]
        cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
        logits_BV = jnp.where(logits_BV < cutoff_B1, NEG_INF, logits_BV)  # [B, V]
    return logits_BV


def sample(tokens_to_logits, cache, batch_size, max_len, rng, *, temperature=1.0, top_k=0, top_p=1.0,
           prompt=None, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID):
    """Ancestral sampling, ``[B, max_len]`` new tokens; ``temperature=0`` is argmax (``rng`` unused).

    ``prompt [B, P]`` (one length for all rows) is fed as one chunk ``[BOS, prompt...]`` before the first sampled
    token, so the cache must hold ``1 + P + max_len`` positions. Step ``i`` draws with ``fold_in(rng, i)``.
    """
    B = batch_size
    first_BS = jnp.full((B, 1), bos_id, jnp.int32)  # [B, 1]
    if prompt is not None:
        first_BS = jnp.concatenate([first_BS, jnp.asarray(prompt, jnp.int32)], axis=1)  # [B, 1+P]

    def pick(logits_BV, i):
        logits_BV = _mask_pad(logits_BV, pad_id)  # [B, V]
        if temperature == 0.0:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)  # [B]
        logits_BV = filter_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)  # [B, V]
        return jax.random.categorical(jax.random.fold_in(rng, i), logits_BV, axis=-1).astype(jnp.int32)  # [B]

    def step(i, tokens_BL, finished_B, cache, inputs_BS):
        logits_BV, cache = _last_logits(tokens_to_logits, inputs_BS, cache)  # [B, V]
        next_B = jnp.where(finished_B, pad_id, pick(logits_BV, i))  # [B]
        tokens_BL = tokens_BL.at[:, i].set(next_B)  # [B, L]
        return i + 1, tokens_BL, finished_B | (next_B == eos_id), cache

    def cond(state):
        i, _, finished_B, _ = state
        return (i < max_len) & ~jnp.all(finished_B)

    def body(state):
        i, tokens_BL, finished_B, cache = state
        inputs_B1 = jax.lax.dynamic_slice_in_dim(tokens_BL, i - 1, 1, axis=1)  # [B, 1]
        return step(i, tokens_BL, finished_B, cache, inputs_B1)

    tokens_BL = jnp.full((B, max_len), pad_id, jnp.int32)  # [B, L]
    state = step(0, tokens_BL, jnp.zeros((B,), bool), cache, first_BS)  # the (prompt) chunk, outside the loop
    return jax.lax.while_loop(cond, body, state)[1]  # [B, L]


# ----------------------------------------------------------------------------------------------------------------
# Beam search
# ----------------------------------------------------------------------------------------------------------------
def beam_search(tokens_to_logits, cache, batch_size, beam_size, max_len, *, lenpen=1.0, bos_id=BOS_ID,
                eos_id=EOS_ID, pad_id=PAD_ID, max_len_per_row=None):
    """Beam search with fairseq's scores; returns ``tokens [B, beam, max_len]``, ``scores [B, beam]``, best first.

    A finished hypothesis scores ``sum(log p) / length**lenpen`` (EOS counted in both). Alive and finished
    hypotheses are kept apart, so an EOS never takes an alive slot: each step ranks the top ``2*beam``
    extensions, the best ``beam`` non-EOS ones stay alive, EOS ones compete for the finished set. EOS is forced at
    ``max_len_per_row[b]`` tokens (EOS included; default ``max_len``). A row stops searching once no alive
    hypothesis can beat its worst finished one (log-probs only fall; the length bonus is at most
    ``max(len)**lenpen``). ``cache`` is for ``batch_size`` rows; it is tiled per beam here. Empty finished slots
    score -inf and hold PAD.
    """
    B, k, L = batch_size, beam_size, max_len
    lenpen = jnp.float32(lenpen)
    if max_len_per_row is None:
        limit_B = jnp.full((B,), L, jnp.int32)  # [B]
    else:
        limit_B = jnp.clip(jnp.asarray(max_len_per_row, jnp.int32), 1, L)  # [B]
    max_pen_B = jnp.power(limit_B.astype(jnp.float32), lenpen)  # [B]

    def cond(state):
        i, _, alive_logp_Bk, _, finished_Bk, _ = state
        best_pen_B = jnp.maximum(jnp.power((i + 1).astype(jnp.float32), lenpen), max_pen_B)  # [B]
        best_alive_B = jnp.max(alive_logp_Bk, axis=-1) / best_pen_B  # [B] upper bound of any future score
        done_B = finished_Bk[:, -1] >= best_alive_B  # [B] worst finished beats every alive hypothesis
        return (i < L) & ~jnp.all(done_B)

    def body(state):
        i, alive_BkL, alive_logp_Bk, finished_BkL, finished_Bk, cache = state
        last_Bk1 = jax.lax.dynamic_slice_in_dim(alive_BkL, jnp.maximum(i - 1, 0), 1, axis=2)  # [B, beam, 1]
        prev_Bk1 = jnp.where(i == 0, bos_id, last_Bk1)  # [B, beam, 1]
        logits_NV, cache = _last_logits(tokens_to_logits, prev_Bk1.reshape(B * k, 1), cache)  # [B*beam, V]
        logp_BkV = jax.nn.log_softmax(logits_NV, axis=-1).reshape(B, k, -1)  # [B, beam, V]
        V = logp_BkV.shape[-1]
        logp_BkV = _mask_pad(logp_BkV, pad_id)  # [B, beam, V]
        at_limit_B = i + 1 >= limit_B  # [B] this token is the row's last
        only_eos_V = jnp.arange(V) == eos_id  # [V]
        logp_BkV = jnp.where(at_limit_B[:, None, None] & ~only_eos_V, NEG_INF, logp_BkV)  # [B, beam, V]
        cand_BkV = alive_logp_Bk[:, :, None] + logp_BkV  # [B, beam, V]

        # The top 2*beam extensions: at most beam of them end in EOS, so beam non-EOS ones remain alive.
        top_logp_B2k, top_idx_B2k = jax.lax.top_k(cand_BkV.reshape(B, k * V), min(2 * k, k * V))  # [B, 2beam]
        top_beam_B2k = top_idx_B2k // V  # [B, 2beam] which alive beam it extends
        top_tok_B2k = (top_idx_B2k % V).astype(jnp.int32)  # [B, 2beam]
        top_seqs_B2kL = jnp.take_along_axis(alive_BkL, top_beam_B2k[:, :, None], axis=1)  # [B, 2beam, L]
        top_seqs_B2kL = top_seqs_B2kL.at[:, :, i].set(top_tok_B2k)  # [B, 2beam, L]
        is_eos_B2k = top_tok_B2k == eos_id  # [B, 2beam]

        # Alive: the best beam non-EOS extensions; the cache follows the beams they extend.
        alive_cand_B2k = jnp.where(is_eos_B2k, NEG_INF, top_logp_B2k)  # [B, 2beam]
        alive_logp_Bk, keep_Bk = jax.lax.top_k(alive_cand_B2k, k)  # [B, beam]
        alive_BkL = jnp.take_along_axis(top_seqs_B2kL, keep_Bk[:, :, None], axis=1)  # [B, beam, L]
        cache = gather_beams(cache, jnp.take_along_axis(top_beam_B2k, keep_Bk, axis=1))  # [B*beam, ...]

        # Finished: EOS extensions, length-normalised, merged with the finished set.
        length_pen = jnp.power((i + 1).astype(jnp.float32), lenpen)  # ()
        new_scores_B2k = jnp.where(is_eos_B2k, top_logp_B2k / length_pen, NEG_INF)  # [B, 2beam]
        all_scores_B3k = jnp.concatenate([finished_Bk, new_scores_B2k], axis=1)  # [B, 3beam]
        all_seqs_B3kL = jnp.concatenate([finished_BkL, top_seqs_B2kL], axis=1)  # [B, 3beam, L]
        finished_Bk, best_Bk = jax.lax.top_k(all_scores_B3k, k)  # [B, beam]
        finished_BkL = jnp.take_along_axis(all_seqs_B3kL, best_Bk[:, :, None], axis=1)  # [B, beam, L]
        return i + 1, alive_BkL, alive_logp_Bk, finished_BkL, finished_Bk, cache

    seqs_BkL = jnp.full((B, k, L), pad_id, jnp.int32)  # [B, beam, L]
    alive_logp_Bk = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (B, 1))  # [B, beam] one live beam
    finished_Bk = jnp.full((B, k), NEG_INF, jnp.float32)  # [B, beam] empty
    state = (jnp.int32(0), seqs_BkL, alive_logp_Bk, seqs_BkL, finished_Bk, tile_cache(cache, B, k))
    _, _, _, finished_BkL, finished_Bk, _ = jax.lax.while_loop(cond, body, state)
    finished_BkL = jnp.where(finished_Bk[:, :, None] > NEG_INF, finished_BkL, pad_id)  # [B, beam, L]
    return finished_BkL, finished_Bk


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------
def _apply_cache(model, variables, cache, *args, **kwargs):
    out, mutated = model.apply({**variables, "cache": cache}, *args, mutable=["cache"], **kwargs)
    return out, mutated["cache"]


def translate(model, variables, inputs_BS, *, inputs_segmentation=None, beam_size=4, max_len=256, lenpen=1.0,
              max_len_a=None, max_len_b=None, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID):
    """Best beam of an ``EncoderDecoder`` (or any module with its ``encode``/``decode``), ``[B, max_len]``.

    Encodes once; the cache is created for ``B`` rows and tiled per beam by ``beam_search``, the encoder output
    and source ids are tiled here the same way (row ``b*beam + k``). With ``max_len_a``/``max_len_b`` a row may
    generate ``a * src_len + b`` tokens plus EOS (fairseq's limit), and never more than ``max_len``.
    """
    variables = {name: v for name, v in variables.items() if name != "cache"}
    B, k = inputs_BS.shape[0], beam_size
    encoded_BSD = model.apply(variables, inputs_BS, inputs_segmentation=inputs_segmentation, method=model.encode)
    tile = lambda x: None if x is None else jnp.repeat(x, k, axis=0)  # [B, ...] -> [B*beam, ...]
    _, cache = _apply_cache(model, variables, {}, encoded_BSD, inputs_BS, jnp.zeros((B, max_len), jnp.int32),
                            inputs_segmentation=inputs_segmentation, decode=True, method=model.decode)
    encoded_NSD, inputs_NS, segmentation_NS = tile(encoded_BSD), tile(inputs_BS), tile(inputs_segmentation)

    def tokens_to_logits(tokens_NT, cache):
        return _apply_cache(model, variables, cache, encoded_NSD, inputs_NS, tokens_NT,
                            inputs_segmentation=segmentation_NS, decode=True, method=model.decode)

    limit_B = None
    if max_len_a is not None or max_len_b is not None:
        src_len_B = jnp.sum(inputs_BS != pad_id, axis=1).astype(jnp.float32)  # [B]
        limit_B = jnp.floor((max_len_a or 0.0) * src_len_B + (max_len_b or 0)).astype(jnp.int32) + 1  # [B] + EOS
    tokens_BkL, _ = beam_search(tokens_to_logits, cache, B, k, max_len, lenpen=lenpen, bos_id=bos_id,
                                eos_id=eos_id, pad_id=pad_id, max_len_per_row=limit_B)
    return tokens_BkL[:, 0]  # [B, L]


def lm_generate(model, variables, prompt=None, *, max_len, batch_size=None, rng=None, temperature=0.0, top_k=0,
                top_p=1.0, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID):
    """Continues ``prompt [B, P]`` (or starts from BOS) with a ``DecoderOnlyLM``; ``[B, max_len]`` new tokens.

    ``temperature=0`` (the default) is greedy; otherwise ``rng`` is needed.
    """
    variables = {name: v for name, v in variables.items() if name != "cache"}
    if prompt is None and batch_size is None:
        raise ValueError("lm_generate needs a prompt [B, P] or batch_size")
    if temperature != 0.0 and rng is None:
        raise ValueError(f"lm_generate with temperature={temperature} needs rng (or temperature=0 for greedy)")
    B = prompt.shape[0] if prompt is not None else batch_size
    P = prompt.shape[1] if prompt is not None else 0
    _, cache = _apply_cache(model, variables, {}, jnp.zeros((B, 1 + P + max_len), jnp.int32), decode=True,
                            shift=False)

    def tokens_to_logits(tokens_BS, cache):
        return _apply_cache(model, variables, cache, tokens_BS, decode=True, shift=False)

    return sample(tokens_to_logits, cache, B, max_len, rng, temperature=temperature, top_k=top_k, top_p=top_p,
                  prompt=prompt, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
