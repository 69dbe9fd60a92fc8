"""The fairseq language-model importer (``lconv.interop.fairseq_lm``) against a float64 NumPy fairseq LM
(tests/fairseq_lm_reference.py): random weights under fairseq's names, shapes and tying, imported, give fairseq's
log-probabilities; a ``.pt`` file written as fairseq writes one becomes a workdir whose ``lconv.load`` scores
texts and continues prompts as fairseq-eval-lm and greedy fairseq generation would.
"""
from __future__ import annotations

import argparse
import collections

import fairseq_lm_reference
import flax.linen as nn
import jax
import numpy as np
import pytest
from reference import tolerance

from lconv.errors import UserError
from lconv.interop import fairseq_lm, fairseq_vocab

_V = 40  # fairseq ids: 0-3 special, then the dictionary's 36 lines (smaller than any vocabulary lconv trains)
_BASE = dict(decoder_embed_dim=16, decoder_ffn_embed_dim=24, decoder_layers=2, decoder_attention_heads=4,
             decoder_normalize_before=True, decoder_learned_pos=False, max_target_positions=12, dropout=0.1,
             share_decoder_input_output_embed=False, adaptive_input=False, adaptive_softmax_cutoff=None,
             tie_adaptive_weights=False, tie_adaptive_proj=False, adaptive_input_factor=2, adaptive_softmax_factor=2,
             character_embeddings=False, no_token_positional_embeddings=False)
_LIGHTCONV = dict(arch="lightconv_lm", decoder_kernel_size_list=[2, 4], decoder_glu=True, decoder_conv_type="dynamic",
                  weight_softmax=True, decoder_conv_dim=16, input_dropout=0.1, weight_dropout=0.1)
# Together: both architectures, adaptive input tied with and without the projections, an untied adaptive
# softmax, projections in and out, shared / separate output tables, learned / sinusoidal / no positions, the final
# norm on and off, pre- and post-norm, conv types and GLU; a transformer_lm's --activation-fn (gelu, gelu_fast) and
# --layernorm-embedding (after the projection in and the positions, or alone), which a lightconv_lm ignores.
VARIANTS = {
    "lightconv_adaptive_tied_proj": dict(
        _LIGHTCONV, adaptive_input=True, adaptive_input_cutoff="10,20", adaptive_softmax_cutoff="10,20",
        tie_adaptive_weights=True, tie_adaptive_proj=True),
    "transformer_projected_untied_adaptive_softmax": dict(
        arch="transformer_lm", activation_fn="relu", decoder_input_dim=8, decoder_output_dim=12,
        adaptive_softmax_cutoff="12,24," + str(_V), decoder_learned_pos=True),
    "transformer_adaptive_tied_no_final_norm": dict(
        arch="transformer_lm_gbw", activation_fn="relu", adaptive_input=True, adaptive_input_cutoff="8,24",
        adaptive_softmax_cutoff="8,24", tie_adaptive_weights=True, no_decoder_final_norm=True),
    "transformer_postnorm_shared_output": dict(  # fairseq 0.12's plain transformer_lm: the flag's default
        arch="transformer_lm", activation_fn="relu", decoder_normalize_before=False,
        share_decoder_input_output_embed=True),
    "lightconv_lightweight_shared_output": dict(
        _LIGHTCONV, decoder_conv_type="lightweight", decoder_glu=False, decoder_conv_dim=12,
        share_decoder_input_output_embed=True, decoder_learned_pos=True),
    "transformer_gelu_layernorm_embedding_projected_in": dict(
        arch="transformer_lm_gpt", activation_fn="gelu", layernorm_embedding=True, decoder_input_dim=8,
        decoder_learned_pos=True),
    "transformer_no_positions_gelu_fast_layernorm_embedding": dict(  # learned_pos without a table: no positions
        arch="transformer_lm", activation_fn="gelu_fast", no_token_positional_embeddings=True,
        layernorm_embedding=True, decoder_learned_pos=True, share_decoder_input_output_embed=True),
    "lightconv_no_positions_ignores_activation_and_embedding_norm": dict(  # LightConvDecoder reads neither
        _LIGHTCONV, no_token_positional_embeddings=True, activation_fn="gelu", layernorm_embedding=True),
}


