"""``ModelConfig``: the hyper-parameters of both model kinds (``lconv.nn.models``) and every check a config's ``model``
field gets before anything is traced. Each field carries its default, rule and doc (``lconv.fields``), which
docs/config.md is made from."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from lconv.constants import ATTENTION_IMPLS, BOS_ID, EOS_ID, MATMUL_PRECISIONS, REMAT_POLICIES
from lconv.errors import UserError
from lconv.fields import (
    BOOL,
    MAX_LAYERS,
    MAX_TOKENS,
    MAX_VOCAB,
    MAX_WIDTH,
    SIZE_REASON,
    Rule,
    anything,
    check,
    choice,
    field,
    integer,
    number,
)
from lconv.nn import adaptive_softmax, kwarg_checks, mixers
from lconv.nn.mixers import BOTH_SIDES
from lconv.ops.activations import ACTIVATIONS
from lconv.ops.conv import DYNAMIC_IMPLS, LIGHT_IMPLS

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # params and the loss stay float32 whatever this is
DECODER_STARTS = {"bos": BOS_ID, "eos": EOS_ID}  # config.model.decoder_start -> the token id
CONV_IMPLS = tuple(dict.fromkeys(LIGHT_IMPLS + DYNAMIC_IMPLS))
# The paper's per-layer kernel sizes (Wu et al. 2019, Sec. 6.1): the defaults.
PAPER_ENCODER_KERNELS = (3, 7, 15, 31, 31, 31, 31)
PAPER_DECODER_KERNELS = (3, 7, 15, 31, 31, 31)

_COUNT = integer(1)
_WIDTH = integer(1, maximum=MAX_WIDTH, reason=SIZE_REASON)
_OPTIONAL_WIDTH = integer(0, " (0 = none)", maximum=MAX_WIDTH, reason=SIZE_REASON)
_LAYERS = integer(1, maximum=MAX_LAYERS, reason=SIZE_REASON)
_POSITIONS = integer(1, maximum=MAX_TOKENS, reason=SIZE_REASON)
_VOCAB = integer(1, maximum=MAX_VOCAB, reason=SIZE_REASON)
_RATE = number(lambda v: 0 <= v < 1, "a rate in [0, 1)")
_KERNELS = Rule(lambda v: not isinstance(v, str) and all(_POSITIONS.test(k) for k in v),
                f"kernel sizes in [1, {MAX_TOKENS:,}] ({SIZE_REASON})")


def _empty_dict(value: Any) -> dict:
    """A config spells "none" as {}: a dict the command line can fill."""
    return dict(value or {})


def _dtype_name(value: Any) -> str | None:
    try:
        return jnp.dtype(value).name
    except TypeError:
        return None


_DTYPE = Rule(lambda v: _dtype_name(v) in COMPUTE_DTYPES, f"one of {', '.join(COMPUTE_DTYPES)}")
_SIDE_COUNT = Rule(lambda v: v is None or _WIDTH.test(v), f"None (= the shared field) or an integer in [1, "
                   f"{MAX_WIDTH:,}] ({SIZE_REASON})")
_SIDE_BOOL = Rule(lambda v: v is None or isinstance(v, bool), "None (= the shared field), True or False")
_SIDE_CONV = Rule(lambda v: v is None or v == 0 or _WIDTH.test(v), f"None (= the shared field), 0 (= the side's "
                  f"width) or an integer in [1, {MAX_WIDTH:,}] ({SIZE_REASON})")


@dataclasses.dataclass(frozen=True)
class SideConfig:
    """One side's block settings with its overrides applied (``ModelConfig.side``): what the model code reads."""

    name: str  # "encoder" or "decoder"
    d_model: int
    ffn_dim: int
    num_heads: int
    use_glu: bool
    conv_features: int  # the conv block's inner width: fairseq's {side}_conv_dim, the side's width unless set
    normalize_before: bool
    learned_positions: bool


