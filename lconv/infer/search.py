"""Autoregressive decoding on incremental caches: greedy, beam search (fairseq's scoring), sampling.

Everything here is model agnostic and jit-able: the token loop is a ``jax.lax.while_loop`` over one step function::

    logits_BTV, new_cache = tokens_to_logits(tokens_BT, cache)

``tokens_BT`` is a chunk of ``T >= 1`` new decoder inputs per row (the searches feed one token; ``sample`` feeds
``[BOS, prompt...]`` as a first chunk), and only the last position's logits are read. ``cache`` is any pytree whose
leaves lead with the batch, except scalar counters (``position``, ``cache_index``), never tiled or reordered. PAD
is never generated (finished rows emit it after EOS); outputs hold the generated tokens only, ``[..., max_len]``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

from lconv.constants import BOS_ID, EOS_ID, IMPOSSIBLE_LOGP, PAD_ID, STOP_RULES
from lconv.errors import UserError
from lconv.infer import guards as guards_lib
from lconv.infer.guards import Guards
from lconv.infer.prefix import Prefix  # noqa: F401 (search.Prefix, as the callers name it)
from lconv.ops.top_k import rowwise_top_k  # per shard of the rows: XLA cannot split a TopK

if TYPE_CHECKING:
    import flax.linen as nn

Array = jax.Array
# (tokens_BT, cache) -> (logits_BTV, new cache); the contract above
TokensToLogits = Callable[[Array, Any], tuple[Array, Any]]


class Hypotheses(NamedTuple):
    """``N`` hypotheses per row, best first (``translate_hypotheses``, ``beam_search(..., with_token_scores=True)``)."""

    tokens: Array  # [B, N, L] the generated tokens, EOS last, PAD after (an empty slot: all PAD)
    scores: Array  # [B, N] sum(token_scores) / length**lenpen, EOS counted in both (an empty slot: -inf)
    token_scores: Array  # [B, N, L] each token's log-prob under the model (log_softmax of its logits), 0 after EOS


# Cache helpers
BEAM_INVARIANT_PREFIX = "beam_invariant_"  # cache entries equal on every beam of a row (e.g. projected encoder keys)


def tile_cache(cache: Any, batch_size: int, beam_size: int) -> Any:
    """Repeats every batch leaf ``[B, ...] -> [B*beam, ...]``; scalars and ``beam_invariant_*`` entries stay."""
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


def gather_beams(cache: Any, beam_idx_BN: Array) -> Any:
    """Reorders a tiled cache: new beam n of row b takes old beam ``beam_idx[b, n]``."""
    B, N = beam_idx_BN.shape

    def gather(path, x):
        if x.ndim == 0 or _beam_invariant(path):
            return x
        # Per row (not a gather over the flat B*beam axis), so a mesh's batch split stays local to each device.
        x_BN_ = x.reshape(B, N, *x.shape[1:])  # [B, beam, ...]
        index_BN_ = beam_idx_BN.reshape(B, N, *([1] * (x.ndim - 1)))  # [B, beam, 1...]
        return jnp.take_along_axis(x_BN_, index_BN_, axis=1).reshape(x.shape)  # [B*beam, ...]

    return jax.tree_util.tree_map_with_path(gather, cache)


def _last_logits(tokens_to_logits, tokens_BT, cache):
    logits_BTV, cache = tokens_to_logits(tokens_BT, cache)
    return logits_BTV[:, -1].astype(jnp.float32), cache  # [B, V]


def _mask_pad(logits_XV, pad_id):
    return logits_XV.at[..., pad_id].set(IMPOSSIBLE_LOGP)  # PAD is never generated


# Sampling
def filter_logits(logits_BV: Array, *, temperature: float, top_k: int, top_p: float) -> Array:
    """Temperature, then top-k, then nucleus (smallest set whose mass reaches ``top_p``); the rest get -inf."""
    logits_BV = logits_BV / temperature  # [B, V]
    if top_k:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]  # [B, 1]
        logits_BV = jnp.where(logits_BV < kth_B1, IMPOSSIBLE_LOGP, logits_BV)  # [B, V]
    if top_p < 1.0:
        sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # [B, V] descending
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)  # [B, V]
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # [B, V]; the top token always stays
        keep_BV = mass_before_BV < top_p  # [B, V]
        cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
        logits_BV = jnp.where(logits_BV < cutoff_B1, IMPOSSIBLE_LOGP, logits_BV)  # [B, V]
    return logits_BV


def sample(tokens_to_logits: TokensToLogits, cache: Any, batch_size: int, max_len: int, rng: Array | None, *,
           temperature: float, top_k: int, top_p: float, prompt: Array | None = None,
           bos_id: int = BOS_ID, eos_id: int = EOS_ID, pad_id: int = PAD_ID, max_len_per_row: Array | None = None,
           with_token_scores: bool = False, prefix: Prefix | None = None, guards: Guards | None = None,
           output_start_B: Array | None = None) -> Array | tuple[Array, Array]:
    """Ancestral sampling, ``[B, max_len]`` new tokens; ``temperature=0`` is argmax (``rng`` unused).

    ``prompt [B, T]`` is fed as one chunk after BOS. ``rng``: one key or ``[B]`` keys (``row_keys``). ``max_len_per_row
    [B]`` forces EOS at a row's limit. ``with_token_scores``: also the chosen tokens' log-probs (before temperature and
    filters). ``prefix`` forces each row's first tokens; ``guards`` act from ``output_start_B`` on.
    """
    B = batch_size
    if prefix is not None:
        max_len_per_row = prefix.limits(max_len_per_row, B, max_len)
    first_BT = jnp.full((B, 1), bos_id, jnp.int32)  # [B, 1]
    if prompt is not None:
        first_BT = jnp.concatenate([first_BT, jnp.asarray(prompt, jnp.int32)], axis=1)  # [B, 1+T]
    keys_B = None
    if temperature != 0.0:
        keys_B = rng if rng.shape == (B,) else jnp.broadcast_to(rng, (B,))  # [B] keys

    def pick(logits_BV, i, tokens_BL):
        logits_BV = _mask_pad(logits_BV, pad_id)  # [B, V]
        if max_len_per_row is not None:
            at_limit_B1 = (i + 1 >= max_len_per_row)[:, None]  # this token is the row's last
            logits_BV = jnp.where(at_limit_B1 & (jnp.arange(logits_BV.shape[-1]) != eos_id), IMPOSSIBLE_LOGP,
                                  logits_BV)  # [B, V]
        if guards is not None:
            logits_BV = guards_lib.apply(logits_BV[:, None], tokens_BL[:, None], i, guards, eos_id=eos_id,
                                         start_B=output_start_B, limit_B=max_len_per_row)[:, 0]  # [B, V]
        if temperature == 0.0:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)  # [B]
        logits_BV = filter_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)  # [B, V]
        draw = lambda key, logits_V: jax.random.categorical(jax.random.fold_in(key, i), logits_V)  # noqa: E731
        return jax.vmap(draw)(keys_B, logits_BV).astype(jnp.int32)  # [B]: row by row, each with its own key

    def pick_or_force(logits_BV, i, tokens_BL):
        picked_B = pick(logits_BV, i, tokens_BL)  # [B]
        if prefix is None:
            return picked_B
        forcing_B, forced_B = prefix.at(i)
        return jnp.where(forcing_B, forced_B, picked_B)  # [B]

    def step(i, tokens_BL, scores_BL, finished_B, cache, inputs_BT):
        logits_BV, cache = _last_logits(tokens_to_logits, inputs_BT, cache)  # [B, V]
        next_B = jnp.where(finished_B, pad_id, pick_or_force(logits_BV, i, tokens_BL))  # [B]
        tokens_BL = tokens_BL.at[:, i].set(next_B)  # [B, L]
        if with_token_scores:
            logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV), next_B[:, None], axis=1)[:, 0]  # [B]
            scores_BL = scores_BL.at[:, i].set(jnp.where(finished_B, 0.0, logp_B))  # [B, L]
        return i + 1, tokens_BL, scores_BL, finished_B | (next_B == eos_id), cache

    def cond(state):
        i, _, _, finished_B, _ = state
        return (i < max_len) & ~jnp.all(finished_B)

    def body(state):
        i, tokens_BL, scores_BL, finished_B, cache = state
        inputs_B1 = jax.lax.dynamic_slice_in_dim(tokens_BL, i - 1, 1, axis=1)  # [B, 1]
        return step(i, tokens_BL, scores_BL, finished_B, cache, inputs_B1)

    tokens_BL = jnp.full((B, max_len), pad_id, jnp.int32)  # [B, L]
    scores_BL = jnp.zeros((B, max_len if with_token_scores else 0), jnp.float32)  # [B, L] (or none kept)
    state = step(0, tokens_BL, scores_BL, jnp.zeros((B,), bool), cache, first_BT)  # the (prompt) chunk first
    _, tokens_BL, scores_BL, _, _ = jax.lax.while_loop(cond, body, state)
    return (tokens_BL, scores_BL) if with_token_scores else tokens_BL  # [B, L]


def row_keys(rng: Array, ids_BT: Array) -> Array:
    """One key per row, ``[B]``: ``rng`` folded with a hash of the row's ids, so draws follow content only."""
    multiplier = jnp.uint32(0x01000193)  # FNV-1's 32-bit prime: odd, so each position's term is a bijection
    powers_T = jnp.cumprod(jnp.full((ids_BT.shape[1],), multiplier, jnp.uint32))  # [T], wrapping mod 2**32
    hash_B = jnp.sum(ids_BT.astype(jnp.uint32) * powers_T, axis=1, dtype=jnp.uint32)  # [B]; PAD = 0 adds 0
    return jax.vmap(jax.random.fold_in, (None, 0))(rng, hash_B)  # [B]


