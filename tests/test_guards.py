"""Generation guards (``lconv.infer.guards``): ``no_repeat_ngram_size`` and ``min_len`` in beam search and sampling,
each against an independent reference on test_decode's toy model: every hypothesis enumerated and the rule applied
token by token (a hypothesis is allowed when each free token is), or a NumPy greedy loop applying it step by step.
Off, a search traces none of it."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode import BOS, EOS, PAD, V, _logp, _tables, _toy

from lconv.configs import schema
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import search
from lconv.infer.guards import Guards

FREE = [t for t in range(V) if t not in (PAD, EOS)]  # 2, 3, 4


def _allowed(seq: list[int], j: int, *, ngram: int, min_len: int, start: int, limit: int) -> bool:
    """The rule, read plainly: token ``seq[j]`` at a free step ``j`` (from ``start`` on) may not complete an n-gram
    that ends before ``j``, nor be EOS before ``start + min_len`` unless it is the row's last token."""
    if j < start:
        return True
    if ngram and j + 1 >= ngram:
        earlier = {tuple(seq[k:k + ngram]) for k in range(j - ngram + 1)}
        if tuple(seq[j - ngram + 1:j + 1]) in earlier and not (seq[j] == EOS and j + 1 == limit):
            return False
    return not (seq[j] == EOS and j < start + min_len and j + 1 < limit)


def _brute_force(A, Bm, Cp, bias_V, limit, lenpen, *, ngram, min_len, prefix=(), scored=True):
    """Every allowed hypothesis of <= ``limit`` tokens that starts with ``prefix`` and ends in EOS, best first, with
    its fairseq score (an unscored prefix counts in neither the log-prob nor the length, and is the context the
    guards start after)."""
    first = 0 if scored else len(prefix)
    hyps = []
    for n in range(limit - len(prefix)):
        for body in itertools.product(FREE, repeat=n):
            seq = list(prefix) + list(body) + [EOS]
            if not all(_allowed(seq, j, ngram=ngram, min_len=min_len, start=first, limit=limit)
                       for j in range(len(prefix), len(seq))):
                continue
            logp = sum(_logp(A, Bm, Cp, bias_V, [BOS] + seq[:j], seq[j]) for j in range(first, len(seq)))
            hyps.append((logp / (len(seq) - first) ** lenpen, seq))
    return sorted(hyps, key=lambda h: -h[0])


LIMIT = 5  # tokens per hypothesis, EOS included: 1 + 3 + 9 + 27 + 81 hypotheses before the guards
BEAM = sum(3 ** n for n in range(LIMIT))  # exhaustive: the beam holds every hypothesis


SLOW = pytest.mark.slow  # more programs of the same code: CI runs them, the quick tier keeps one of each kind


@pytest.mark.parametrize("ngram,min_len,prefix,scored,stop", [
    pytest.param(2, 0, None, True, "optimal", marks=SLOW), pytest.param(0, 3, None, True, "optimal", marks=SLOW),
    (2, 2, None, True, "fairseq"),
    pytest.param(3, 0, ([4, 4], [2]), True, "optimal", marks=SLOW),  # a translation's prefix: its n-grams count,
    (2, 2, ([2, 3], [4]), False, "optimal"),  # and min_len counts it; an LM's prompt: context, min_len after it
])
def test_an_exhaustive_guarded_beam_equals_brute_force_over_the_allowed_hypotheses(ngram, min_len, prefix, scored,
                                                                                   stop):
    A, Bm, Cp, bias = _tables(seed=7)
    A[np.arange(V), np.arange(V)] += 3.0  # the model likes repeating its last token ("today today today")
    fn, cache = _toy(A, Bm, Cp, bias)
    forced = None
    if prefix is not None:
        forced = search.Prefix(jnp.asarray([p + [PAD] * (3 - len(p)) for p in prefix]),
                               jnp.asarray([len(p) for p in prefix]))
    found = search.beam_search(fn, cache, 2, BEAM, LIMIT, lenpen=1.0, stop=stop, with_token_scores=True,
                               prefix=forced, prefix_scored=scored, guards=Guards(ngram, min_len))
    for b in range(2):
        ref = _brute_force(A, Bm, Cp, bias[b], LIMIT, 1.0, ngram=ngram, min_len=min_len,
                           prefix=() if prefix is None else prefix[b], scored=scored)
        count = len(ref)
        assert 0 < count < BEAM  # the guards removed some hypotheses, and some remain
        np.testing.assert_allclose(found.scores[b, :count], [s for s, _ in ref], rtol=1e-5, atol=1e-5)
        assert np.all(np.isneginf(found.scores[b, count:]))
        got = sorted(tuple(t for t in row if t != PAD) for row in found.tokens[b, :count].tolist())
        assert got == sorted(tuple(seq) for _, seq in ref)