# The ModelConfig fields that encoder_<name> / decoder_<name> override for one side.
SIDE_FIELDS = tuple(f.name for f in dataclasses.fields(SideConfig) if f.name != "name")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of both model kinds; ``from_config`` validates a config's ``model`` field."""

    # From the tokenizer (config.data.vocab_size): no default, so not a field of the config's model section.
    vocab_size: int = dataclasses.field(metadata={"doc": "the vocabulary's size", "rule": _VOCAB})
    d_model: int = field(512, "model width (fairseq encoder_embed_dim)", _WIDTH)
    ffn_dim: int = field(2048, "FFN hidden size", _WIDTH)
    num_heads: int = field(8, "conv heads / attention heads", _WIDTH)
    encoder_layers: int = field(7, "encoder layers (0 for a decoder-only LM's unused side)",
                                integer(0, maximum=MAX_LAYERS, reason=SIZE_REASON))
    decoder_layers: int = field(6, "decoder layers", _LAYERS)
    # One mixer name for all layers, or one per layer; checked against the registry by ``validate``.
    encoder_mixer: str | Sequence[str] = field("dynamicconv", "a registered mixer or package.module:Class, or "
                                               "a comma list, one per layer",
                                               Rule(mixers.is_layer_spec, mixers.LAYER_SPEC))
    decoder_mixer: str | Sequence[str] = field("dynamicconv", "a registered mixer or package.module:Class, or "
                                               "a comma list, one per layer",
                                               Rule(mixers.is_layer_spec, mixers.LAYER_SPEC))
    encoder_kernel_sizes: Sequence[int] = field(PAPER_ENCODER_KERNELS, "one per layer, or one for all (the "
                                                "paper's, Wu et al. 2019 Sec. 6.1)", _KERNELS)
    decoder_kernel_sizes: Sequence[int] = field(PAPER_DECODER_KERNELS, "one per layer, or one for all", _KERNELS)
    mixer_kwargs: Any = field(None, 'per-mixer extra fields, e.g. {"fixed": {"factorized_rank": 8}}',
                              anything("{mixer name: {field: value}}, checked by the registry"), to_config=_empty_dict)
    ffn_type: str = field("dense", "dense | colt5 (a routed light/heavy FFN in ENCODER layers; decoders keep the "
                          "dense one) | a registered FFN | package.module:Class",
                          Rule(lambda v: isinstance(v, str) and bool(v), "a feed-forward name or 'module:Class'"))
    ffn_kwargs: Any = field(None, "fields of CoLT5FeedForward when ffn_type = colt5",
                            anything("{field: value} of CoLT5FeedForward"), to_config=_empty_dict)
    use_glu: bool = field(True, "GLU after the block's input projection", BOOL)
    conv_features: int | None = field(None, "fairseq's conv_dim; 0 (None) = d_model", Rule(
        lambda v: v is None or v == 0 or _WIDTH.test(v), f"0 (= d_model) or in [1, {MAX_WIDTH:,}] ({SIZE_REASON})"),
        to_config=lambda v: v or 0)
    dropout: float = field(0.1, "residual and embedding dropout", _RATE)
    attention_dropout: float = field(0.0, "dropout on attention weights", _RATE)
    relu_dropout: float = field(0.0, "dropout after the FFN's ReLU", _RATE)
    input_dropout: float = field(0.0, "dropout on the conv block's input", _RATE)
    weight_dropout: float = field(0.1, "DropConnect on the normalised conv kernels", _RATE)
    normalize_before: bool = field(False, "pre-norm; the paper's translation models are post-norm", BOOL)
    share_embeddings: bool = field(True, "one table for source, target and output (joint vocabulary)", BOOL)
    adaptive_softmax_cutoffs: Sequence[int] = field(
        (), "e.g. (8000, 20000): fairseq's adaptive softmax output, () = a plain softmax; needs "
        "share_embeddings=False (the output is no longer the embedding table)",
        anything("increasing vocabulary cutoffs (checked with the vocabulary)"))
    adaptive_softmax_factor: float = field(4.0, "adaptive softmax tail i is d_model / factor**(i+1) wide",
                                           number(lambda v: v > 0, "a number > 0"))
    adaptive_softmax_dropout: float = field(0.0, "dropout inside the adaptive softmax tails", _RATE)
    learned_positions: bool = field(False, "learned position embeddings; sinusoidal otherwise", BOOL)
    max_len: int = field(1024, "longest sequence for learned positions / Fixed / Hadamard attention", _POSITIONS)
    conv_impl: str = field("auto", "the conv op's implementation (lconv.ops.conv)", choice(*CONV_IMPLS))
    dtype: Any = field(jnp.float32, "compute dtype (bfloat16 on TPU); params and loss stay float32",
                       _DTYPE, to_config=_dtype_name)
    remat: str = field("none", "recompute in the backward pass: none | full (keep layer inputs) | dots (keep "
                       "matmuls)", choice(*REMAT_POLICIES))
    matmul_precision: str = field("default", "dots outside the conv ops: default (TF32 on GPU) | high | highest "
                                  "(lconv.ops.precision)", choice(*MATMUL_PRECISIONS))
    attention_impl: str = field("auto", "the attention kernel: auto (cuDNN flash on GPU; blockwise when long) | "
                                "xla | chunked | cudnn (lconv.ops.flash)", choice(*ATTENTION_IMPLS))
    weight_softmax: bool = field(True, "softmax-normalise conv kernels over K (fairseq's --weight-softmax)", BOOL)
    # Conventions a model imported from fairseq needs (lconv.interop.fairseq); the defaults are lconv's own.
    decoder_start: str = field("bos", 'the first decoder input: "bos" (lconv) or "eos" (fairseq)',
                               choice(*DECODER_STARTS))
    position_offset: int = field(0, "added to positions before the position embedding (fairseq: padding id + 1)",
                                 integer(0))
    scale_embeddings: bool = field(True, "token embeddings times sqrt(d_model) (fairseq's --no-scale-embedding: "
                                   "False)", BOOL)
    share_decoder_input_output: bool = field(
        False, "with share_embeddings=False: the target embedding is also the output layer (fairseq's "
        "--share-decoder-input-output-embed)", BOOL)
    decoder_input_dim: int = field(0, "token embedding width of the decoder, projected to d_model without bias "
                                   "(fairseq's decoder_input_dim, project_in_dim); 0 = d_model", _OPTIONAL_WIDTH)
    decoder_output_dim: int = field(0, "width the decoder's output is projected to, without bias, before the "
                                    "output layer (fairseq's decoder_output_dim, project_out_dim); 0 = d_model",
                                    _OPTIONAL_WIDTH)
    decoder_final_norm: bool = field(True, "with normalize_before: a LayerNorm after the last decoder layer "
                                     "(fairseq's --no-decoder-final-norm and lightconv_lm: False)", BOOL)
    lm_pre_norm: bool = field(True, "a decoder-only LM is pre-norm whatever normalize_before says (as fairseq's "
                              "lightconv_lm forces it); False: it follows normalize_before (fairseq 0.12's plain "
                              "transformer_lm is post-norm)", BOOL)
    adaptive_input_cutoffs: Sequence[int] = field(
        (), "e.g. (8000, 20000): fairseq's adaptive input: the decoder's embeddings in bands, band i "
        "decoder_input_dim / factor**i wide and projected to d_model; () = one table; needs share_embeddings=False",
        anything("increasing vocabulary cutoffs (checked with the vocabulary)"))
    adaptive_input_factor: float = field(4.0, "adaptive input band i is decoder_input_dim / factor**i wide",
                                         number(lambda v: v > 0, "a number > 0"))
    tie_adaptive_weights: bool = field(False, "the adaptive softmax scores against the adaptive input's tables "
                                       "(fairseq's --tie-adaptive-weights; same cutoffs and factor)", BOOL)
    tie_adaptive_proj: bool = field(False, "with tie_adaptive_weights: the adaptive softmax tails' projections are "
                                    "the adaptive input's, transposed (fairseq's --tie-adaptive-proj)", BOOL)
    activation: str = field("relu", "the FFN's activation (fairseq's --activation-fn): gelu is the exact erf form, "
                            "gelu_accurate its tanh approximation", choice(*ACTIVATIONS))
    layernorm_embedding: bool = field(False, "a layer norm after embedding + positions, before dropout, on each side "
                                      "(fairseq's --layernorm-embedding)", BOOL)
    token_positions: bool = field(True, "add position embeddings to the tokens (fairseq's "
                                  "--no-token-positional-embeddings: False)", BOOL)
    output_vocab_size: int = field(0, "the decoder predicts only ids below this; 0 = every id (a model imported "
                                   "with separate source and target dictionaries: the target's come first)",
                                   integer(0))

    # Per-side overrides (fairseq's encoder_* / decoder_*): None = the shared field; read through ``side(name)``.
    encoder_d_model: int | None = field(None, "encoder width; None = d_model", _SIDE_COUNT, placeholder=int)
    decoder_d_model: int | None = field(None, "decoder width; None = d_model (the encoder-decoder attention reads "
                                        "keys and values of the encoder's width)", _SIDE_COUNT, placeholder=int)
    encoder_ffn_dim: int | None = field(None, "encoder FFN hidden size; None = ffn_dim", _SIDE_COUNT, placeholder=int)
    decoder_ffn_dim: int | None = field(None, "decoder FFN hidden size; None = ffn_dim", _SIDE_COUNT, placeholder=int)
    encoder_num_heads: int | None = field(None, "encoder heads; None = num_heads", _SIDE_COUNT, placeholder=int)
    decoder_num_heads: int | None = field(None, "decoder heads (its self- and encoder attention); None = num_heads",
                                          _SIDE_COUNT, placeholder=int)
    encoder_use_glu: bool | None = field(None, "None = use_glu", _SIDE_BOOL, placeholder=bool)
    decoder_use_glu: bool | None = field(None, "None = use_glu", _SIDE_BOOL, placeholder=bool)
    encoder_conv_features: int | None = field(None, "None = conv_features; 0 = the encoder's width", _SIDE_CONV,
                                              placeholder=int)
    decoder_conv_features: int | None = field(None, "None = conv_features; 0 = the decoder's width", _SIDE_CONV,
                                              placeholder=int)
    encoder_normalize_before: bool | None = field(None, "None = normalize_before", _SIDE_BOOL, placeholder=bool)
    decoder_normalize_before: bool | None = field(None, "None = normalize_before", _SIDE_BOOL, placeholder=bool)
    encoder_learned_positions: bool | None = field(None, "None = learned_positions", _SIDE_BOOL, placeholder=bool)
    decoder_learned_positions: bool | None = field(None, "None = learned_positions", _SIDE_BOOL, placeholder=bool)

    @classmethod
    def from_config(cls, cfg: Any, *, decoder_only: bool = False, **overrides: Any) -> ModelConfig:
        """From an ml_collections ``config.model`` (or a dict), validated; unknown fields are a one-line error."""
        if isinstance(cfg, cls) and not overrides:
            cfg.ensure_valid(decoder_only)
            return cfg
        values = dict(dataclasses.asdict(cfg) if isinstance(cfg, cls) else
                      cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
        values.update(overrides)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise UserError(f"config.model has unknown field(s) {unknown}; known: {sorted(names)}")
        for name in ("conv_features", "mixer_kwargs", "ffn_kwargs"):  # a config's 0 / {} = none: the dataclass's None
            if not values.get(name):
                values[name] = None
        if isinstance(values.get("dtype"), str):
            check("config.model.dtype", values["dtype"], _DTYPE)
            values["dtype"] = jnp.dtype(values["dtype"])
        for key in ("encoder_kernel_sizes", "decoder_kernel_sizes"):
            if key in values and isinstance(values[key], (int, np.integer)):
                values[key] = (int(values[key]),)
        config = cls(**values)
        config.validate()  # both sides' fields, an LM's unused encoder's too: a typo there is not ignored
        config.ensure_valid(decoder_only)
        return config

    def ensure_valid(self, decoder_only: bool = False) -> None:
        """``validate`` once per model kind: a model's ``setup`` runs at every trace, the check need not."""
        if decoder_only not in self.__dict__.get("_valid_for", ()):
            self.validate(decoder_only)

    def validate(self, decoder_only: bool = False) -> None:
        """Every field rule and combination for an encoder-decoder or (``decoder_only``) an LM; one line each."""
        for f in dataclasses.fields(self):  # each field's own rule first: a zero head count would divide by zero
            check(f"config.model.{f.name}", getattr(self, f.name), f.metadata["rule"])
        self._check_decoder_ends()
        if self.adaptive_softmax_cutoffs:
            adaptive_softmax.check_cutoffs(self.adaptive_softmax_cutoffs, self.vocab_size, self.decoder_output_width,
                                           self.adaptive_softmax_factor, "config.model.adaptive_softmax_cutoffs")
            if self.share_embeddings:
                raise UserError("config.model.adaptive_softmax_cutoffs needs config.model.share_embeddings=False "
                                 "(the output layer is no longer the embedding table)")
        if self.share_decoder_input_output and self.share_embeddings:
            raise UserError("config.model.share_decoder_input_output is for share_embeddings=False (with "
                            "share_embeddings=True one table is already the input and the output)")
        if self.share_decoder_input_output and self.adaptive_softmax_cutoffs:
            raise UserError("config.model.share_decoder_input_output and adaptive_softmax_cutoffs both set the "
                            "output layer; choose one")
        if self.output_vocab_size and (self.output_vocab_size > self.vocab_size or self.adaptive_softmax_cutoffs):
            raise UserError(f"config.model.output_vocab_size={self.output_vocab_size}: must be at most the "
                            f"vocabulary's {self.vocab_size} ids, and without adaptive_softmax_cutoffs")
        ffn_class = _registered("ffn_type", mixers.ffn_class, self.ffn_type)
        if self.activation != "relu" and "activation" not in mixers.constructor_fields(ffn_class):
            raise UserError(f"config.model.activation={self.activation!r} needs an FFN with an activation field; "
                            f"ffn_type={self.ffn_type!r} has none (use ffn_type='dense')")
        ffn_sides = getattr(ffn_class, "sides", BOTH_SIDES)
        if decoder_only and "decoder" not in ffn_sides:
            raise UserError(f"config.model.ffn_type={self.ffn_type!r} is for encoder layers only (its routing ranks "
                            f"future tokens); a decoder-only LM needs ffn_type='dense'")
        sides = [("decoder", self.decoder_layers)] if decoder_only else [
            ("encoder", self.encoder_layers), ("decoder", self.decoder_layers)]
        for side, n in sides:
            for layer, name in enumerate(self.layer_mixers(side)):
                info = _registered(f"{side}_mixer", mixers.info, name)  # unknown names fail here, before tracing
                if side not in info.sides:
                    only = info.sides[0]
                    raise UserError(f"config.model.{side}_mixer: {name!r} is {'an' if only == 'encoder' else 'a'} "
                                    f"{only}-only mixer ({info.side_reason or 'see its class'}); use 'attention' "
                                    f"or a conv mixer in the {side}")
                centred_conv = side == "encoder" and "kernel_size" in info.model_fields
                if centred_conv and self.kernel_size(side, layer) % 2 == 0:
                    raise UserError(f"config.model.encoder_kernel_sizes: layer {layer} has kernel "
                                     f"{self.kernel_size(side, layer)}; an encoder (centred) conv needs an odd kernel")
            if any("kernel_size" in mixers.model_fields(m) for m in self.layer_mixers(side)):
                self.kernel_size(side, n - 1)
        self._check_mixer_kwargs(decoder_only)
        self._check_contracts(decoder_only)  # after the kwargs are known to be dicts of the classes' fields
        self._check_widths(decoder_only)  # after the mixer names are known to resolve
        # Frozen: the record is an attribute beside the fields (not one of them: eq, hash and replace ignore it).
        object.__setattr__(self, "_valid_for", self.__dict__.get("_valid_for", frozenset()) | {decoder_only})

    def check_kernel_counts(self, decoder_only: bool = False) -> None:
        """One kernel size for all layers, or exactly one per layer of a side whose mixers take one."""
        for side in ("decoder",) if decoder_only else BOTH_SIDES:
            layers = getattr(self, f"{side}_layers")
            if not any("kernel_size" in mixers.model_fields(m) for m in self.layer_mixers(side)):
                continue
            sizes = tuple(getattr(self, f"{side}_kernel_sizes"))
            if len(sizes) != 1 and len(sizes) != layers:
                surplus = f"; the last {len(sizes) - layers} would be ignored" if len(sizes) > layers else ""
                raise UserError(f"config.model.{side}_kernel_sizes has {len(sizes)} entries for {layers} {side} "
                                f"layers{surplus}: give one per layer, or one for all")

    def _check_mixer_kwargs(self, decoder_only: bool) -> None:
        """``mixer_kwargs`` and ``ffn_kwargs`` name registered mixers and fields they have (no typo ignored)."""
        used: dict[str, set[str]] = {}
        for side in ("decoder",) if decoder_only else BOTH_SIDES:
            for name in self.layer_mixers(side):
                fields = mixers.constructor_fields(mixers.mixer_class(name))
                used.setdefault(name, fields)
                if mixers.is_spec(name):
                    used.setdefault(name.rpartition(":")[2], fields)
        kwargs = self.mixer_kwargs or {}
        if not isinstance(kwargs, dict):
            raise UserError(f"config.model.mixer_kwargs={kwargs!r}: must be {{mixer name: {{field: value}}}}")
        for key, values in kwargs.items():
            where = f"config.model.mixer_kwargs[{key!r}]"
            if key in used:
                fields = used[key]
            elif key in mixers.mixer_names():  # a registered mixer this model does not use (a shared config)
                fields = mixers.constructor_fields(mixers.mixer_class(key))
            else:
                raise UserError(f"{where}: {key!r} is no registered mixer and no layer's (the layers use "
                                f"{sorted(used)}); it would be ignored")
            kwarg_checks.check_field_dict(where, values, fields, f"mixer {key!r}")
            kwarg_checks.check_field_kinds(where, values, mixers.mixer_class(key) if key in mixers.mixer_names() or
                               mixers.is_spec(key) else None)
        ffn = mixers.ffn_class(self.ffn_type)
        kwarg_checks.check_field_dict("config.model.ffn_kwargs", self.ffn_kwargs or {}, mixers.constructor_fields(ffn),
                          f"ffn_type {self.ffn_type!r}")
        kwarg_checks.check_field_kinds("config.model.ffn_kwargs", self.ffn_kwargs or {}, ffn)

    def _check_contracts(self, decoder_only: bool) -> None:
        """Each mixer and the FFN can be built with what a layer gives and called as it calls them: a module that
        cannot (a stored ``"flax.linen:Dense"``) is one line here, not a traceback at the first trace."""
        kwargs = self.mixer_kwargs or {}
        for side in ("decoder",) if decoder_only else BOTH_SIDES:
            for name in dict.fromkeys(self.layer_mixers(side)):
                extra = kwargs.get(name, kwargs.get(name.rpartition(":")[2], {}) if mixers.is_spec(name) else {})
                problem = mixers.contract_problem("mixer", mixers.mixer_class(name),
                                                  {*mixers.model_fields(name), *extra})
                if problem:
                    raise UserError(f"config.model.{side}_mixer={name!r} cannot be a mixer: {problem}")
        ffn = mixers.ffn_class(self.ffn_type)
        problem = mixers.contract_problem("ffn", ffn, {*getattr(ffn, "model_fields", {}), *(self.ffn_kwargs or {})})
        if problem:
            raise UserError(f"config.model.ffn_type={self.ffn_type!r} cannot be an FFN: {problem}")

    def _check_widths(self, decoder_only: bool) -> None:
        """Each side's heads divide its width and its conv width (named by the field that set the value)."""
        for side in ("decoder",) if decoder_only else BOTH_SIDES:
            resolved = self.side(side)
            heads = self._field_name(side, "num_heads")
            if resolved.d_model % resolved.num_heads:
                raise UserError(f"config.model.{self._field_name(side, 'd_model')}={resolved.d_model} must be "
                                f"divisible by config.model.{heads}={resolved.num_heads}")
            convs = any("conv_features" in mixers.model_fields(m) for m in self.layer_mixers(side))
            if convs and resolved.conv_features % resolved.num_heads:
                raise UserError(f"config.model.{self._field_name(side, 'conv_features')}={resolved.conv_features} "
                                f"(the {side}'s conv width) must be divisible by config.model.{heads}="
                                f"{resolved.num_heads}")
        widths = {side: self.side(side).d_model for side in BOTH_SIDES}
        if self.share_embeddings and not decoder_only and widths["encoder"] != widths["decoder"]:
            raise UserError(f"config.model.share_embeddings needs one width: encoder {widths['encoder']}, decoder "
                            f"{widths['decoder']} (fairseq's --share-all-embeddings requires equal embed dims too)")

    def _field_name(self, side: str, name: str) -> str:
        """The field that gives ``side`` its ``name``: the override where it is set, else the shared field."""
        if name == "conv_features" and not getattr(self, f"{side}_conv_features") and not self.conv_features:
            return f"{side}_d_model" if getattr(self, f"{side}_d_model") is not None else "d_model"
        return f"{side}_{name}" if getattr(self, f"{side}_{name}") is not None else name

    def side(self, name: str) -> SideConfig:
        """Side ``name``'s block settings: its ``{name}_<field>`` where set, else the shared one."""
        if name not in BOTH_SIDES:
            raise ValueError(f"side must be one of {BOTH_SIDES}; got {name!r}")
        values = {}
        for field_name in SIDE_FIELDS:
            override = getattr(self, f"{name}_{field_name}")
            values[field_name] = getattr(self, field_name) if override is None else override
        values["conv_features"] = values["conv_features"] or values["d_model"]
        return SideConfig(name=name, **values)

    def per_side(self, name: str, decoder_only: bool = False) -> Any:
        """Side field ``name`` as tables show it: one value, or ``(encoder, decoder)`` where the sides differ."""
        encoder, decoder = (getattr(self.side(s), name) for s in BOTH_SIDES)
        return decoder if decoder_only or encoder == decoder else (encoder, decoder)

    @property
    def decoder_input_width(self) -> int:
        """The width of the decoder's token embeddings (band 0's with adaptive input)."""
        return self.decoder_input_dim or self.side("decoder").d_model

    @property
    def decoder_output_width(self) -> int:
        """The width the output layer reads."""
        return self.decoder_output_dim or self.side("decoder").d_model

    def _check_decoder_ends(self) -> None:
        """The decoder's embeddings, projections and output layer fit together (as fairseq can build them)."""
        name, width = "config.model", self.side("decoder").d_model
        if self.adaptive_input_cutoffs:
            adaptive_softmax.check_cutoffs(self.adaptive_input_cutoffs, self.vocab_size, self.decoder_input_width,
                                           self.adaptive_input_factor, f"{name}.adaptive_input_cutoffs")
            if self.share_embeddings or self.share_decoder_input_output:
                raise UserError(f"{name}.adaptive_input_cutoffs needs share_embeddings=False and "
                                "share_decoder_input_output=False (the output layer cannot be the adaptive input; "
                                "tie_adaptive_weights ties an adaptive softmax to it)")
        if self.decoder_input_dim and self.decoder_input_dim != width and self.share_embeddings:
            raise UserError(f"{name}.decoder_input_dim={self.decoder_input_dim} needs share_embeddings=False (the "
                            f"source embeddings are {width} wide)")
        reads_table = self.share_embeddings or self.share_decoder_input_output
        if reads_table and self.decoder_output_width != self.decoder_input_width:
            raise UserError(f"{name}.decoder_output_dim={self.decoder_output_width} differs from the embedding width "
                            f"{self.decoder_input_width}, which the tied output layer reads; set them equal or "
                            "share_embeddings=share_decoder_input_output=False")
        if self.tie_adaptive_weights:
            same = (tuple(self.adaptive_input_cutoffs) == tuple(self.adaptive_softmax_cutoffs) != ()
                    and self.adaptive_input_factor == self.adaptive_softmax_factor
                    and self.decoder_input_width == self.decoder_output_width == width)
            if not same:
                raise UserError(f"{name}.tie_adaptive_weights needs adaptive_input_cutoffs = adaptive_softmax_cutoffs, "
                                "adaptive_input_factor = adaptive_softmax_factor and decoder_input_dim = "
                                "decoder_output_dim = d_model")
        elif self.tie_adaptive_proj:
            raise UserError(f"{name}.tie_adaptive_proj ties the adaptive softmax's projections to the adaptive "
                            "input's: it needs tie_adaptive_weights=True")

    @property
    def decoder_start_id(self) -> int:
        """The token id the decoder reads first (targets shifted right, and the first step of a search)."""
        return DECODER_STARTS[self.decoder_start]

    def layer_mixers(self, side: str) -> list[str]:
        spec = getattr(self, f"{side}_mixer")
        check(f"config.model.{side}_mixer", spec, Rule(mixers.is_layer_spec, mixers.LAYER_SPEC))  # never list(a dict)
        n = getattr(self, f"{side}_layers")
        names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
        if len(names) == 1:
            names = names * n
        if len(names) != n:
            raise UserError(f"config.model.{side}_mixer names {len(names)} mixers for {n} {side} layers")
        return names

    def kernel_size(self, side: str, layer: int) -> int:
        sizes = tuple(getattr(self, f"{side}_kernel_sizes"))
        if len(sizes) == 1:
            return sizes[0]
        if layer >= len(sizes):
            raise UserError(
                f"config.model.{side}_kernel_sizes has {len(sizes)} entries for {getattr(self, f'{side}_layers')}"
                f" {side} layers"
            )
        return sizes[layer]


def _registered(field: str, lookup: Any, name: Any) -> Any:
    """``lookup(name)`` with a failure named by the config field (``config.model.<field>: ...``)."""
    try:
        return lookup(name)
    except UserError as e:
        raise UserError(f"config.model.{field}: {e}") from None
