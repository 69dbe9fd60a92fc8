"""Counts, what preparing skipped, and an example batch (ids and detokenised text) per task; or prepare one.

    python -m lconv.data                       # every DDTP task, from the bundled snapshot
    python -m lconv.data en_de lm_en           # some (or full names: ddtp/de_en, iwslt14/de_en, lm1b, ...)
    python -m lconv.data en_de --raw_dir=DIR   # from apt Translation-* files instead of the snapshot
    python -m lconv.data files --raw_dir=DIR --source_lang=xx --target_lang=yy   # check your own files' folder
    python -m lconv.data prepare wmt14/en_de --data_dir=gs://bucket/tfds     # once, where there is network

Defaults are configs/default.py's, so the data prepared here is the copy train.py reads; details: docs/data.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from lconv import console, shared_folders
from lconv.data import catalog, copy_report, ddtp, paths, pipeline, sources
from lconv.data import tokenizer as tokenizer_lib
from lconv.data.data_config import DataConfig
from lconv.errors import UserError

TOKENIZER_CACHE = "data_tokenizers"  # the inspection's tokenizers, under this user's cache folder


def dataset_name(task: str) -> str:
    """A DDTP task (``en_de``) or a dataset name (``ddtp/de_en``, ``lm1b``) -> the dataset name."""
    if task in sources.DATASETS or task == sources.FILES:
        return task
    if f"ddtp/{task}" in sources.DATASETS:
        return f"ddtp/{task}"
    others = [name for name in sources.DATASETS if not name.startswith("ddtp/")]
    raise UserError(f"unknown task {task!r}; use a DDTP task ({', '.join(ddtp.TASKS)}, or a reverse direction such "
                    f"as de_en) or a dataset name ({', '.join(others)})")


def show(name: str, data_dir: str, workdir: str, vocab_size: int, max_sentences: int, batch_size: int,
         raw_dir: str | None = None, source_lang: str | None = None, target_lang: str | None = None,
         data_name: str | None = None, own_cache: bool = False) -> None:
    """Counts, the data report and an example batch of dataset ``name`` (``"files"``: your own files);
    ``own_cache``: ``workdir`` is this user's cache folder (the default), which must be this user's alone."""
    files = dict(source_lang=source_lang, target_lang=target_lang, name=data_name)
    config = DataConfig.from_config(dict(
        dataset=name, data_dir=data_dir, raw_dir=raw_dir, vocab_size=vocab_size, tokenizer_max_sentences=max_sentences,
        batch_size=batch_size, eval_batch_size=batch_size, max_input_length=64, max_target_length=64, read_threads=1,
        **(files if name == sources.FILES else {})))
    name = sources.display_name(config)
    tokenizer_dir = paths.join(workdir, name.replace("/", "_"))
    problem = paths.private_cache_problem(tokenizer_dir) if own_cache else None
    if problem:  # a folder another user can write: a link planted there had the tokenizer written where it led
        raise UserError(f"the tokenizer folder {tokenizer_dir} {problem}; lconv writes there only when the folder is "
                        "this user's alone (--workdir=DIR names another)")
    if not paths.is_url(tokenizer_dir) and os.path.islink(tokenizer_dir):  # a link would take the tokenizer out
        raise UserError(f"the tokenizer folder {tokenizer_dir} is a link (to {os.path.realpath(tokenizer_dir)}); "
                        "lconv writes the tokenizer in a real folder inside --workdir (remove the link)")
    # Written, then read back, by path: made first, so nobody makes it between the check and the tokenizer's write
    shared_folders.raise_problem(shared_folders.make_checked(tokenizer_dir), f"--workdir={workdir}")
    tokenizer = pipeline.load_or_train_tokenizer(config, tokenizer_dir, process_index=0, process_count=1)
    data = pipeline.make_datasets(config, tokenizer, process_index=0, process_count=1)
    counts = {"train": len(sources.config_source(config, "train")[0])}
    counts.update({split: len(eval_set.examples) for split, eval_set in data.eval_sets.items()})
    print(f"== {name}: examples {counts}; inputs={data.input_key!r} targets={data.target_key!r}; "
          f"vocab {tokenizer.vocab_size}")
    for line in sources.describe_report(data.source_report):
        print(f"  {line}")
    batch = next(data.train_iter)
    for key, value in batch.items():
        print(f"  train {key:22s} {value.dtype}{list(value.shape)} row 0: {np.array2string(value[0][:24])[:-1]} ...]")
    for key in ("inputs", "targets"):
        if key in batch:
            first = batch[key][0][batch[f"{key}_segmentation"][0] == 1]  # the row's first packed example
            print(f"  {key} text: {tokenizer.detokenize(first)[:300]!r}")
    print(f"  packed examples in the batch: {int(batch['targets_segmentation'].max(axis=1).sum())}, "
          f"train stats so far: {dict(data.stats)}")
    eval_batch = next(iter(data.eval_sets["validation"]))
    print(f"  eval batch: {', '.join(f'{k} {list(v.shape)}' for k, v in eval_batch.items())}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from lconv.configs import default

    # The default config's data settings: the copy prepared here is the one train.py reads.
    data = default.get_config().data
    parser = console.OneLineParser(prog="python -m lconv.data", description=__doc__.splitlines()[0])
    parser.add_argument("tasks", nargs="*", default=list(ddtp.TASKS), help=f"default: all of {ddtp.TASKS}")
    parser.add_argument("--data_dir", default=data.data_dir, help="default: the configs' (where train.py reads)")
    parser.add_argument("--raw_dir", default=None, help="apt Translation-* files (ddtp), IWSLT14 text files, or "
                        "the folder of your files (files)")
    for code in ("source_lang", "target_lang"):
        parser.add_argument(f"--{code}", default=None, help="files: config.data." + code)
    parser.add_argument("--name", default=None, help="files: config.data.name")
    parser.add_argument("--workdir", default=None,
                        help="where the inspection's tokenizers go (a run trains its own in its workdir); default: "
                        "this user's cache folder")
    parser.add_argument("--vocab_size", type=int, default=data.vocab_size, help="default: configs/default.py's")
    parser.add_argument("--max_sentences", type=int, default=data.tokenizer_max_sentences,
                        help="default: configs/default.py's")
    parser.add_argument("--batch_size", type=int, default=4)
    args = parser.parse_args(argv)
    args.own_cache = args.workdir is None
    if args.own_cache:
        args.workdir = paths.user_cache_folder(TOKENIZER_CACHE)
    if args.vocab_size < tokenizer_lib.MIN_VOCAB_SIZE:
        parser.error(f"--vocab_size={args.vocab_size}: must be >= {tokenizer_lib.MIN_VOCAB_SIZE} (the tokenizer's "
                     "special and byte pieces)")
    for flag in ("batch_size", "max_sentences"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)}: must be >= 1")
    try:
        args.names = [dataset_name(task) for task in args.tasks]
    except UserError as err:
        parser.error(str(err))
    return args


def _parse_prepare(argv: list[str]) -> argparse.Namespace:
    parser = console.OneLineParser(prog="python -m lconv.data prepare",
                                   description="Prepares a dataset as array_record.")
    parser.add_argument("name", help="a dataset name (wmt14/en_de, lm1b, cnn_dailymail, ddtp/en_de, ...)")
    parser.add_argument("--data_dir", default="~/tensorflow_datasets", help="local folder or URL (gs://...)")
    parser.add_argument("--raw_dir", default=None, help="ddtp/* and iwslt14/* only: their raw files")
    parser.add_argument("--download_dir", default=None, help="where tfds keeps downloads (default: data_dir's)")
    parser.add_argument("--manual_dir", default=None, help="tfds's folder of manually downloaded files")
    args = parser.parse_args(argv)
    try:
        args.name = dataset_name(args.name)
    except UserError as err:
        parser.error(str(err))
    if args.raw_dir is not None and not sources.dataset_spec(args.name).local:
        parser.error(f"--raw_dir is read by ddtp/* and iwslt14/* only; {args.name} is downloaded by tfds")
    return args


def prepare_main(argv: list[str]) -> None:
    """``python -m lconv.data prepare NAME``: prepares one dataset where training will read it."""
    args = _parse_prepare(argv)
    try:
        if sources.dataset_spec(args.name).local:
            from lconv.data import tfds_ddtp

            spec = sources.dataset_spec(args.name)
            builder = tfds_ddtp.prepare(spec.tfds_name, args.data_dir, raw_dir=args.raw_dir)
            report = copy_report.read_report(builder)
            print(f"{args.name}: examples {report['examples']} in {builder.data_dir}")
        else:
            catalog.prepare(args.name, args.data_dir, download_dir=args.download_dir, manual_dir=args.manual_dir)
    except UserError as err:
        console.exit_with(str(err))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    console.show_log("stdout")  # catalog.prepare's progress
    if argv[:1] == ["prepare"]:
        prepare_main(argv[1:])
        return
    args = _parse(argv)
    import tensorflow_datasets as tfds  # after the arguments are known to be good: importing it takes seconds

    tfds.disable_progress_bar()
    try:
        for name in args.names:
            show(name, args.data_dir, args.workdir, args.vocab_size, args.max_sentences, args.batch_size,
                 args.raw_dir, source_lang=args.source_lang, target_lang=args.target_lang, data_name=args.name,
                 own_cache=args.own_cache)
    except UserError as err:
        console.exit_with(str(err))


if __name__ == "__main__":
    main()
