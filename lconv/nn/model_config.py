"""``ModelConfig``: the hyper-parameters of both model kinds (``lconv.nn.models``) and their validation, one
place for every check a config's ``model`` field gets before anything is traced."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from lconv.constants import ATTENTION_IMPLS, BOS_ID, EOS_ID, MATMUL_PRECISIONS, REMAT_POLICIES
from lconv.errors import UserError
from lconv.nn import adaptive_softmax, mixers
from lconv.nn.mixers import BOTH_SIDES
from lconv.ops.conv import DYNAMIC_IMPLS, LIGHT_IMPLS

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # params and the loss stay float32 whatever this is
DECODER_STARTS = {"bos": BOS_ID, "eos": EOS_ID}  # config.model.decoder_start -> the token id
CONV_IMPLS = tuple(dict.fromkeys(LIGHT_IMPLS + DYNAMIC_IMPLS))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of both model kinds; ``from_config`` validates a config's ``model`` field."""

    vocab_size: int
    d_model: int = 512
    ffn_dim: int = 2048
    num_heads: int = 8
    encoder_layers: int = 7
    decoder_layers: int = 6
    # One mixer name for all layers, or one per layer.
    encoder_mixer: str | Sequence[str] = "dynamicconv"
    decoder_mixer: str | Sequence[str] = "dynamicconv"
    encoder_kernel_sizes: Sequence[int] = (3, 7, 15, 31, 31, 31, 31)
    decoder_kernel_sizes: Sequence[int] = (3, 7, 15, 31, 31, 31)
    # Per-mixer extra constructor fields, e.g. {"fixed": {"max_len": 256}}; validated by the registry.
    mixer_kwargs: Any = None
    ffn_type: str = "dense"  # or "colt5": routed light/heavy FFN in ENCODER layers (decoders keep the dense one)
    ffn_kwargs: Any = None
    use_glu: bool = True
    conv_features: int | None = None  # fairseq's conv_dim; None = d_model
    dropout: float = 0.1
    attention_dropout: float = 0.0
    relu_dropout: float = 0.0
    input_dropout: float = 0.0
    weight_dropout: float = 0.0
    normalize_before: bool = False
    share_embeddings: bool = True  # one table for source, target and output
    # Adaptive softmax output layer (fairseq's, for large vocabularies): () = a plain softmax. Needs
    # share_embeddings=False (the output is no longer the embedding table).
    adaptive_softmax_cutoffs: Sequence[int] = ()
    adaptive_softmax_factor: float = 4.0
    adaptive_softmax_dropout: float = 0.0
    learned_positions: bool = False
    max_len: int = 1024  # learned positions and position-indexed mixers
    conv_impl: str = "auto"
    dtype: Any = jnp.float32
    remat: str = "none"  # per-layer rematerialisation: none | full | dots (lconv.constants.REMAT_POLICIES)
    matmul_precision: str = "default"  # dots outside the conv ops: default | high | highest (lconv.ops.precision)
    attention_impl: str = "auto"  # the attention kernel: auto | xla | chunked | cudnn (lconv.ops.flash)
    weight_softmax: bool = True  # softmax-normalise conv kernels over K (fairseq's --weight-softmax)
    # Conventions a model imported from fairseq needs (lconv.interop.fairseq); the defaults are lconv's own.
    decoder_start: str = "bos"  # the first decoder input: "bos" (lconv) or "eos" (fairseq)
    position_offset: int = 0  # added to positions before the position embedding (fairseq: padding id + 1 = 2)
    scale_embeddings: bool = True  # token embeddings times sqrt(d_model) (fairseq's --no-scale-embedding: False)
    # With share_embeddings=False: the target embedding is also the output layer (fairseq's
    # --share-decoder-input-output-embed); else the output layer is a table of its own.
    share_decoder_input_output: bool = False

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> ModelConfig:
        """From an ml_collections ``config.model`` (or a dict); unknown fields are a one-line error."""
        values = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
        values.update(overrides)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise UserError(f"config.model has unknown field(s) {unknown}; known: {sorted(names)}")
        if not values.get("conv_features"):
            values["conv_features"] = None  # 0 in a config = the model width
        if isinstance(values.get("dtype"), str):
            if values["dtype"] not in COMPUTE_DTYPES:
                raise UserError(f"config.model.dtype={values['dtype']!r}: must be one of {', '.join(COMPUTE_DTYPES)}")
            values["dtype"] = jnp.dtype(values["dtype"])
        for key in ("encoder_kernel_sizes", "decoder_kernel_sizes"):
            if key in values and isinstance(values[key], (int, np.integer)):
                values[key] = (int(values[key]),)
        config = cls(**values)
        config.validate()
        return config

    def validate(self, decoder_only: bool = False) -> None:
        self._check_ranges()
        if self.adaptive_softmax_cutoffs:
            adaptive_softmax.check_cutoffs(self.adaptive_softmax_cutoffs, self.vocab_size, self.d_model,
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
        if self.d_model % self.num_heads:
            raise UserError(
                f"config.model.d_model={self.d_model} must be divisible by config.model.num_heads={self.num_heads}"
            )
        ffn_sides = getattr(_registered("ffn_type", mixers.ffn_class, self.ffn_type), "sides", BOTH_SIDES)
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

    def _check_ranges(self) -> None:
        """Each field's own range, before any arithmetic with it (a zero head count would divide by zero)."""
        def require(name: str, ok: bool, requirement: str) -> None:
            if not ok:
                raise UserError(f"config.model.{name}={getattr(self, name)!r}: must be {requirement}")

        def integer(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        for name in ("vocab_size", "d_model", "ffn_dim", "num_heads", "decoder_layers", "max_len"):
            require(name, integer(getattr(self, name)) and getattr(self, name) >= 1, "an integer >= 1")
        require("encoder_layers", integer(self.encoder_layers) and self.encoder_layers >= 0, "an integer >= 0")
        require("conv_features", self.conv_features is None or (integer(self.conv_features)
                                                                and self.conv_features >= 1), "0 (= d_model) or >= 1")
        for name in ("dropout", "attention_dropout", "relu_dropout", "input_dropout", "weight_dropout",
                     "adaptive_softmax_dropout"):
            value = getattr(self, name)
            require(name, isinstance(value, (int, float)) and 0 <= value < 1, "a rate in [0, 1)")
        for side in ("encoder", "decoder"):
            sizes = getattr(self, f"{side}_kernel_sizes")
            require(f"{side}_kernel_sizes", all(integer(k) and k >= 1 for k in sizes), "kernel sizes >= 1")
        require("conv_impl", self.conv_impl in CONV_IMPLS, f"one of {', '.join(CONV_IMPLS)}")
        require("ffn_type", isinstance(self.ffn_type, str), f"one of {mixers.ffn_names()} or 'module:Class'")
        require("decoder_start", self.decoder_start in DECODER_STARTS, f"one of {', '.join(DECODER_STARTS)}")
        require("position_offset", integer(self.position_offset) and self.position_offset >= 0, "an integer >= 0")
        for name, choices in (("remat", REMAT_POLICIES), ("matmul_precision", MATMUL_PRECISIONS),
                              ("attention_impl", ATTENTION_IMPLS)):
            require(name, getattr(self, name) in choices, f"one of {', '.join(choices)}")
        require("dtype", jnp.dtype(self.dtype).name in COMPUTE_DTYPES, f"one of {', '.join(COMPUTE_DTYPES)}")

    @property
    def decoder_start_id(self) -> int:
        """The token id the decoder reads first (targets shifted right, and the first step of a search)."""
        return DECODER_STARTS[self.decoder_start]

    def layer_mixers(self, side: str) -> list[str]:
        spec = getattr(self, f"{side}_mixer")
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
