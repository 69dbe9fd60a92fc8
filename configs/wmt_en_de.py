"""WMT'14 En->De (Wu et al. 2019, Sec. 5.1), base and big.

    python train.py --config=configs/wmt_en_de.py:dynamic,big --workdir=gs://BUCKET/wmt_ende_dynamic_big
    python train.py --config=configs/wmt_en_de.py:lightconv,base --workdir=...
    python train.py --config=configs/wmt_en_de.py:transformer,big --config.mesh.shape="(16,4,1)" --workdir=...

big: d 1024, FFN 4096, 16 heads, dropout 0.3; base: d 512, FFN 2048, 8 heads, dropout 0.1. Both: 7 encoder /
6 decoder layers with kernels [3,7,15,31,31,31,31] / [3,7,15,31,31,31] (``transformer``: 6 / 6, as the
paper's Transformer baselines), GLU, weight dropout 0.1, Adam
(0.9, 0.98), cosine lr 1e-3 with 10k warmup, 30k updates, label smoothing 0.1. Needs tfds
``wmt14/en_de`` (tfds wmt14_translate/de-en) prepared (see README, Datasets).
"""
from lconv.configs import common

SIZES = {
    "base": dict(d_model=512, ffn_dim=2048, num_heads=8, dropout=0.1),
    "big": dict(d_model=1024, ffn_dim=4096, num_heads=16, dropout=0.3),
}


def wmt_config(words, dataset, source_key, target_key, big_dropout):
    c = common.base_config()
    c.data.dataset = dataset
    c.data.vocab_size = 32000
    c.data.max_input_length = c.data.max_target_length = 256
    c.data.batch_size = 512  # x 256 tokens packed ~ fairseq's 3.5k tokens x 128 GPUs... per update
    size = "base" if "base" in words else "big"
    c.model.update(SIZES[size])
    if size == "big":
        c.model.dropout = big_dropout
    c.model.weight_dropout = 0.1
    c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = 1e-3, "cosine", 10_000
    c.optim.clip_norm = 0.0
    c.train.num_steps = 30_000
    c.decode.beam_size, c.decode.lenpen = 5, 0.5
    c.decode.compound_split = True  # the paper's En-De BLEU: tokenized, compounds split (fairseq's script)
    c.model.dtype = "bfloat16"
    if "transformer" in words:  # the paper's Transformer baselines (Vaswani / Ott et al.) are 6 + 6 layers;
        c.model.encoder_layers = 6  # the conv models take a 7th encoder layer to match their size
    return common.set_mixer(c, words)


def get_config(arg=None):
    words = common.parse_args(arg, list(common.MIXER_VARIANTS) + list(SIZES))
    return wmt_config(words or {"dynamic"}, "wmt14/en_de", "en", "de", big_dropout=0.3)