# Beam search
def beam_search(tokens_to_logits: TokensToLogits, cache: Any, batch_size: int, beam_size: int, max_len: int, *,
                lenpen: float, stop: str, bos_id: int = BOS_ID, eos_id: int = EOS_ID, pad_id: int = PAD_ID,
                max_len_per_row: Array | None = None, with_token_scores: bool = False, prefix: Prefix | None = None,
                prefix_scored: bool = True, guards: Guards | None = None) -> tuple[Array, Array] | Hypotheses:
    """Beam search with fairseq's scores (``sum(log p) / length**lenpen``): ``tokens [B, beam, max_len]``, ``scores [B,
    beam]``, best first (a ``Hypotheses`` with ``with_token_scores``); empty slots score -inf.

    EOS is forced at ``max_len_per_row[b]`` tokens. ``stop``: ``"optimal"`` or ``"fairseq"`` (docs/training.md).
    ``cache`` is for ``batch_size`` rows. ``prefix`` forces each row's first tokens (unscored with
    ``prefix_scored=False``); what ``guards`` ban is never taken.
    """
    B, N, L = batch_size, beam_size, max_len
    if stop not in STOP_RULES:
        raise UserError(f"decode.stop={stop!r}: must be one of {', '.join(STOP_RULES)}")
    fairseq = stop == "fairseq"
    limit_B, penalty = _limits_and_penalty(B, L, max_len_per_row, prefix, prefix_scored, jnp.float32(lenpen))
    max_pen_B = penalty(limit_B)  # [B]

    def cond(state):
        i, _, alive_logp_BN, _, finished_BN, _, count_B = state
        if fairseq:
            return (i < L) & ~jnp.all(count_B >= N)
        best_pen_B = jnp.maximum(penalty(i + 1), max_pen_B)  # [B]
        best_alive_B = jnp.max(alive_logp_BN, axis=-1) / best_pen_B  # [B] upper bound of any future score
        done_B = finished_BN[:, -1] >= best_alive_B  # [B] worst finished beats every alive hypothesis
        return (i < L) & ~jnp.all(done_B)

    def body(state):
        i, alive, alive_logp_BN, finished, finished_BN, cache, count_B = state
        last_BN1 = jax.lax.dynamic_slice_in_dim(alive[0], jnp.maximum(i - 1, 0), 1, axis=2)  # [B, beam, 1]
        prev_BN1 = jnp.where(i == 0, bos_id, last_BN1)  # [B, beam, 1]
        flat_logits, cache = _last_logits(tokens_to_logits, prev_BN1.reshape(B * N, 1), cache)  # [B*beam, V]
        logp_BNV = _allowed_logp(flat_logits.reshape(B, N, -1), i, limit_B, eos_id, pad_id, fairseq, prefix,
                                 prefix_scored, guards, alive[0])  # [B, beam, V]
        V = logp_BNV.shape[-1]
        cand_BNV = alive_logp_BN[:, :, None] + logp_BNV  # [B, beam, V]

        # The top 2*beam extensions: at most beam of them end in EOS, so beam non-EOS ones remain alive.
        top_logp_B2N, top_idx_B2N = rowwise_top_k(cand_BNV.reshape(B, N * V), min(2 * N, N * V))  # [B, 2beam]
        top_beam_B2N = top_idx_B2N // V  # [B, 2beam] which alive beam it extends
        top_tok_B2N = (top_idx_B2N % V).astype(jnp.int32)  # [B, 2beam]
        top_tok_logp_B2N = jnp.take_along_axis(logp_BNV.reshape(B, N * V), top_idx_B2N, axis=1)  # [B, 2beam]
        top = jax.tree.map(lambda seqs_BNL, new_B2N: _take(seqs_BNL, top_beam_B2N).at[:, :, i].set(new_B2N),
                           alive, (top_tok_B2N, top_tok_logp_B2N))  # [B, 2beam, L] each
        is_eos_B2N = top_tok_B2N == eos_id  # [B, 2beam]

        # Alive: the best beam non-EOS extensions; the cache follows the beams they extend.
        alive_cand_B2N = jnp.where(is_eos_B2N, IMPOSSIBLE_LOGP, top_logp_B2N)  # [B, 2beam]
        alive_logp_BN, keep_BN = rowwise_top_k(alive_cand_B2N, N)  # [B, beam]
        alive = jax.tree.map(lambda seqs: _take(seqs, keep_BN), top)  # [B, beam, L] each
        cache = gather_beams(cache, jnp.take_along_axis(top_beam_B2N, keep_BN, axis=1))  # [B*beam, ...]

        # Finished: EOS extensions, length-normalised, merged with the finished set.
        length_pen_B1 = penalty(i + 1)[:, None]  # [B, 1]
        new_scores_B2N = jnp.where(is_eos_B2N, top_logp_B2N / length_pen_B1, IMPOSSIBLE_LOGP)  # [B, 2beam]
        if fairseq:
            finished, finished_BN, count_B = _append_finished(
                finished, finished_BN, count_B, top, new_scores_B2N, is_eos_B2N, top_logp_B2N)
        else:
            finished, finished_BN = _best_finished(finished, finished_BN, top, new_scores_B2N, N)
        return i + 1, alive, alive_logp_BN, finished, finished_BN, cache, count_B

    empty = (jnp.full((B, N, L), pad_id, jnp.int32), jnp.zeros((B, N, L), jnp.float32))
    # [B, beam]: one live beam per row at the start
    alive_logp_BN = jnp.tile(jnp.array([0.0] + [IMPOSSIBLE_LOGP] * (N - 1), jnp.float32), (B, 1))
    finished_BN = jnp.full((B, N), IMPOSSIBLE_LOGP, jnp.float32)  # [B, beam] empty
    state = (jnp.int32(0), empty, alive_logp_BN, empty, finished_BN, tile_cache(cache, B, N),
             jnp.zeros((B,), jnp.int32))
    _, _, _, finished, finished_BN, _, _ = jax.lax.while_loop(cond, body, state)
    found = _sorted_finished(finished, finished_BN, fairseq, pad_id)
    return found if with_token_scores else (found.tokens, found.scores)


