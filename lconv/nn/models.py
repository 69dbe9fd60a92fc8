"""Encoder-decoder and decoder-only models built from the token-mixer registry (fairseq's LightConv architecture).

A layer is ``mixer block -> [encoder-decoder attention] -> FFN``, each sublayer wrapped as fairseq does (pre- or
post-norm, dropout, residual); each layer's mixer and kernel size are config values, so the paper's models are configs,
not code. Every mixer and each config's parameter count: docs/models.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lconv.constants import ACT_LENGTH, BOS_ID, EMBED, LENGTH, MLP, PAD_ID
from lconv.errors import UserError
from lconv.nn import adaptive_softmax, decoder_ends, mixers
from lconv.nn.attention import CrossAttention
from lconv.nn.common import BTC, BTF, BTV, Dropout, DType, Embed, LayerNorm, constrain, xavier_dense
from lconv.nn.model_config import SIDE_FIELDS, ModelConfig  # re-exported: models.ModelConfig is documented
from lconv.ops import activations

Array = jax.Array


# Models
class EncoderDecoder(nn.Module):
    """fairseq's ``lightconv`` translation model. ``__call__`` = ``encode`` then ``run_decoder`` (teacher forcing)."""

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        cfg.ensure_valid()  # once per config object, not at every trace
        self.source_embed = decoder_ends.embedding(cfg, cfg.side("encoder").d_model, "source_embed")
        self.target_embed = (self.source_embed if cfg.share_embeddings
                             else decoder_ends.token_embedding(cfg, "target_embed"))
        self.project_in = decoder_ends.project_in(cfg)
        self.project_out = decoder_ends.project_out(cfg)
        self.encoder = Stack(cfg, side="encoder", name="encoder")
        self.decoder = Stack(cfg, side="decoder", name="decoder")
        self.source_positions = ScaleAndPosition(cfg, side="encoder")
        self.target_positions = ScaleAndPosition(cfg, side="decoder")
        self.positions = DecodePositions()
        if not (cfg.share_embeddings or cfg.share_decoder_input_output):
            self.output_projection = _output_projection(cfg)

    def encode(self, inputs_BS: Array, *, inputs_segmentation: Array | None = None,
               inputs_position: Array | None = None, deterministic: bool = True) -> Array:
        """The encoder output ``encoded_BSC``."""
        segment_ids = _segments(inputs_BS, inputs_segmentation)
        x = self.source_positions(self.source_embed(inputs_BS), inputs_position, deterministic=deterministic)
        return self.encoder(x, segment_ids=segment_ids, positions=inputs_position, deterministic=deterministic)

    def run_decoder(self, encoded_BSC: Array, inputs_BS: Array, decoder_input_BT: Array, *,
                    inputs_segmentation: Array | None = None, targets_segmentation: Array | None = None,
                    targets_position: Array | None = None, deterministic: bool = True, decode: bool = False,
                    logits: bool = True) -> Array | decoder_ends.OutputLayer:
        """Float32 logits ``[B, T, V]`` of the shifted ``decoder_input`` (``logits=False``: the output's inputs)."""
        encoded_segments = _segments(inputs_BS, inputs_segmentation)
        segment_ids = None if decode else _segments(decoder_input_BT, targets_segmentation, allow_pad_start=True)
        positions = self.positions(decoder_input_BT, targets_position, decode)
        x = self.target_positions(_project(self.project_in, self.target_embed(decoder_input_BT)), positions,
                                  deterministic=deterministic)
        x = self.decoder(x, segment_ids=segment_ids, positions=positions, deterministic=deterministic,
                         decode=decode, encoded=encoded_BSC, encoded_segment_ids=encoded_segments)
        return _output(self.config, _project(self.project_out, x), self.target_embed,
                       getattr(self, "output_projection", None), deterministic, logits)

    def __call__(self, inputs_BS: Array, targets_BT: Array, *, inputs_segmentation: Array | None = None,
                 inputs_position: Array | None = None, targets_segmentation: Array | None = None,
                 targets_position: Array | None = None, deterministic: bool = True,
                 logits: bool = True) -> Array | decoder_ends.OutputLayer:
        encoded_BSC = self.encode(inputs_BS, inputs_segmentation=inputs_segmentation,
                                  inputs_position=inputs_position, deterministic=deterministic)
        decoder_input_BT = shift_right(targets_BT, targets_segmentation, self.config.decoder_start_id)
        return self.run_decoder(encoded_BSC, inputs_BS, decoder_input_BT, inputs_segmentation=inputs_segmentation,
                                targets_segmentation=targets_segmentation, targets_position=targets_position,
                                deterministic=deterministic, logits=logits)


