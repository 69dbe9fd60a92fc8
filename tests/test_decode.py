"""lconv.infer.search against brute-force NumPy references on a toy second-order Markov "model", and a tiny LM.

The toy's next-token logits at step t are ``A[y_t] + Bm[y_{t-1}] + Cp[t] + bias[row]`` (``y_0 = BOS``,
``y_{-1} = PAD``): the cache carries the previous input (a batch leaf), the position (a scalar counter) and a
per-row bias (a batch leaf), so a cache that is tiled or reordered wrongly changes the scores.
"""
import collections
import dataclasses
import itertools
import threading
import types

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lconv.data import pipeline
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import batching, compiled, search
from lconv.infer.infer_config import InferConfig
from lconv.nn.models import DecoderOnlyLM, EncoderDecoder, ModelConfig

PAD, EOS, BOS = 0, 1, 3
V, L = 5, 4  # tokens 2, 3, 4 can be generated besides EOS: 1 + 3 + 9 + 27 = 40 hypotheses of <= 4 tokens
N_HYP = sum(3 ** n for n in range(L))


def _tables(seed=0, batch=2):
    r = np.random.default_rng(seed)
    return [r.normal(size=s).astype(np.float32) for s in [(V, V), (V, V), (L + 8, V), (batch, V)]]


def _toy(A, Bm, Cp, bias):
    """The step function and its cache for ``batch = len(bias)`` rows."""
    A, Bm, Cp = map(jnp.asarray, (A, Bm, Cp))

    def tokens_to_logits(tokens_BT, cache):
        prev_BT = jnp.concatenate([cache["prev"][:, None], tokens_BT[:, :-1]], axis=1)  # [B, T]
        pos_T = cache["position"] + jnp.arange(tokens_BT.shape[1])  # [T]
        logits_BTV = A[tokens_BT] + Bm[prev_BT] + Cp[pos_T][None] + cache["bias"][:, None]  # [B, T, V]
        new = dict(prev=tokens_BT[:, -1], position=cache["position"] + tokens_BT.shape[1], bias=cache["bias"])
        return logits_BTV, new

    cache = dict(prev=jnp.full((len(bias),), PAD, jnp.int32), position=jnp.int32(0), bias=jnp.asarray(bias))
    return tokens_to_logits, cache


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def _logp(A, Bm, Cp, bias_V, history, token):
    """log p(token | history) where ``history`` are the inputs fed so far (starting with BOS)."""
    prev2 = history[-2] if len(history) > 1 else PAD
    return _log_softmax(A[history[-1]] + Bm[prev2] + Cp[len(history) - 1] + bias_V)[token]


def _brute_force(A, Bm, Cp, bias_V, limit, lenpen):
    """Every hypothesis of <= ``limit`` tokens ending in EOS with its fairseq score, best first."""
    hyps = []
    for n in range(limit):
        for body in itertools.product([t for t in range(V) if t not in (PAD, EOS)], repeat=n):
            seq = list(body) + [EOS]
            logp = sum(_logp(A, Bm, Cp, bias_V, [BOS] + seq[:j], seq[j]) for j in range(len(seq)))
            hyps.append((logp / len(seq) ** lenpen, seq))
    return sorted(hyps, key=lambda h: -h[0])


def _padded(seq, length=L):
    return list(seq) + [PAD] * (length - len(seq))


@pytest.mark.parametrize("lenpen", [0.0, 1.0, 2.0])
def test_exhaustive_beam_equals_brute_force(lenpen):
    A, Bm, Cp, bias = _tables(seed=int(lenpen))
    fn, cache = _toy(A, Bm, Cp, bias)
    tokens, scores = search.beam_search(fn, cache, 2, N_HYP, L, lenpen=lenpen, stop="optimal")
    assert tokens.shape == (2, N_HYP, L) and scores.shape == (2, N_HYP)
    for b in range(2):
        ref = _brute_force(A, Bm, Cp, bias[b], L, lenpen)
        np.testing.assert_allclose(scores[b], [s for s, _ in ref], rtol=1e-5, atol=1e-5)
        assert tokens[b, 0].tolist() == _padded(ref[0][1])


