"""WMT'14 En->De (Wu et al. 2019), base and big: fairseq's ``lightconv_wmt_en_de[_big]`` and its training command
(fairseq examples/pay_less_attention_paper/README.md). docs/recipes.md compares every value with fairseq's.

    python train.py --config=configs/wmt_en_de.py:dynamic,big --workdir=gs://BUCKET/wmt_ende_dynamic_big
    python train.py --config=configs/wmt_en_de.py:lightconv,base --workdir=...
    python train.py --config=configs/wmt_en_de.py:transformer,big --config.mesh.shape="(16,4,1)" --workdir=...

big: d 1024, FFN 4096, 16 heads, dropout 0.3; base: d 512, FFN 2048, 8 heads, dropout 0.1. Both: 7 encoder /
6 decoder layers with kernels [3,7,15,31,31,31,31] / [3,7,15,31,31,31] (``transformer``: 6 / 6, as the
paper's Transformer baselines), GLU, attention / weight / input dropout 0.1, Adam (0.9, 0.98), lr 1e-3 warmed up
from 1e-7 over 10k updates, then one cosine period down to 1e-7 (fairseq's ``--lr-period-updates``; here the
period is ``train.num_steps - optim.warmup_steps`` = 20k), 30k updates, label smoothing 0.1. Needs tfds
``wmt14/en_de`` (tfds wmt14_translate/de-en) prepared (see README, Datasets).

Batch: fairseq's recipe is ``--max-tokens 3584`` on 8 GPUs with ``--update-freq 16``: 3584 x 8 x 16 = 458,752
tokens per update. Here ``data.batch_size`` is the whole update (global rows of ``max_target_length`` = 256 packed
tokens), so tokens per update = batch_size x max_target_length = 1792 x 256 = 458,752 whatever the hardware.
``optim.grad_accum_steps`` (fairseq's update-freq) only splits those rows into micro-batches to bound memory:
each device holds batch_size / (data-parallel devices x grad_accum_steps) rows at a time, and batch_size must be
divisible by that product. Per target:
- 8 GPUs: the default grad_accum_steps=16 gives 14 rows (3,584 tokens) per GPU per micro-batch: fairseq's recipe.
- a TPU v4-32 slice (16 chips): ``--config.optim.grad_accum_steps=4`` gives 28 rows (7,168 tokens) per chip.
- 32 devices: ``--config.optim.grad_accum_steps=2`` (28 rows each); 1 device: 16 (112 rows) or more.
Keep batch_size (and so the recipe) fixed and raise grad_accum_steps when a micro-batch does not fit.
"""
from lconv.configs import common

SIZES = {
    "base": dict(d_model=512, ffn_dim=2048, num_heads=8, dropout=0.1),
    "big": dict(d_model=1024, ffn_dim=4096, num_heads=16, dropout=0.3),
}
# fairseq's tokens per update: --max-tokens 3584 x 8 GPUs x --update-freq 16 = 458,752 = WMT_ROWS x 256.
WMT_ROWS, WMT_UPDATE_FREQ = 1792, 16


def wmt_config(words, dataset, source_key, target_key, big_dropout):
    c = common.follow_fairseq(common.base_config())  # fairseq's Adam eps, clip and label smoothing split
    c.data.dataset = dataset
    c.data.vocab_size = 32000
    c.data.max_input_length = c.data.max_target_length = 256
    c.data.batch_size = WMT_ROWS  # rows per update (all micro-batches): 1792 x 256 = fairseq's 458,752 tokens
    c.optim.grad_accum_steps = WMT_UPDATE_FREQ  # 8 GPUs: fairseq's --update-freq 16, 3,584 tokens per micro-batch
    size = "base" if "base" in words else "big"
    c.model.update(SIZES[size])
    if size == "big":
        c.model.dropout = big_dropout
    # The recipe's --attention-dropout 0.1 --weight-dropout 0.1; input dropout 0.1: fairseq's WMT archs' default.
    c.model.attention_dropout, c.model.weight_dropout, c.model.input_dropout = 0.1, 0.1, 0.1
    c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = 1e-3, "cosine", 10_000
    c.optim.min_lr = 1e-7  # the cosine floor: fairseq's --min-lr 1e-7 (--stop-min-lr 1e-9 only ends a run)
    c.optim.clip_norm = 0.0
    c.train.num_steps = 30_000  # 10k warmup + fairseq's --lr-period-updates 20000
    c.decode.beam_size, c.decode.lenpen = 5, 0.5
    c.decode.compound_split = True  # the paper's En-De BLEU: tokenized, compounds split (fairseq's script)
    c.model.dtype = "bfloat16"  # fairseq trains with --fp16; bfloat16 needs no loss scaling (params stay float32)
    if "transformer" in words:  # the paper's Transformer baselines (Vaswani / Ott et al.) are 6 + 6 layers;
        c.model.encoder_layers = 6  # the conv models take a 7th encoder layer to match their size
    return common.set_mixer(c, words)


def get_config(arg=None):
    words = common.parse_args(arg, list(common.mixer_variants()) + list(SIZES))
    return wmt_config(words or {"dynamic"}, "wmt14/en_de", "en", "de", big_dropout=0.3)