class DecoderOnlyLM(nn.Module):
    """fairseq's ``lightconv_lm`` / ``transformer_lm``: a causal stack, pre-norm and a final norm by default."""

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        cfg.ensure_valid(decoder_only=True)  # once per config object, not at every trace; the norms below break no rule
        if cfg.lm_pre_norm:  # lightconv_lm's and lconv's LMs; fairseq 0.12's transformer_lm follows its flag
            cfg = dataclasses.replace(cfg, normalize_before=True, decoder_normalize_before=True)
        self.embed = decoder_ends.token_embedding(cfg, "embed")
        self.project_in = decoder_ends.project_in(cfg)
        self.project_out = decoder_ends.project_out(cfg)
        self.decoder = Stack(cfg, side="decoder", cross_attention=False, name="decoder")
        self.scale_and_position = ScaleAndPosition(cfg, side="decoder")
        self.positions = DecodePositions()
        if not (cfg.share_embeddings or cfg.share_decoder_input_output):
            self.output_projection = _output_projection(cfg)

    def __call__(self, targets_BT: Array, *, targets_segmentation: Array | None = None,
                 targets_position: Array | None = None, deterministic: bool = True, decode: bool = False,
                 shift: bool = True, logits: bool = True) -> Array | decoder_ends.OutputLayer:
        """Next-token logits ``[B, T, V]`` (``shift``: of ``targets`` shifted right); ``logits=False`` as ``decode``."""
        inputs = shift_right(targets_BT, targets_segmentation, self.config.decoder_start_id) if shift else targets_BT
        segment_ids = None if decode else _segments(inputs, targets_segmentation, allow_pad_start=True)
        positions = self.positions(inputs, targets_position, decode)
        x = self.scale_and_position(_project(self.project_in, self.embed(inputs)), positions,
                                    deterministic=deterministic)
        x = self.decoder(x, segment_ids=segment_ids, positions=positions, deterministic=deterministic, decode=decode)
        return _output(self.config, _project(self.project_out, x), self.embed, getattr(self, "output_projection", None),
                       deterministic, logits)


# Layers
class Stack(nn.Module):
    """Encoder or decoder layers, with the final layer norm that pre-norm models need."""

    config: ModelConfig
    side: str  # "encoder" or "decoder"
    cross_attention: bool = True

    @nn.compact
    def __call__(self, x: Array, *, segment_ids: Array | None, positions: Array | None, deterministic: bool,
                 decode: bool = False, encoded: Array | None = None,
                 encoded_segment_ids: Array | None = None) -> Array:
        """``[B, T, C] -> [B, T, C]``; ``encoded`` is the encoder output ``[B, S, C]`` that cross-attention reads."""
        cfg = self.config
        causal = self.side == "decoder"
        layer_class = Layer if decode else remat_layer(cfg.remat)  # decoding computes no gradients
        for i, mixer_name in enumerate(cfg.layer_mixers(self.side)):
            x = layer_class(cfg, mixer_name, layer=i, side=self.side, causal=causal,
                            cross_attention=causal and self.cross_attention, name=f"layer_{i}")(
                x, segment_ids, positions, deterministic, decode, encoded, encoded_segment_ids)
        if cfg.side(self.side).normalize_before and (self.side == "encoder" or cfg.decoder_final_norm):
            x = _layer_norm(cfg, "final_norm")(x)
        return constrain(x, BTC)


@functools.cache
def remat_layer(policy: str) -> type[nn.Module]:
    """``Layer``, under ``nn.remat`` with the checkpoint policy ``policy`` names (``ModelConfig`` checked it)."""
    policies = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
    return Layer if policy == "none" else nn.remat(Layer, policy=policies[policy], static_argnums=(4, 5))