def test_small_beam_scores_its_hypotheses_and_respects_row_limits():
    A, Bm, Cp, bias = _tables(seed=3)
    A[:, EOS] -= 3.0  # make EOS unlikely, so the limits bind
    fn, cache = _toy(A, Bm, Cp, bias)
    limits = np.array([2, 3])
    tokens, scores = jax.jit(lambda c, m: search.beam_search(fn, c, 2, 3, L, lenpen=1.0, max_len_per_row=m,
                                                             stop="optimal"))(
        cache, limits)
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)  # best first
    for b in range(2):
        ref = dict((tuple(seq), s) for s, seq in _brute_force(A, Bm, Cp, bias[b], limits[b], 1.0))
        for k in range(3):
            seq = [t for t in tokens[b, k].tolist() if t != PAD]
            assert seq[-1] == EOS and EOS not in seq[:-1] and len(seq) <= limits[b]
            assert tokens[b, k].tolist() == _padded(seq)  # PAD only after EOS
            np.testing.assert_allclose(scores[b, k], ref[tuple(seq)], rtol=1e-5)
    # Exhaustive beam under the limits: exactly the brute-force best.
    tokens, _ = search.beam_search(fn, cache, 2, N_HYP, L, lenpen=1.0, max_len_per_row=limits, stop="optimal")
    for b in range(2):
        assert tokens[b, 0].tolist() == _padded(_brute_force(A, Bm, Cp, bias[b], limits[b], 1.0)[0][1])


def _beam_reference(A, Bm, Cp, bias_V, k, length, lenpen):
    """Plain alive/finished beam search in NumPy, run to ``length`` (no early stop): the finished scores."""
    alive, finished = [(0.0, [])], []
    for t in range(length):
        cands = []
        for logp, seq in alive:
            for tok in range(V):
                if tok != PAD and (tok == EOS or t + 1 < length):
                    cands.append((logp + _logp(A, Bm, Cp, bias_V, [BOS] + seq, tok), seq + [tok]))
        cands = sorted(cands, key=lambda c: -c[0])[: 2 * k]
        finished += [(lp / (t + 1) ** lenpen, seq) for lp, seq in cands if seq[-1] == EOS]
        finished = sorted(finished, key=lambda c: -c[0])[:k]
        alive = [c for c in cands if c[1][-1] != EOS][:k]
    return [f[0] for f in finished]


def _fairseq_reference(A, Bm, Cp, bias_V, k, limit, lenpen):
    """fairseq's SequenceGenerator rule in plain Python: no EOS first; EOS among the top-k of the 2k candidates
    (ranked by summed log-prob) finalizes, in rank order, until k are final; only EOS at the length limit."""
    alive, final = [(0.0, [])], []
    for t in range(limit):
        cands = []
        for logp, seq in alive:
            for tok in range(V):
                allowed = tok == EOS if t + 1 == limit else (tok != PAD and not (tok == EOS and t == 0))
                if allowed:
                    cands.append((logp + _logp(A, Bm, Cp, bias_V, [BOS] + seq, tok), seq + [tok]))
        cands = sorted(cands, key=lambda c: -c[0])[: 2 * k]
        for logp, seq in cands[:k]:
            if seq[-1] == EOS and len(final) < k:
                final.append((logp / (t + 1) ** lenpen, seq))
        if len(final) == k:
            break
        alive = [c for c in cands if c[1][-1] != EOS][:k]
    return sorted(final, key=lambda c: -c[0])


@pytest.mark.parametrize("lenpen,seed,beam", [(1.0, 2, 2), (1.0, 5, 3), (0.5, 9, 2), (2.0, 8, 3)])
def test_the_fairseq_stop_rule_equals_a_plain_reading_of_fairseqs_generator(lenpen, seed, beam):
    A, Bm, Cp, bias = _tables(seed=seed)
    A[:, EOS] += 1.0  # EOS competitive, so early finishes and the first-come rule matter
    fn, cache = _toy(A, Bm, Cp, bias)
    limits = np.array([6, 8])
    tokens, scores = search.beam_search(fn, cache, 2, beam, 8, lenpen=lenpen, max_len_per_row=limits, stop="fairseq")
    optimal_tokens, optimal_scores = search.beam_search(fn, cache, 2, beam, 8, lenpen=lenpen, max_len_per_row=limits,
                                                        stop="optimal")
    for b in range(2):
        ref = _fairseq_reference(A, Bm, Cp, bias[b], beam, limits[b], lenpen)
        np.testing.assert_allclose(scores[b], [s for s, _ in ref], rtol=1e-5, atol=1e-6)
        for n, (_, seq) in enumerate(ref):
            assert tokens[b, n].tolist() == _padded(seq, 8), (b, n)
        assert np.all(optimal_scores[b] >= np.asarray(scores[b]) - 1e-6)  # first come is never better
    with pytest.raises(UserError, match="decode.stop='greedy'"):
        search.beam_search(fn, cache, 2, 2, 8, stop="greedy", lenpen=1.0)


def _counting(fn):
    """``fn`` plus a host-side count of its calls (decoding steps)."""
    calls = [0]

    def counted(tokens_BT, cache):
        jax.debug.callback(lambda: calls.__setitem__(0, calls[0] + 1))
        return fn(tokens_BT, cache)
    return counted, calls


