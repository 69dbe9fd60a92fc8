"""Models and configs: every config builds and counts its parameters abstractly; decoding equals the full pass;
the causal decoder never sees the future; bad model configs fail with one clear line."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lconv import models, train_lib

TINY = dict(vocab_size=37, d_model=16, ffn_dim=24, num_heads=4, encoder_layers=2, decoder_layers=2,
            encoder_kernel_sizes=(3, 5), decoder_kernel_sizes=(3, 4), dropout=0.0)
MIXES = ["dynamicconv", "lightconv", "attention", "lightconv,attention"]


def _tokens(shape, seed, pad_from=None):
    t = np.random.default_rng(seed).integers(4, TINY["vocab_size"], size=shape).astype(np.int32)
    if pad_from is not None:
        t[-1, pad_from:] = 0
    return jnp.asarray(t)


CONFIGS = [("default", None), ("default", "transformer"), ("iwslt14_de_en", "lightconv"),
           ("iwslt14_de_en", "dynamic"), ("wmt_en_de", "dynamic,big"), ("wmt_en_de", "lightconv,big"),
           ("wmt_en_de", "transformer,base"), ("wmt_en_fr", None), ("wmt_zh_en", None), ("lm1b", None),
           ("cnn_dailymail", None), ("cnn_dailymail", "ddtp")]


@pytest.mark.parametrize("name,variant", CONFIGS)
def test_every_config_builds_and_counts_parameters_without_allocating(name, variant):
    config = importlib.import_module(f"configs.{name}").get_config(variant)
    model = train_lib.build_model(config, vocab_size=config.data.vocab_size)
    args, kwargs = train_lib.model_inputs(train_lib._dummy_batch(config))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    n = train_lib.count_params(shapes["params"])
    assert n > 1e6


def _analytic_count(d, ffn, H, enc_kernels, dec_kernels, vocab, dynamic):
    """Parameters of the post-norm GLU conv model, counted by hand from fairseq's layer definitions."""
    def conv_block(K):
        return (d * 2 * d + 2 * d) + (d * H * K if dynamic else H * K) + (d * d + d)

    ffn_and_norms = (d * ffn + ffn) + (ffn * d + d) + 2 * (2 * d)
    encoder = sum(conv_block(K) + ffn_and_norms for K in enc_kernels)
    cross_attention = 4 * (d * d + d) + 2 * d
    decoder = sum(conv_block(K) + ffn_and_norms + cross_attention for K in dec_kernels)
    return encoder + decoder + vocab * d  # one shared embedding table


@pytest.mark.parametrize("variant,dynamic", [("lightconv,big", False), ("dynamic,big", True)])
def test_wmt_big_parameter_count_matches_hand_count(variant, dynamic):
    """The table in docs/models.md (beside the paper's 202M / 213M) comes from these counts."""
    config = importlib.import_module("configs.wmt_en_de").get_config(variant)
    model = train_lib.build_model(config, vocab_size=32_768)
    args, kwargs = train_lib.model_inputs(train_lib._dummy_batch(config))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    want = _analytic_count(1024, 4096, 16, (3, 7, 15, 31, 31, 31, 31), (3, 7, 15, 31, 31, 31), 32_768, dynamic)
    assert train_lib.count_params(shapes["params"]) == want


@pytest.mark.parametrize("mix", MIXES)
def test_encoder_decoder_cached_decoding_equals_full_pass(mix):
    cfg = models.ModelConfig(**TINY, encoder_mixer=mix, decoder_mixer=mix)
    m = models.EncoderDecoder(cfg)
    src, tgt = _tokens((2, 7), 0, pad_from=5), _tokens((2, 9), 1)
    v = m.init(jax.random.key(0), src, tgt)
    full = m.apply(v, src, tgt)
    encoded = m.apply(v, src, method=m.encode)
    decoder_input = models.shift_right(tgt)
    _, cache = m.apply(v, encoded, src, jnp.zeros((2, 9), jnp.int32), decode=True, mutable=["cache"],
                       method=m.decode)
    outs = []
    for start, stop in [(0, 1), (1, 4), (4, 5), (5, 9)]:
        y, cache = m.apply({**v, **cache}, encoded, src, decoder_input[:, start:stop], decode=True,
                           mutable=["cache"], method=m.decode)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-4)