def _sorted_finished(finished, finished_BN, fairseq, pad_id) -> Hypotheses:
    """The finished set, best first, empty slots holding PAD (and token scores 0)."""
    if fairseq:  # slots are in order of finishing
        none = jax.tree.map(lambda seqs: seqs[:, :0], finished)
        finished, finished_BN = _best_finished(none, finished_BN[:, :0], finished, finished_BN, finished_BN.shape[1])
    filled_BN1 = (finished_BN > IMPOSSIBLE_LOGP)[:, :, None]
    return Hypotheses(jnp.where(filled_BN1, finished[0], pad_id), finished_BN, jnp.where(filled_BN1, finished[1], 0.0))


def _take(seqs_BXL: Array, index_BY: Array) -> Array:
    """Hypotheses ``index[b, y]`` of each row: ``[B, X, L] -> [B, Y, L]``."""
    return jnp.take_along_axis(seqs_BXL, index_BY[:, :, None], axis=1)


def _limits_and_penalty(B, L, max_len_per_row, prefix, prefix_scored, lenpen):
    """``(limit_B, penalty)``: the tokens each row may have (EOS included), and the length penalty function."""
    limit_B = jnp.clip(jnp.full((B,), L) if max_len_per_row is None else jnp.asarray(max_len_per_row), 1, L)
    limit_B = limit_B.astype(jnp.int32)  # [B]
    if prefix is not None:
        limit_B = prefix.limits(limit_B, B, L)
    unscored_B = jnp.zeros((B,), jnp.int32) if prefix is None or prefix_scored else prefix.length  # [B]

    def penalty(length_B):  # [B]
        return jnp.power(jnp.maximum(length_B - unscored_B, 1).astype(jnp.float32), lenpen)

    return limit_B, penalty


