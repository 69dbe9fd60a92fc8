"""A fairseq translation checkpoint (``lightconv`` or ``transformer`` architectures) as lconv's config and params.

``read_checkpoint`` reads the ``.pt`` file (torch needed: ``pip install "lconv[fairseq]"``); ``model_fields`` turns
fairseq's arguments into ``config.model`` fields, refusing in one line what lconv cannot express; ``lconv_params`` maps
the state dict onto lconv's tree and fails on any tensor left over or missing. fairseq's conventions become model
options (``decoder_start``, ``position_offset``, ...), not a fork of the model; the mapping: docs/fairseq.md.
"""
from __future__ import annotations

import argparse
import io
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from lconv import command_files
from lconv.errors import UserError
from lconv.interop.fairseq_vocab import lconv_rows
from lconv.nn.model_config import ModelConfig

LIGHTCONV_ARCHS = "lightconv"  # lightconv, lightconv_iwslt_de_en, lightconv_wmt_en_de(_big), ...
TRANSFORMER_ARCHS = "transformer"  # transformer, transformer_wmt_en_de(_big), transformer_iwslt_de_en, ...
LM_ARCHS = ("lightconv_lm", "transformer_lm")  # lightconv_lm_gbw, transformer_lm_wiki103, ...: fairseq_lm
CONV_MIXERS = {"lightweight": "lightconv", "dynamic": "dynamicconv"}
PADDING_IDX = 1  # fairseq's <pad>; its positions start at PADDING_IDX + 1
# Never trained in fairseq 0.12: copies registered for its BetterTransformer path, refilled from the real keys.
_BETTER_TRANSFORMER = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias", "fc1_weight",
                       "fc1_bias", "fc2_weight", "fc2_bias")


class Float32Tensors(Mapping[str, np.ndarray]):
    """A state dict's tensors, each turned into float32 numpy when first read: a tensor the import never reads is
    never converted (an unused int8 tensor stored with zero strides would otherwise be allocated whole as float32
    before the leftover check refuses it)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors = {k: v for k, v in tensors.items() if hasattr(v, "detach")}
        self.converted: dict[str, np.ndarray] = {}

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.converted:
            self.converted[key] = self.tensors[key].detach().float().numpy()
        return self.converted[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def read_checkpoint(path: str, *, trust: bool = False) -> tuple[Mapping[str, np.ndarray], dict[str, Any], int]:
    """``(state dict as float32 numpy, each converted when read; model arguments; updates trained)`` of a fairseq
    ``.pt`` file, read with torch's ``weights_only`` loader (a pickle could run code); ``trust=True`` uses the full
    unpickler, for files you trust."""
    try:
        import torch
    except ImportError:
        raise UserError('reading a fairseq checkpoint needs PyTorch: pip install "lconv[fairseq]" (or torch)') \
            from None
    from etils import epath

    from lconv.data import paths

    if not epath.Path(path).exists():
        raise UserError(f"no fairseq checkpoint at {path}")
    paths.check_file(path)  # a pipe hung the import; /dev/zero reached torch's loader
    torch.serialization.add_safe_globals([argparse.Namespace])
    trusted = None
    if trust and not paths.is_url(path):  # code it runs: the file this user wrote, read once as a config is
        _, trusted = command_files.read_checked(path, f"--checkpoint={path}", "with --trust_checkpoint it is code "
                                                "lconv would run as you", paths.READ_LIMIT)
    try:
        with (io.BytesIO(trusted) if trusted is not None else epath.Path(path).open("rb")) as f:
            state = torch.load(f, map_location="cpu", weights_only=not trust)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds; each becomes one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hint = "" if trust else " (if it holds other objects and you trust its source, pass --trust_checkpoint)"
        raise UserError(f"cannot read {path} as a torch checkpoint: {first[:200]}{hint}") from None
    if not isinstance(state, Mapping) or not isinstance(state.get("model"), Mapping):
        raise UserError(f"{path} is not a fairseq checkpoint (no 'model' state dict)")
    args = _model_args(state, path)
    return Float32Tensors(state["model"]), args, _updates(state, path)


def _updates(state: Mapping[str, Any], path: str) -> int:
    """The updates trained, from the last of ``optimizer_history``'s records (0 when it has none)."""
    history = state.get("optimizer_history") or [{}]
    last = history[-1] if isinstance(history, (list, tuple)) else None
    updates = last.get("num_updates") if isinstance(last, Mapping) else "no record"
    if updates is None:
        return 0
    if isinstance(updates, bool) or not isinstance(updates, (int, float)) or not math.isfinite(updates):
        raise UserError(f"{path}: optimizer_history is {str(history)[:80]}; fairseq records a list of dicts, the "
                        "last with num_updates a count")
    return int(updates)


