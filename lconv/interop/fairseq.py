"""A fairseq translation checkpoint (``lightconv`` or ``transformer`` architectures) as lconv's config and params.

``read_checkpoint`` reads the ``.pt`` file (torch is needed for that alone: ``pip install "lconv[fairseq]"``);
``model_fields`` turns fairseq's model arguments into ``config.model`` fields, refusing in one line what lconv's
model cannot express; ``lconv_params`` maps the state dict onto lconv's parameter tree and fails on any tensor
left over or missing. ``lconv.interop.fairseq_workdir`` writes the result as a workdir. Language models
(``lightconv_lm*``, ``transformer_lm*``) go through ``lconv.interop.fairseq_lm``, which reuses the reading and
the layers here.

fairseq's conventions become model options, not a fork of the model (``ModelConfig``): the decoder starts from
EOS (``decoder_start="eos"``), positions count from the padding id + 1 (``position_offset=2``), embeddings are
scaled by sqrt(d) unless ``--no-scale-embedding``. Its dictionary ids are re-numbered into lconv's
(``fairseq_vocab``), so embedding rows are permuted. Left-padded sources need nothing: lconv pads on the right,
and both zero padding before a conv and mask it in attention, so real positions see the same inputs.
Torch stores linear weights ``[out, in]``; flax kernels are ``[in, out]``.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lconv.errors import UserError
from lconv.interop.fairseq_vocab import lconv_rows

LIGHTCONV_ARCHS = "lightconv"  # lightconv, lightconv_iwslt_de_en, lightconv_wmt_en_de(_big), ...
TRANSFORMER_ARCHS = "transformer"  # transformer, transformer_wmt_en_de(_big), transformer_iwslt_de_en, ...
LM_ARCHS = ("lightconv_lm", "transformer_lm")  # lightconv_lm_gbw, transformer_lm_wiki103, ...: fairseq_lm
CONV_MIXERS = {"lightweight": "lightconv", "dynamic": "dynamicconv"}
PADDING_IDX = 1  # fairseq's <pad>; its positions start at PADDING_IDX + 1
# Never trained in fairseq 0.12: copies registered for its BetterTransformer path, refilled from the real keys.
_BETTER_TRANSFORMER = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias", "fc1_weight",
                       "fc1_bias", "fc2_weight", "fc2_bias")


def read_checkpoint(path: str, *, trust: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any], int]:
    """``(state dict as float32 numpy, model arguments, updates trained)`` of a fairseq ``.pt`` file.

    The file is read with torch's ``weights_only`` loader (tensors, containers and ``argparse.Namespace`` only):
    a checkpoint is a pickle, and a pickle from elsewhere could run code. ``trust=True`` uses the full unpickler
    for older checkpoints holding other objects (fairseq's meters), for files whose source you trust."""
    try:
        import torch
    except ImportError:
        raise UserError('reading a fairseq checkpoint needs PyTorch: pip install "lconv[fairseq]" (or torch)') \
            from None
    from etils import epath

    if not epath.Path(path).exists():
        raise UserError(f"no fairseq checkpoint at {path}")
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        with epath.Path(path).open("rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=not trust)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds; each becomes one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hint = "" if trust else " (if it holds other objects and you trust its source, pass --trust_checkpoint)"
        raise UserError(f"cannot read {path} as a torch checkpoint: {first[:200]}{hint}") from None
    if not isinstance(state, Mapping) or "model" not in state:
        raise UserError(f"{path} is not a fairseq checkpoint (no 'model' state dict)")
    args = _model_args(state, path)
    weights = {k: v.detach().float().numpy() for k, v in state["model"].items() if hasattr(v, "detach")}
    history = state.get("optimizer_history") or [{}]
    return weights, args, int(history[-1].get("num_updates", 0) or 0)


def _model_args(state: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The model's hyper-parameters: ``cfg["model"]`` (fairseq >= 0.10) or ``args`` (older checkpoints)."""
    cfg = state.get("cfg")
    source = cfg.get("model") if isinstance(cfg, Mapping) else None
    if source is None:
        source = state.get("args")
    if source is None:
        raise UserError(f"{path} records no model arguments (neither cfg['model'] nor args)")
    args = dict(vars(source)) if isinstance(source, argparse.Namespace) else dict(source)
    args.setdefault("arch", args.get("_name"))
    return args


def model_fields(args: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """``config.model`` fields equal to fairseq's model arguments; one ``UserError`` lists all that lconv cannot
    express (different encoder and decoder widths, adaptive softmax, a non-ReLU activation, ...)."""
    arch = str(args.get("arch") or "")
    if is_language_model(args):
        raise UserError(f"fairseq architecture {arch!r} is a language model: import it with "
                        "lconv.interop.fairseq_lm (python -m lconv.import_fairseq does)")
    if not arch.startswith((LIGHTCONV_ARCHS, TRANSFORMER_ARCHS)):
        raise UserError(f"fairseq architecture {arch!r} is not importable; lconv imports lightconv* and "
                        "transformer* translation models and lightconv_lm* and transformer_lm* language models")
    lightconv = arch.startswith(LIGHTCONV_ARCHS)
    problems: list[str] = []

    def same(encoder_key: str, decoder_key: str) -> Any:
        if args.get(encoder_key) != args.get(decoder_key):
            problems.append(f"{encoder_key}={args.get(encoder_key)} differs from {decoder_key}="
                            f"{args.get(decoder_key)} (lconv has one value for both)")
        return args.get(encoder_key)

    def require(key: str, allowed: Callable[[Any], bool], why: str) -> None:
        if key in args and not allowed(args[key]):
            problems.append(f"{key}={args[key]!r} ({why})")

    d_model = same("encoder_embed_dim", "decoder_embed_dim")
    # decoder_input_dim is not read here: fairseq's translation models embed targets decoder_embed_dim wide
    output_dim = int(args.get("decoder_output_dim") or d_model)  # a str in transformer checkpoints (no argparse type)
    if output_dim != d_model and (args.get("share_all_embeddings") or args.get("share_decoder_input_output_embed")):
        problems.append(f"decoder_output_dim={output_dim} with shared output embeddings {d_model} wide (fairseq "
                        "itself cannot run it)")
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, d_model=d_model, ffn_dim=same("encoder_ffn_embed_dim", "decoder_ffn_embed_dim"),
        num_heads=same("encoder_attention_heads", "decoder_attention_heads"),
        encoder_layers=args["encoder_layers"], decoder_layers=args["decoder_layers"],
        dropout=args.get("dropout", 0.1), attention_dropout=args.get("attention_dropout", 0.0),
        normalize_before=same("encoder_normalize_before", "decoder_normalize_before"),
        learned_positions=same("encoder_learned_pos", "decoder_learned_pos"),
        # learned tables must have one size; sinusoidal positions only bound the lengths lconv accepts
        max_len=same("max_source_positions", "max_target_positions") if args.get("encoder_learned_pos")
        else max(args.get("max_source_positions", 1024), args.get("max_target_positions", 1024)),
        share_embeddings=bool(args.get("share_all_embeddings")),
        share_decoder_input_output=bool(args.get("share_decoder_input_output_embed"))
        and not args.get("share_all_embeddings"),
        decoder_start="eos", position_offset=PADDING_IDX + 1,
        scale_embeddings=not args.get("no_scale_embedding", False),
        decoder_output_dim=0 if output_dim == d_model else int(output_dim))
    if lightconv:
        fields.update(
            encoder_mixer=CONV_MIXERS.get(args.get("encoder_conv_type"), args.get("encoder_conv_type")),
            decoder_mixer=CONV_MIXERS.get(args.get("decoder_conv_type"), args.get("decoder_conv_type")),
            encoder_kernel_sizes=tuple(args["encoder_kernel_size_list"]),
            decoder_kernel_sizes=tuple(args["decoder_kernel_size_list"]),
            use_glu=bool(same("encoder_glu", "decoder_glu")),
            conv_features=conv_features_field(same("encoder_conv_dim", "decoder_conv_dim"), d_model),
            relu_dropout=args.get("relu_dropout", 0.0), input_dropout=args.get("input_dropout", 0.0),
            weight_dropout=args.get("weight_dropout", 0.0), weight_softmax=bool(args.get("weight_softmax", True)))
        for side in ("encoder", "decoder"):
            require(f"{side}_conv_type", lambda v: v in CONV_MIXERS, "lightweight or dynamic")
    else:
        fields.update(encoder_mixer="attention", decoder_mixer="attention", encoder_kernel_sizes=(3,),
                      decoder_kernel_sizes=(3,), weight_dropout=0.0, relu_dropout=args.get("activation_dropout", 0.0),
                      decoder_final_norm=not args.get("no_decoder_final_norm", False))
        require("activation_fn", lambda v: v == "relu", "lconv's FFN is ReLU")
        for key in ("layernorm_embedding", "no_cross_attention", "cross_self_attention", "adaptive_input",
                    "tie_adaptive_weights"):
            require(key, lambda v: not v, "not in lconv's model")
        for key in ("encoder_layers_to_keep", "decoder_layers_to_keep"):
            require(key, lambda v: not v, "pruned layers")
        require("quant_noise_pq", lambda v: not v, "quantisation noise")
    require("adaptive_softmax_cutoff", lambda v: not v, "adaptive softmax is for language models")
    require("no_token_positional_embeddings", lambda v: not v, "lconv's models always add positions")
    if problems:
        raise UserError(f"this {arch} checkpoint has settings lconv's model lacks: {'; '.join(problems)}")
    return fields


def conv_features_field(conv_dim: Any, d_model: int) -> int:
    return 0 if conv_dim in (None, d_model) else int(conv_dim)  # 0 = the model width


class StateDict:
    """The checkpoint's tensors, handed out once each, so that ``leftover`` lists what no lconv parameter used."""

    def __init__(self, weights: Mapping[str, np.ndarray]):
        self.weights = dict(weights)
        self.used: set[str] = set()

    def take(self, key: str) -> np.ndarray:
        if key not in self.weights:
            raise UserError(f"the fairseq checkpoint lacks {key!r}, which its architecture arguments imply")
        self.used.add(key)
        return self.weights[key]

    def linear(self, prefix: str, bias: bool = True) -> dict[str, np.ndarray]:
        out = {"kernel": self.take(f"{prefix}.weight").T}
        if bias:
            out["bias"] = self.take(f"{prefix}.bias")
        return out

    def norm(self, prefix: str) -> dict[str, np.ndarray]:
        return {"scale": self.take(f"{prefix}.weight"), "bias": self.take(f"{prefix}.bias")}

    def attention(self, prefix: str) -> dict[str, dict[str, np.ndarray]]:
        return {ours: self.linear(f"{prefix}.{theirs}_proj") for ours, theirs in
                (("query", "q"), ("key", "k"), ("value", "v"), ("out", "out"))}

    def leftover(self) -> list[str]:
        ignored = ("version", "_float_tensor") + _BETTER_TRANSFORMER
        return sorted(k for k in self.weights if k not in self.used and not k.endswith(ignored))

    def check_all_used(self) -> None:
        leftover = self.leftover()
        if leftover:
            raise UserError(f"the fairseq checkpoint has tensors lconv's model would not use: {leftover[:6]}"
                            f"{' ...' if len(leftover) > 6 else ''}; is its architecture argument right?")


def lconv_params(weights: Mapping[str, np.ndarray], fields: Mapping[str, Any]) -> dict[str, Any]:
    """lconv's parameter tree (``EncoderDecoder``) from a fairseq state dict, for the model ``fields`` describe."""
    state = StateDict(weights)
    lightconv = fields["encoder_mixer"] != "attention"
    params: dict[str, Any] = {}
    if fields["share_embeddings"]:
        params["source_embed"] = {"embedding": lconv_rows(state.take("encoder.embed_tokens.weight"))}
        for copy in ("decoder.embed_tokens.weight", "decoder.output_projection.weight", "decoder.embed_out"):
            if copy in weights:  # the same tensor stored again
                check_copy(state.take(copy), params["source_embed"]["embedding"], copy)
    else:
        params["source_embed"] = {"embedding": lconv_rows(state.take("encoder.embed_tokens.weight"))}
        params["target_embed"] = {"embedding": lconv_rows(state.take("decoder.embed_tokens.weight"))}
        output = "decoder.embed_out" if "decoder.embed_out" in weights else "decoder.output_projection.weight"
        if fields["share_decoder_input_output"]:
            if output in weights:
                check_copy(state.take(output), params["target_embed"]["embedding"], output)
        else:
            params["output_projection"] = {"kernel": lconv_rows(state.take(output)).T}
    if fields.get("decoder_output_dim"):
        params["project_out"] = state.linear("decoder.project_out_dim", bias=False)
    if fields["learned_positions"]:
        for side, ours in (("encoder", "source_positions"), ("decoder", "target_positions")):
            params[ours] = {"learned": {"embedding": state.take(f"{side}.embed_positions.weight")}}
    for side in ("encoder", "decoder"):
        layers = {f"layer_{i}": layer_params(state, f"{side}.layers.{i}", side, lightconv)
                  for i in range(fields[f"{side}_layers"])}
        if fields["normalize_before"] and (side == "encoder" or fields.get("decoder_final_norm", True)):
            layers["final_norm"] = state.norm(f"{side}.layer_norm")
        params[side] = layers
    state.check_all_used()
    return params


def layer_params(state: StateDict, prefix: str, side: str, lightconv: bool,
                 cross_attention: bool = True) -> dict[str, Any]:
    """One encoder or decoder layer's params (a decoder layer without ``cross_attention``: a language model's)."""
    if lightconv:
        mixer_norm = f"{prefix}.layer_norms.0" if side == "encoder" else f"{prefix}.conv_layer_norm"
        ffn_norm = f"{prefix}.layer_norms.1" if side == "encoder" else f"{prefix}.final_layer_norm"
        layer = {"mixer": _conv_block(state, prefix)}
    else:
        mixer_norm, ffn_norm = f"{prefix}.self_attn_layer_norm", f"{prefix}.final_layer_norm"
        layer = {"mixer": state.attention(f"{prefix}.self_attn")}
    layer["mixer_norm"] = state.norm(mixer_norm)
    if side == "decoder" and cross_attention:
        layer["encoder_attention"] = state.attention(f"{prefix}.encoder_attn")
        layer["encoder_attention_norm"] = state.norm(f"{prefix}.encoder_attn_layer_norm")
    layer["ffn"] = {"fc1": state.linear(f"{prefix}.fc1"), "fc2": state.linear(f"{prefix}.fc2")}
    layer["ffn_norm"] = state.norm(ffn_norm)
    return layer


def _conv_block(state: StateDict, prefix: str) -> dict[str, Any]:
    """``linear1`` (GLU or not: the same ``[in, out]`` kernel), the conv, ``linear2``."""
    if f"{prefix}.conv.bias" in state.weights:
        raise UserError(f"{prefix}.conv.bias: a conv bias is not in lconv's conv block (fairseq's lightconv "
                        "models have none)")
    if f"{prefix}.conv.weight_linear.weight" in state.weights:  # DynamicConv: [H*K, C] head-major
        conv = {"weight_linear": state.linear(f"{prefix}.conv.weight_linear", bias=False)}
    else:  # LightweightConv: [H, 1, K]
        conv = {"weight": state.take(f"{prefix}.conv.weight")[:, 0, :]}
    return {"linear1": state.linear(f"{prefix}.linear1"), "conv": conv, "linear2": state.linear(f"{prefix}.linear2")}


def check_copy(copy: np.ndarray, embedding_VC: np.ndarray, key: str, what: str = "the shared embedding "
               "(share_all_embeddings)", rows: Callable[[np.ndarray], np.ndarray] = lconv_rows) -> None:
    """A tensor fairseq stores twice (tied weights) must be the same tensor: ``rows`` maps it as its original was."""
    mapped = rows(copy)
    if mapped.shape != embedding_VC.shape or not np.array_equal(mapped, embedding_VC):
        raise UserError(f"{key} should be a copy of {what} but differs")


def is_language_model(args: Mapping[str, Any]) -> bool:
    return str(args.get("arch") or "").startswith(LM_ARCHS)