def _allowed_logp(logits_BNV, i, limit_B, eos_id, pad_id, fairseq, prefix=None, prefix_scored=True, guards=None,
                  history_BNL=None):
    """Step ``i``'s log-probs with what may not come masked and the rows in their ``prefix`` forced."""
    logp_BNV = _mask_pad(jax.nn.log_softmax(logits_BNV, axis=-1), pad_id)  # [B, beam, V]
    at_limit_B11 = (i + 1 >= limit_B)[:, None, None]  # this token is the row's last
    only_eos_V = jnp.arange(logp_BNV.shape[-1]) == eos_id  # [V]
    logp_BNV = jnp.where(at_limit_B11 & ~only_eos_V, IMPOSSIBLE_LOGP, logp_BNV)
    if fairseq:
        logp_BNV = jnp.where((i == 0) & only_eos_V & ~at_limit_B11, IMPOSSIBLE_LOGP, logp_BNV)
    if guards is not None:
        start_B = None if prefix is None or prefix_scored else prefix.length  # [B]
        logp_BNV = guards_lib.apply(logp_BNV, history_BNL, i, guards, eos_id=eos_id, start_B=start_B, limit_B=limit_B)
    if prefix is not None:
        logp_BNV = _forced_logp(logp_BNV, logits_BNV, prefix, i, prefix_scored)
    return logp_BNV