# Seed 2 at lenpen 1 fails a bound that forgets the length bonus still to come; seed 4 stops after 6 of 8 steps.
@pytest.mark.parametrize("lenpen,seed", [(0.0, 7), (1.0, 2), (1.0, 4), (2.0, 8)])
def test_early_stopping_keeps_the_full_search_result(lenpen, seed):
    A, Bm, Cp, bias = _tables(seed=seed)
    fn, cache = _toy(A, Bm, Cp, bias)
    fn, calls = _counting(fn)
    _, scores = search.beam_search(fn, cache, 2, 2, 8, lenpen=lenpen, stop="optimal")
    jax.effects_barrier()
    for b in range(2):
        np.testing.assert_allclose(scores[b], _beam_reference(A, Bm, Cp, bias[b], 2, 8, lenpen), rtol=1e-5)
    if seed == 4:
        assert calls[0] < 8


def _greedy_reference(A, Bm, Cp, bias_V, steps, prompt=()):
    history, out = [BOS] + list(prompt), []
    for _ in range(steps):
        if out and out[-1] in (EOS, PAD):
            out.append(PAD)
            continue
        lp = np.array([_logp(A, Bm, Cp, bias_V, history, t) for t in range(V)])
        lp[PAD] = -np.inf
        out.append(int(lp.argmax()))
        history.append(out[-1])
    return out


def test_greedy_equals_argmax_loop_and_pads_after_eos():
    A, Bm, Cp, bias = _tables(seed=4, batch=3)
    A[2, EOS] += 4.0  # rows that emit 2 then likely stop; others run to the end
    fn, cache = _toy(A, Bm, Cp, bias)
    fn, calls = _counting(fn)
    tokens = search.sample(fn, cache, 3, 6, None, temperature=0.0, top_k=0, top_p=1.0)  # greedy
    jax.effects_barrier()
    ref = [_greedy_reference(A, Bm, Cp, bias[b], 6) for b in range(3)]
    assert tokens.tolist() == ref
    assert any(EOS in r for r in ref)  # the EOS/PAD path is exercised
    assert calls[0] == max(r.index(EOS) + 1 if EOS in r else 6 for r in ref)  # stops once all rows are done


def test_tile_and_gather_cache_keep_scalars():
    cache = {"layer": {"state": jnp.arange(2 * 3 * 2).reshape(2, 3, 2), "position": jnp.int32(7),
                       "beam_invariant_key": jnp.ones((2, 5))}, "cache_index": jnp.int32(5)}
    tiled = search.tile_cache(cache, 2, 3)
    assert tiled["layer"]["state"].shape == (6, 3, 2) and int(tiled["cache_index"]) == 5
    assert tiled["layer"]["beam_invariant_key"].shape == (2, 5)  # shared by the beams of a row: not tiled
    np.testing.assert_array_equal(tiled["layer"]["state"][4], cache["layer"]["state"][1])  # row 1, beam 1
    beam_idx = jnp.array([[2, 2, 0], [1, 0, 0]])
    assert int(search.gather_beams(tiled, beam_idx)["layer"]["position"]) == 7
    marked = tiled["layer"]["state"].at[:, 0, 0].set(jnp.arange(6))  # tell the beams apart
    got = search.gather_beams({"s": marked, "p": jnp.int32(7), "beam_invariant_key": marked}, beam_idx)
    assert got["s"][:, 0, 0].tolist() == [2, 2, 0, 4, 3, 3] and int(got["p"]) == 7
    assert got["beam_invariant_key"] is marked  # equal on every beam of a row by contract: not copied
    with pytest.raises(ValueError, match="leading batch dim"):
        search.tile_cache({"x": jnp.zeros((4, 2))}, 2, 3)


def test_sampling_limits_and_determinism():
    B = 16
    A, Bm, Cp, bias = _tables(seed=5, batch=B)
    fn, cache = _toy(A, Bm, Cp, bias)
    greedy = search.sample(fn, cache, B, L, None, temperature=0.0, top_k=0, top_p=1.0)
    rng = jax.random.key(0)
    assert search.sample(fn, cache, B, L, rng, temperature=1e-4, top_k=0, top_p=1.0).tolist() == greedy.tolist()
    assert search.sample(fn, cache, B, L, rng, top_k=1, temperature=1.0, top_p=1.0).tolist() == greedy.tolist()
    assert search.sample(fn, cache, B, L, rng, top_p=1e-3, temperature=1.0, top_k=0).tolist() == greedy.tolist()
    s1 = search.sample(fn, cache, B, L, rng, top_k=2, temperature=1.0, top_p=1.0)
    assert s1.tolist() == search.sample(fn, cache, B, L, rng, top_k=2, temperature=1.0, top_p=1.0).tolist()
    other = search.sample(fn, cache, B, L, jax.random.key(1), top_k=2, temperature=1.0, top_p=1.0)
    assert s1.tolist() != other.tolist()
    assert s1.tolist() != greedy.tolist()
    for b in range(B):  # every draw is among the 2 most likely tokens given its prefix
        history = [BOS]
        for t in s1[b].tolist():
            if t == PAD:
                break
            lp = np.array([_logp(A, Bm, Cp, bias[b], history, u) if u != PAD else -np.inf for u in range(V)])
            assert t in np.argsort(-lp)[:2]
            history.append(t)


