"""fairseq's translation forward pass in float64 NumPy, written from fairseq's rules (../shared/fairseq/README.md,
"Conventions an importer must honour") and run on fairseq's own state-dict names, ids and padding: the
independent reference for the importer's model variants that no fairseq fixture covers (lightweight conv, no
GLU, pre-norm, learned positions, separate embeddings). tests/test_fairseq_import.py first checks it against
fairseq's golden log-probabilities.

Names: fairseq ids (pad 1, EOS 2), sources left-padded, ``prev_output_tokens`` = [EOS, y...] right-padded.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

PAD = 1
_ERF = np.vectorize(math.erf)
ACTIVATIONS = {  # fairseq's --activation-fn (fairseq.utils.get_activation_fn), in float64
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0))),
    "gelu_accurate": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
}
ACTIVATIONS["gelu_fast"] = ACTIVATIONS["gelu_accurate"]


def forward(weights: Mapping[str, np.ndarray], args: Mapping[str, Any], src_tokens: np.ndarray,
            prev_output_tokens: np.ndarray) -> np.ndarray:
    """Logits ``[B, T, V]`` (float64) of fairseq's ``lightconv`` or ``transformer`` model in eval mode."""
    W = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    lightconv = str(args["arch"]).startswith("lightconv")
    src_pad = src_tokens == PAD
    x = _embed(W, args, "encoder", src_tokens)
    if not lightconv:
        x = x * ~src_pad[..., None]
    for i in range(args["encoder_layers"]):
        x = _layer(W, args, f"encoder.layers.{i}", x, src_pad, None, lightconv, encoder=True)
    if args["encoder_normalize_before"]:
        x = _norm(W, "encoder.layer_norm", x)
    y = _embed(W, args, "decoder", prev_output_tokens)
    for i in range(args["decoder_layers"]):
        y = _layer(W, args, f"decoder.layers.{i}", y, prev_output_tokens == PAD, (x, src_pad), lightconv,
                   encoder=False)
    if args["decoder_normalize_before"] and not args.get("no_decoder_final_norm"):
        y = _norm(W, "decoder.layer_norm", y)
    if "decoder.project_out_dim.weight" in W:  # decoder_output_dim != decoder_embed_dim
        y = y @ W["decoder.project_out_dim.weight"].T
    if args.get("share_all_embeddings") or args.get("share_decoder_input_output_embed"):
        return y @ W["decoder.embed_tokens.weight"].T
    out = W.get("decoder.embed_out", W.get("decoder.output_projection.weight"))
    return y @ out.T


def _embed(W, args, side, tokens):
    """scale * embedding + positions, then (transformer only) the embedding layer norm: fairseq's lightconv reads
    neither --no-scale-embedding nor --layernorm-embedding."""
    C = W[f"{side}.embed_tokens.weight"].shape[1]
    transformer = not str(args["arch"]).startswith("lightconv")
    scale = 1.0 if transformer and args.get("no_scale_embedding") else math.sqrt(C)
    x = scale * W[f"{side}.embed_tokens.weight"][tokens]
    if not args.get("no_token_positional_embeddings"):
        x = x + _positions(W, args, side, tokens, C)
    if transformer and args.get("layernorm_embedding"):
        x = _norm(W, f"{side}.layernorm_embedding", x)
    return x


def _positions(W, args, side, tokens, C):
    real = tokens != PAD
    positions = np.cumsum(real, axis=1) * real + PAD  # pad -> 1, the first real token -> 2
    if args[f"{side}_learned_pos"]:
        table = W[f"{side}.embed_positions.weight"]
    else:
        half = C // 2
        freq = np.exp(np.arange(half) * -(math.log(10000.0) / (half - 1)))
        angles = np.arange(int(positions.max()) + 1)[:, None] * freq[None]
        table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
        table[PAD] = 0.0
    return table[positions]


def _linear(W, name, x):
    y = x @ W[f"{name}.weight"].T
    return y + W[f"{name}.bias"] if f"{name}.bias" in W else y