def _greedy_reference(A, Bm, Cp, bias_V, steps, *, ngram, min_len, prompt=()):
    """Argmax step by step over the tokens the rule allows; the prompt is forced and the guards start after it."""
    seq = list(prompt)
    while len(seq) < steps and (not seq or seq[-1] != EOS):
        j = len(seq)
        lp = [_logp(A, Bm, Cp, bias_V, [BOS] + seq, t) if t != PAD and (t == EOS or j + 1 < steps) and _allowed(
            seq + [t], j, ngram=ngram, min_len=min_len, start=len(prompt), limit=steps) else -np.inf
            for t in range(V)]
        seq.append(int(np.argmax(lp)))
    return seq[len(prompt):] + [PAD] * (steps - len(seq))


@pytest.mark.parametrize("ngram,min_len", [pytest.param(2, 0, marks=SLOW), pytest.param(1, 3, marks=SLOW), (3, 4)])
def test_guarded_greedy_sampling_equals_the_rule_applied_step_by_step(ngram, min_len):
    B, steps = 6, 8
    A, Bm, Cp, bias = _tables(seed=8, batch=B)
    A[np.arange(V), np.arange(V)] += 3.0
    A[:, EOS] += 1.0  # early EOS, which min_len holds back
    fn, cache = _toy(A, Bm, Cp, bias)
    limits = jnp.full((B,), steps)
    tokens = search.sample(fn, cache, B, steps, None, temperature=0.0, top_k=0, top_p=1.0, max_len_per_row=limits,
                           guards=Guards(ngram, min_len))
    unguarded = search.sample(fn, cache, B, steps, None, temperature=0.0, top_k=0, top_p=1.0,
                              max_len_per_row=limits)
    ref = [_greedy_reference(A, Bm, Cp, bias[b], steps, ngram=ngram, min_len=min_len) for b in range(B)]
    assert tokens.tolist() == ref
    assert tokens.tolist() != unguarded.tolist()  # the guards changed something


@SLOW
def test_samples_follow_the_guards_after_a_prompt_given_as_forced_steps():
    """As ``compiled.generate`` feeds an LM's prompt (forced tokens, ``output_start_B`` after it): the prompt's
    n-grams count, min_len counts the continuation, and every sample keeps to both."""
    B, steps, ngram, min_len = 12, 10, 2, 3
    A, Bm, Cp, bias = _tables(seed=9, batch=B)
    A[np.arange(V), np.arange(V)] += 2.0
    A[:, EOS] += 1.5
    fn, cache = _toy(A, Bm, Cp, bias)
    prompt_len = jnp.asarray([0, 1, 2] * 4)
    prefix = search.Prefix(jnp.tile(jnp.asarray([[3, 3, PAD]]), (B, 1)), prompt_len)
    tokens = search.sample(fn, cache, B, steps, jax.random.key(3), temperature=1.0, top_k=0, top_p=1.0,
                           max_len_per_row=prompt_len + 6, prefix=prefix, guards=Guards(ngram, min_len),
                           output_start_B=prompt_len)
    for b, row in enumerate(tokens.tolist()):
        seq = [t for t in row if t != PAD]
        start = int(prompt_len[b])
        assert seq[:start] == [3] * start and seq[-1] == EOS
        assert all(_allowed(seq, j, ngram=ngram, min_len=min_len, start=start, limit=start + 6)
                   for j in range(start, len(seq)))