def _model_args(state: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The model's hyper-parameters: ``cfg["model"]`` (fairseq >= 0.10) or ``args`` (older checkpoints)."""
    cfg = state.get("cfg")
    source = cfg.get("model") if isinstance(cfg, Mapping) else None
    if source is None:
        source = state.get("args")
    if source is None:
        raise UserError(f"{path} records no model arguments (neither cfg['model'] nor args)")
    if not isinstance(source, (argparse.Namespace, Mapping)):
        raise UserError(f"{path}: its model arguments are {type(source).__name__} {str(source)[:40]}; fairseq records "
                        "a dict or an argparse.Namespace")
    args = dict(vars(source)) if isinstance(source, argparse.Namespace) else dict(source)
    args.setdefault("arch", args.get("_name"))
    return args


# lconv's per-side model fields and the fairseq arguments that set them ("{side}_" + the argument's tail).
SIDE_ARGS = {"d_model": "embed_dim", "ffn_dim": "ffn_embed_dim", "num_heads": "attention_heads",
             "normalize_before": "normalize_before", "learned_positions": "learned_pos"}
LIGHTCONV_SIDE_ARGS = {"use_glu": "glu"}  # and conv_dim (conv_features: 0 = the side's width)
# fairseq's --activation-fn names lconv has, under lconv's name (gelu_fast is fairseq's old name of gelu_accurate)
ACTIVATION_NAMES = {"relu": "relu", "gelu": "gelu", "gelu_fast": "gelu_accurate", "gelu_accurate": "gelu_accurate",
                    "relu_squared": "relu_squared", "tanh": "tanh", "linear": "linear"}
# Transformer arguments that add parameters or computation lconv's model lacks: any true value is refused.
_TRANSFORMER_ABSENT = {
    "no_cross_attention": "a decoder without encoder attention", "cross_self_attention": "cross+self attention",
    "adaptive_input": "adaptive input is for language models", "tie_adaptive_weights": "adaptive input",
    "encoder_layers_to_keep": "pruned layers", "decoder_layers_to_keep": "pruned layers",
    "quant_noise_pq": "quantisation noise", "base_layers": "BASE layers", "scale_attn": "NormFormer",
    "scale_fc": "NormFormer", "scale_heads": "NormFormer", "scale_resids": "NormFormer",
    "char_inputs": "character inputs"}


def model_fields(args: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """``config.model`` fields equal to fairseq's model arguments (``decoder_<field>`` where the decoder's differ); one
    ``UserError`` lists all that lconv cannot express."""
    arch = str(args.get("arch") or "")
    if is_language_model(args):
        raise UserError(f"fairseq architecture {arch!r} is a language model: import it with "
                        "lconv.interop.fairseq_lm (python -m lconv.import_fairseq does)")
    if not arch.startswith((LIGHTCONV_ARCHS, TRANSFORMER_ARCHS)):
        raise UserError(f"fairseq architecture {arch!r} is not importable; lconv imports lightconv* and "
                        "transformer* translation models and lightconv_lm* and transformer_lm* language models")
    lightconv = arch.startswith(LIGHTCONV_ARCHS)
    _check_recorded(args, arch, lightconv)
    problems: list[str] = []

    def require(key: str, allowed: Callable[[Any], bool], why: str) -> None:
        if key in args and not allowed(args[key]):
            problems.append(f"{key}={args[key]!r} ({why})")

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, encoder_layers=args["encoder_layers"], decoder_layers=args["decoder_layers"],
        dropout=args.get("dropout", 0.1), attention_dropout=args.get("attention_dropout", 0.0),
        max_len=_max_len(args, problems), share_embeddings=bool(args.get("share_all_embeddings")),
        share_decoder_input_output=bool(args.get("share_decoder_input_output_embed"))
        and not args.get("share_all_embeddings"),
        token_positions=not args.get("no_token_positional_embeddings", False),
        decoder_start="eos", position_offset=PADDING_IDX + 1)
    for name, tail in {**SIDE_ARGS, **(LIGHTCONV_SIDE_ARGS if lightconv else {})}.items():
        _per_side(fields, name, args.get(f"encoder_{tail}"), args.get(f"decoder_{tail}"))
    widths = {side: args.get(f"{side}_embed_dim") for side in ("encoder", "decoder")}
    if lightconv and widths["encoder"] != widths["decoder"]:
        problems.append(f"encoder_embed_dim={widths['encoder']} differs from decoder_embed_dim={widths['decoder']} "
                        "(fairseq's lightconv decoder attends the encoder output with keys of its own width, so "
                        "such a model cannot run in fairseq either)")
    # decoder_input_dim is not read: fairseq's translation decoders embed targets decoder_embed_dim wide
    output_dim = int(args.get("decoder_output_dim") or widths["decoder"])  # a str in transformer checkpoints
    if output_dim != widths["decoder"] and (args.get("share_all_embeddings")
                                             or args.get("share_decoder_input_output_embed")):
        problems.append(f"decoder_output_dim={output_dim} with shared output embeddings {widths['decoder']} wide "
                        "(fairseq itself cannot run it)")
    fields["decoder_output_dim"] = 0 if output_dim == widths["decoder"] else output_dim
    if lightconv:
        fields.update(_lightconv_fields(args, require))
    else:
        fields.update(_transformer_fields(args, require))
    require("adaptive_softmax_cutoff", lambda v: not v, "adaptive softmax is for language models")
    if problems:
        raise UserError(f"this {arch} checkpoint has settings lconv's model lacks: {'; '.join(problems)}")
    return fields


def _check_recorded(args: Mapping[str, Any], arch: str, lightconv: bool) -> None:
    """The arguments fairseq always writes are there and the layer counts positive ints (else the record is hand-made
    or truncated)."""
    required = ("encoder_layers", "decoder_layers") + (
        ("encoder_kernel_size_list", "decoder_kernel_size_list") if lightconv else ())
    missing = [name for name in required if name not in args]
    if missing:
        raise UserError(f"this {arch} checkpoint's model arguments lack {', '.join(missing)}")
    for name in ("encoder_layers", "decoder_layers"):
        if type(args[name]) is not int or args[name] < 1:
            raise UserError(f"this {arch} checkpoint's {name}={args[name]!r:.40} is not a layer count")


def _per_side(fields: dict[str, Any], name: str, encoder_value: Any, decoder_value: Any) -> None:
    """The shared field takes the encoder's value; ``decoder_<name>`` only where the decoder's differs."""
    fields[name] = encoder_value
    if decoder_value != encoder_value:
        fields[f"decoder_{name}"] = decoder_value


def _max_len(args: Mapping[str, Any], problems: list[str]) -> int:
    """Learned tables must have one size; sinusoidal positions only bound the lengths lconv accepts."""
    source, target = args.get("max_source_positions", 1024), args.get("max_target_positions", 1024)
    if (args.get("encoder_learned_pos") or args.get("decoder_learned_pos")) and source != target:
        problems.append(f"max_source_positions={source} differs from max_target_positions={target} (lconv's "
                        "learned position tables have one size)")
    return max(source, target)


def _lightconv_fields(args: Mapping[str, Any], require: Callable[..., None]) -> dict[str, Any]:
    """fairseq's lightconv ignores --activation-fn, --layernorm-embedding and --no-scale-embedding."""
    fields: dict[str, Any] = dict(
        encoder_mixer=CONV_MIXERS.get(args.get("encoder_conv_type"), args.get("encoder_conv_type")),
        decoder_mixer=CONV_MIXERS.get(args.get("decoder_conv_type"), args.get("decoder_conv_type")),
        encoder_kernel_sizes=_kernel_sizes(args, "encoder"), decoder_kernel_sizes=_kernel_sizes(args, "decoder"),
        relu_dropout=args.get("relu_dropout", 0.0), input_dropout=args.get("input_dropout", 0.0),
        weight_dropout=args.get("weight_dropout", 0.0), weight_softmax=bool(args.get("weight_softmax", True)),
        scale_embeddings=True)
    convs = [conv_features_field(args.get(f"{side}_conv_dim"), args.get(f"{side}_embed_dim"))
             for side in ("encoder", "decoder")]
    _per_side(fields, "conv_features", *convs)
    for side in ("encoder", "decoder"):
        require(f"{side}_conv_type", lambda v: v in CONV_MIXERS, "lightweight or dynamic")
    return fields


def _kernel_sizes(args: Mapping[str, Any], side: str) -> tuple[int, ...]:
    sizes = args[f"{side}_kernel_size_list"]
    if not isinstance(sizes, (list, tuple)) or not all(type(size) is int for size in sizes):
        raise UserError(f"{side}_kernel_size_list={sizes!r:.60}: fairseq records a list of kernel widths, one a layer")
    return tuple(sizes)


def _transformer_fields(args: Mapping[str, Any], require: Callable[..., None]) -> dict[str, Any]:
    activation = args.get("activation_fn", "relu")
    require("activation_fn", lambda v: v in ACTIVATION_NAMES, f"lconv has {', '.join(ACTIVATION_NAMES)}")
    for key, why in _TRANSFORMER_ABSENT.items():
        require(key, lambda v: not v, why)
    return dict(encoder_mixer="attention", decoder_mixer="attention", encoder_kernel_sizes=(3,),
                decoder_kernel_sizes=(3,), weight_dropout=0.0,
                decoder_final_norm=not args.get("no_decoder_final_norm", False),
                relu_dropout=args.get("activation_dropout", 0.0) or args.get("relu_dropout", 0.0) or 0.0,
                activation=ACTIVATION_NAMES.get(activation, activation),
                layernorm_embedding=bool(args.get("layernorm_embedding", False)),
                scale_embeddings=not args.get("no_scale_embedding", False))


def conv_features_field(conv_dim: Any, d_model: int) -> int:
    return 0 if conv_dim in (None, d_model) else int(conv_dim)  # 0 = the side's width


class StateDict:
    """The checkpoint's tensors, handed out once each, so that ``leftover`` lists what no lconv parameter used."""

    def __init__(self, weights: Mapping[str, np.ndarray]):
        self.weights = weights  # not copied: a Float32Tensors converts only the tensors taken
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


def lconv_params(weights: Mapping[str, np.ndarray], fields: Mapping[str, Any],
                 orders: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """lconv's parameter tree (``EncoderDecoder``) from a fairseq state dict; ``orders``: ``{side: the fairseq id of
    each lconv id}`` for separate dictionaries."""
    if orders is None and len(weights.get("encoder.embed_tokens.weight", ())) != \
            len(weights.get("decoder.embed_tokens.weight", ())):  # rows: one per dictionary entry
        raise UserError("the checkpoint's source and target dictionaries differ (fairseq-preprocess without "
                        "--joined-dictionary): each side's row order is needed (fairseq_vocab.side_order)")
    rows = lambda side, table: lconv_rows(table, None if orders is None else orders[side])  # noqa: E731
    state = StateDict(weights)
    lightconv = fields["encoder_mixer"] != "attention"
    params: dict[str, Any] = {}
    params["source_embed"] = {"embedding": rows("encoder", state.take("encoder.embed_tokens.weight"))}
    if fields["share_embeddings"]:
        for copy in ("decoder.embed_tokens.weight", "decoder.output_projection.weight", "decoder.embed_out"):
            if copy in weights:  # the same tensor stored again
                check_copy(state.take(copy), params["source_embed"]["embedding"], copy,
                           rows=lambda table: rows("decoder", table))
    else:
        params["target_embed"] = {"embedding": rows("decoder", state.take("decoder.embed_tokens.weight"))}
        output = "decoder.embed_out" if "decoder.embed_out" in weights else "decoder.output_projection.weight"
        if fields["share_decoder_input_output"]:
            if output in weights:
                check_copy(state.take(output), params["target_embed"]["embedding"], output,
                           rows=lambda table: rows("decoder", table))
        else:
            params["output_projection"] = {"kernel": rows("decoder", state.take(output)).T}
    if fields.get("decoder_output_dim"):
        params["project_out"] = state.linear("decoder.project_out_dim", bias=False)
    config = ModelConfig.from_config(fields)  # each side's settings, resolved as the model resolves them
    for side, ours in (("encoder", "source_positions"), ("decoder", "target_positions")):
        embedding = {}
        if config.token_positions and config.side(side).learned_positions:
            embedding["learned"] = {"embedding": state.take(f"{side}.embed_positions.weight")}
        if config.layernorm_embedding:
            embedding["embedding_norm"] = state.norm(f"{side}.layernorm_embedding")
        if embedding:
            params[ours] = embedding
    for side in ("encoder", "decoder"):
        layers = {f"layer_{i}": layer_params(state, f"{side}.layers.{i}", side, lightconv)
                  for i in range(fields[f"{side}_layers"])}
        if config.side(side).normalize_before and (side == "encoder" or config.decoder_final_norm):
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
