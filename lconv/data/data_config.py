"""``DataConfig``: the fields of a config's ``data`` section, each with its default, rule and doc (``lconv.fields``).
The input pipeline reads its settings through it, so a dict naming only some fields gets the same defaults as a
config built from ``configs/common.py``."""
from __future__ import annotations

import dataclasses
from typing import Any

from lconv.data import own_files
from lconv.data import tokenizer as tokenizer_lib
from lconv.fields import (
    BOOL,
    MAX_ROWS,
    MAX_TOKENS,
    MAX_VOCAB,
    SIZE_REASON,
    Rule,
    as_dict,
    check_values,
    choice,
    field,
    integer,
    is_split_name,
)

_LENGTH = integer(2, " (EOS and at least one token)", maximum=MAX_TOKENS, reason=SIZE_REASON)
_ROWS = integer(1, maximum=MAX_ROWS, reason=SIZE_REASON)
_CODE = Rule(own_files.check_code, "None or a code of letters, digits, _ and - (not tsv or jsonl), e.g. de or src")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The dataset, its tokenizer and the input pipeline's batches (``lconv.data.pipeline``)."""

    dataset: str = field("ddtp/en_de", "tfds name[/config]; ddtp/* is built from the corpus bundled with lconv; "
                         "files = your own files in raw_dir (README, Train on your own data)",
                         Rule(lambda v: isinstance(v, str) and bool(v), "a dataset name, e.g. ddtp/en_de"))
    data_dir: str = field("~/tensorflow_datasets", "where tfds datasets are (or, for ddtp, get) prepared",
                          Rule(lambda v: isinstance(v, str) and bool(v), "a directory"))
    raw_dir: str | None = field(None, "files: the folder of your files (lconv/data/own_files.py); iwslt14: its text "
                                "files; ddtp: raw apt Translation-* files (None = the bundled snapshot)",
                                Rule(lambda v: v is None or isinstance(v, str), "a directory or None"),
                                placeholder=str)
    source_lang: str | None = field(None, "files: the inputs' code: train.<code> beside train.<target_lang>, the "
                                    "JSON-lines key; None = a language model (train.txt)", _CODE, placeholder=str)
    target_lang: str | None = field(None, "files: the targets' code (file suffix, JSON-lines key); None = txt files "
                                    "and the key text (a language model)", _CODE, placeholder=str)
    name: str | None = field(None, "files: what logs and the data report call your data (None = raw_dir's folder "
                             "name)", Rule(lambda v: v is None or (isinstance(v, str) and bool(v.strip())),
                                           "a name or None"), placeholder=str)
    # An imported vocabulary (a fairseq dictionary) can be smaller than any lconv trains: the rule is the 4 special
    # ids and a piece; training a tokenizer checks its own minimum (tokenizer.MIN_VOCAB_SIZE) when it trains.
    vocab_size: int = field(8000, "joint SentencePiece vocabulary, trained from the training split",
                            integer(5, f" (4 special ids and a piece; a tokenizer lconv trains needs >= "
                                       f"{tokenizer_lib.MIN_VOCAB_SIZE}: its special and byte pieces)",
                                    maximum=MAX_VOCAB, reason=SIZE_REASON))
    max_input_length: int = field(128, "longer training examples are truncated (and counted)", _LENGTH)
    max_target_length: int = field(128, "longer training targets are truncated (and counted)", _LENGTH)
    eval_max_input_length: int = field(256, "evaluation examples are truncated only past this (counted)", _LENGTH)
    eval_max_target_length: int = field(256, "evaluation targets are truncated only past this (counted)", _LENGTH)
    pack: bool = field(True, "pack several examples per row (segment ids keep them apart)", BOOL)
    batch_size: int = field(32, "rows per global batch (all hosts); tokens per batch ~ batch_size * max_len", _ROWS)
    eval_batch_size: int = field(64, "rows per global evaluation batch", _ROWS)
    seed: int = field(0, "shuffling", integer())
    num_epochs: int | None = field(None, "passes over the training split (None = repeat forever)",
                                   Rule(lambda v: v is None or integer(1).test(v),
                                        "None (repeat forever) or an integer >= 1"), placeholder=int)
    train_long: str = field("truncate", "over-long training examples are truncated or dropped (both counted)",
                            choice("truncate", "drop"))
    eval_splits: tuple[str, ...] = field(
        ("validation", "test"), "the splits prepared for evaluation (validation loss in training; decode.split "
        "at the end)",
        Rule(lambda v: isinstance(v, (tuple, list)) and len(v) > 0 and all(is_split_name(s) for s in v),
             "a non-empty list of split names (no folder in one)"))
    max_validation_examples: int = field(
        0, "evaluate only the validation split's first N examples (its loss in training, the best checkpoint); "
        "0 = all", integer(0, " (0 = the whole split)"))
    max_test_examples: int = field(
        0, "evaluate only the first N examples of each other eval split (decode.split at the end, eval.py "
        "--split); 0 = all", integer(0, " (0 = the whole split)"))
    tokenizer_max_sentences: int = field(200_000, "training-split sentences the tokenizer is trained on",
                                         integer(1))
    read_threads: int = field(2, "threads reading and tokenising training examples (grain)",
                              integer(1, maximum=1024, reason="one thread per core is plenty"))
    stream: bool = field(False, "lm only: every row reads whole documents, max_target_length tokens per step "
                         "(lconv.data.stream); a stateful mixer's state (the kNN memory) is carried from window to "
                         "window (reset at each new document)", BOOL)

    @classmethod
    def from_config(cls, config: Any) -> DataConfig:
        """From a config's ``data`` section (missing fields at their defaults); a bad field is a one-line error."""
        if isinstance(config, cls):
            return config
        values = as_dict(config)
        check_values(cls, values, "config.data")
        return cls(**values)