@pytest.mark.parametrize("mix", ["lightconv,dynamicconv", "attention,dynamicconv"])
def test_language_model_decoder_never_sees_the_future(mix):
    cfg = models.ModelConfig(**TINY, decoder_mixer=mix)
    m = models.DecoderOnlyLM(cfg)
    tokens = _tokens((2, 9), 2)
    v = m.init(jax.random.key(0), tokens)
    y1 = m.apply(v, tokens, shift=False)
    for t in (0, 4, 7):
        changed = tokens.at[:, t + 1:].set(5)
        np.testing.assert_allclose(m.apply(v, changed, shift=False)[:, : t + 1], y1[:, : t + 1], atol=1e-6)
    # Cached decoding in chunks equals the full pass.
    _, cache = m.apply(v, jnp.zeros_like(tokens), decode=True, shift=False, mutable=["cache"])
    outs = []
    for start, stop in [(0, 3), (3, 4), (4, 9)]:
        y, cache = m.apply({**v, **cache}, tokens[:, start:stop], decode=True, shift=False, mutable=["cache"])
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), y1, atol=1e-4)


def test_packed_rows_equal_separate_sequences():
    """Two examples packed in one row give the logits each gives alone (segments and positions honoured)."""
    cfg = models.ModelConfig(**TINY, encoder_mixer="dynamicconv", decoder_mixer="lightconv,attention")
    m = models.EncoderDecoder(cfg)
    s1, s2, t1, t2 = _tokens((1, 4), 3), _tokens((1, 3), 4), _tokens((1, 5), 5), _tokens((1, 4), 6)
    src = jnp.concatenate([s1, s2], 1)
    tgt = jnp.concatenate([t1, t2], 1)
    seg = lambda a, b: jnp.asarray([[1] * a + [2] * b])  # noqa: E731
    pos = lambda a, b: jnp.asarray([list(range(a)) + list(range(b))])  # noqa: E731
    v = m.init(jax.random.key(0), src, tgt)
    packed = m.apply(v, src, tgt, inputs_segmentation=seg(4, 3), inputs_position=pos(4, 3),
                     targets_segmentation=seg(5, 4), targets_position=pos(5, 4))
    np.testing.assert_allclose(packed[:, :5], m.apply(v, s1, t1), atol=1e-4)
    np.testing.assert_allclose(packed[:, 5:], m.apply(v, s2, t2), atol=1e-4)


def test_embeddings_and_linears_follow_fairseq_init():
    cfg = models.ModelConfig(**{**TINY, "vocab_size": 400, "d_model": 32}, encoder_mixer="attention",
                             decoder_mixer="attention")
    m = models.EncoderDecoder(cfg)
    v = jax.tree.map(np.asarray, models.nn.meta.unbox(m.init(jax.random.key(0), _tokens((1, 3), 0),
                                                              _tokens((1, 3), 1))))
    table = v["params"]["source_embed"]["embedding"]
    np.testing.assert_array_equal(table[0], 0.0)  # PAD row
    assert abs(table[1:].std() - 32 ** -0.5) < 0.1 * 32 ** -0.5
    fc1 = v["params"]["encoder"]["layer_0"]["ffn"]["fc1"]
    assert np.abs(fc1["kernel"]).max() <= np.sqrt(6 / (32 + 24)) and not fc1["bias"].any()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(encoder_mixer="dynamicconv", encoder_kernel_sizes=(4,)), "odd"),
        (dict(d_model=18), "divisible"),
        (dict(encoder_mixer="lightconvv"), "unknown mixer"),
        (dict(encoder_mixer="attention,attention,attention"), "3 mixers for 2"),
        (dict(decoder_kernel_sizes=(3, 5, 7)), None),  # more sizes than layers: fine, extra ignored
        (dict(encoder_kernel_sizes=(3, 5, 7, 9), encoder_layers=5), "5 encoder layers"),
    ],
)
def test_bad_model_configs_fail_with_one_line(overrides, message):
    def build():
        cfg = models.ModelConfig.from_config({**TINY, **overrides})
        m = models.EncoderDecoder(cfg)
        m.init(jax.random.key(0), _tokens((1, 5), 0), _tokens((1, 5), 1))

    if message is None:
        build()
        return
    with pytest.raises(ValueError, match=message) as info:
        build()
    assert "\n" not in str(info.value)


def test_unknown_model_field_is_named():
    with pytest.raises(ValueError, match="unknown field.*'kernel_size'"):
        models.ModelConfig.from_config({**TINY, "kernel_size": 3})
