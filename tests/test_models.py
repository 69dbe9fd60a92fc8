"""Models and configs: every config builds and counts its parameters abstractly; decoding equals the full pass;
the causal decoder never sees the future; bad model configs fail with one clear line."""
import pathlib
import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tolerance

from lconv.nn import knn_memory as memory
from lconv.nn import mixers, models
from scripts import param_table

# The models compare paths (decoding with the full pass, packed with separate rows) at float32's tolerances, so their
# dots run at "highest": exact on every backend, not only on CPU (tests/test_precision.py checks the setting's reach).
TINY = dict(vocab_size=37, d_model=16, ffn_dim=24, num_heads=4, encoder_layers=2, decoder_layers=2,
            encoder_kernel_sizes=(3, 5), decoder_kernel_sizes=(3, 4), dropout=0.0, matmul_precision="highest")


def _tol(atol):
    return tolerance(np.float32, TINY["matmul_precision"], atol=atol)


# Every registered mixer that can be causal, with the smallest fields that fit the test shapes (T <= 9).
CAUSAL_MIXERS = [name for name in mixers.mixer_names() if "decoder" in mixers.sides(name)]
SMALL = dict(max_len=16, mixer_kwargs={"knn_memory": {"memory_size": 12, "num_neighbors": 3},
                                       "colt5": {"local_radius": 2, "num_routed": 3}})


def _small(**overrides):
    return models.ModelConfig(**{**TINY, **SMALL, **overrides})


def _tokens(shape, seed, pad_from=None):
    t = np.random.default_rng(seed).integers(4, TINY["vocab_size"], size=shape).astype(np.int32)
    if pad_from is not None:
        t[-1, pad_from:] = 0
    return jnp.asarray(t)


DOCS_TABLE = param_table.parse_table((pathlib.Path(__file__).parents[1] / "docs" / "models.md").read_text())
# A row of docs/models.md per mixer variant and per config family; each is recounted here.
CONFIGS = [("default", ""), ("default", "transformer"), ("iwslt14_de_en", "lightconv"), ("iwslt14_de_en", "dynamic"),
           ("iwslt14_de_en", "fixed"), ("iwslt14_de_en", "hadamard"), ("iwslt14_de_en", "colt5"),
           ("iwslt14_de_en", "knn"), ("wmt_en_de", "dynamic,big"), ("wmt_en_de", "lightconv,big"),
           ("wmt_en_de", "transformer,base"), ("wmt_en_fr", "dynamic,big"), ("wmt_zh_en", "dynamic,big"),
           ("lm1b", "dynamic"), ("lm1b", "knn"), ("cnn_dailymail", "dynamic"), ("cnn_dailymail", "dynamic,ddtp")]


REGENERATE = "if the config change is intended, run: PYTHONPATH=. python scripts/param_table.py --write docs/models.md"


@pytest.mark.parametrize("name,variant", CONFIGS)
def test_every_config_builds_and_its_count_is_the_one_in_the_docs(name, variant):
    """The count comes from jax.eval_shape (nothing allocated) and equals docs/models.md's row."""
    config = param_table.get_config(name, variant)
    n = param_table.count_parameters(config)
    assert n > 1e6
    documented = DOCS_TABLE.get((param_table.label(name, variant), config.data.vocab_size, False))
    assert documented == n, f"docs/models.md says {documented}, the model has {n}: {REGENERATE}"


def test_docs_table_has_every_row_the_script_writes():
    want = {(param_table.label(name, variant), vocab or param_table.get_config(name, variant).data.vocab_size,
             vocab is not None) for name, variant, vocab in param_table.ROWS}
    assert set(DOCS_TABLE) == want, REGENERATE


def _analytic_count(d, ffn, H, enc_kernels, dec_kernels, vocab, mixer):
    """Parameters of the post-norm model, counted by hand from fairseq's layer definitions."""
    def mixer_block(K):
        if mixer == "attention":
            return 4 * (d * d + d)  # Q, K, V, out
        kernel = d * H * K if mixer == "dynamicconv" else H * K  # kernel projection (no bias) or [H, K]
        return (d * 2 * d + 2 * d) + kernel + (d * d + d)  # GLU input projection, kernel, output projection

    ffn_and_norms = (d * ffn + ffn) + (ffn * d + d) + 2 * (2 * d)
    encoder = sum(mixer_block(K) + ffn_and_norms for K in enc_kernels)
    cross_attention = 4 * (d * d + d) + 2 * d
    decoder = sum(mixer_block(K) + ffn_and_norms + cross_attention for K in dec_kernels)
    return encoder + decoder + vocab * d  # one shared embedding table