class Layer(nn.Module):
    config: ModelConfig
    mixer_name: str
    layer: int
    side: str
    causal: bool
    cross_attention: bool = False

    @nn.compact
    def __call__(self, x: Array, segment_ids: Array | None, positions: Array | None, deterministic: bool,
                 decode: bool, encoded: Array | None = None, encoded_segment_ids: Array | None = None) -> Array:
        """One layer, ``[B, T, C] -> [B, T, C]``; positional arguments let ``nn.remat`` hold two of them static."""
        cfg = self.config
        mixer = mixers.make_mixer(self.mixer_name, **_mixer_fields(cfg, self.mixer_name, self.side, self.layer,
                                                                   self.causal), name="mixer")
        def mix(h: Array) -> Array:
            y = mixer(h, segment_ids=segment_ids, positions=positions, deterministic=deterministic, decode=decode)
            mixers.check_output(self.mixer_name, h, y, f"{self.side} layer {self.layer}")
            return y

        x = self._sublayer(x, mix, "mixer", deterministic)
        if self.cross_attention:
            # fairseq: decoder_attention_heads, and keys/values from the encoder's width (kdim = vdim)
            attend = CrossAttention(num_heads=cfg.side(self.side).num_heads, attention_dropout=cfg.attention_dropout,
                                    dtype=cfg.dtype, matmul_precision=cfg.matmul_precision,
                                    attention_impl=cfg.attention_impl, name="encoder_attention")
            query_segments = None if decode else segment_ids
            x = self._sublayer(x, lambda h: attend(h, encoded, query_segment_ids=query_segments,
                                                     encoded_segment_ids=encoded_segment_ids,
                                                     deterministic=deterministic, decode=decode),
                               "encoder_attention", deterministic)
        ffn_name = mixers.ffn_for_side(cfg.ffn_type, self.side)  # CoLT5's routed FFN: encoder layers only
        ffn_fields = _model_values(cfg, ffn_name, mixers.ffn_class(ffn_name), self.side, self.layer, self.causal)
        if ffn_name == cfg.ffn_type:
            ffn_fields.update(dict(cfg.ffn_kwargs or {}))
        ffn = mixers.make_ffn(ffn_name, **ffn_fields, name="ffn")
        x = self._sublayer(x, lambda h: ffn(h, segment_ids=segment_ids, deterministic=deterministic), "ffn",
                           deterministic)
        return x

    def _sublayer(self, x: Array, fn: Callable[[Array], Array], name: str, deterministic: bool) -> Array:
        cfg = self.config
        normalize_before = cfg.side(self.side).normalize_before
        residual = x
        if normalize_before:
            x = _layer_norm(cfg, f"{name}_norm")(x)
        x = Dropout(cfg.dropout)(constrain(fn(x), BTC), deterministic=deterministic)
        x = residual + x
        if not normalize_before:
            x = _layer_norm(cfg, f"{name}_norm")(x)
        return constrain(x, BTC)


class FeedForward(nn.Module):
    """``Dense(d -> ffn) -> activation -> dropout -> Dense(ffn -> d)``, xavier-uniform with zero biases (ReLU unless
    ``activation`` names another); takes ``segment_ids`` as every FFN does."""

    model_fields: ClassVar[dict[str, str]] = {"hidden_dim": "ffn_dim", "relu_dropout": "relu_dropout",
                                              "activation": "activation", "dtype": "dtype",
                                              "matmul_precision": "matmul_precision"}

    hidden_dim: int = 2048
    relu_dropout: float = 0.0  # after the activation, whichever it is (fairseq's activation_dropout)
    activation: str = "relu"
    dtype: DType = jnp.float32
    matmul_precision: str = "default"

    @nn.compact
    def __call__(self, x_BTC: Array, *, segment_ids: Array | None = None, deterministic: bool = True) -> Array:
        linear = functools.partial(xavier_dense, dtype=self.dtype, precision=self.matmul_precision)
        h = constrain(linear(self.hidden_dim, (EMBED, MLP), name="fc1")(x_BTC), BTF)
        h = Dropout(self.relu_dropout)(activations.activation(self.activation, h), deterministic=deterministic)
        return linear(x_BTC.shape[-1], (MLP, EMBED), name="fc2")(h)