def _norm(W, name, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * W[f"{name}.weight"] + W[f"{name}.bias"]


def _sublayer(W, args, norm, x, fn, encoder):
    before = args["encoder_normalize_before" if encoder else "decoder_normalize_before"]
    h = fn(_norm(W, norm, x) if before else x)
    return x + h if before else _norm(W, norm, x + h)


def _layer(W, args, prefix, x, pad, encoded, lightconv, encoder):
    if lightconv:
        norms = ((f"{prefix}.layer_norms.0", f"{prefix}.layer_norms.1") if encoder
                 else (f"{prefix}.conv_layer_norm", f"{prefix}.final_layer_norm"))
        kernels = args["encoder_kernel_size_list" if encoder else "decoder_kernel_size_list"]
        K = kernels[int(prefix.rsplit(".", 1)[1])]
        mix = lambda h: _conv_block(W, args, prefix, h, pad if encoder else None, K, encoder)
    else:
        norms = (f"{prefix}.self_attn_layer_norm", f"{prefix}.final_layer_norm")
        mix = lambda h: _attention(W, args, f"{prefix}.self_attn", h, h, pad, causal=not encoder)
    x = _sublayer(W, args, norms[0], x, mix, encoder)
    if encoded is not None:
        memory, memory_pad = encoded
        x = _sublayer(W, args, f"{prefix}.encoder_attn_layer_norm", x,
                      lambda h: _attention(W, args, f"{prefix}.encoder_attn", h, memory, memory_pad, causal=False),
                      encoder)
    act = ACTIVATIONS[args.get("activation_fn", "relu") if not lightconv else "relu"]  # lightconv: ReLU only
    ffn = lambda h: _linear(W, f"{prefix}.fc2", act(_linear(W, f"{prefix}.fc1", h)))
    return _sublayer(W, args, norms[1], x, ffn, encoder)


def _conv_block(W, args, prefix, x, pad, K, encoder):
    h = _linear(W, f"{prefix}.linear1", x)
    if args["encoder_glu" if encoder else "decoder_glu"]:
        C = h.shape[-1] // 2
        h = h[..., :C] / (1.0 + np.exp(-h[..., C:]))
    if pad is not None:
        h = h * ~pad[..., None]
    B, T, C = h.shape
    H = args["encoder_attention_heads" if encoder else "decoder_attention_heads"]
    if f"{prefix}.conv.weight_linear.weight" in W:
        logits = (h @ W[f"{prefix}.conv.weight_linear.weight"].T).reshape(B, T, H, K)
    else:
        logits = np.broadcast_to(W[f"{prefix}.conv.weight"][:, 0, :], (B, T, H, K))
    if args.get("weight_softmax", True):
        logits = np.exp(logits - logits.max(-1, keepdims=True))
        logits = logits / logits.sum(-1, keepdims=True)
    P = K // 2 if encoder else K - 1
    out = np.zeros_like(h)
    for t in range(T):
        for k in range(K):
            s = t + k - P
            if 0 <= s < T:
                out[:, t] += np.repeat(logits[:, t, :, k], C // H, axis=-1) * h[:, s]
    return _linear(W, f"{prefix}.linear2", out)


def _attention(W, args, prefix, x, memory, memory_pad, causal):
    B, T, C = x.shape
    H = args["decoder_attention_heads"] if prefix.startswith("decoder") else args["encoder_attention_heads"]
    D = C // H
    q = (_linear(W, f"{prefix}.q_proj", x) * D ** -0.5).reshape(B, T, H, D)
    k = _linear(W, f"{prefix}.k_proj", memory).reshape(B, -1, H, D)
    v = _linear(W, f"{prefix}.v_proj", memory).reshape(B, -1, H, D)
    scores = np.einsum("bthd,bshd->bhts", q, k)
    masked = np.broadcast_to(memory_pad[:, None, None, :], scores.shape)
    if causal:
        masked = masked | np.triu(np.ones((T, T), bool), 1)
    scores = np.where(masked, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    return _linear(W, f"{prefix}.out_proj", np.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, C))
