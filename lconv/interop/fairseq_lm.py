"""A fairseq language model checkpoint (``lightconv_lm*`` or ``transformer_lm*``) as lconv's config and params: its
architecture flags become ``config.model`` fields and decoder ends (``lconv.nn.decoder_ends``). Flag by flag, and how
fairseq's LM data and perplexity map onto lconv's: docs/fairseq.md, "Language models"."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lconv.errors import UserError
from lconv.interop import fairseq
from lconv.interop.fairseq_vocab import FAIRSEQ_TO_LCONV, lconv_rows

_NOT_IN_LCONV = {  # flag -> why lconv refuses a checkpoint that sets it (to a true value)
    "character_embeddings": "character CNN embeddings are not in lconv's model",
    "add_bos_token": "its inputs start with BOS; lconv's imported LMs start from EOS",
    "decoder_layers_to_keep": "pruned layers",
    "quant_noise_pq": "quantisation noise",
    "base_layers": "BASE layers",
    "scale_fc": "NormFormer's extra norms", "scale_attn": "NormFormer's extra norms",
    "scale_heads": "NormFormer's head scales", "scale_resids": "NormFormer's residual scales",
    "cross_self_attention": "not in lconv's model",
}


def cutoff_list(value: Any, key: str) -> tuple[int, ...]:
    """fairseq's cutoff argument (``"20000,60000"``, a list, or None) as a tuple of ints."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            return tuple(int(v) for v in value.strip("[]() ").split(",") if v.strip())
        except ValueError:
            raise UserError(f"{key}={value!r}: not a comma-separated list of integers") from None
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def model_fields(args: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """``config.model`` fields equal to a fairseq LM's arguments; one ``UserError`` lists all lconv cannot express."""
    arch = str(args.get("arch") or "")
    lightconv = arch.startswith("lightconv_lm")
    if not fairseq.is_language_model(args):
        raise UserError(f"fairseq architecture {arch!r} is not a lightconv_lm* or transformer_lm* language model")
    args = _upgraded(args)
    problems: list[str] = []

    def require(key: str, allowed: Callable[[Any], bool], why: str) -> None:
        if key in args and not allowed(args[key]):
            problems.append(f"{key}={args[key]!r} ({why})")

    for key, why in _NOT_IN_LCONV.items():
        require(key, lambda v: not v, why)
    if not lightconv:
        require("activation_fn", lambda v: v in fairseq.ACTIVATION_NAMES,
                f"lconv has {', '.join(fairseq.ACTIVATION_NAMES)}")
    d_model = int(args["decoder_embed_dim"])
    ends = _decoder_ends(args, vocab_size, d_model, problems)
    if problems:
        raise UserError(f"this {arch} checkpoint has settings lconv's model lacks: {'; '.join(problems)}")
    max_len = args.get("max_target_positions") or args.get("tokens_per_sample") or 1024
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, d_model=d_model, ffn_dim=int(args["decoder_ffn_embed_dim"]),
        num_heads=int(args["decoder_attention_heads"]), encoder_layers=0, decoder_layers=int(args["decoder_layers"]),
        dropout=args.get("dropout", 0.1), attention_dropout=args.get("attention_dropout", 0.0),
        # named LM architectures force pre-norm, plain transformer_lm (0.12) keeps the default: follow the flag
        normalize_before=bool(args.get("decoder_normalize_before", True)), lm_pre_norm=False,
        learned_positions=bool(args.get("decoder_learned_pos")), max_len=int(max_len),
        token_positions=not args.get("no_token_positional_embeddings", False),
        decoder_start="eos", position_offset=fairseq.PADDING_IDX + 1,
        scale_embeddings=lightconv or not args.get("no_scale_embedding", False),
        # lightconv_lm builds its decoder with final_norm=False whatever the flags say; post-norm has none
        decoder_final_norm=not lightconv and bool(args.get("decoder_normalize_before", True))
        and not args.get("no_decoder_final_norm", False), **ends)
    if lightconv:
        kernels = list(args["decoder_kernel_size_list"])
        fields.update(
            decoder_mixer=fairseq.CONV_MIXERS.get(args.get("decoder_conv_type", "dynamic"), "?"),
            decoder_kernel_sizes=tuple(kernels * fields["decoder_layers"] if len(kernels) == 1 else kernels),
            use_glu=bool(args.get("decoder_glu", True)),
            conv_features=fairseq.conv_features_field(args.get("decoder_conv_dim"), d_model),
            relu_dropout=args.get("relu_dropout", 0.0), input_dropout=args.get("input_dropout", 0.0),
            weight_dropout=args.get("weight_dropout", 0.0), weight_softmax=bool(args.get("weight_softmax", True)),
            activation="relu", layernorm_embedding=False)  # LightConvDecoder: F.relu, no embedding norm
        if fields["decoder_mixer"] == "?":
            raise UserError(f"decoder_conv_type={args.get('decoder_conv_type')!r}: lightweight or dynamic")
    else:
        activation = args.get("activation_fn", "relu")
        fields.update(decoder_mixer="attention", decoder_kernel_sizes=(3,), weight_dropout=0.0,
                      # fairseq's layer reads relu_dropout where activation_dropout is 0 (older checkpoints)
                      relu_dropout=args.get("activation_dropout", 0.0) or args.get("relu_dropout", 0.0) or 0.0,
                      activation=fairseq.ACTIVATION_NAMES.get(activation, activation),
                      layernorm_embedding=bool(args.get("layernorm_embedding", False)))
    fields.update(encoder_mixer=fields["decoder_mixer"], encoder_kernel_sizes=(3,))  # no encoder: any valid value
    return fields


