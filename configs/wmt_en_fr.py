"""WMT'14 En->Fr big (Wu et al. 2019, Sec. 5.1): as ``wmt_en_de`` big with dropout 0.1.

    python train.py --config=configs/wmt_en_fr.py:dynamic,big --workdir=gs://BUCKET/wmt_enfr_dynamic
"""
from lconv.configs import common
from lconv.configs.wmt_en_de import SIZES, wmt_config


def get_config(arg=None):
    words = common.parse_args(arg, list(common.MIXER_VARIANTS) + list(SIZES))
    c = wmt_config(words or {"dynamic"}, "wmt14/en_fr", "en", "fr", big_dropout=0.1)
    c.data.vocab_size = 40000
    c.decode.compound_split = False  # compound splitting is the paper's En-De convention only
    return c