@pytest.mark.parametrize("variant,mixer,enc_kernels", [
    ("lightconv,big", "lightconv", (3, 7, 15, 31, 31, 31, 31)),
    ("dynamic,big", "dynamicconv", (3, 7, 15, 31, 31, 31, 31)),
    ("transformer,big", "attention", (0,) * 6),  # 6 encoder layers, no kernels
])
def test_wmt_big_parameter_count_matches_hand_count(variant, mixer, enc_kernels):
    """The rows of docs/models.md beside the paper's 202M / 213M, at fairseq's 32,768-entry vocabulary."""
    config = param_table.get_config("wmt_en_de", variant)
    n = param_table.count_parameters(config, vocab_size=32_768)
    assert n == _analytic_count(1024, 4096, 16, enc_kernels, (3, 7, 15, 31, 31, 31), 32_768, mixer)
    assert DOCS_TABLE[f"wmt_en_de:{variant}", 32_768, True] == n


_JITTED = {}  # (repr(config), kind) -> jitted functions; configs hold dicts, so they are not hashable


def _jitted(cfg, kind):
    """``init`` / ``full`` / ``decode`` (and ``encode``) of a model, each under ``jax.jit`` (eager dispatch of
    a model recompiles every op for each new shape: several times slower on CPU)."""
    key = (repr(cfg), kind)
    if key in _JITTED:
        return _JITTED[key]
    if kind == "lm":
        m = models.DecoderOnlyLM(cfg)
        fns = types.SimpleNamespace(
            init=jax.jit(lambda rng, tok: m.init(rng, tok)),
            full=jax.jit(lambda v, tok: m.apply(v, tok, shift=False)),
            decode=jax.jit(lambda v, tok: m.apply(v, tok, decode=True, shift=False, mutable=["cache"])))
    else:
        m = models.EncoderDecoder(cfg)
        fns = types.SimpleNamespace(
            init=jax.jit(lambda rng, src, tgt: m.init(rng, src, tgt)),
            full=jax.jit(lambda v, src, tgt: m.apply(v, src, tgt)),
            encode=jax.jit(lambda v, src: m.apply(v, src, method=m.encode)),
            decode=jax.jit(lambda v, enc, src, dec_in: m.apply(v, enc, src, dec_in, decode=True, mutable=["cache"],
                                                               method=m.run_decoder)))
    _JITTED[key] = fns
    return fns


PREFIX_THEN_TOKENS = [(0, 4)] + [(t, t + 1) for t in range(4, 9)]  # a prompt in one chunk, then token by token


def _decode_in_chunks(step, variables, inputs_BT, *context):
    """Creates the cache with a zero max-length input, then feeds ``inputs`` in PREFIX_THEN_TOKENS chunks."""
    _, cache = step(variables, *context, jnp.zeros_like(inputs_BT))
    outs = []
    for start, stop in PREFIX_THEN_TOKENS:
        y, cache = step({**variables, **cache}, *context, inputs_BT[:, start:stop])
        outs.append(y)
    return jnp.concatenate(outs, 1)


def _change_from(tokens_BT, i):
    """Every token at index >= i replaced by a different one."""
    changed = jnp.where(tokens_BT == 5, 6, 5)
    return jnp.where(jnp.arange(tokens_BT.shape[1]) >= i, changed, tokens_BT)


def _assert_causal(full, first_logits, tokens, shifted, atol=1e-5):
    """Logits up to ``t`` do not move when every decoder input after ``t`` changes, and later ones do (so the
    check can fail). With ``shifted`` the model shifts ``tokens`` right first: input t+1 is token t."""
    for t in (0, 4, 7):
        y = full(_change_from(tokens, t if shifted else t + 1))
        np.testing.assert_allclose(y[:, : t + 1], first_logits[:, : t + 1], **_tol(atol), err_msg=f"t={t}")
        assert np.abs(np.asarray(y[:, t + 1:] - first_logits[:, t + 1:])).max() > 1e-4, f"t={t}"


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_encoder_decoder_with_every_mixer_decodes_like_the_full_pass_and_never_sees_the_future():
    """One model whose decoder has a layer of every causal mixer: each must be exact for the whole to be (one
    model, not one per mixer, because compiling dominates; each mixer's own test file checks its cache alone).
    The encoder is CoLT5 with the routed FFN, which the decoder layers do not get (routing is non-causal)."""
    cfg = _small(encoder_layers=2, decoder_layers=len(CAUSAL_MIXERS), encoder_mixer="colt5,lightconv",
                 decoder_mixer=CAUSAL_MIXERS, encoder_kernel_sizes=(3,), decoder_kernel_sizes=(4,), ffn_type="colt5",
                 ffn_kwargs={"num_routed": 3})
    fns = _jitted(cfg, "ed")
    src, tgt = _tokens((2, 7), 0, pad_from=5), _tokens((2, 9), 1)
    v = fns.init(jax.random.key(0), src, tgt)
    assert "router" in v["params"]["encoder"]["layer_0"]["ffn"] and "fc1" in v["params"]["decoder"]["layer_0"]["ffn"]
    full = fns.full(v, src, tgt)
    _assert_causal(lambda t: fns.full(v, src, t), full, tgt, shifted=True)
    decoded = _decode_in_chunks(fns.decode, v, models.shift_right(tgt), fns.encode(v, src), src)
    np.testing.assert_allclose(decoded, full, **_tol(1e-4))