def _upgraded(args: Mapping[str, Any]) -> dict[str, Any]:
    """Older transformer_lm arguments as fairseq 0.12 reads them (``base_lm_architecture``)."""
    args = dict(args)
    if "no_tie_adaptive_proj" in args:
        args["no_decoder_final_norm"] = True
        args["tie_adaptive_proj"] = args.get("tie_adaptive_proj") or not args["no_tie_adaptive_proj"]
    if "decoder_final_norm" in args:
        args["no_decoder_final_norm"] = not args["decoder_final_norm"]
    return args


def _decoder_ends(args: Mapping[str, Any], vocab_size: int, d_model: int, problems: list[str]) -> dict[str, Any]:
    """The embedding / output fields (``lconv.nn.decoder_ends``); what fairseq itself could not run is a problem."""
    input_dim = int(args.get("decoder_input_dim") or d_model)
    output_dim = int(args.get("decoder_output_dim") or d_model)
    softmax_cutoffs = _cutoffs(args, "adaptive_softmax_cutoff", vocab_size, problems)
    input_cutoffs = _cutoffs(args, "adaptive_input_cutoff", vocab_size, problems) if args.get("adaptive_input") \
        else ()
    tie = bool(args.get("tie_adaptive_weights"))
    shared = bool(args.get("share_decoder_input_output_embed")) and not softmax_cutoffs
    if tie and not (input_cutoffs and softmax_cutoffs and input_cutoffs == softmax_cutoffs
                    and float(args.get("adaptive_input_factor") or 4) == float(args.get("adaptive_softmax_factor") or 4)
                    and input_dim == output_dim == d_model):
        problems.append("tie_adaptive_weights needs adaptive input and softmax with the same cutoffs and factor, "
                        "and decoder_input_dim = decoder_output_dim = decoder_embed_dim (fairseq asserts it)")
    if shared and (input_cutoffs or input_dim != output_dim):
        problems.append("share_decoder_input_output_embed with adaptive input or decoder_input_dim != "
                        "decoder_output_dim (fairseq itself cannot run it)")
    return dict(
        share_embeddings=False, share_decoder_input_output=shared,
        decoder_input_dim=0 if input_dim == d_model else input_dim,
        # tied adaptive weights: fairseq builds no project_out_dim (the widths are equal then anyway)
        decoder_output_dim=0 if output_dim == d_model or tie else output_dim,
        adaptive_input_cutoffs=input_cutoffs, adaptive_input_factor=float(args.get("adaptive_input_factor") or 4),
        adaptive_softmax_cutoffs=softmax_cutoffs,
        adaptive_softmax_factor=float(args.get("adaptive_softmax_factor") or 4),
        adaptive_softmax_dropout=float(args.get("adaptive_softmax_dropout") or 0.0),
        tie_adaptive_weights=tie, tie_adaptive_proj=tie and bool(args.get("tie_adaptive_proj")))


def _cutoffs(args: Mapping[str, Any], key: str, vocab_size: int, problems: list[str]) -> tuple[int, ...]:
    """fairseq's cutoffs without the vocabulary size as the last one; the special ids must be in band 0."""
    cuts = cutoff_list(args.get(key), key)
    if cuts and cuts[-1] == vocab_size:
        cuts = cuts[:-1]
    if cuts and cuts[0] < len(FAIRSEQ_TO_LCONV):
        problems.append(f"{key}={args.get(key)!r} (its first band must hold the 4 special ids)")
    return cuts