@pytest.mark.parametrize("sampled", [False, pytest.param(True, marks=SLOW)])
def test_today_today_today_cannot_come_out_of_a_guarded_search(sampled):
    """A model that repeats its last word loops without guards ("today today today ..."); with
    ``no_repeat_ngram_size=2`` no word follows itself twice, with 3 no trigram comes back (the output has no
    "today" four times in a row): in a beam search and in samples."""
    A, Bm, Cp, bias = _tables(seed=10)
    A[np.arange(V), np.arange(V)] += 6.0
    A[:, EOS] -= 6.0
    fn, cache = _toy(A, Bm, Cp, bias)
    width = 12

    def run(guards):
        if sampled:
            return search.sample(fn, cache, 2, width, jax.random.key(0), temperature=1.0, top_k=0, top_p=1.0,
                                 guards=guards).tolist()
        return search.beam_search(fn, cache, 2, 3, width, lenpen=1.0, stop="optimal", guards=guards)[0][:, 0].tolist()

    assert any(row[:4] == [row[0]] * 4 for row in run(None))  # the degenerate output, unguarded
    for ngram in (2, 3):
        for row in run(Guards(ngram, 0)):
            seq = [t for t in row if t != PAD]
            grams = [tuple(seq[k:k + ngram]) for k in range(len(seq) - ngram + 1)]
            assert len(grams) == len(set(grams)), (ngram, seq)
            assert not any(seq[k:k + ngram + 1] == [seq[k]] * (ngram + 1) for k in range(len(seq)))


def test_guards_off_trace_nothing():
    """At 0 (the defaults) ``Guards.of`` is None: the search is the unguarded program, op for op."""
    settings = DecodeSettings.build(schema.base_config().decode)
    assert (settings.no_repeat_ngram_size, settings.min_len) == (0, 0) and Guards.of(settings) is None
    A, Bm, Cp, bias = _tables(seed=1)
    fn, cache = _toy(A, Bm, Cp, bias)
    plain = jax.make_jaxpr(lambda c: search.beam_search(fn, c, 2, 3, 4, lenpen=1.0, stop="optimal"))(cache)
    off = jax.make_jaxpr(lambda c: search.beam_search(fn, c, 2, 3, 4, lenpen=1.0, stop="optimal",
                                                      guards=Guards.of(settings)))(cache)
    on = jax.make_jaxpr(lambda c: search.beam_search(fn, c, 2, 3, 4, lenpen=1.0, stop="optimal",
                                                     guards=Guards(2, 1)))(cache)
    assert str(off) == str(plain) and str(on) != str(plain)
    chosen = DecodeSettings.build(schema.base_config().decode, no_repeat_ngram_size=3, min_len=5)
    assert Guards.of(chosen) == Guards(3, 5) and chosen.program_key() != settings.program_key()


@pytest.mark.parametrize("name,value", [("no_repeat_ngram_size", -1), ("no_repeat_ngram_size", 65),
                                        ("no_repeat_ngram_size", 2.5), ("min_len", -3), ("min_len", "5")])
def test_bad_guard_values_are_one_line_errors(name, value):
    for spell, shown in ((lambda n: f"config.decode.{n}", f"config.decode.{name}"), (lambda n: f"--{n}", f"--{name}"),
                         (str, name)):
        with pytest.raises(UserError, match=rf"^{shown}={value!r}: must be an integer[^\n]*$"):
            schema.check_search(spell=spell, **{name: value})
