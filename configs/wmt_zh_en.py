"""WMT'17 Zh->En big (Wu et al. 2019): fairseq's ``lightconv_wmt_zh_en_big`` (dropout, attention and weight
dropout 0.2) on ``wmt_en_de`` big's recipe (fairseq's README has no Zh-En command): 30k updates, 10k warmup, then
a 20k-update cosine. Batch and grad_accum_steps per hardware: see ``wmt_en_de``.

    python train.py --config=configs/wmt_zh_en.py:dynamic,big --workdir=gs://BUCKET/wmt_zhen_dynamic
"""
from lconv.configs import common
from lconv.configs.wmt_en_de import SIZES, wmt_config


def get_config(arg=None):
    words = common.parse_args(arg, list(common.mixer_variants()) + list(SIZES))
    c = wmt_config(words or {"dynamic"}, "wmt17/zh_en", "zh", "en", big_dropout=0.2)
    c.data.vocab_size = 32000  # the paper uses separate 30k BPE vocabularies; lconv trains one joint model
    if "base" not in words:  # lightconv_wmt_zh_en_big's attention and weight dropout
        c.model.attention_dropout = 0.2
        if c.model.weight_dropout:  # 0 for the Transformer baseline (common.set_mixer): no conv kernels to drop
            c.model.weight_dropout = 0.2
    c.decode.compound_split = False  # compound splitting is the paper's En-De convention only
    return c