def lconv_params(weights: Mapping[str, np.ndarray], fields: Mapping[str, Any]) -> dict[str, Any]:
    """lconv's parameter tree (``DecoderOnlyLM``) from a fairseq LM state dict, for the model ``fields`` describe."""
    state = fairseq.StateDict(weights)
    lightconv = fields["decoder_mixer"] != "attention"
    params: dict[str, Any] = {"embed": _embedding(state, fields)}
    if fields["decoder_input_dim"] and not fields["adaptive_input_cutoffs"]:
        params["project_in"] = state.linear("decoder.project_in_dim", bias=False)
    scale_and_position = {}
    if fields["token_positions"] and fields["learned_positions"]:
        scale_and_position["learned"] = {"embedding": state.take("decoder.embed_positions.weight")}
    if fields["layernorm_embedding"]:
        scale_and_position["embedding_norm"] = state.norm("decoder.layernorm_embedding")
    if scale_and_position:
        params["scale_and_position"] = scale_and_position
    decoder = {f"layer_{i}": fairseq.layer_params(state, f"decoder.layers.{i}", "decoder", lightconv,
                                                  cross_attention=False)
               for i in range(fields["decoder_layers"])}
    if fields["decoder_final_norm"]:
        decoder["final_norm"] = state.norm("decoder.layer_norm")
    params["decoder"] = decoder
    if fields["decoder_output_dim"]:
        params["project_out"] = state.linear("decoder.project_out_dim", bias=False)
    if fields["adaptive_softmax_cutoffs"]:
        params["adaptive_softmax"] = _adaptive_softmax(state, fields, params["embed"])
    else:
        output = "decoder.embed_out" if "decoder.embed_out" in weights else "decoder.output_projection.weight"
        if fields["share_decoder_input_output"]:
            if output in weights:  # transformer_lm stores the shared table again as its output projection
                fairseq.check_copy(state.take(output), params["embed"]["embedding"], output,
                                   "the embedding (share_decoder_input_output_embed)")
        else:
            params["output_projection"] = {"kernel": lconv_rows(state.take(output)).T}
    state.check_all_used()
    return params


def _embedding(state: fairseq.StateDict, fields: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One table (rows re-numbered to lconv's ids), or the adaptive input's bands and their projections."""
    if not fields["adaptive_input_cutoffs"]:
        return {"embedding": lconv_rows(state.take("decoder.embed_tokens.weight"))}
    bands: dict[str, np.ndarray] = {}
    for band in range(len(fields["adaptive_input_cutoffs"]) + 1):
        table = state.take(f"decoder.embed_tokens.embeddings.{band}.0.weight")
        bands[f"band_{band}"] = lconv_rows(table) if band == 0 else table
        bands[f"band_{band}_projection"] = state.take(f"decoder.embed_tokens.embeddings.{band}.1.weight").T
    return bands


def _adaptive_softmax(state: fairseq.StateDict, fields: Mapping[str, Any],
                      embed: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """fairseq's ``AdaptiveSoftmax`` (``head``, per tail ``tail.i.0`` and ``tail.i.2``) or its tied form on the adaptive
    input's weights."""
    prefix = "decoder.adaptive_softmax"
    tails = range(len(fields["adaptive_softmax_cutoffs"]))
    if not fields["tie_adaptive_weights"]:
        out = {"head": {"kernel": lconv_rows(state.take(f"{prefix}.head.weight")).T}}
        for i in tails:
            out[f"tail_{i}_projection"] = state.linear(f"{prefix}.tail.{i}.0", bias=False)
            out[f"tail_{i}"] = state.linear(f"{prefix}.tail.{i}.2", bias=False)
        return out
    out = {"head_clusters": state.linear(f"{prefix}.head.class_proj", bias=False)}
    copies = [(f"{prefix}.head.word_proj.weight", embed["band_0"], lconv_rows)]
    for i in tails:
        copies.append((f"{prefix}.tail.{i}.2.weight", embed[f"band_{i + 1}"], _same))
        if fields["tie_adaptive_proj"]:
            copies.append((f"{prefix}.tail.{i}.0.weight", embed[f"band_{i + 1}_projection"], np.transpose))
        else:
            out[f"tail_{i}_projection"] = state.linear(f"{prefix}.tail.{i}.0", bias=False)
    for key, original, rows in copies:
        if key in state.weights:
            fairseq.check_copy(state.take(key), original, key, "the adaptive input's (tie_adaptive_weights)", rows)
    return out


def _same(x: np.ndarray) -> np.ndarray:
    return x