def test_sample_with_prompt_chunk():
    A, Bm, Cp, bias = _tables(seed=6)
    fn, cache = _toy(A, Bm, Cp, bias)
    prompt = np.array([[2, 4], [4, 4]], np.int32)
    got = search.sample(fn, cache, 2, 4, jax.random.key(0), top_k=1, prompt=prompt, temperature=1.0, top_p=1.0)
    assert got.tolist() == [_greedy_reference(A, Bm, Cp, bias[b], 4, prompt[b]) for b in range(2)]


class _ToyDecoder(nn.Module):
    """The toy step with its cache as Flax ``'cache'`` variables; the first decode call only creates them."""

    @nn.compact
    def __call__(self, tables, bias_BV, tokens_BT):
        init = not self.has_variable("cache", "prev")
        prev = self.variable("cache", "prev", lambda: jnp.full(tokens_BT.shape[:1], PAD, jnp.int32))
        position = self.variable("cache", "position", lambda: jnp.int32(0))
        if init:
            return jnp.zeros(tokens_BT.shape + (V,))
        fn, _ = _toy(*tables, bias_BV)
        logits, new = fn(tokens_BT, dict(prev=prev.value, position=position.value, bias=bias_BV))
        prev.value, position.value = new["prev"], new["position"]
        return logits


class _StandInTranslator(nn.Module):
    """EncoderDecoder's ``encode``/``run_decoder`` signatures around the toy: the row bias comes from the source."""

    def setup(self):
        init = nn.initializers.normal(1.0)
        self.A, self.Bm, self.Cp, self.E = [self.param(n, init, s) for n, s in [
            ("A", (V, V)), ("Bm", (V, V)), ("Cp", (L + 8, V)), ("E", (V, V))]]
        self.step = _ToyDecoder()

    def encode(self, inputs_BS, *, inputs_segmentation=None, inputs_position=None, deterministic=True):
        return self.E[inputs_BS]  # [B, S, V]

    def run_decoder(self, encoded_BSV, inputs_BS, decoder_input_BT, *, inputs_segmentation=None,
                    targets_segmentation=None, targets_position=None, deterministic=True, decode=False):
        mask_BS1 = (inputs_BS != PAD)[..., None]
        bias_BV = (encoded_BSV * mask_BS1).sum(1) / mask_BS1.sum(1)  # [B, V]
        return self.step((self.A, self.Bm, self.Cp), bias_BV, decoder_input_BT)


def test_translate_tiles_encoder_output_and_cache_per_beam():
    model = _StandInTranslator()
    inputs = jnp.array([[2, 4, 0], [4, 2, 2], [2, 0, 0]], jnp.int32)
    variables = model.init(jax.random.key(0), inputs, method=model.encode)
    p = {k: np.asarray(v) for k, v in variables["params"].items()}
    src_len = np.array([2, 3, 1])
    got = jax.jit(lambda v, x: search.translate_hypotheses(
        model, v, x, beam_size=N_HYP, max_len=L, lenpen=1.0, max_len_a=1.0, max_len_b=0, stop="optimal", bos_id=BOS,
        temperature=0.0, top_k=0, top_p=1.0).tokens[:, 0])(variables, inputs)  # the best beam
    for b in range(3):
        bias = p["E"][np.asarray(inputs[b, : src_len[b]])].mean(0)
        best = _brute_force(p["A"], p["Bm"], p["Cp"], bias, min(src_len[b] + 1, L), 1.0)[0][1]
        assert got[b].tolist() == _padded(best)


