"""WMT'17 Zh->En big (Wu et al. 2019, Sec. 5.1): as ``wmt_en_de`` big with dropout 0.2.

    python train.py --config=configs/wmt_zh_en.py:dynamic,big --workdir=gs://BUCKET/wmt_zhen_dynamic
"""
from lconv.configs import common
from lconv.configs.wmt_en_de import SIZES, wmt_config


def get_config(arg=None):
    words = common.parse_args(arg, list(common.MIXER_VARIANTS) + list(SIZES))
    c = wmt_config(words or {"dynamic"}, "wmt17/zh_en", "zh", "en", big_dropout=0.2)
    c.data.vocab_size = 32000  # the paper uses separate 30k BPE vocabularies; lconv trains one joint model
    c.decode.compound_split = False  # compound splitting is the paper's En-De convention only
    return c