def _forced_logp(logp_BNV, logits_BNV, prefix, i, scored):
    """Step ``i``'s log-probs with the rows in their prefix forced: the prefix token keeps its log-prob (0 unscored)."""
    forcing_B, forced_B = prefix.at(i)  # [B], [B]
    is_forced_BNV = jnp.arange(logp_BNV.shape[-1]) == forced_B[:, None, None]  # [B, 1, V]
    model_BNV = jax.nn.log_softmax(logits_BNV, axis=-1) if scored else jnp.zeros_like(logp_BNV)  # [B, beam, V]
    kept_BNV = jnp.where(is_forced_BNV, model_BNV, IMPOSSIBLE_LOGP)  # [B, beam, V]
    return jnp.where(forcing_B[:, None, None], kept_BNV, logp_BNV)  # [B, beam, V]


def _best_finished(finished, finished_BN, top, scores_B2N, keep):
    """The default rule: the ``keep`` best of the finished set and this step's EOS extensions."""
    all_scores_B3N = jnp.concatenate([finished_BN, scores_B2N], axis=1)  # [B, 3beam]
    finished_BN, best_BN = rowwise_top_k(all_scores_B3N, keep)  # [B, beam]
    return jax.tree.map(lambda old, new: _take(jnp.concatenate([old, new], axis=1), best_BN), finished, top), \
        finished_BN