@pytest.mark.parametrize("mixer, position_tables", [("lightconv,dynamicconv", False), ("fixed,hadamard", True)])
def test_lm_greedy_cache_path_equals_full_forward_passes(mixer, position_tables):
    """Greedy decoding from a prompt equals re-running the whole sequence each step. ``max_len`` is exactly the
    positions fed (BOS, prompt and every new token but the last): Fixed and Hadamard's tables hold no more."""
    steps = 6
    cfg = ModelConfig(vocab_size=11, d_model=8, ffn_dim=16, num_heads=2, decoder_layers=2, decoder_mixer=mixer,
                      decoder_kernel_sizes=(3, 4), dropout=0.0, max_len=1 + 3 + steps - 1,
                      matmul_precision="highest")  # float32 dots on every backend: the argmaxes must agree
    model = DecoderOnlyLM(cfg)
    prompt = jnp.array([[5, 7, 2], [9, 4, 6]], jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(1), prompt)
    greedy = dict(temperature=0.0, top_k=0, top_p=1.0)
    got = jax.jit(lambda v, p: search.lm_generate(model, v, p, max_len=steps, eos_id=-1, **greedy))(variables, prompt)
    # No cache: the whole sequence every step. One fixed length (filler 2 after the prefix) so it compiles once;
    # the model is causal, so the filler cannot change the logits read at the prefix's end.
    full = jax.jit(lambda v, s: model.apply(v, s, shift=False))
    seq = np.full((2, 4 + steps), 2, np.int32)
    seq[:, 0], seq[:, 1:4] = BOS, prompt
    for t in range(4, 4 + steps):
        logits = np.array(full(variables, seq[:, :cfg.max_len]))[:, t - 1]
        logits[:, PAD] = -np.inf
        seq[:, t] = logits.argmax(-1)
    assert got.tolist() == seq[:, 4:].tolist()
    if position_tables:  # one more new token needs one more position than the tables hold
        with pytest.raises(UserError, match="exceeds max_len"):
            search.lm_generate(model, variables, prompt, max_len=steps + 1, eos_id=-1, **greedy)


def _batch_mesh():
    """The 8 virtual CPU devices as a training mesh's batch axes (data x fsdp): asked of the CPU, so that the mesh
    tests hold whatever the default backend is (conftest adds the CPU to a user's ``JAX_PLATFORMS``)."""
    return jax.make_mesh((8, 1), ("data", "fsdp"), (jax.sharding.AxisType.Auto,) * 2, devices=helpers.cpu_devices(8))


def _on_cpu(tree):
    """``tree`` on the first CPU device: the one-device reference a CPU mesh's result is compared with."""
    return jax.device_put(tree, jax.devices("cpu")[0])


def test_beam_search_on_a_mesh_keeps_each_row_on_its_devices():
    """Rows split over a mesh are searched where they are: the same result as one device, and no step gathers
    the rows (XLA cannot split a TopK, and a gather over the flat ``B*beam`` axis would move every cache)."""
    A, Bm, Cp, bias = _tables(seed=5, batch=8)
    mesh = _batch_mesh()
    rows = NamedSharding(mesh, P(("data", "fsdp")))

    def search_rows(prev, bias):
        fn, cache = _toy(A, Bm, Cp, bias)
        return search.beam_search(fn, dict(cache, prev=prev), 8, 3, L, lenpen=1.0, stop="optimal")

    prev = np.full((8,), PAD, np.int32)
    expected = jax.jit(search_rows)(*_on_cpu((prev, bias)))
    prev, bias = jax.device_put((prev, bias), rows)
    with jax.set_mesh(mesh):
        got = jax.jit(search_rows)(prev, bias)
        compiled = jax.jit(search_rows).lower(prev, bias).compile().as_text()
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)
    assert "all-gather" not in compiled and "all-to-all" not in compiled


def _tiny_split_decoder(batch_size=0):
    """A tiny conv translator, its params and a split of 20 sources decoded 8 rows per eval batch."""
    cfg = ModelConfig(vocab_size=13, d_model=8, ffn_dim=16, num_heads=2, encoder_layers=1, decoder_layers=1,
                      encoder_kernel_sizes=(3,), decoder_kernel_sizes=(3,), dropout=0.0)
    model = EncoderDecoder(cfg)
    params = jax.jit(model.init)(jax.random.key(3), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))
    config = types.SimpleNamespace(decode=types.SimpleNamespace(beam_size=3, lenpen=1.0, max_len_a=1.0, max_len_b=4,
                                                                batch_size=batch_size, stop="optimal"),
                                   infer=InferConfig(task="translation", mesh_rules=(), batch_size=batch_size,
                                                     eval_batch_size=8, max_input_length=16, max_target_length=16,
                                                     max_positions=16))
    r = np.random.default_rng(0)
    tokens = [{"inputs": np.append(r.integers(4, 13, r.integers(1, 12)), 1).astype(np.int32)} for _ in range(20)]
    eval_set = pipeline.EvalSet([{}] * 20, tokens, 8, 3, {"inputs": 16}, collections.Counter())
    return config, model, params["params"], eval_set


