"""Facts every layer of lconv shares, each defined once: special token ids, logical axis names, mesh axes,
masking values.

Shape letters used in names across the package (``x_BTC``, ``w_HK``, ``logits_BHTS``):

    B  batch rows                      T  time: the sequence (target, query, or a decoded chunk's new positions)
    S  source: encoder length / the keys attended to       C  channels: the model or block width
    H  heads                           D  the width of one head (C // H or qkv_features // H)
    K  conv kernel taps                P  previous inputs a causal conv keeps while decoding (K - 1)
    L  a length fixed ahead: time tile of the band conv, max decode length of a cache, max_len of a table
    V  vocabulary                      N  beams of a beam search
    M  kNN-memory slots                J  neighbours retrieved from the kNN memory (its top-k)
    R  tokens CoLT5 routes to its heavy branch

A ``_`` separates letters of a rank-agnostic name (``scores_B___``: batch first, any dims after).
"""
from __future__ import annotations

# --- token ids (SentencePiece is trained with exactly these; lconv.data.tokenizer) ----------------------------
PAD_ID = 0  # padding, never generated; segment id 0 in packed batches
EOS_ID = 1  # ends every input and target; decoding stops at it
UNK_ID = 2
BOS_ID = 3  # the first decoder input (targets shifted right)

# --- logical axis names of parameters and activations (mapped to mesh axes by config.mesh.rules) -------------
EMBED = "embed"  # the model width
MLP = "mlp"  # FFN hidden units
VOCAB = "vocab"
CONV = "conv"  # the conv block's inner width
HEADS = "heads"  # attention / conv heads (flattened heads x head width in projections)
KERNEL = "kernel"  # conv kernel taps
LENGTH = "length"  # tables indexed by position (learned positions, Fixed / Hadamard attention)
LOGICAL_AXES = (EMBED, MLP, VOCAB, CONV, HEADS, KERNEL, LENGTH)

# --- mesh ----------------------------------------------------------------------------------------------------
MESH_AXES = ("data", "fsdp", "tensor")
BATCH_MESH_AXES = ("data", "fsdp")  # batch rows (and the kNN memory's rows) are split over these

# --- masking values ------------------------------------------------------------------------------------------
# A masked attention logit: finite, so a row with every key masked (padding) softmaxes to numbers, not NaN.
MASKED_LOGIT = -1e30
# A log-probability that can never win (dead beams, filtered tokens): only compared or max-ed, never
# softmaxed over a whole row, so -inf is safe and exact.
IMPOSSIBLE_LOGP = float("-inf")