def _args(variant: str) -> dict:
    return {**_BASE, **VARIANTS[variant]}


def lm_weights(args: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random fairseq LM state dict for ``args``: fairseq's names, [out, in] layouts, tied tensors stored twice."""
    C, F, H = args["decoder_embed_dim"], args["decoder_ffn_embed_dim"], args["decoder_attention_heads"]
    d_in, d_out = args.get("decoder_input_dim", C), args.get("decoder_output_dim", C)
    w: dict[str, np.ndarray] = {}
    normal = lambda *shape: rng.normal(0.0, 0.4, shape).astype(np.float32)

    def linear(name, out, inp, bias=True):
        w[f"{name}.weight"] = normal(out, inp)
        if bias:
            w[f"{name}.bias"] = normal(out)

    def norm(name):
        w[f"{name}.weight"], w[f"{name}.bias"] = 1.0 + normal(C), normal(C)

    if args["adaptive_input"]:
        edges = [0] + fairseq_lm_reference.cutoffs(args["adaptive_input_cutoff"], _V)
        for band in range(len(edges) - 1):
            width = int(d_in // args["adaptive_input_factor"] ** band)
            w[f"decoder.embed_tokens.embeddings.{band}.0.weight"] = normal(edges[band + 1] - edges[band], width)
            linear(f"decoder.embed_tokens.embeddings.{band}.1", C, width, bias=False)
    else:
        w["decoder.embed_tokens.weight"] = normal(_V, d_in)
        if d_in != C:
            linear("decoder.project_in_dim", C, d_in, bias=False)
    if args["decoder_learned_pos"] and not args["no_token_positional_embeddings"]:
        w["decoder.embed_positions.weight"] = normal(args["max_target_positions"] + 2, C)
    if args["arch"].startswith("transformer") and args.get("layernorm_embedding"):
        norm("decoder.layernorm_embedding")
    for i in range(args["decoder_layers"]):
        p = f"decoder.layers.{i}"
        if args["arch"].startswith("lightconv"):
            K, conv = args["decoder_kernel_size_list"][i], args["decoder_conv_dim"]
            linear(f"{p}.linear1", 2 * conv if args["decoder_glu"] else conv, C)
            if args["decoder_conv_type"] == "dynamic":
                linear(f"{p}.conv.weight_linear", H * K, conv, bias=False)
            else:
                w[f"{p}.conv.weight"] = normal(H, 1, K)
            linear(f"{p}.linear2", C, conv)
            norm(f"{p}.conv_layer_norm")
        else:
            for proj in ("q", "k", "v", "out"):
                linear(f"{p}.self_attn.{proj}_proj", C, C)
            norm(f"{p}.self_attn_layer_norm")
        linear(f"{p}.fc1", F, C)
        linear(f"{p}.fc2", C, F)
        norm(f"{p}.final_layer_norm")
    if args["arch"].startswith("transformer") and args["decoder_normalize_before"] \
            and not args.get("no_decoder_final_norm"):
        norm("decoder.layer_norm")
    if d_out != C:
        linear("decoder.project_out_dim", d_out, C, bias=False)
    _output_layer(args, w, normal, d_out)
    return w


def _output_layer(args, w, normal, d_out):
    prefix = "decoder.adaptive_softmax"
    if not args["adaptive_softmax_cutoff"]:
        if args["share_decoder_input_output_embed"]:
            if args["arch"].startswith("transformer"):
                w["decoder.output_projection.weight"] = w["decoder.embed_tokens.weight"]
        else:
            key = "decoder.output_projection.weight" if args["arch"].startswith("transformer") else "decoder.embed_out"
            w[key] = normal(_V, d_out)
        return
    edges = fairseq_lm_reference.cutoffs(args["adaptive_softmax_cutoff"], _V)
    tied = args["tie_adaptive_weights"]
    if tied:
        w[f"{prefix}.head.word_proj.weight"] = w["decoder.embed_tokens.embeddings.0.0.weight"]
        w[f"{prefix}.head.class_proj.weight"] = normal(len(edges) - 1, d_out)
    else:
        w[f"{prefix}.head.weight"] = normal(edges[0] + len(edges) - 1, d_out)
    for i in range(len(edges) - 1):
        width = int(d_out // args["adaptive_softmax_factor"] ** (i + 1))
        band = f"decoder.embed_tokens.embeddings.{i + 1}"
        if tied and args["tie_adaptive_proj"]:
            w[f"{prefix}.tail.{i}.0.weight"] = w[f"{band}.1.weight"]
        else:
            w[f"{prefix}.tail.{i}.0.weight"] = normal(width, d_out)
        w[f"{prefix}.tail.{i}.2.weight"] = w[f"{band}.0.weight"] if tied else normal(edges[i + 1] - edges[i], width)
    w[f"{prefix}.version"] = np.ones(1, np.float32)


def _batch(rng: np.random.Generator, lengths: list[int], width: int):
    """fairseq's decoder input ([EOS, w...], right-padded with 1) and lconv's targets ([w..., EOS], padded 0)."""
    previous = np.ones((len(lengths), width), np.int64)
    target = np.zeros((len(lengths), width), np.int32)
    for b, n in enumerate(lengths):
        tokens = np.append(rng.integers(4, _V, n - 1), 2)
        previous[b, :n] = np.append(2, tokens[:-1])
        target[b, :n] = [fairseq_vocab.FAIRSEQ_TO_LCONV.get(int(t), int(t)) for t in tokens]
    return previous, target


LCONV_COLUMNS = [fairseq_vocab.FAIRSEQ_TO_LCONV.get(i, i) for i in range(_V)]


@pytest.mark.slow  # compiles eight models: CI runs it, the quick command skips it (the workdir test is quick)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_lm_variant_matches_the_reference(variant):
    """Random weights under fairseq's names, imported, give the float64 reference's log-probabilities."""
    from lconv.nn.models import DecoderOnlyLM, ModelConfig

    args = _args(variant)
    rng = np.random.default_rng(1)
    weights = lm_weights(args, rng)
    fields = fairseq_lm.model_fields(args, _V)
    model = DecoderOnlyLM(ModelConfig.from_config(fields, matmul_precision="highest"))
    params = fairseq_lm.lconv_params(weights, fields)
    previous, target = _batch(rng, [9, 4, 7], 9)
    # the import fills exactly the model's tree (apply alone would ignore a parameter the model never reads)
    shapes = jax.eval_shape(model.init, jax.random.key(0), target)["params"]
    assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, nn.meta.unbox(shapes))
    logits = model.apply({"params": params}, target, targets_segmentation=(target != 0).astype(np.int32))
    logp = np.asarray(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))  # logits or log-probs alike
    expected = fairseq_lm_reference.log_probs(weights, args, previous)
    real = target != 0
    np.testing.assert_allclose(logp[..., LCONV_COLUMNS][real], expected[real],
                               **tolerance(np.float32, "highest", rtol=1e-5, atol=1e-5))


def test_the_lm_fields_follow_fairseqs_arguments():
    fields = fairseq_lm.model_fields(_args("transformer_projected_untied_adaptive_softmax"), _V)
    # the vocabulary size as the last cutoff is fairseq's spelling of "no more bands"
    assert fields["adaptive_softmax_cutoffs"] == (12, 24) and fields["decoder_input_dim"] == 8
    assert (fields["decoder_output_dim"], fields["decoder_final_norm"], fields["decoder_start"]) == (12, True, "eos")
    assert fields["encoder_layers"] == 0 and fields["position_offset"] == 2
    lightconv = fairseq_lm.model_fields(_args("lightconv_adaptive_tied_proj"), _V)
    # lightconv_lm never has a final norm; tied widths are equal, so no project_out
    assert (lightconv["decoder_final_norm"], lightconv["tie_adaptive_proj"], lightconv["decoder_output_dim"]) == (
        False, True, 0)
    assert lightconv["decoder_mixer"] == "dynamicconv" and lightconv["decoder_kernel_sizes"] == (2, 4)
    post = fairseq_lm.model_fields(_args("transformer_postnorm_shared_output"), _V)
    # the flag as stored: post-norm (no final norm then), and the LM does not force pre-norm over it
    assert (post["normalize_before"], post["lm_pre_norm"], post["decoder_final_norm"]) == (False, False, False)
    assert post["share_decoder_input_output"] and not post["share_embeddings"]
    old = {**_args("transformer_adaptive_tied_no_final_norm"), "no_tie_adaptive_proj": False,
           "no_decoder_final_norm": False}  # pre-0.10 spelling: no final norm, projections tied
    assert fairseq_lm.model_fields(old, _V)["decoder_final_norm"] is False
    assert fairseq_lm.model_fields(old, _V)["tie_adaptive_proj"] is True
    # the translation importer's mapping: fairseq's activation names as lconv's, the embedding norm, no positions
    gelu = fairseq_lm.model_fields(_args("transformer_gelu_layernorm_embedding_projected_in"), _V)
    assert (gelu["activation"], gelu["layernorm_embedding"], gelu["token_positions"]) == ("gelu", True, True)
    fast = fairseq_lm.model_fields(_args("transformer_no_positions_gelu_fast_layernorm_embedding"), _V)
    assert (fast["activation"], fast["layernorm_embedding"], fast["token_positions"]) == ("gelu_accurate", True, False)
    conv = fairseq_lm.model_fields(_args("lightconv_no_positions_ignores_activation_and_embedding_norm"), _V)
    assert (conv["activation"], conv["layernorm_embedding"], conv["token_positions"]) == ("relu", False, False)
    assert fairseq_lm.model_fields({**_args("transformer_postnorm_shared_output"), "activation_dropout": 0.0,
                                    "relu_dropout": 0.2}, _V)["relu_dropout"] == 0.2  # fairseq's fallback


def test_what_lconv_cannot_express_is_one_line_naming_each_flag():
    args = {**_args("transformer_projected_untied_adaptive_softmax"), "character_embeddings": True,
            "activation_fn": "swish", "add_bos_token": True, "layernorm_embedding": True,
            "no_token_positional_embeddings": True}
    with pytest.raises(UserError) as err:
        fairseq_lm.model_fields(args, _V)
    message = str(err.value)
    assert "\n" not in message and message.startswith("this transformer_lm checkpoint has settings")
    for named in ("character_embeddings=True", "activation_fn='swish' (lconv has relu, gelu", "add_bos_token=True"):
        assert named in message
    assert "layernorm_embedding" not in message and "no_token_positional" not in message  # both imported now
    untieable = {**_args("lightconv_adaptive_tied_proj"), "adaptive_softmax_cutoff": "10,30"}
    with pytest.raises(UserError, match="tie_adaptive_weights needs adaptive input and softmax with the same cutoffs"):
        fairseq_lm.model_fields(untieable, _V)
    with pytest.raises(UserError, match=r"adaptive_input_cutoff='2,20' \(its first band must hold the 4 special"):
        fairseq_lm.model_fields({**untieable, "adaptive_input_cutoff": "2,20", "tie_adaptive_weights": False}, _V)


def test_tied_copies_and_leftovers_are_checked():
    args = _args("lightconv_adaptive_tied_proj")
    weights = lm_weights(args, np.random.default_rng(2))
    fields = fairseq_lm.model_fields(args, _V)
    broken = {**weights, "decoder.adaptive_softmax.tail.1.0.weight": weights["decoder.adaptive_softmax.tail.1.0.weight"]
              + 1}
    with pytest.raises(UserError, match=r"tail.1.0.weight should be a copy of the adaptive input's"):
        fairseq_lm.lconv_params(broken, fields)
    with pytest.raises(UserError, match=r"would not use: \['decoder.layer_norm.weight'\]"):
        fairseq_lm.lconv_params({**weights, "decoder.layer_norm.weight": np.ones(16, np.float32)}, fields)
    missing = {k: v for k, v in weights.items() if k != "decoder.adaptive_softmax.head.class_proj.weight"}
    with pytest.raises(UserError, match="lacks 'decoder.adaptive_softmax.head.class_proj.weight'"):
        fairseq_lm.lconv_params(missing, fields)


def write_checkpoint(path, args: dict, weights: dict[str, np.ndarray], updates: int = 7) -> None:
    """A ``.pt`` file as fairseq 0.12 saves one: ``cfg["model"]`` an argparse.Namespace, an OrderedDict of
    tensors (tied ones stored under each name)."""
    import torch

    state = collections.OrderedDict((k, torch.from_numpy(np.array(v))) for k, v in weights.items())
    torch.save({"args": None, "cfg": {"model": argparse.Namespace(**args), "task": {"_name": "language_modeling"}},
                "model": state, "optimizer_history": [{"num_updates": updates}], "extra_state": {}}, str(path))


def _reference_greedy(weights, args, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by the reference: argmax over every id but <pad>, stopping after EOS."""
    tokens = [2, *prompt]
    out: list[int] = []
    for _ in range(steps):
        logp = fairseq_lm_reference.log_probs(weights, args, np.array([tokens]))[0, -1]
        logp[1] = -np.inf
        out.append(int(np.argmax(logp)))
        if out[-1] == 2:
            break
        tokens.append(out[-1])
    return out


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_an_imported_lm_workdir_scores_and_continues_as_fairseq(tmp_path):
    """``python -m lconv.import_fairseq``'s function on a fairseq-written ``.pt`` (tied adaptive input and softmax):
    ``lconv.load`` opens an LM whose perplexity is fairseq-eval-lm's (``--sample-break-mode eos``: each line read
    as [EOS, w...] and scored on [w..., EOS], EOS counted) and whose greedy continuation is the reference's."""
    import lconv
    from lconv.interop import fairseq_workdir

    args = _args("lightconv_adaptive_tied_proj")
    weights = lm_weights(args, np.random.default_rng(13))  # a seed whose greedy continuations vary
    write_checkpoint(tmp_path / "checkpoint_best.pt", args, weights)
    symbols = [f"w{i}" for i in range(4, _V)]
    (tmp_path / "dict.txt").write_text("".join(f"{s} {100 - i}\n" for i, s in enumerate(symbols)))
    workdir = str(tmp_path / "lm")
    record = fairseq_workdir.import_checkpoint(str(tmp_path / "checkpoint_best.pt"), str(tmp_path / "dict.txt"),
                                               None, workdir, continuation="")
    assert (record["arch"], record["updates"], record["step"]) == ("lightconv_lm", 7, 7)
    model = lconv.load(workdir)
    assert model.task == "lm" and model.config.model.decoder_start == "eos"
    rng = np.random.default_rng(4)
    lines = [rng.integers(4, _V, n).tolist() for n in (5, 9, 1, 7)]
    total, count = 0.0, 0
    for ids in lines:
        previous = np.array([[2, *ids]])
        logp = fairseq_lm_reference.log_probs(weights, args, previous)[0]
        total += sum(logp[t, target] for t, target in enumerate([*ids, 2]))
        count += len(ids) + 1
    scored = model.perplexity([" ".join(f"w{i}" for i in ids) for ids in lines])
    assert scored["tokens"] == count
    np.testing.assert_allclose(scored["nll"], -total / count, rtol=1e-5)
    np.testing.assert_allclose(scored["ppl"], 2 ** (-total / count / np.log(2)), rtol=1e-4)  # eval-lm's 2**loss
    # fairseq-eval-lm's default rows: one stream (EOS after each line) in blocks of tokens_per_sample -
    # context_window tokens, each read after the context_window inputs before it, positions from each row's start
    stream = np.concatenate([[*ids, 2] for ids in lines])
    shifted = np.append(2, stream[:-1])  # the input of each stream position
    total, block, context = 0.0, 8 - 3, 3
    for start in range(0, len(stream), block):
        first = max(0, start - context)
        logp = fairseq_lm_reference.log_probs(weights, args, shifted[None, first:start + block])[0]
        total += sum(logp[start - first + t, target] for t, target in enumerate(stream[start:start + block]))
    scored = model.perplexity([" ".join(f"w{i}" for i in ids) for ids in lines], sample_break_mode="none",
                              tokens_per_sample=8, context_window=3)
    assert scored["tokens"] == len(stream)
    np.testing.assert_allclose(scored["nll"], -total / len(stream), rtol=1e-5)
    prompts = [lines[0], lines[2]]
    continued = [_reference_greedy(weights, args, p, 6) for p in prompts]
    assert all(len(set(c)) > 2 and min(c) >= 4 for c in continued)  # six tokens, several words, no special id
    expected = [" ".join(f"w{i}" for i in c) for c in continued]
    assert model.generate([" ".join(f"w{i}" for i in p) for p in prompts], max_len=6) == expected