# Every side setting differs between encoder and decoder (ModelConfig.side), plus the fairseq transformer flags.
SIDES_APART = dict(encoder_layers=1, decoder_layers=2, encoder_mixer="lightconv", decoder_mixer="dynamicconv,attention",
                   encoder_kernel_sizes=(3,), decoder_kernel_sizes=(4,), share_embeddings=False,
                   d_model=16, decoder_d_model=12, ffn_dim=24, decoder_ffn_dim=20, num_heads=4, decoder_num_heads=3,
                   use_glu=True, decoder_use_glu=False, conv_features=8, decoder_conv_features=0,
                   normalize_before=False, decoder_normalize_before=True, learned_positions=True,
                   decoder_learned_positions=False, activation="gelu", layernorm_embedding=True)


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_a_model_whose_sides_differ_has_each_sides_shapes_and_decodes_like_the_full_pass():
    """Each side's parameters have its own widths (the decoder's encoder attention projects keys and values from
    the encoder's width), and the decoder, pre-norm and narrower, decodes exactly like its full pass."""
    fns = _jitted(_small(**SIDES_APART), "ed")
    src, tgt = _tokens((2, 7), 0, pad_from=5), _tokens((2, 9), 1)
    v = fns.init(jax.random.key(0), src, tgt)
    shapes = jax.tree.map(np.shape, flax.linen.unbox(v["params"]))
    encoder, decoder = shapes["encoder"]["layer_0"], shapes["decoder"]
    assert encoder["mixer"]["linear1"]["kernel"] == (16, 2 * 8)  # GLU over its conv width 8
    assert encoder["ffn"]["fc1"]["kernel"] == (16, 24)
    assert decoder["layer_0"]["mixer"]["linear1"]["kernel"] == (12, 12)  # no GLU, conv width = its own
    assert decoder["layer_0"]["mixer"]["conv"]["weight_linear"]["kernel"] == (12, 3 * 4)  # 3 heads, K = 4
    assert decoder["layer_1"]["ffn"]["fc1"]["kernel"] == (12, 20)
    cross = decoder["layer_1"]["encoder_attention"]
    assert (cross["query"]["kernel"], cross["key"]["kernel"], cross["value"]["kernel"]) == ((12, 12), (16, 12),
                                                                                            (16, 12))
    assert "final_norm" in decoder and "final_norm" not in shapes["encoder"]  # pre-norm decoder, post-norm encoder
    assert "learned" in shapes["source_positions"] and "learned" not in shapes["target_positions"]
    assert shapes["target_embed"]["embedding"] == (37, 12) and shapes["output_projection"]["kernel"] == (12, 37)
    full = fns.full(v, src, tgt)
    _assert_causal(lambda t: fns.full(v, src, t), full, tgt, shifted=True)
    decoded = _decode_in_chunks(fns.decode, v, models.shift_right(tgt), fns.encode(v, src), src)
    np.testing.assert_allclose(decoded, full, **_tol(1e-4))


def _lm_with_every_causal_mixer():
    """A decoder-only LM with one layer per causal mixer (kNN memory is the last, layer 5)."""
    return _small(decoder_layers=len(CAUSAL_MIXERS), decoder_mixer=CAUSAL_MIXERS, decoder_kernel_sizes=(4,))


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_language_model_with_every_causal_mixer_decodes_like_the_full_pass_and_never_sees_the_future():
    fns = _jitted(_lm_with_every_causal_mixer(), "lm")
    tokens = _tokens((2, 9), 2)
    v = fns.init(jax.random.key(0), tokens)
    full = fns.full(v, tokens)
    _assert_causal(lambda t: fns.full(v, t), full, tokens, shifted=False)
    np.testing.assert_allclose(_decode_in_chunks(fns.decode, v, tokens), full, **_tol(1e-4))


