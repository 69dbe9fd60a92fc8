"""Data for lconv: the DDTP corpus and its bundled snapshot, tfds builders, paper datasets, tokenizer, pipeline.

Import the module you need (this package imports nothing heavy); ``python -m lconv.data`` inspects or prepares a
dataset. The modules: docs/data.md.
"""
from lconv.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID

__all__ = ["PAD_ID", "EOS_ID", "UNK_ID", "BOS_ID"]
