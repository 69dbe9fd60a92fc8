"""WMT'14 En->Fr big (Wu et al. 2019): fairseq's ``lightconv_wmt_en_fr_big`` and its training command (fairseq
examples/pay_less_attention_paper/README.md): as ``wmt_en_de`` big with dropout 0.1, a 70k-update cosine period
of which the recipe's 30k updates run the first 20k after warmup, and length penalty 0.9. Batch and
grad_accum_steps per hardware: see ``wmt_en_de``'s docstring (the same 458,752 tokens per update).

    python train.py --config=configs/wmt_en_fr.py:dynamic,big --workdir=gs://BUCKET/wmt_enfr_dynamic
"""
from lconv.configs import common
from lconv.configs.wmt_en_de import SIZES, wmt_config


def get_config(arg=None):
    words = common.parse_args(arg, list(common.mixer_variants()) + list(SIZES))
    c = wmt_config(words or {"dynamic"}, "wmt14/en_fr", "en", "fr", big_dropout=0.1)
    c.data.vocab_size = 40000
    c.optim.cosine_period = 70_000  # fairseq's --lr-period-updates 70000, cut at its --max-update 30000
    c.decode.lenpen = 0.9  # the recipe's fairseq-generate --lenpen 0.9
    c.decode.compound_split = False  # compound splitting is the paper's En-De convention only
    return c