def _append_finished(finished, finished_BN, count_B, top, scores_B2N, is_eos_B2N, top_logp_B2N):
    """fairseq's rule: EOS extensions among the top ``beam`` fill a row's free finished slots in rank order."""
    N = finished_BN.shape[1]
    rank_2N = jnp.arange(2 * N)
    eligible_B2N = is_eos_B2N & (rank_2N < N)[None] & (top_logp_B2N > IMPOSSIBLE_LOGP / 2)  # [B, 2beam]
    slot_B2N = count_B[:, None] + jnp.cumsum(eligible_B2N, axis=1) - 1  # [B, 2beam] the slot each would fill
    take_B2N = eligible_B2N & (slot_B2N < N)
    into_B2NN = (slot_B2N[:, :, None] == jnp.arange(N)) & take_B2N[:, :, None]  # [B, 2beam, beam] one-hot
    filled_BN = jnp.any(into_B2NN, axis=1)  # [B, beam]
    # Selections as masked sums, not dots: a float32 dot may run as TF32 on a GPU and round the scores.
    new_scores_BN = jnp.sum(jnp.where(into_B2NN, scores_B2N[:, :, None], 0.0), axis=1)  # [B, beam]
    finished_BN = jnp.where(filled_BN, new_scores_BN, finished_BN)

    def fill(old_BNL, new_B2NL):
        selected_BNL = jnp.sum(jnp.where(into_B2NN[..., None], new_B2NL[:, :, None], 0), axis=1)  # [B, beam, L]
        return jnp.where(filled_BN[:, :, None], selected_BNL, old_BNL)

    return jax.tree.map(fill, finished, top), finished_BN, count_B + jnp.sum(take_B2N, axis=1)


# Models
def _apply_cache(model, variables, cache, *args, **kwargs):
    out, mutated = model.apply({**variables, "cache": cache}, *args, mutable=["cache"], **kwargs)
    return out, mutated["cache"]


def lm_decoder(model: nn.Module, variables: Any, batch_size: int, positions: int) -> tuple[TokensToLogits, Any]:
    """A ``DecoderOnlyLM``'s step function and its empty cache of ``positions`` positions for ``batch_size`` rows."""
    variables = {name: v for name, v in variables.items() if name != "cache"}

    def tokens_to_logits(tokens_BT, cache):
        return _apply_cache(model, variables, cache, tokens_BT, decode=True, shift=False)

    return tokens_to_logits, tokens_to_logits(jnp.zeros((batch_size, positions), jnp.int32), {})[1]


def sampled_hypotheses(tokens_to_logits: TokensToLogits, cache: Any, rng_B: Array, beam_size: int, max_len: int, *,
                       lenpen: Array | float, limit_B: Array, temperature: float, top_k: int, top_p: float,
                       bos_id: int, eos_id: int = EOS_ID, pad_id: int = PAD_ID, prefix: Prefix | None = None,
                       guards: Guards | None = None, output_start_B: Array | None = None,
                       scored: Callable[[Array], Array] = lambda x_BNL: x_BNL) -> Hypotheses:
    """``beam_size`` samples per row (the n-th drawn with ``rng_B[b]`` folded with n), each scored as a beam is over
    the positions ``scored`` keeps of ``[B, N, max_len]``, best first."""
    B, N = rng_B.shape[0], beam_size
    fold_n = lambda key: jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(N))  # noqa: E731  [N]
    keys = jax.vmap(fold_n)(rng_B).reshape(B * N)  # [B*N]: row b*N + n
    tokens, token_scores = sample(tokens_to_logits, tile_cache(cache, B, N), B * N, max_len, keys,
                                  temperature=temperature, top_k=top_k, top_p=top_p, bos_id=bos_id, eos_id=eos_id,
                                  pad_id=pad_id, max_len_per_row=jnp.repeat(limit_B, N), with_token_scores=True,
                                  prefix=None if prefix is None else prefix.repeat(N), guards=guards,
                                  output_start_B=None if output_start_B is None else jnp.repeat(output_start_B, N))
    tokens_BNL, token_scores_BNL = (scored(x.reshape(B, N, max_len)) for x in (tokens, token_scores))
    length_BN = jnp.sum(tokens_BNL != pad_id, axis=-1).astype(jnp.float32)  # [B, N] EOS included
    scores_BN = jnp.sum(token_scores_BNL, axis=-1) / jnp.power(length_BN, jnp.float32(lenpen))  # [B, N]
    order_BN = jnp.argsort(-scores_BN, axis=1)  # [B, N] best first, as beams are
    return Hypotheses(_take(tokens_BNL, order_BN), jnp.take_along_axis(scores_BN, order_BN, axis=1),
                      _take(token_scores_BNL, order_BN))