def test_colt5_is_encoder_only_with_one_line_errors():
    for bad in (dict(decoder_mixer="colt5"), dict(decoder_mixer="attention,colt5")):
        with pytest.raises(ValueError, match="decoder_mixer.*'colt5'.*encoder") as info:
            models.ModelConfig.from_config({**TINY, **bad})
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="ffn_type='colt5'.*encoder layers only"):
        models.DecoderOnlyLM(models.ModelConfig(**TINY, ffn_type="colt5")).init(jax.random.key(0), _tokens((1, 3), 0))


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_language_model_threads_knn_memory_and_resets_a_row_at_a_new_document():
    """A DecoderOnlyLM with a kNN-memory layer, fed a stream window by window: the 'memory' collection carries
    the past; ``reset_memory`` makes a row start over exactly like a fresh stream; decoding reads the memory.
    (The model of the test above, so its compiled init / full / decode are reused.)"""
    cfg = _lm_with_every_causal_mixer()
    fns = _jitted(cfg, "lm")
    m = models.DecoderOnlyLM(cfg)
    thread = jax.jit(lambda v, tok: m.apply(v, tok, shift=False, mutable=["memory"]))
    w0, w1 = _tokens((2, 9), 7), _tokens((2, 9), 8)
    v = fns.init(jax.random.key(0), w0)
    params, empty = {"params": v["params"]}, v["memory"]
    _, upd = thread({**params, "memory": empty}, w0)
    mem1 = upd["memory"]
    y1, upd = thread({**params, "memory": mem1}, w1)  # window 1 continues both documents
    fresh1, _ = thread({**params, "memory": empty}, w1)  # window 1 as the start of a document
    assert np.abs(np.asarray(y1 - fresh1)).max() > 1e-3  # the memory of window 0 matters ...
    np.testing.assert_allclose(fns.full({**params, "memory": empty}, w1), fresh1, **_tol(1e-6))  # ... and only it
    # Row 0 starts a new document at window 1: it must equal the fresh stream; row 1 keeps its memory.
    y1r, upd_r = thread({**params, "memory": memory.reset_memory(mem1, np.array([True, False]))}, w1)
    np.testing.assert_allclose(y1r[0], fresh1[0], **_tol(1e-5))
    np.testing.assert_allclose(y1r[1], y1[1], **_tol(1e-5))
    valid = np.asarray(upd_r["memory"]["decoder"]["layer_5"]["mixer"]["valid"]).sum(-1)
    assert list(valid) == [9, 12]  # row 0: window 1 only; row 1: windows 0 + 1, FIFO-capped at 12
    # Cached decoding of window 1 reads the (read-only) memory of window 0 and equals the full pass.
    decoded = _decode_in_chunks(fns.decode, {**params, "memory": mem1}, w1)
    np.testing.assert_allclose(decoded, fns.full({**params, "memory": mem1}, w1), **_tol(1e-4))
    np.testing.assert_allclose(decoded, y1, **_tol(1e-4))


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_packed_rows_equal_separate_sequences():
    """Two examples packed in one row give the logits each gives alone (segments and positions honoured).
    Alone, each sits at the start of a row of the same length padded with PAD, so one compiled apply serves all
    three calls and padding is checked not to leak as well."""
    cfg = models.ModelConfig(**TINY, encoder_mixer="dynamicconv", decoder_mixer="lightconv,attention")
    m = models.EncoderDecoder(cfg)
    s1, s2, t1, t2 = _tokens((1, 4), 3), _tokens((1, 3), 4), _tokens((1, 5), 5), _tokens((1, 4), 6)
    src = jnp.concatenate([s1, s2], 1)
    tgt = jnp.concatenate([t1, t2], 1)
    seg = lambda a, b: jnp.asarray([[1] * a + [2] * b])  # noqa: E731
    pos = lambda a, b: jnp.asarray([list(range(a)) + list(range(b))])  # noqa: E731
    apply = jax.jit(lambda v, src, tgt, src_seg, src_pos, tgt_seg, tgt_pos: m.apply(
        v, src, tgt, inputs_segmentation=src_seg, inputs_position=src_pos, targets_segmentation=tgt_seg,
        targets_position=tgt_pos))
    v = jax.jit(m.init)(jax.random.key(0), src, tgt)
    packed = apply(v, src, tgt, seg(4, 3), pos(4, 3), seg(5, 4), pos(5, 4))
    padded = lambda a, n: jnp.pad(a, ((0, 0), (0, n - a.shape[1])))  # noqa: E731  PAD (0) at the end
    ids = lambda n_real, n: padded(jnp.ones((1, n_real), jnp.int32), n)  # noqa: E731  segment 1, then padding
    for (s_i, t_i), cols in (((s1, t1), slice(0, 5)), ((s2, t2), slice(5, 9))):
        alone = apply(v, padded(s_i, 7), padded(t_i, 9), ids(s_i.shape[1], 7), pos(7, 0), ids(t_i.shape[1], 9),
                      pos(9, 0))
        np.testing.assert_allclose(packed[:, cols], alone[:, : t_i.shape[1]], **_tol(1e-4))


