"""Billion Word language modelling, fairseq's ``lightconv_lm_gbw`` (decoder-only, pre-norm).

    python train.py --config=configs/lm1b.py:dynamic --workdir=gs://BUCKET/lm1b_dynamic
    python train.py --config=configs/lm1b.py:transformer --workdir=...

d 512, FFN 4096, 16 heads, 6 layers with kernels [3,7,15,31,31,31], dropout 0.1, NAG (momentum 0.99) with
cosine lr and gradient-norm clipping 0.1. The output layer is the shared embedding over a 32k SentencePiece
vocabulary; the ``adaptive`` variant word swaps in fairseq's adaptive softmax (``lconv.adaptive_softmax``; its
gbw recipe cuts a 793k word vocabulary at 60k/160k, here 32k pieces at 8k/20k, factor 4, untied embeddings):

    python train.py --config=configs/lm1b.py:dynamic,adaptive --workdir=...

Needs tfds ``lm1b`` prepared (see README).
"""
from configs import common


def get_config(arg=None):
    words = common.parse_args(arg, [*common.MIXER_VARIANTS, "adaptive"])
    c = common.base_config()
    c.task = "lm"
    c.data.dataset = "lm1b"
    c.data.vocab_size = 32000
    c.data.max_target_length = 256
    c.data.batch_size = 256
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 512, 4096, 16
    c.model.encoder_layers, c.model.decoder_layers = 0, 6
    c.model.normalize_before = True
    c.model.dropout, c.model.attention_dropout, c.model.weight_dropout = 0.1, 0.1, 0.1
    c.optim.optimizer, c.optim.momentum = "nag", 0.99
    c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = 1e-4, "cosine", 16_000
    c.optim.clip_norm = 0.1
    c.optim.label_smoothing = 0.0
    c.train.num_steps = 984_000  # fairseq's gbw recipe: max_update 984k with the cosine period
    if "adaptive" in words:
        c.model.share_embeddings = False
        c.model.adaptive_softmax_cutoffs = (8000, 20000)
        c.model.adaptive_softmax_dropout = 0.1
    return common.set_mixer(c, words or {"dynamic"})
