"""Adaptive softmax: the float64 NumPy reference of fairseq's head/tail factorisation, normalisation, its use as
an LM's output layer, and its config errors."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tolerance

from lconv.nn import models
from lconv.nn.adaptive_softmax import AdaptiveSoftmax


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_matches_a_float64_reference_and_normalises():
    V, cutoffs, d = 50, (8, 20), 16
    x = np.asarray(jax.random.normal(jax.random.key(0), (2, 3, d)), np.float32)
    layer = AdaptiveSoftmax(V, cutoffs, factor=2.0, matmul_precision="highest")  # exact on every backend
    params = layer.init(jax.random.key(1), jnp.asarray(x))["params"]
    got = np.asarray(layer.apply({"params": params}, jnp.asarray(x)))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.meta.unbox(params))
    x64 = x.astype(np.float64)
    head = _log_softmax(x64 @ p["head"]["kernel"])  # [2, 3, 8 + 2]
    assert p["head"]["kernel"].shape == (d, 10)
    assert p["tail_0_projection"]["kernel"].shape == (d, 8) and p["tail_1_projection"]["kernel"].shape == (d, 4)
    expected = [head[..., :8]]
    for i, (lo, hi) in enumerate([(8, 20), (20, 50)]):
        tail = _log_softmax(x64 @ p[f"tail_{i}_projection"]["kernel"] @ p[f"tail_{i}"]["kernel"])
        assert tail.shape[-1] == hi - lo
        expected.append(head[..., 8 + i, None] + tail)
    np.testing.assert_allclose(got, np.concatenate(expected, -1), **tolerance(np.float32, "highest", atol=1e-5))
    np.testing.assert_allclose(np.exp(got.astype(np.float64)).sum(-1), 1.0, atol=1e-5)  # log-softmaxes: any precision


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_an_lm_with_an_adaptive_output_layer():
    cfg = models.ModelConfig(vocab_size=64, d_model=16, ffn_dim=32, num_heads=2, encoder_layers=0,
                             decoder_layers=1, decoder_mixer="lightconv", decoder_kernel_sizes=(3,),
                             share_embeddings=False, adaptive_softmax_cutoffs=(16, 40),
                             adaptive_softmax_dropout=0.5)
    lm = models.DecoderOnlyLM(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, 64, (2, 5)), jnp.int32)
    params = lm.init(jax.random.key(0), tokens)["params"]
    assert "adaptive_softmax" in params and "output_projection" not in jax.tree_util.keystr(params)
    out = lm.apply({"params": params}, tokens)
    assert out.shape == (2, 5, 64) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.exp(np.asarray(out, np.float64)).sum(-1), 1.0, atol=1e-5)  # at any precision
    noisy = lm.apply({"params": params}, tokens, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(np.asarray(noisy), np.asarray(out))  # the tails' dropout is on in training


@pytest.mark.parametrize("fields, message", [
    (dict(adaptive_softmax_cutoffs=(16, 8)), r"adaptive_softmax_cutoffs=\(16, 8\) must increase strictly"),
    (dict(adaptive_softmax_cutoffs=(16, 64)), r"within \(0, vocab_size=64\)"),
    (dict(adaptive_softmax_cutoffs=(16,), share_embeddings=True), "needs config.model.share_embeddings=False"),
    (dict(adaptive_softmax_cutoffs=(8, 16, 32), adaptive_softmax_factor=4.0), "no width"),
])
def test_bad_adaptive_softmax_configs(fields, message):
    base = dict(vocab_size=64, d_model=16, num_heads=2, share_embeddings=False, encoder_kernel_sizes=(3,),
                decoder_kernel_sizes=(3,), encoder_layers=1, decoder_layers=1)
    with pytest.raises(ValueError, match=message):
        models.ModelConfig.from_config({**base, **fields})
