"""Decoding settings: every knob of a search, in one frozen object built once at each surface's boundary.

``SamplingSettings`` holds what a user picks per call (eval.py's flags, the API's and export's arguments); the beam's
settings are the config's ``decode`` section. ``DecodeSettings.build`` puts the two together and the surfaces hand the
result down: ``lconv.infer`` writes no default of its own, so no default can differ between layers (tests/test_layout.py
checks it). The temperature's default, 0, is greedy decoding.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from lconv.errors import UserError
from lconv.fields import Rule, as_dict, defaults, field, integer, number

# Below it sampling is the greedy choice, and logits / temperature overflows float32 near 1e-36: a subnormal
# temperature sampled garbage. Above the maximum sampling is uniform to float32's precision, and near 1e38 the
# inverse temperature flushes to zero, so every output came back empty.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6
# A nucleus below the top token's probability keeps that token alone, as this does; below float32's smallest normal
# number the filter kept nothing and every output came back empty.
MIN_TOP_P = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """An LM's sampling settings, chosen per call (eval.py's flags, the API's and export's arguments)."""

    max_len: int = field(50, "new tokens per prompt", integer(1, " (new tokens per prompt)"))
    temperature: float = field(0.0, "sampling temperature; 0 = greedy", number(
        lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
        f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"))
    top_k: int = field(0, "sample from the k most likely tokens; 0 = all", integer(0, " (0 = no top-k filter)"))
    top_p: float = field(1.0, "nucleus sampling: the smallest set of tokens holding this much probability; 1 = off",
                         number(lambda v: MIN_TOP_P <= v <= 1, f"in [{MIN_TOP_P:g}, 1] (1 = no nucleus filter)"))
    seed: int = field(0, "the sampling seed (a uint32 on the device)", Rule(
        lambda v: integer().test(v) and 0 <= v < 2**32, "an integer in [0, 2**32)"))


SAMPLING_DEFAULTS = defaults(SamplingSettings)  # greedy, 50 tokens
BEAM_FIELDS = ("beam_size", "lenpen", "max_len_a", "max_len_b", "stop")  # from config.decode
# The generation guards' defaults (off): a decode section written before the guards existed reads as them.
GUARDS_OFF = {"no_repeat_ngram_size": 0, "min_len": 0}


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """One search's settings, complete (``build`` fills them); hashable, so compiled programs are keyed by it."""

    beam_size: int  # hypotheses per source or prompt: beams, or with temperature > 0 samples
    lenpen: float  # fairseq's length penalty: a hypothesis scores sum(log p) / length**lenpen
    max_len_a: float  # a translation's output length: max_len_a * source length + max_len_b (EOS added)
    max_len_b: int
    stop: str  # when a beam search ends: lconv.constants.STOP_RULES
    max_len: int  # an LM's new tokens per prompt
    temperature: float  # 0 = greedy / beam search
    top_k: int  # 0 = no top-k filter
    top_p: float  # 1 = no nucleus filter
    seed: int  # the sampling seed
    no_repeat_ngram_size: int  # no n-gram of this size twice in an output (prefix included); 0 = off
    min_len: int  # no EOS before this many output tokens (an LM's continuation); 0 = off

    @classmethod
    def build(cls, decode: Any, **chosen: Any) -> DecodeSettings:
        """``decode`` and ``SAMPLING_DEFAULTS`` with each ``chosen`` value that is not None in place (checked)."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            raise UserError(f"unknown decoding setting(s) {unknown}; known: {known}")
        decode = as_dict(decode)
        values = {name: decode[name] for name in BEAM_FIELDS}
        values.update({name: decode[name] if name in decode else off for name, off in GUARDS_OFF.items()})
        values.update(SAMPLING_DEFAULTS)
        values.update({name: value for name, value in chosen.items() if value is not None})
        as_type = {"int": int, "float": float, "str": str}  # each field's annotation: a plain value, hashable
        return cls(**{f.name: as_type[f.type](values[f.name]) for f in dataclasses.fields(cls)})

    @property
    def sampling(self) -> bool:
        """Whether the search samples (temperature > 0) rather than taking the argmax or beams."""
        return self.temperature > 0

    def program_key(self) -> DecodeSettings:
        """What a compiled program depends on (``lenpen`` and ``seed`` are its arguments)."""
        sampling = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p) if self.sampling else \
            dict(temperature=0.0, top_k=0, top_p=1.0)
        return dataclasses.replace(self, lenpen=0.0, seed=0, **sampling)

    def prompt_limit(self, positions: int, name: str = "max_len") -> int:
        """The most prompt tokens an LM of ``positions`` positions reads before ``max_len`` new ones (BOS + prompt +
        output); too few is a one-line error naming ``name``."""
        limit = int(positions) - 1 - self.max_len
        if limit < 0:
            raise UserError(f"{name}={self.max_len} new tokens do not fit the model's config.model.max_len="
                            f"{positions} positions (BOS included); ask for at most {int(positions) - 2} "
                            f"({int(positions) - 1} from blank prompts)")
        return limit