def _auto_rows(config, params, eval_set):
    """The rows per batch "auto" decodes ``eval_set`` with, for ``params`` on the platform they live on: the eval
    set's 8 rows on CPU, wider on an accelerator (the 20 sources' 32 on a GPU)."""
    return batching.plan(config.infer, params, eval_set, config.decode.beam_size)[0]


def _settings(config):
    """The search a surface would build from ``config.decode`` (the sampling settings at their defaults)."""
    return DecodeSettings.build(vars(config.decode))


def _split_hypotheses(config, model, params, eval_set, rows, **kwargs):
    """{example index: best beam} of ``decode_batches``, checking every batch has ``rows`` rows."""
    found = {}
    for batch, best in batching.decode_batches(config.infer, model, params, eval_set, _settings(config), **kwargs):
        assert best.shape[0] == rows  # every row of the global batch, on this (every) process
        found.update({int(i): best[row].tolist() for row, i in enumerate(batch["example_index"]) if i >= 0})
    return found


@pytest.mark.slow  # a multi-device mesh: CI runs it, the quick command skips it
def test_decoding_a_split_on_the_params_mesh_matches_one_device():
    """``decode_batches`` splits each batch's rows over the mesh the params live on and hands every row back;
    the hypotheses are those of plain single-device params."""
    config, model, params, eval_set = _tiny_split_decoder()
    one_device = _split_hypotheses(config, model, _on_cpu(params), eval_set, 8)  # auto on CPU: the eval set's 8 rows
    on_mesh = _split_hypotheses(config, model, jax.device_put(params, NamedSharding(_batch_mesh(), P())), eval_set, 8)
    assert sorted(one_device) == list(range(20)) and on_mesh == one_device
    assert len({tuple(h) for h in one_device.values()}) > 1  # the sources steer the outputs


def test_the_decoding_batch_size_changes_the_batches_not_the_hypotheses():
    config, model, params, eval_set = _tiny_split_decoder()
    by_eval_batch = _split_hypotheses(config, model, params, eval_set, _auto_rows(config, params, eval_set))
    assert sorted(by_eval_batch) == list(range(20))
    assert _split_hypotheses(*_tiny_split_decoder(batch_size=4), 4) == by_eval_batch
    assert _split_hypotheses(*_tiny_split_decoder(batch_size=32), 32) == by_eval_batch  # one batch: 20 rows + 12 pad


def test_auto_decoding_batches_keep_the_eval_batch_on_cpu_and_widen_on_accelerators():
    infer = InferConfig(task="translation", mesh_rules=(), batch_size=0, eval_batch_size=64, max_input_length=16,
                        max_target_length=16, max_positions=16)
    assert compiled.decode_rows(infer, "cpu", 64, 4) == 64
    assert compiled.decode_rows(infer, "gpu", 64, 4) == 512  # 2,048 hypotheses
    assert compiled.decode_rows(infer, "tpu", 64, 5) == 256  # 512 x 5 would pass 2,048
    assert compiled.decode_rows(infer, "gpu", 48, 1) == 1536  # a multiple of the eval batch: the mesh splits it alike
    assert compiled.decode_rows(infer, "gpu", 4096, 4) == 4096  # never fewer than the eval batch
    infer = dataclasses.replace(infer, batch_size=100)
    assert [compiled.decode_rows(infer, p, 64, 4) for p in ("cpu", "gpu")] == [100, 100]


@pytest.mark.parametrize("on_mesh", [False, True])
def test_a_prepared_program_decodes_as_the_jitted_one_without_compiling_again(on_mesh):
    """``Translator.prepare`` compiles a ``[rows, width]`` program in the background; a call of that shape runs it
    (the jitted function compiles nothing) and finds what a fresh translator's jitted program finds, on one
    device and with the rows split over a mesh. The params it was made with may be gone (donated to a training
    step) by the time the thread compiles."""
    config, model, params, eval_set = _tiny_split_decoder()
    params = jax.device_put(params, NamedSharding(_batch_mesh(), P())) if on_mesh else _on_cpu(params)
    final = jax.tree.map(jnp.copy, params)  # a training run's later params: same shapes and layouts
    settings = _settings(config)
    sources = compiled.pad_rows([t["inputs"] for t in eval_set.tokens[:8]], 8, 16)  # [8, 16]
    prepared = compiled.Translator(config.infer, model, params)
    held = threading.Event()
    compiled._background().submit(held.wait)  # the compile thread runs only once the params are deleted
    prepared.prepare(8, 16, settings)
    jax.tree.map(lambda x: x.delete(), params)
    held.set()
    found = prepared.with_params(final).hypotheses(sources, settings)  # the final params share the program
    expected = compiled.Translator(config.infer, model, final).hypotheses(sources, settings)
    assert prepared.jitted._cache_size() == 0
    np.testing.assert_array_equal(found.tokens, expected.tokens)
    np.testing.assert_array_equal(found.scores, expected.scores)