# Pieces
def _mixer_fields(cfg: ModelConfig, name: str, side: str, layer: int, causal: bool) -> dict[str, Any]:
    """Layer ``layer``'s mixer fields: those its class declares, then ``mixer_kwargs``; a missing one is an error."""
    kwargs = _model_values(cfg, name, mixers.mixer_class(name), side, layer, causal)
    extra = dict(cfg.mixer_kwargs or {})  # keyed by the name a layer uses (a plugin's also by its class name)
    kwargs.update(dict(extra.get(name, extra.get(name.rpartition(":")[2], {}) if mixers.is_spec(name) else {})))
    return kwargs


def _model_values(cfg: ModelConfig, name: str, cls: type[nn.Module], side: str, layer: int,
                  causal: bool) -> dict[str, Any]:
    """``{constructor field: value}`` for the model values ``cls.model_fields`` declares."""
    def value(source: str) -> Any:
        if source == "causal":
            return causal
        if source == "kernel_size":
            return cfg.kernel_size(side, layer)
        if source in SIDE_FIELDS:  # the side's own value where the config overrides the shared one
            return getattr(cfg.side(side), source)
        if source not in ModelConfig.__dataclass_fields__:
            raise UserError(f"{name!r} declares model field {source!r}, which ModelConfig does not have; "
                            f"known: {sorted(ModelConfig.__dataclass_fields__)} and {mixers.LAYER_VALUES}")
        return getattr(cfg, source)

    return {field: value(source) for field, source in getattr(cls, "model_fields", {}).items()}


def _output_projection(cfg: ModelConfig) -> nn.Module:
    """The untied output layer: the adaptive softmax, or one ``[C, V]`` kernel."""
    if cfg.adaptive_softmax_cutoffs:
        return adaptive_softmax.AdaptiveSoftmax(cfg.vocab_size, tuple(cfg.adaptive_softmax_cutoffs),
                                                cfg.adaptive_softmax_factor, cfg.adaptive_softmax_dropout,
                                                cfg.matmul_precision, cfg.tie_adaptive_proj, name="adaptive_softmax")
    return decoder_ends.OutputProjection(cfg.vocab_size, cfg.decoder_output_width, name="output_projection")


def _output(cfg: ModelConfig, x_BTC: Array, embedding: nn.Module, projection: nn.Module | None, deterministic: bool,
            logits: bool) -> Array | decoder_ends.OutputLayer:
    """Float32 logits ``[B, T, V]`` (the adaptive softmax's log-probabilities), or with ``logits=False`` the output
    layer's inputs; ids past ``output_vocab_size`` score -inf, as in fairseq."""
    if cfg.adaptive_softmax_cutoffs:
        tied = decoder_ends.tied_bands(cfg, embedding)
        return constrain(projection(x_BTC, deterministic=deterministic, tied=tied), BTV)
    table_VC = embedding.output_table() if projection is None else projection.table()
    layer = decoder_ends.OutputLayer(constrain(x_BTC, BTC), table_VC, cfg.output_vocab_size or cfg.vocab_size,
                                     cfg.dtype, cfg.matmul_precision)
    return constrain(layer.logits(), BTV) if logits else layer


def _project(projection: nn.Module | None, x: Array) -> Array:
    """``decoder_ends.project_in`` / ``project_out``, where the widths differ."""
    return x if projection is None else projection(x)


def _layer_norm(cfg: ModelConfig, name: str) -> LayerNorm:
    return LayerNorm(epsilon=1e-5, dtype=cfg.dtype, name=name)


