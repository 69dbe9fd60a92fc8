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
    R  tokens CoLT5 routes to its heavy branch        F  factors of Fixed attention's factorized table (its rank)
    G  tiles of a tiled computation (the band conv: T / L of them)
    W  the inputs one tile reads (its L positions and the K - 1 before them: L + K - 1)

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
BATCH_MESH_AXES = ("data", "fsdp")  # batch rows (and the rows of the mixers' carried state) are split over these

# --- masking values ------------------------------------------------------------------------------------------
# A masked attention logit: finite, so a row with every key masked (padding) softmaxes to numbers, not NaN.
MASKED_LOGIT = -1e30
# A log-probability that can never win (dead beams, filtered tokens): only compared or max-ed, never
# softmaxed over a whole row, so -inf is safe and exact.
IMPOSSIBLE_LOGP = float("-inf")

# --- more logical axis names (appended with the pods-and-clusters sharding work) -------------------------------
# The key-position side of a [H, L, L] position-pair table (Fixed / Hadamard attention): max_len² entries per
# head, too many to replicate, so it is sharded like the model width (fsdp); the query side stays LENGTH.
KEY_LENGTH = "key_length"
PARAM_AXES = LOGICAL_AXES + (KEY_LENGTH,)

# Activations carry their own names: a [B, T, C] activation's batch takes the data and fsdp mesh axes, so its
# width cannot also go to fsdp as a parameter's EMBED does (one array cannot use a mesh axis twice).
ACT_BATCH = "activation_batch"
ACT_LENGTH = "activation_length"
ACT_EMBED = "activation_embed"  # the model width of a [B, T, C] activation: replicated (params are gathered)
ACT_HEADS = "activation_heads"  # the H of [B, T, H, D] queries / keys / values and of [B, T, H, K] conv kernels
ACT_MLP = "activation_mlp"  # FFN hidden units
ACT_CONV = "activation_conv"  # the conv block's inner width
ACT_VOCAB = "activation_vocab"  # logits

# What lconv maps when the config's mesh rules do not name an axis (lconv.nn.common.axis_rules merges them,
# the config's rules first): the config then only needs the parameter names of configs/common.py.
DEFAULT_AXIS_RULES = (
    (KEY_LENGTH, "fsdp"),
    (ACT_BATCH, BATCH_MESH_AXES),
    (ACT_LENGTH, None),
    (ACT_EMBED, None),
    (ACT_HEADS, "tensor"),
    (ACT_MLP, "tensor"),
    (ACT_CONV, "tensor"),
    (ACT_VOCAB, "tensor"),
)

# Per-layer rematerialisation (config.model.remat): what the backward pass keeps from the forward pass of a
# layer; the rest is recomputed.
# config.model.matmul_precision: the precision of dots outside the conv ops (those always run float32 exactly at
# "highest"). "default" is the backend's fast path (TF32 on GPU, one bfloat16 pass on TPU, exact on CPU).
MATMUL_PRECISIONS = ("default", "high", "highest")
# config.model.attention_impl: the attention kernel (lconv.ops.flash): auto = cuDNN flash where it applies on CUDA,
# blockwise (online softmax) on long sequences, else materialised logits.
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn")
# config.decode.stop: when beam search ends (lconv.infer.search.beam_search).
STOP_RULES = ("optimal", "fairseq")
REMAT_POLICIES = ("none", "full", "dots")  # none: keep all; full: keep only the layer's inputs; dots: keep the
# outputs of matmuls against parameters (projections, FFN), recompute attention scores, softmax, convs, norms

# --- files ---------------------------------------------------------------------------------------------------
EXPORT_SIDECAR = "lconv_export.json"  # marks a folder written by python -m lconv.export (lconv.export.SIDECAR)