def test_a_batch_that_runs_the_device_out_of_memory_is_decoded_again_in_halves(monkeypatch, lconv_log):
    config, model, params, eval_set = _tiny_split_decoder()
    auto = _auto_rows(config, params, eval_set)
    expected = _split_hypotheses(config, model, params, eval_set, auto)
    real, asked = compiled.Translator(config.infer, model, params), []

    def translator(inputs_BS, settings):  # a device that holds 2 rows at most
        asked.append(inputs_BS.shape[0])
        if inputs_BS.shape[0] > 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")
        return real(inputs_BS, settings)

    found = {}
    settings = _settings(config)
    batches = batching.decode_batches(config.infer, model, params, eval_set, settings, translator=translator)
    for batch, best in batches:
        found.update({int(i): best[row].tolist() for row, i in enumerate(batch["example_index"]) if i >= 0})
    halvings = [auto >> i for i in range(auto.bit_length() - 1)]  # 8, 4, 2 on CPU
    assert found == expected and asked[:len(halvings)] == halvings and set(asked[len(halvings):]) == {2}
    assert lconv_log() == [f"decoding {rows} rows per batch ran out of device memory: going on with {rows // 2} "
                           "(config.decode.batch_size sets it)" for rows in halvings[:-1]]

    def broken(inputs_BS, settings):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # only running out of memory is retried
        list(batching.decode_batches(config.infer, model, params, eval_set, settings, translator=broken))
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # every process must run the same batches: no retry
    with pytest.raises(UserError, match=rf"^.*\b{auto} rows.*memory.*config\.decode"):
        list(batching.decode_batches(config.infer, model, params, eval_set, settings, translator=translator))


@pytest.mark.parametrize("stop,lenpen", [("optimal", 1.0), ("fairseq", 0.5)])
def test_token_scores_kept_along_the_beams_are_the_models_log_probs(stop, lenpen):
    A, Bm, Cp, bias = _tables(seed=3)
    A[:, EOS] += 1.0  # early finishes: hypotheses of several lengths
    fn, cache = _toy(A, Bm, Cp, bias)
    limits = np.array([5, 8])
    found = search.beam_search(fn, cache, 2, 3, 8, lenpen=lenpen, max_len_per_row=limits, stop=stop,
                               with_token_scores=True)
    tokens, scores = search.beam_search(fn, cache, 2, 3, 8, lenpen=lenpen, max_len_per_row=limits, stop=stop)
    assert found.tokens.tolist() == tokens.tolist() and found.scores.tolist() == scores.tolist()
    for b in range(2):
        for n in range(3):
            seq = found.tokens[b, n].tolist()
            length = seq.index(EOS) + 1
            expected = [_logp(A, Bm, Cp, bias[b], [BOS] + seq[:j], seq[j]) for j in range(length)]
            np.testing.assert_allclose(found.token_scores[b, n, :length], expected, rtol=1e-5, atol=1e-6)
            assert not np.any(found.token_scores[b, n, length:])
            assert float(found.scores[b, n]) == pytest.approx(sum(expected) / length ** lenpen, rel=1e-5)


def test_samples_with_a_length_limit_end_in_eos_and_do_not_depend_on_their_row():
    A, Bm, Cp, bias = _tables(seed=7, batch=5)
    A[:, EOS] -= 3.0  # EOS unlikely: most rows reach their limit, where it is forced
    fn, cache = _toy(A, Bm, Cp, bias)
    limits = jnp.array([3, 6, 8, 4, 8])
    tokens, token_scores = search.sample(fn, cache, 5, 8, jax.random.key(0), max_len_per_row=limits,
                                         with_token_scores=True, temperature=1.0, top_k=0, top_p=1.0)
    for b in range(5):
        seq = tokens[b].tolist()
        assert EOS in seq and seq.index(EOS) < int(limits[b])
        length = seq.index(EOS) + 1
        expected = [_logp(A, Bm, Cp, bias[b], [BOS] + seq[:j], seq[j]) for j in range(length)]
        np.testing.assert_allclose(token_scores[b, :length], expected, rtol=1e-5, atol=1e-6)
    # Row 3 sampled alone (its own cache row, limit and the same key) draws what it drew in the batch of 5.
    fn_alone, cache_alone = _toy(A, Bm, Cp, bias[3:4])
    alone = search.sample(fn_alone, cache_alone, 1, 8, jax.random.key(0), max_len_per_row=limits[3:4],
                          temperature=1.0, top_k=0, top_p=1.0)
    assert alone[0].tolist() == tokens[3].tolist()
    keys = search.row_keys(jax.random.key(0), jnp.array([[5, 6, 0, 0], [5, 6, 0, 0], [6, 5, 0, 0]]))
    as_data = jax.random.key_data(keys).tolist()
    assert as_data[0] == as_data[1] != as_data[2]  # by content, not by row
    padded = search.row_keys(jax.random.key(0), jnp.array([[5, 6, 0, 0, 0, 0, 0, 0]]))
    assert jax.random.key_data(padded).tolist()[0] == as_data[0]  # the padded width changes nothing