class ScaleAndPosition(nn.Module):
    """``dropout(LN?(sqrt(d) * embedding + positions))`` of one side, as fairseq's, positions at ``+ position_offset``.
    """

    config: ModelConfig
    side: str  # "encoder" or "decoder": whose learned_positions

    @nn.compact
    def __call__(self, x_BTC: Array, positions_BT: Array | None, *, deterministic: bool) -> Array:
        cfg = self.config
        C = x_BTC.shape[-1]
        scale = math.sqrt(C) if cfg.scale_embeddings else 1.0
        x_BTC = x_BTC * scale
        if cfg.token_positions:
            x_BTC = x_BTC + self._positions(x_BTC, positions_BT)
        if cfg.layernorm_embedding:
            x_BTC = _layer_norm(cfg, "embedding_norm")(x_BTC)
        return Dropout(cfg.dropout)(constrain(x_BTC, BTC), deterministic=deterministic)

    def _positions(self, x_BTC: Array, positions_BT: Array | None) -> Array:
        cfg = self.config
        B, T, C = x_BTC.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        positions_BT = positions_BT + cfg.position_offset
        if cfg.side(self.side).learned_positions:
            init = nn.with_logical_partitioning(nn.initializers.normal(C ** -0.5), (LENGTH, EMBED))
            return Embed(cfg.max_len + cfg.position_offset, C, dtype=cfg.dtype, embedding_init=init,
                         table_axes=(ACT_LENGTH, None), name="learned")(positions_BT)
        length = max(cfg.max_len, T) + cfg.position_offset
        table_LC = jnp.asarray(sinusoidal_table(length, C))
        inside = jnp.all((positions_BT >= 0) & (positions_BT < length))
        rows_BTC = jax.lax.cond(inside, lambda p: table_LC.at[p].get(mode="promise_in_bounds"),
                                lambda p: sinusoidal_positions(p, C), positions_BT)  # a table row, else computed
        return rows_BTC.astype(x_BTC.dtype)


def sinusoidal_positions(positions_BT: Array, dim: int) -> Array:
    """fairseq's sinusoidal table: ``[sin(p * f_i), cos(p * f_i)]``, ``f_i = 10000^(-i / (dim/2 - 1))``."""
    half = dim // 2
    freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000.0) / max(half - 1, 1)))
    angles = positions_BT[..., None].astype(jnp.float32) * freq  # [B, T, half]
    table = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return jnp.pad(table, [(0, 0)] * (table.ndim - 1) + [(0, dim - 2 * half)])


@functools.lru_cache(maxsize=8)
def sinusoidal_table(length: int, dim: int) -> np.ndarray:
    """``sinusoidal_positions`` of ``0 .. length - 1``, ``[length, dim]``, computed once by the same XLA ops."""
    with jax.ensure_compile_time_eval():
        rows = jax.jit(sinusoidal_positions, static_argnums=1)(jnp.arange(length, dtype=jnp.int32)[None], dim)
        return np.asarray(rows[0])


def _segments(tokens_BT: Array, segmentation_BT: Array | None, allow_pad_start: bool = False) -> Array:
    """Segment ids: the packed ``*_segmentation`` if given, else 1 on non-PAD tokens."""
    if segmentation_BT is not None:
        return segmentation_BT.astype(jnp.int32)
    seg = (tokens_BT != PAD_ID).astype(jnp.int32)
    if allow_pad_start:  # a shifted decoder input starts with BOS, never PAD, so this is only a safeguard
        seg = seg.at[:, 0].set(1)
    return seg


class DecodePositions(nn.Module):
    """Positions of the decoder inputs: given ones, or while decoding a counter in the ``'cache'`` collection."""

    @nn.compact
    def __call__(self, tokens_BT: Array, positions_BT: Array | None, decode: bool) -> Array | None:
        if not decode:
            return positions_BT
        initialised = self.has_variable("cache", "position")
        position = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
        T = tokens_BT.shape[1]
        start = position.value
        if initialised:  # the cache-creating call does not advance the counter
            position.value = start + T
        return jnp.broadcast_to(start + jnp.arange(T), tokens_BT.shape)


def shift_right(targets_BT: Array, segmentation_BT: Array | None = None, start_id: int = BOS_ID) -> Array:
    """Decoder inputs ``[start, y_0, ..., y_{T-2}]`` inside every packed segment (start: BOS, or EOS for fairseq's)."""
    shifted = jnp.pad(targets_BT, ((0, 0), (1, 0)), constant_values=start_id)[:, :-1]
    if segmentation_BT is None:
        return shifted
    prev_seg = jnp.pad(segmentation_BT, ((0, 0), (1, 0)))[:, :-1]
    starts = segmentation_BT != prev_seg
    shifted = jnp.where(starts, start_id, shifted)
    return jnp.where(segmentation_BT == 0, PAD_ID, shifted)