def translate_hypotheses(model: nn.Module, variables: Any, inputs_BS: Array, *,
                         beam_size: int, max_len: int, lenpen: float, max_len_a: float | None,
                         max_len_b: int | None, stop: str, temperature: float, top_k: int, top_p: float,
                         inputs_segmentation: Array | None = None, rng: Array | None = None, bos_id: int | None = None,
                         eos_id: int = EOS_ID, pad_id: int = PAD_ID, prefix: Prefix | None = None,
                         guards: Guards | None = None) -> Hypotheses:
    """``beam_size`` hypotheses per row of an ``EncoderDecoder``, best first: beams or, with ``temperature > 0``,
    samples; a row may generate ``max_len_a * src_len + max_len_b`` tokens plus EOS, at most ``max_len``."""
    variables = {name: v for name, v in variables.items() if name != "cache"}
    bos_id = model.config.decoder_start_id if bos_id is None else bos_id
    B, N = inputs_BS.shape[0], beam_size
    encoded_BSC = model.apply(variables, inputs_BS, inputs_segmentation=inputs_segmentation, method=model.encode)
    tile = lambda x: jax.tree.map(lambda leaf: jnp.repeat(leaf, N, axis=0), x)  # noqa: E731
    _, cache = _apply_cache(model, variables, {}, encoded_BSC, inputs_BS, jnp.zeros((B, max_len), jnp.int32),
                            inputs_segmentation=inputs_segmentation, decode=True, method=model.run_decoder)
    beam_encoded, beam_inputs, beam_segmentation = tile(encoded_BSC), tile(inputs_BS), tile(inputs_segmentation)

    def tokens_to_logits(tokens_BT, cache):  # B here is B*beam
        return _apply_cache(model, variables, cache, beam_encoded, beam_inputs, tokens_BT,
                            inputs_segmentation=beam_segmentation, decode=True, method=model.run_decoder)

    limit_B = jnp.full((B,), max_len, jnp.int32)  # [B] tokens a row may have, EOS included
    if max_len_a is not None or max_len_b is not None:
        src_len_B = jnp.sum(inputs_BS != pad_id, axis=1).astype(jnp.float32)  # [B]
        limit_B = jnp.floor((max_len_a or 0.0) * src_len_B + (max_len_b or 0)).astype(jnp.int32) + 1  # [B] + EOS
    limit_B = jnp.clip(limit_B, 1, max_len)
    if not temperature:
        return beam_search(tokens_to_logits, cache, B, N, max_len, lenpen=lenpen, bos_id=bos_id, eos_id=eos_id,
                           pad_id=pad_id, max_len_per_row=limit_B, stop=stop, with_token_scores=True, prefix=prefix,
                           guards=guards)
    if rng is None:
        raise UserError(f"translate_hypotheses with temperature={temperature} needs rng (or temperature=0)")
    return sampled_hypotheses(tokens_to_logits, cache, row_keys(rng, inputs_BS), N, max_len, lenpen=lenpen,
                              limit_B=limit_B, temperature=temperature, top_k=top_k, top_p=top_p, bos_id=bos_id,
                              eos_id=eos_id, pad_id=pad_id, prefix=prefix, guards=guards)


def lm_generate(model: nn.Module, variables: Any, prompt: Array | None = None, *, max_len: int, temperature: float,
                top_k: int, top_p: float, batch_size: int | None = None, rng: Array | None = None,
                bos_id: int | None = None, eos_id: int = EOS_ID, pad_id: int = PAD_ID) -> Array:
    """Continues ``prompt [B, T]`` (or BOS) with a ``DecoderOnlyLM``: ``[B, max_len]`` new tokens."""
    bos_id = model.config.decoder_start_id if bos_id is None else bos_id
    if prompt is None and batch_size is None:
        raise UserError("lm_generate needs a prompt [B, T] or batch_size")
    if temperature != 0.0 and rng is None:
        raise UserError(f"lm_generate with temperature={temperature} needs rng (or temperature=0 for greedy)")
    B = prompt.shape[0] if prompt is not None else batch_size
    T = prompt.shape[1] if prompt is not None else 0
    # Positions fed: BOS + prompt + every new token but the last (``sample`` never feeds the last one).
    tokens_to_logits, cache = lm_decoder(model, variables, B, T + max_len)
    return sample(tokens_to_logits, cache, B, max_len, rng, temperature=temperature, top_k=top_k, top_p=top_p,
                  prompt=prompt, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
