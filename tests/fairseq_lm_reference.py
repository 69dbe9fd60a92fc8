"""fairseq's language models (``lightconv_lm``, ``transformer_lm``) in float64 NumPy, written from fairseq 0.12.2's
``LightConvDecoder`` / ``TransformerDecoder`` built with ``no_encoder_attn``, ``AdaptiveInput`` and
``AdaptiveSoftmax.get_log_prob``, on fairseq's own state-dict names and ids (pad 1, EOS 2): the independent
reference for the LM importer. The layers are ``fairseq_reference``'s (checked there against fairseq's goldens):
a ``transformer_lm``'s FFN applies ``--activation-fn``, a ``lightconv_lm``'s ReLU whatever it says.

The embedding is ``TransformerDecoderBase`` / ``LightConvDecoder``'s: ``embed_scale * embed_tokens``, then
``project_in_dim``, then the positions (none with ``--no-token-positional-embeddings``), then, in a
``transformer_lm`` with ``--layernorm-embedding`` only (``LightConvDecoder`` has no such module), the
``decoder.layernorm_embedding`` LayerNorm, and dropout (nothing in eval mode).

Every band is computed by a plain loop over tokens (``AdaptiveInput.forward`` selects each token's band by mask;
``get_log_prob`` fills each tail's columns), so nothing here shares the vectorised form lconv uses.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import fairseq_reference
import numpy as np

PAD, EOS = 1, 2


def cutoffs(value: Any, vocab_size: int) -> list[int]:
    cuts = [int(v) for v in str(value).split(",")] if isinstance(value, str) else list(value)
    return cuts if cuts[-1] == vocab_size else cuts + [vocab_size]


def log_probs(weights: Mapping[str, np.ndarray], args: Mapping[str, Any], tokens: np.ndarray) -> np.ndarray:
    """``[B, T, V]`` natural-log next-token probabilities for the decoder input ``tokens`` ([EOS, w1, ...],
    right-padded with 1), in eval mode."""
    W = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    lightconv = str(args["arch"]).startswith("lightconv_lm")
    d = args["decoder_embed_dim"]
    scale = 1.0 if (not lightconv and args.get("no_scale_embedding")) else math.sqrt(d)
    x = scale * _embed_tokens(W, args, tokens)
    if "decoder.project_in_dim.weight" in W:
        x = x @ W["decoder.project_in_dim.weight"].T
    if not args.get("no_token_positional_embeddings"):
        x = x + _positions(W, args, tokens, d)
    if not lightconv and args.get("layernorm_embedding"):
        x = fairseq_reference._norm(W, "decoder.layernorm_embedding", x)
    pad = tokens == PAD
    for i in range(args["decoder_layers"]):
        x = fairseq_reference._layer(W, args, f"decoder.layers.{i}", x, pad, None, lightconv, encoder=False)
    if not lightconv and args["decoder_normalize_before"] and not args.get("no_decoder_final_norm"):
        x = fairseq_reference._norm(W, "decoder.layer_norm", x)
    if "decoder.project_out_dim.weight" in W:
        x = x @ W["decoder.project_out_dim.weight"].T
    if args.get("adaptive_softmax_cutoff"):
        return _adaptive_softmax(W, args, x)
    if args.get("share_decoder_input_output_embed"):
        logits = x @ W["decoder.embed_tokens.weight"].T
    else:
        logits = x @ W.get("decoder.embed_out", W.get("decoder.output_projection.weight")).T
    return _log_softmax(logits)


def _embed_tokens(W, args, tokens):
    if not args.get("adaptive_input"):
        return W["decoder.embed_tokens.weight"][tokens]
    edges = [0] + cutoffs(args["adaptive_input_cutoff"], _vocab(W, args))
    out = np.zeros(tokens.shape + (args["decoder_embed_dim"],))
    for index in np.ndindex(tokens.shape):
        token = tokens[index]
        band = next(i for i in range(len(edges) - 1) if edges[i] <= token < edges[i + 1])
        row = W[f"decoder.embed_tokens.embeddings.{band}.0.weight"][token - edges[band]]
        out[index] = W[f"decoder.embed_tokens.embeddings.{band}.1.weight"] @ row
    return out


def _vocab(W, args):
    if args.get("adaptive_input"):
        return sum(v.shape[0] for k, v in W.items() if k.startswith("decoder.embed_tokens.embeddings.")
                   and k.endswith(".0.weight"))
    return W["decoder.embed_tokens.weight"].shape[0]


def _positions(W, args, tokens, d):
    real = tokens != PAD
    positions = np.cumsum(real, axis=1) * real + PAD  # pad -> 1, the first real token -> 2
    if args["decoder_learned_pos"]:
        return W["decoder.embed_positions.weight"][positions]
    half = d // 2
    freq = np.exp(np.arange(half) * -(math.log(10000.0) / (half - 1)))
    angles = np.arange(int(positions.max()) + 1)[:, None] * freq[None]
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    table[PAD] = 0.0
    return table[positions]


def _adaptive_softmax(W, args, x):
    """``AdaptiveSoftmax.get_log_prob`` with no target: every column. Tied weights are read through their own
    fairseq keys (the stored copies), so a wrong copy check would show."""
    prefix = "decoder.adaptive_softmax"
    V = _vocab(W, args)
    edges = cutoffs(args["adaptive_softmax_cutoff"], V)
    tails = len(edges) - 1
    if f"{prefix}.head.weight" in W:
        head = x @ W[f"{prefix}.head.weight"].T
    else:  # TiedHeadModule: the words against band 0's table, then the clusters
        head = np.concatenate([x @ W[f"{prefix}.head.word_proj.weight"].T,
                               x @ W[f"{prefix}.head.class_proj.weight"].T], axis=-1)
    out = np.zeros(x.shape[:-1] + (V,))
    head_logp = _log_softmax(head)
    out[..., :edges[0] + tails] = head_logp
    for i in range(tails):
        proj = W[f"{prefix}.tail.{i}.0.weight"]
        if args.get("tie_adaptive_weights") and args.get("tie_adaptive_proj"):
            h = x @ proj  # TiedLinear(transpose=True): the input's [d, width] projection
        else:
            h = x @ proj.T
        tail = h @ W[f"{prefix}.tail.{i}.2.weight"].T
        out[..., edges[i]:edges[i + 1]] = _log_softmax(tail) + head_logp[..., edges[0] + i, None]
    return out


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))
