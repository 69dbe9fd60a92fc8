"""Facts every layer of lconv shares, each defined once: special token ids, logical axis names, mesh axes, masking
values. The shape letters in names (``x_BTC``): docs/models.md, "Shape letters in names"."""
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
# A log-probability that can never win (dead beams, filtered tokens): never softmaxed over a row, so -inf is exact.
IMPOSSIBLE_LOGP = float("-inf")

# --- more logical axis names ----------------------------------------------------------------------------------
# The key side of a [H, L, L] position-pair table: max_len² entries per head, so sharded like EMBED (fsdp).
KEY_LENGTH = "key_length"
PARAM_AXES = LOGICAL_AXES + (KEY_LENGTH,)

# Activations' own names: their batch takes the data and fsdp axes, so their width cannot also go to fsdp.
ACT_BATCH = "activation_batch"
ACT_LENGTH = "activation_length"
ACT_EMBED = "activation_embed"  # the model width of a [B, T, C] activation: replicated (params are gathered)
ACT_HEADS = "activation_heads"  # the H of [B, T, H, D] queries / keys / values and of [B, T, H, K] conv kernels
ACT_MLP = "activation_mlp"  # FFN hidden units
ACT_CONV = "activation_conv"  # the conv block's inner width
ACT_VOCAB = "activation_vocab"  # logits

# What lconv maps when the config's mesh rules do not name an axis (``lconv.nn.common.axis_rules``).
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

# config.model.matmul_precision: dots outside the conv ops; "default" is the backend's fast path (TF32 on GPU).
MATMUL_PRECISIONS = ("default", "high", "highest")
# config.model.attention_impl: the attention kernel (lconv.ops.flash).
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn")
# config.decode.stop: when beam search ends (lconv.infer.search.beam_search).
STOP_RULES = ("optimal", "fairseq")
REMAT_POLICIES = ("none", "full", "dots")  # none: keep all; full: keep only the layer's inputs; dots: keep the
# outputs of matmuls against parameters (projections, FFN), recompute attention scores, softmax, convs, norms

# --- files ---------------------------------------------------------------------------------------------------
EXPORT_SIDECAR = "lconv_export.json"  # marks a folder written by python -m lconv.export (lconv.export.SIDECAR)
