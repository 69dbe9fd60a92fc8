"""Counts and an example batch (ids and detokenised text) per task, on the bundled DDTP snapshot.

    python -m lconv.data                       # every DDTP task
    python -m lconv.data en_de lm_en           # some (or full names: ddtp/de_en, lm1b, ...)
    python -m lconv.data en_de --data_dir=~/tensorflow_datasets --workdir=/tmp/tok --vocab_size=8000

A tokenizer per task is trained on a small training sample (``--max_sentences``) into ``--workdir/<task>``
(reused when it exists).
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from lconv.data import ddtp, pipeline, sources


def _name(task: str) -> str:
    return task if task in sources.DATASETS else f"ddtp/{task}"


def show(name: str, data_dir: str, workdir: str, vocab_size: int, max_sentences: int, batch_size: int) -> None:
    config = dict(dataset=name, data_dir=data_dir, vocab_size=vocab_size, tokenizer_max_sentences=max_sentences,
                  batch_size=batch_size, eval_batch_size=batch_size, max_input_length=64, max_target_length=64,
                  read_threads=1)
    tokenizer = pipeline.load_or_train_tokenizer(config, os.path.join(workdir, name.replace("/", "_")))
    data = pipeline.make_datasets(config, tokenizer, process_index=0, process_count=1)
    counts = {"train": len(sources.get_source(name, "train", data_dir)[0])}
    counts.update({split: len(eval_set.examples) for split, eval_set in data.eval_sets.items()})
    print(f"== {name}: examples {counts}; inputs={data.input_key!r} targets={data.target_key!r}; "
          f"vocab {tokenizer.vocab_size}")
    batch = next(data.train_iter)
    for key, value in batch.items():
        print(f"  train {key:22s} {value.dtype}{list(value.shape)} row 0: {np.array2string(value[0][:24])[:-1]} ...]")
    for key in ("inputs", "targets"):
        if key in batch:
            first = batch[key][0][batch[f"{key}_segmentation"][0] == 1]  # the row's first packed example
            print(f"  {key} text: {tokenizer.decode(first)[:300]!r}")
    print(f"  packed examples in the batch: {int(batch['targets_segmentation'].max(axis=1).sum())}, "
          f"train stats so far: {dict(data.stats)}")
    eval_batch = next(iter(data.eval_sets["validation"]))
    print(f"  eval batch: {', '.join(f'{k} {list(v.shape)}' for k, v in eval_batch.items())}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", nargs="*", default=list(ddtp.TASKS), help=f"default: all of {ddtp.TASKS}")
    parser.add_argument("--data_dir", default=os.path.join(tempfile.gettempdir(), "lconv_tfds"))
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "lconv_data_tokenizers"))
    parser.add_argument("--vocab_size", type=int, default=2000)
    parser.add_argument("--max_sentences", type=int, default=20000)
    parser.add_argument("--batch_size", type=int, default=4)
    args = parser.parse_args(argv)
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    for task in args.tasks:
        show(_name(task), args.data_dir, args.workdir, args.vocab_size, args.max_sentences, args.batch_size)


if __name__ == "__main__":
    main()