def _brute_force_prefixed(A, Bm, Cp, bias_V, limit, lenpen, prefix, scored):
    """``_brute_force`` over the hypotheses that start with ``prefix``; unscored, the prefix counts in neither the
    log-prob nor the length."""
    hyps = []
    for n in range(limit - len(prefix)):
        for body in itertools.product([t for t in range(V) if t not in (PAD, EOS)], repeat=n):
            seq = list(prefix) + list(body) + [EOS]
            first = 0 if scored else len(prefix)
            logp = sum(_logp(A, Bm, Cp, bias_V, [BOS] + seq[:j], seq[j]) for j in range(first, len(seq)))
            hyps.append((logp / (len(seq) - first) ** lenpen, seq))
    return sorted(hyps, key=lambda h: -h[0])


@pytest.mark.parametrize("scored,lenpen,stop", [(True, 1.0, "optimal"), (False, 0.5, "optimal"),
                                                (True, 1.0, "fairseq")])
def test_an_exhaustive_beam_with_a_forced_prefix_equals_brute_force_over_the_prefixed_hypotheses(scored, lenpen,
                                                                                                 stop):
    A, Bm, Cp, bias = _tables(seed=5)
    A[:, 4] += 2.0  # the model prefers token 4: the prefixes below go against it
    fn, cache = _toy(A, Bm, Cp, bias)
    prefixes = [[2], [3, 2]]  # one per row, ragged
    prefix = search.Prefix(jnp.asarray([[2, PAD, PAD], [3, 2, PAD]]), jnp.asarray([1, 2]))
    found = search.beam_search(fn, cache, 2, N_HYP, L, lenpen=lenpen, stop=stop, with_token_scores=True,
                               prefix=prefix, prefix_scored=scored)
    for b in range(2):
        ref = _brute_force_prefixed(A, Bm, Cp, bias[b], L, lenpen, prefixes[b], scored)
        count = len(ref)  # fewer than the beam: the other slots stay empty
        np.testing.assert_allclose(found.scores[b, :count], [s for s, _ in ref], rtol=1e-5, atol=1e-5)
        assert np.all(np.isneginf(found.scores[b, count:]))
        assert sorted(map(tuple, found.tokens[b, :count].tolist())) == sorted(tuple(_padded(q)) for _, q in ref)
        best = ref[0][1]
        expected = [_logp(A, Bm, Cp, bias[b], [BOS] + best[:j], best[j]) for j in range(len(best))]
        if not scored:
            expected[:len(prefixes[b])] = [0.0] * len(prefixes[b])
        np.testing.assert_allclose(found.token_scores[b, 0, :len(best)], expected, rtol=1e-5, atol=1e-6)


def test_samples_with_a_forced_prefix_start_with_it_and_score_it_under_the_model():
    A, Bm, Cp, bias = _tables(seed=6, batch=3)
    fn, cache = _toy(A, Bm, Cp, bias)
    prefix = search.Prefix(jnp.asarray([[4, 4, 2], [2, PAD, PAD], [PAD, PAD, PAD]]), jnp.asarray([3, 1, 0]))
    limits = jnp.asarray([2, 8, 8])  # row 0's limit is raised to hold its prefix and EOS
    tokens, token_scores = search.sample(fn, cache, 3, 8, jax.random.key(1), max_len_per_row=limits,
                                         with_token_scores=True, prefix=prefix, temperature=1.0, top_k=0, top_p=1.0)
    free, _ = search.sample(fn, cache, 3, 8, jax.random.key(1), max_len_per_row=limits, with_token_scores=True,
                            temperature=1.0, top_k=0, top_p=1.0)
    assert tokens[0].tolist() == [4, 4, 2, EOS] + [PAD] * 4 and tokens[1, 0] == 2
    assert tokens[2].tolist() == free[2].tolist()  # no prefix: the same draws as without any
    for b in range(3):
        seq = tokens[b].tolist()
        length = seq.index(EOS) + 1
        expected = [_logp(A, Bm, Cp, bias[b], [BOS] + seq[:j], seq[j]) for j in range(length)]
        np.testing.assert_allclose(token_scores[b, :length], expected, rtol=1e-5, atol=1e-6)
