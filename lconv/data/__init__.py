"""Data for lconv: the DDTP corpus and its bundled snapshot, tfds builders, paper datasets, tokenizer, pipeline.

Modules (import what you need; this package imports nothing heavy):
    ddtp        parse apt Translation files, align by Description-md5, build tasks; the bundled snapshot
    tfds_ddtp   tfds builders (array_record, TensorFlow-free) for DDTP and local parallel text (IWSLT14)
    sources     dataset name -> (random-access source, input key, target key), incl. the paper's tfds datasets
    catalog     preparing the paper's datasets with their tfds builders (``python -m lconv.data prepare NAME``)
    paths       data_dir / raw_dir / workdir as local paths or etils.epath URLs (gs://...)
    tokenizer   SentencePiece joint model saved in the workdir, with lconv.constants' special ids
    pipeline    grain input pipeline: packed train batches, padded eval batches; ``make_datasets``

``python -m lconv.data <task>`` prints counts, what preparing skipped, and an example batch for a task;
``python -m lconv.data prepare <name> --data_dir=DIR`` prepares a dataset there.
"""
from lconv.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID

__all__ = ["PAD_ID", "EOS_ID", "UNK_ID", "BOS_ID"]
