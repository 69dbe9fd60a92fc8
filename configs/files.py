"""Your own data: a folder of your files (README, "Train on your own data"; the formats: lconv/data/own_files.py).

    python train.py --config=configs/files.py --config.data.raw_dir=DIR \
        --config.data.source_lang=xx --config.data.target_lang=yy --workdir=runs/mine      # translation
    python train.py --config=configs/files.py:summarization --config.data.raw_dir=DIR \
        --config.data.source_lang=document --config.data.target_lang=summary --workdir=runs/mine_summaries
    python train.py --config=configs/files.py:lm --config.data.raw_dir=DIR --workdir=runs/mine_lm
    python train.py --config=configs/files.py:lm,stream --config.data.raw_dir=DIR --workdir=...   # documents

Each task takes the small local recipe lconv tunes on the bundled corpus (configs/default.py for translation,
cnn_dailymail.py:ddtp for summarization, lm1b.py:ddtp for a language model), reading ``data.dataset="files"``
instead. Any mixer word picks the mixer (``files.py:lm,transformer``); ``stream`` (an LM only) reads documents
separated by blank lines, window by window, as a stateful mixer (``knn``) does. A vocabulary larger than a small
corpus gives is cut to what it gives, and the log says so.
"""
from lconv.configs import cnn_dailymail, common, default, lm1b
from lconv.errors import UserError

TASKS = ("translation", "summarization", "lm")


def get_config(arg=None):
    words = common.parse_args(arg, [*common.mixer_variants(), *TASKS, "stream"])
    tasks = words & set(TASKS)
    if len(tasks) > 1:
        raise UserError(f"choose one task of {TASKS}; got {sorted(tasks)}")
    task = next(iter(tasks), "translation")
    rest = ",".join(sorted(words - tasks))
    if "stream" in words and task != "lm":
        raise UserError("the variant word stream reads documents for a language model: use files.py:lm,stream")
    if task == "lm":
        c = lm1b.get_config(",".join(filter(None, ["ddtp", rest])))
    elif task == "summarization":
        c = cnn_dailymail.get_config(",".join(filter(None, ["ddtp", rest])))
    else:
        c = default.get_config(rest or None)
    c.data.dataset = "files"
    return c