def test_embeddings_and_linears_follow_fairseq_init():
    cfg = models.ModelConfig(**{**TINY, "vocab_size": 400, "d_model": 32}, encoder_mixer="attention",
                             decoder_mixer="attention")
    m = models.EncoderDecoder(cfg)
    v = jax.tree.map(np.asarray, models.nn.meta.unbox(jax.jit(m.init)(jax.random.key(0), _tokens((1, 3), 0),
                                                                      _tokens((1, 3), 1))))
    table = v["params"]["source_embed"]["embedding"]
    np.testing.assert_array_equal(table[0], 0.0)  # PAD row
    assert abs(table[1:].std() - 32 ** -0.5) < 0.1 * 32 ** -0.5
    fc1 = v["params"]["encoder"]["layer_0"]["ffn"]["fc1"]
    assert np.abs(fc1["kernel"]).max() <= np.sqrt(6 / (32 + 24)) and not fc1["bias"].any()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(encoder_mixer="dynamicconv", encoder_kernel_sizes=(4,)), "encoder_kernel_sizes: layer 0 .* odd"),
        (dict(encoder_mixer="attention,lightconv", encoder_kernel_sizes=(3, 6)), "encoder_kernel_sizes: layer 1"),
        (dict(d_model=18), "d_model=18 must be divisible by config.model.num_heads=4"),
        (dict(encoder_mixer="lightconvv"), "encoder_mixer: unknown mixer 'lightconvv'"),
        (dict(decoder_mixer="attention,lightconvv"), "decoder_mixer: unknown mixer 'lightconvv'"),
        (dict(encoder_mixer="attention,attention,attention"), "3 mixers for 2"),
        (dict(decoder_kernel_sizes=(3, 5, 7)), None),  # more sizes than layers: fine, extra ignored
        (dict(encoder_kernel_sizes=(3, 5, 7, 9), encoder_layers=5), "5 encoder layers"),
    ],
)
def test_bad_model_configs_fail_with_one_line(overrides, message):
    def build():
        cfg = models.ModelConfig.from_config({**TINY, **overrides})
        m = models.EncoderDecoder(cfg)  # tracing raises what init would (nothing computed)
        jax.eval_shape(m.init, jax.random.key(0), _tokens((1, 5), 0), _tokens((1, 5), 1))

    if message is None:
        build()
        return
    with pytest.raises(ValueError, match=message) as info:
        build()
    assert "\n" not in str(info.value)


def test_unknown_model_field_is_named():
    with pytest.raises(ValueError, match="unknown field.*'kernel_size'"):
        models.ModelConfig.from_config({**TINY, "kernel_size": 3})


def test_sinusoidal_positions_are_fairseqs_table_inside_and_past_the_constant_one():
    """``ScaleAndPosition``'s sinusoidal positions (rows of a constant table, computed past its end) equal fairseq's
    formula in float64 NumPy within float32 rounding, and the table's rows equal the computed ones bit for bit."""
    cfg = _small(max_len=8, scale_embeddings=False)
    C, length = cfg.d_model, 8 + cfg.position_offset
    layer = models.ScaleAndPosition(cfg, side="encoder")
    zeros = jnp.zeros((2, 3, C))

    def numpy_table(p):
        half = C // 2
        angles = (np.asarray(p, np.float64)[..., None] + cfg.position_offset) * np.exp(
            np.arange(half) * -(np.log(10000.0) / (half - 1)))
        return np.concatenate([np.sin(angles), np.cos(angles)], -1)

    for p in ([[0, 1, 2], [5, 6, 7]], [[0, 1, 2], [6, 7, 30]]):  # the second past the table: computed
        p = np.asarray(p, np.int32)
        got = jax.jit(lambda p: layer.apply({}, zeros, p, deterministic=True))(p)
        np.testing.assert_allclose(got, numpy_table(p), rtol=0, atol=1e-5)
    table = models.sinusoidal_table(length, C)
    positions = jnp.arange(length)[None]
    np.testing.assert_array_equal(table, jax.jit(models.sinusoidal_positions, static_argnums=1)(positions, C)[0])
