"""Every config field's type and range, checked before anything is read or written (``validate_config``).

One table per section; each rule is ``field: (type, test, the requirement as printed)``. A failed rule is one
``UserError`` line naming the field, its value and what is allowed. Fields a section does not know are errors
too (a typo in a config file would otherwise be silently ignored). The model's fields are checked by
``lconv.nn.models.ModelConfig`` (the same rules serve users who build a model without a config file).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lconv.data import pipeline
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError
from lconv.infer.search import STOP_RULES
from lconv.nn import models

Rule = tuple[type | tuple[type, ...], Callable[[Any], bool], str]

_ANY = lambda v: True  # noqa: E731
_POSITIVE = (int, lambda v: v >= 1, "an integer >= 1")
_NON_NEGATIVE = (int, lambda v: v >= 0, "an integer >= 0")
_LENGTH = (int, lambda v: v >= 2, "an integer >= 2 (EOS and at least one token)")
_PROBABILITY = (float, lambda v: 0 <= v < 1, "a number in [0, 1)")
_NON_NEGATIVE_FLOAT = (float, lambda v: v >= 0, "a number >= 0")
_BOOL = (bool, _ANY, "True or False")


def _choice(*allowed: str) -> Rule:
    return (str, lambda v: v in allowed, f"one of {', '.join(allowed)}")


TOP = {
    "task": _choice("translation", "summarization", "lm"),
    "seed": (int, _ANY, "an integer"),
}
DATA = {
    "dataset": (str, bool, "a dataset name, e.g. ddtp/en_de"),
    "data_dir": (str, bool, "a directory"),
    "raw_dir": ((str, type(None)), _ANY, "a directory or None"),
    "vocab_size": (int, lambda v: v >= tokenizer_lib.MIN_VOCAB_SIZE,
                   f"an integer >= {tokenizer_lib.MIN_VOCAB_SIZE} (the tokenizer's special and byte pieces)"),
    "batch_size": _POSITIVE, "eval_batch_size": _POSITIVE,
    "max_input_length": _LENGTH, "max_target_length": _LENGTH,
    "eval_max_input_length": _LENGTH, "eval_max_target_length": _LENGTH,
    "seed": (int, _ANY, "an integer"),
    "num_epochs": ((int, type(None)), lambda v: v is None or v >= 1, "None (repeat forever) or an integer >= 1"),
    "pack": _BOOL,
    "train_long": _choice("truncate", "drop"),
    "eval_splits": ((tuple, list), lambda v: len(v) > 0 and all(isinstance(s, str) for s in v),
                    "a non-empty list of split names"),
    "tokenizer_max_sentences": _POSITIVE,
    "read_threads": _POSITIVE,
    "stream": _BOOL,
}
OPTIM = {
    "optimizer": _choice("adam", "adamw", "nag"),
    "learning_rate": (float, lambda v: v > 0, "a number > 0"),
    "schedule": _choice("inverse_sqrt", "cosine", "constant"),
    "warmup_steps": _NON_NEGATIVE,
    "warmup_init_lr": _NON_NEGATIVE_FLOAT, "min_lr": _NON_NEGATIVE_FLOAT,
    "cosine_period": _NON_NEGATIVE,
    "b1": _PROBABILITY, "b2": _PROBABILITY, "momentum": _PROBABILITY,
    "eps": (float, lambda v: v > 0, "a number > 0"),
    "weight_decay": _NON_NEGATIVE_FLOAT,
    "clip_norm": (float, lambda v: v >= 0, "a number >= 0 (0 = off)"),
    "label_smoothing": _PROBABILITY,
    "grad_accum_steps": _POSITIVE,
}
TRAIN = {
    "num_steps": _POSITIVE,
    "max_minutes": (float, lambda v: v >= 0, "a number >= 0 (0 = no limit)"),
    "stop_check_every": _POSITIVE,
    "log_every": _POSITIVE, "eval_every": _POSITIVE, "checkpoint_every": _POSITIVE, "keep_checkpoints": _POSITIVE,
    "eval_after_training": _BOOL,
    "spike_factor": (float, lambda v: v == 0 or v > 1, "0 (off) or a number > 1"),
    "spike_windows": _POSITIVE,
    "checkpoint_checksums": _BOOL,
    "async_checkpoints": _BOOL,
}
DECODE = {
    "beam_size": _POSITIVE,
    "lenpen": (float, lambda v: v >= 0, "a number >= 0"),
    "max_len_a": _NON_NEGATIVE_FLOAT,
    "max_len_b": _NON_NEGATIVE,
    "split": (str, bool, "a split name"),
    "num_print": _NON_NEGATIVE,
    "stop": (str, lambda v: v in STOP_RULES, f"one of {', '.join(STOP_RULES)}"),
    "compound_split": _BOOL,
    "batch_size": (int, lambda v: v >= 0, "an integer >= 0 (0 = auto: the eval batch on CPU, wider on a GPU/TPU)"),
}
MESH = {
    "shape": ((tuple, list), lambda v: len(v) == 3 and all(isinstance(s, int) and (s >= 1 or s == -1) for s in v),
              "three sizes (data, fsdp, tensor), each >= 1 or one -1"),
    "axis_names": ((tuple, list), lambda v: tuple(v) == ("data", "fsdp", "tensor"), "('data', 'fsdp', 'tensor')"),
    "rules": ((tuple, list), lambda v: all(len(r) == 2 and isinstance(r[0], str) for r in v),
              "(logical axis, mesh axis or None) pairs"),
}
SECTIONS = {"data": DATA, "optim": OPTIM, "train": TRAIN, "decode": DECODE, "mesh": MESH}
OPTIONAL = {"data": set(pipeline.DEFAULTS),
            "train": {"spike_factor", "spike_windows", "checkpoint_checksums", "async_checkpoints",
                      "stop_check_every"},
            "decode": {"stop", "compound_split", "batch_size"}}


def _check(name: str, value: Any, rule: Rule) -> None:
    types, test, requirement = rule
    types = types if isinstance(types, tuple) else (types,)
    if float in types:
        types += (int,)  # an integer where a number is asked for is fine
    type_ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    finite = not isinstance(value, float) or math.isfinite(value)
    if not (type_ok and finite and test(value)):
        raise UserError(f"config.{name}={value!r}: must be {requirement}")


def _check_section(prefix: str, values: dict[str, Any], rules: dict[str, Rule], optional: set[str]) -> None:
    unknown = sorted(set(values) - set(rules))
    if unknown:
        raise UserError(f"config.{prefix} has unknown field(s) {unknown}; known: {sorted(rules)}")
    missing = sorted(set(rules) - set(values) - optional)
    if missing:
        raise UserError(f"config.{prefix} lacks field(s) {missing}; start from configs/common.py's base_config()")
    for name, value in values.items():
        _check(f"{prefix}.{name}", value, rules[name])


def validate_config(config: Any) -> None:
    """Fails fast, before any data is read or file written, with one line naming the bad field."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    sections = set(SECTIONS) | {"model"}
    unknown = sorted(set(values) - sections - set(TOP))
    if unknown:
        raise UserError(f"config has unknown field(s) {unknown}; known: {sorted(sections | set(TOP))}")
    for name, rule in TOP.items():
        if name not in values:
            raise UserError(f"config lacks field {name!r}; start from configs/common.py's base_config()")
        _check(name, values[name], rule)
    for section, rules in SECTIONS.items():
        _check_section(section, dict(values.get(section, {})), rules, OPTIONAL.get(section, set()))
    data = values["data"]
    if data.get("stream", False) and values["task"] != "lm":
        raise UserError(f"config.data.stream=True feeds document streams to a language model; it needs task=lm, "
                        f"not {values['task']!r}")
    model_cfg = models.ModelConfig.from_config(config.model, vocab_size=int(data["vocab_size"]))
    model_cfg.validate(decoder_only=values["task"] == "lm")
