"""The config schema: every field of a config, each defined once with its default, rule and one-line doc. Sections are
dataclasses at the lowest layer that uses them (``DataConfig``, ``ModelConfig``; the rest here); defaults, checks and
docs/config.md's tables (``python -m lconv.run.schema > docs/config.md``) are read from them."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from lconv.constants import STOP_RULES
from lconv.data.data_config import DataConfig
from lconv.decode_settings import (  # noqa: F401 (the schema's too)
    GUARDS_OFF,
    SAMPLING_DEFAULTS,
    DecodeSettings,
    SamplingSettings,
)
from lconv.errors import UserError
from lconv.fields import (
    BOOL,
    MAX_ROWS,
    MAX_TOKENS,
    RATE,
    SIZE_REASON,
    Rule,
    as_dict,
    check,
    check_values,
    choice,
    default_of,
    field,
    integer,
    is_split_name,
    markdown_table,
    number,
    one_line,
    schema_fields,
)
from lconv.infer.infer_config import InferConfig
from lconv.nn.model_config import ModelConfig

_POSITIVE = integer(1)
_NON_NEGATIVE = integer(0)
_NON_NEGATIVE_NUMBER = number(lambda v: v >= 0, "a number >= 0")
# length**lenpen is float32 on the device: past this a long output's penalty overflows and the ranking is lost.
MAX_LENPEN = 10
_LENPEN = number(lambda v: 0 <= v <= MAX_LENPEN, f"a number in [0, {MAX_LENPEN}] (0 = no length normalisation, 1 = "
                                                  "divide by the length)")
MAX_NGRAM = 64  # decode.no_repeat_ngram_size: fairseq's summarizers use 3; the guard unrolls n - 1 comparisons


@dataclasses.dataclass(frozen=True)
class TopConfig:
    """The config's own fields, beside its sections."""

    task: str = field("translation", "what the run learns; lm is a decoder-only language model",
                      choice("translation", "summarization", "lm"))
    seed: int = field(0, "params init, dropout (folded with the step) and data shuffling", integer())


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimiser and its learning-rate schedule (``lconv.train.setup``)."""

    optimizer: str = field("adam", "adam | adamw | nag", choice("adam", "adamw", "nag"))
    learning_rate: float = field(5e-4, "peak learning rate", number(lambda v: v > 0, "a number > 0"))
    schedule: str = field("inverse_sqrt", "inverse_sqrt | cosine | constant (all with linear warmup) | budget (in "
                          "time: warmup over warmup_fraction of the training time, the peak, then a linear decay to 0 "
                          "over its last decay_fraction, ending where train.max_minutes stops training; "
                          "docs/training.md)", choice("inverse_sqrt", "cosine", "constant", "budget"))
    warmup_fraction: float = field(0.05, "schedule=budget: the share of the training time spent warming up",
                                   number(lambda v: 0 <= v < 1, "a number in [0, 1)"))
    decay_fraction: float = field(0.2, "schedule=budget: the final share of the training time over which the rate "
                                  "falls to 0", number(lambda v: 0 < v <= 1, "a number in (0, 1]"))
    cooldown_fraction: float = field(0.0, "the rate times a linear fall to 0 over this last share of training "
                                     "(of train.num_steps, or of the training time train.max_minutes leaves, "
                                     "whichever ends it first); 0 = none; schedule=budget has decay_fraction "
                                     "instead",
                                     number(lambda v: 0 <= v <= 1, "a number in [0, 1]"))
    warmup_steps: int = field(4000, "linear warmup updates", _NON_NEGATIVE)
    warmup_init_lr: float = field(1e-7, "the learning rate warmup starts from (fairseq's warmup-init-lr)",
                                  _NON_NEGATIVE_NUMBER)
    min_lr: float = field(1e-9, "cosine floor", _NON_NEGATIVE_NUMBER)
    cosine_period: int = field(0, "cosine updates after warmup (fairseq's --lr-period-updates); 0 = the rest of "
                               "the run", _NON_NEGATIVE)
    b1: float = field(0.9, "Adam's beta1", RATE)
    b2: float = field(0.98, "Adam's beta2", RATE)
    eps: float = field(1e-8, "Adam's epsilon", number(lambda v: v > 0, "a number > 0"))
    adam_eps_form: str = field("after_correction", "where Adam adds eps: to the bias-corrected sqrt(v) "
                               "(after_correction: optax, PyTorch) | to the uncorrected sqrt(v), the correction "
                               "folded into the step size (before_correction: fairseq's Adam; docs/fairseq.md)",
                               choice("after_correction", "before_correction"))
    momentum: float = field(0.99, "nag's momentum", RATE)
    weight_decay: float = field(0.0, "decoupled weight decay (adamw)", _NON_NEGATIVE_NUMBER)
    clip_norm: float = field(0.0, "global gradient-norm clipping; 0 = off",
                             number(lambda v: v >= 0, "a number >= 0 (0 = off)"))
    clip_form: str = field("max_norm", "the clip's factor: clip_norm / max(norm, clip_norm) (max_norm: optax) | "
                           "min(1, clip_norm / (norm + 1e-6)), applied to every update (norm_plus_eps: fairseq)",
                           choice("max_norm", "norm_plus_eps"))
    label_smoothing: float = field(0.1, "label smoothing of the cross-entropy loss", RATE)
    label_smoothing_split: str = field("all", "how label_smoothing is spread: eps / V on every id, the target's "
                                       "included (all) | the target keeps 1 - eps and each other id gets "
                                       "eps / (V - 1) (others: fairseq's label_smoothed_cross_entropy)",
                                       choice("all", "others"))
    grad_accum_steps: int = field(1, "micro-batches per update (fairseq's update-freq)", _POSITIVE)
    fused_loss: bool = field(True, "the output layer and the loss make the logits a chunk of tokens at a time, "
                             "forward and backward, never the whole [tokens, vocab] array (docs/training.md); False "
                             "= a log-softmax over the materialised logits", BOOL)


MAX_MINUTES = 365 * 24 * 60  # a year: more is a typo, and a huge budget overflows the deadline's seconds


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop (``lconv.train.loop``)."""

    num_steps: int = field(50_000, "optimizer updates", _POSITIVE)
    max_minutes: float = field(0.0, "the whole run's wall-time budget: training stops (and checkpoints) early enough "
                               "for the final validation and test (1.5 x their time on their first batches) to end "
                               "within it "
                               "(docs/training.md); 0 = no limit",
                               number(lambda v: 0 <= v <= MAX_MINUTES,
                                      f"a number in [0, {MAX_MINUTES:,}] (0 = no limit; {SIZE_REASON})"))
    stop_check_every: int = field(10, "several processes agree on a stop (signal, max_minutes) every N steps",
                                  _POSITIVE)
    log_every: int = field(100, "steps per log line (and per divergence-guard window)", _POSITIVE)
    eval_every: int = field(2000, "steps per validation loss / ppl", _POSITIVE)
    checkpoint_every: int = field(2000, "steps per checkpoint", _POSITIVE)
    keep_checkpoints: int = field(5, "latest checkpoints kept", _POSITIVE)
    eval_after_training: bool = field(True, "decode the test split and report BLEU/ROUGE at the end", BOOL)
    spike_factor: float = field(3.0, "divergence guard: a log window whose mean loss is above spike_factor x the "
                                "median of the windows before it is a spike (no checkpoint during one); 0 = off",
                                number(lambda v: v == 0 or v > 1, "0 (off) or a number > 1"))
    spike_windows: int = field(3, "spike windows in a row that stop the run", _POSITIVE)
    init_from: str = field("", "a run (its workdir: a path or URL) whose params a new run starts from, with a new "
                           "optimizer at step 0 (fine-tuning); its task, model and tokenizer are this run's; '' = "
                           "random init", Rule(lambda v: isinstance(v, str), "a workdir path or URL, or '' (none)"))
    init_checkpoint: str = field("latest", "init_from's latest checkpoint, or its best by validation loss",
                                 choice("latest", "best"))
    best_metric: str = field("loss", "what picks <workdir>/best and early stopping: validation loss, or the BLEU "
                             "(translation) / ROUGE-L (summarization) of the validation split decoded at each "
                             "validation pass (lconv/train/eval_control.py)", choice("loss", "bleu", "rougeL"))
    validation_beam_size: int = field(1, "best_metric bleu/rougeL: the validation decode's beam (1 = greedy, the "
                                      "fastest)", _POSITIVE)
    validation_lenpen: float = field(1.0, "best_metric bleu/rougeL: the validation decode's length penalty",
                                     _LENPEN)
    patience: int = field(0, "stop training after this many validation passes in a row without a better "
                          "best_metric (counted across resumes, from metrics.jsonl); 0 = never", _NON_NEGATIVE)
    checkpoint_checksums: bool = field(True, "a SHA-256 manifest per checkpoint, verified on restore", BOOL)
    async_checkpoints: bool = field(True, "checkpoint files are written while training goes on (orbax async)", BOOL)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Decoding and scoring a split (``lconv.infer``), at the end of training and by eval.py."""

    beam_size: int = field(5, "beam width (1 = greedy)", Rule(
        _POSITIVE.test, ">= 1 (1 = greedy), an integer, at most the vocabulary's size - 1 (fairseq's cap: a beam "
        "holds distinct continuations)"))
    batch_size: int = field(0, "sources per decoding batch; 0 = auto: data.eval_batch_size on CPU, wider on a "
                            "GPU/TPU", integer(0, " (0 = auto: the eval batch on CPU, wider on a GPU/TPU)",
                                               maximum=MAX_ROWS, reason=SIZE_REASON))
    lenpen: float = field(1.0, "fairseq length penalty: score / length**lenpen", _LENPEN)
    max_len_a: float = field(1.2, "max output length = a * source length + b", number(
        lambda v: 0 <= v <= 1000, f"a number in [0, 1000] ({SIZE_REASON})"))
    max_len_b: int = field(10, "max output length = a * source length + b",
                           integer(0, maximum=MAX_TOKENS, reason=SIZE_REASON))
    split: str = field("test", "the split decoded and scored", Rule(is_split_name, "a split name (no folder in it)"))
    num_print: int = field(5, "sample translations printed at the end", _NON_NEGATIVE)
    stop: str = field("optimal", 'beam search ends when no alive hypothesis can win | "fairseq" (its generator\'s '
                      "rule)", choice(*STOP_RULES))
    compound_split: bool = field(False, "tokenized BLEU splits hyphenated compounds (the paper's WMT En-De BLEU)",
                                 BOOL)
    no_repeat_ngram_size: int = field(
        GUARDS_OFF["no_repeat_ngram_size"], "no n-gram of this size twice in an output, its prefix or prompt "
        "included (fairseq's --no-repeat-ngram-size); 0 = off",
        integer(0, maximum=MAX_NGRAM, reason="the guard compares n - 1 tokens per step; 0 = off"))
    min_len: int = field(
        GUARDS_OFF["min_len"], "no EOS before this many output tokens (fairseq's --min-len; an LM counts its "
        "continuation only); 0 = off", integer(0, maximum=MAX_TOKENS, reason=SIZE_REASON))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sharding: the device mesh and where each logical axis goes on it."""

    shape: tuple = field((-1, 1, 1), "(data, fsdp, tensor); -1 = all remaining devices", Rule(
        lambda v: isinstance(v, (tuple, list)) and len(v) == 3 and all(integer().test(s) and (s >= 1 or s == -1)
                                                                        for s in v),
        "three sizes (data, fsdp, tensor), each >= 1 or one -1"))
    axis_names: tuple = field(("data", "fsdp", "tensor"), "the mesh axes' names", Rule(
        lambda v: isinstance(v, (tuple, list)) and tuple(v) == ("data", "fsdp", "tensor"),
        "('data', 'fsdp', 'tensor')"))
    rules: tuple = field(
        (("embed", "fsdp"), ("vocab", "tensor"), ("mlp", "tensor"), ("conv", "tensor"), ("heads", "tensor"),
         ("kernel", None), ("length", None), ("key_length", "fsdp")),  # key_length: Fixed / Hadamard's [T, T]
        "logical axis -> mesh axis (None = replicated); activations follow lconv.constants.DEFAULT_AXIS_RULES "
        "unless named here",
        Rule(lambda v: isinstance(v, (tuple, list)) and all(isinstance(r, (tuple, list)) and len(r) == 2
                                                            and isinstance(r[0], str) for r in v),
             "(logical axis, mesh axis or None) pairs; a mesh axis is one of config.mesh.axis_names, or a list "
             "of them"))


SECTIONS = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig,
            "decode": DecodeConfig, "mesh": MeshConfig}


def _fill(target: Any, section: type) -> None:
    """Sets each field ``target`` lacks to its default (a None default as a typed placeholder flags can set)."""
    for f in schema_fields(section):
        if f.name not in target:
            value, kind = default_of(f), f.metadata["placeholder"]
            if value is None and kind is not None and isinstance(target, ml_collections.ConfigDict):
                value = ml_collections.config_dict.placeholder(kind)
            target[f.name] = value


def complete(config: Any) -> Any:
    """Fills, in place, every field ``config`` (a ConfigDict or a dict) lacks with its default; returns it."""
    unlocked = config.unlocked() if isinstance(config, ml_collections.ConfigDict) else contextlib.nullcontext()
    with unlocked:
        _fill(config, TopConfig)
        for name, section in SECTIONS.items():
            if name not in config:
                config[name] = ml_collections.ConfigDict() if isinstance(config, ml_collections.ConfigDict) else {}
            _fill(config[name], section)
    return config


def base_config() -> ml_collections.ConfigDict:
    """Every field at its default."""
    return complete(ml_collections.ConfigDict())


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A checked config, each section a typed, frozen dataclass: what code below the edges reads."""

    task: str
    seed: int
    data: DataConfig
    model: ModelConfig  # validated for the task's model kind (``ModelConfig.ensure_valid`` then costs nothing)
    optim: OptimConfig
    train: TrainConfig
    decode: DecodeConfig
    mesh: MeshConfig

    @property
    def search(self) -> DecodeSettings:
        """The config's search: its decode section, the sampling settings at their defaults."""
        return DecodeSettings.build(self.decode)

    @property
    def infer(self) -> InferConfig:
        """What ``lconv.infer`` reads: the mesh rules, decoding's rows and the length limits."""
        return InferConfig(task=self.task, mesh_rules=tuple(map(tuple, self.mesh.rules)),
                           batch_size=self.decode.batch_size, eval_batch_size=self.data.eval_batch_size,
                           max_input_length=self.data.eval_max_input_length,
                           max_target_length=self.data.eval_max_target_length, max_positions=self.model.max_len,
                           split=self.decode.split, compound_split=self.decode.compound_split,
                           num_print=self.decode.num_print)

    def replace(self, **sections: Mapping[str, Any]) -> RunConfig:
        """A copy with fields of some sections changed, checked again: ``replace(data={"eval_batch_size": 8})``."""
        values = self.as_config()
        for name, changes in sections.items():
            values[name].update(changes)
        return validate_config(values)

    def as_config(self) -> dict[str, Any]:
        """The plain nested dict of a config file's fields (what ``validate_config`` reads back)."""
        return {"task": self.task, "seed": self.seed,
                **{name: _config_fields(getattr(self, name)) for name in SECTIONS}}


def _config_fields(section: Any) -> dict[str, Any]:
    """A section as a config spells it: the fields a config names, each through its ``to_config``."""
    values = {}
    for f in schema_fields(type(section)):
        to_config = f.metadata.get("to_config")
        values[f.name] = to_config(getattr(section, f.name)) if to_config else getattr(section, f.name)
    return values


def validate_config(config: Any) -> RunConfig:
    """Fills the missing fields with defaults (in place), checks every field; returns the typed ``RunConfig``."""
    complete(config)
    values = as_dict(config)
    top = {f.name for f in schema_fields(TopConfig)}
    unknown = sorted(set(values) - set(SECTIONS) - top)
    if unknown:
        raise UserError(f"config has unknown field(s) {unknown}; known: {sorted(set(SECTIONS) | top)}")
    check_values(TopConfig, {name: values[name] for name in top}, "config")
    data = DataConfig.from_config(values["data"])  # checks the section's fields as it parses them
    for name, section in SECTIONS.items():
        if section not in (ModelConfig, DataConfig):  # the model's fields are checked by ModelConfig, below
            check_values(section, values[name], f"config.{name}")
    _check_splits(values)
    _check_mesh_rules(values["mesh"])
    _check_own_files(values)
    _check_best_metric(values)
    if values["data"]["stream"] and values["task"] != "lm":
        raise UserError(f"config.data.stream=True feeds document streams to a language model; it needs task=lm, "
                        f"not {values['task']!r}")
    check_search(beam_size=values["decode"]["beam_size"], vocab_size=values["data"]["vocab_size"])
    lm = values["task"] == "lm"
    model_cfg = ModelConfig.from_config(values["model"], vocab_size=int(values["data"]["vocab_size"]), decoder_only=lm)
    model_cfg.check_kernel_counts(decoder_only=lm)
    _check_eval_lengths(values)  # after the model's fields are checked: max_len is a positive int
    if values["optim"]["warmup_fraction"] + values["optim"]["decay_fraction"] > 1:
        raise UserError(f"config.optim.warmup_fraction={values['optim']['warmup_fraction']} and decay_fraction="
                        f"{values['optim']['decay_fraction']} share the training time: they must add up to at most 1")
    if values["optim"]["schedule"] == "budget" and not values["train"]["max_minutes"]:
        raise UserError("config.optim.schedule='budget' decays the learning rate to 0 where train.max_minutes stops "
                        "training; set train.max_minutes, or choose another schedule")
    if model_cfg.output_vocab_size and values["optim"]["label_smoothing"]:
        raise UserError(f"config.optim.label_smoothing={values['optim']['label_smoothing']}: must be 0 with "
                        f"config.model.output_vocab_size={model_cfg.output_vocab_size} (smoothing would spread "
                        "probability onto the ids the decoder cannot predict)")
    return RunConfig(values["task"], int(values["seed"]), data, model_cfg, OptimConfig(**values["optim"]),
                     TrainConfig(**values["train"]), DecodeConfig(**values["decode"]), MeshConfig(**values["mesh"]))


def _check_mesh_rules(mesh: Mapping[str, Any]) -> None:
    """Each rule shards onto the mesh's own axes: an unknown one was a jax traceback at the first compile."""
    names = tuple(mesh["axis_names"])
    for rule in mesh["rules"]:
        target = rule[1]
        axes = [target] if target is None or isinstance(target, str) else target
        if not isinstance(axes, (tuple, list)) or not all(axis is None or axis in names for axis in axes):
            raise UserError(f"config.mesh.rules has {one_line(tuple(rule))}: its mesh axis must be one of "
                            f"config.mesh.axis_names {names}, a list of them, or None")


def _check_best_metric(values: Mapping[str, Any]) -> None:
    """BLEU picks a translation run's best checkpoint, ROUGE-L a summarizer's; the loss any run's."""
    train, task = values["train"], values["task"]
    allowed = {"translation": ("loss", "bleu"), "summarization": ("loss", "rougeL")}.get(task, ("loss",))
    if train["best_metric"] not in allowed:
        raise UserError(f"config.train.best_metric={train['best_metric']!r}: a {task} run is scored by "
                        f"{' or '.join(allowed)}")
    check_search(beam_size=train["validation_beam_size"], lenpen=train["validation_lenpen"],
                 spell=lambda name: f"config.train.validation_{name}", vocab_size=values["data"]["vocab_size"])


def _check_own_files(values: Mapping[str, Any]) -> None:
    """Your own files' language codes must agree with the task (pairs for translation, texts for an LM)."""
    data, task = values["data"], values["task"]
    if data["dataset"] != "files":
        return
    if task == "lm" and data["source_lang"] is not None:
        raise UserError(f"config.data.source_lang={data['source_lang']!r}: a language model (task=lm) reads texts "
                        "alone; leave source_lang unset")
    if task != "lm" and (data["source_lang"] is None or data["target_lang"] is None):
        raise UserError(f"config.task={task!r} reads pairs of your files: set config.data.source_lang and "
                        "config.data.target_lang (xx and yy for train.xx + train.yy)")


EVAL_LIMITS = ("eval_max_input_length", "eval_max_target_length")  # a seq2seq run's, at most its positions


def _check_eval_lengths(values: Mapping[str, Any]) -> None:
    """A source or an output past the model's positions (``model.max_len``, as fairseq's max positions) would be
    decoded past what any sinusoid or table was built for, one long line for minutes: a seq2seq run's evaluation
    limits stay within them (an LM scores longer texts in windows of its positions)."""
    if values["task"] == "lm":
        return
    positions = values["model"]["max_len"]
    for name in EVAL_LIMITS:
        if values["data"][name] > positions:
            raise UserError(f"config.data.{name}={values['data'][name]}: at most config.model.max_len={positions}, "
                            "the model's positions; raise model.max_len or lower the limit")


def _check_splits(values: Mapping[str, Any]) -> None:
    """Training validates on ``validation`` and may score ``decode.split``: both must be among ``data.eval_splits``."""
    splits = tuple(values["data"]["eval_splits"])
    if "validation" not in splits:
        raise UserError(f"config.data.eval_splits={splits}: must include 'validation' (training reports its loss "
                        "and keeps the best checkpoint by it)")
    if values["train"]["eval_after_training"] and values["decode"]["split"] not in splits:
        raise UserError(f"config.decode.split={values['decode']['split']!r}: must be one of config.data.eval_splits="
                        f"{splits} (the split scored after training), or set train.eval_after_training=False")


def check_search(*, beam_size: int | None = None, lenpen: float | None = None,
                 spell: Callable[[str], str] = lambda name: f"config.decode.{name}",
                 vocab_size: int | None = None, no_repeat_ngram_size: int | None = None,
                 min_len: int | None = None) -> None:
    """The decode section's rules for the beam search's settings (None = not given), for every surface; with
    ``vocab_size`` the beam is at most ``vocab_size - 1``, as fairseq caps it."""
    check_decode({"beam_size": beam_size, "lenpen": lenpen, "no_repeat_ngram_size": no_repeat_ngram_size,
                  "min_len": min_len}, spell)
    if vocab_size is not None and beam_size is not None and beam_size > vocab_size - 1:
        raise UserError(f"{spell('beam_size')}={beam_size}: must be at most the vocabulary's size - 1 "
                        f"({vocab_size - 1}; fairseq's cap: a wider beam holds no more distinct continuations)")


def check_decode(values: Mapping[str, Any], spell: Callable[[str], str] = lambda name: f"config.decode.{name}",
                 section: type = DecodeConfig) -> None:
    """Each given field of ``values`` by its rule in ``section`` (``config.decode``'s), named as ``spell`` says."""
    rules = {f.name: f.metadata["rule"] for f in schema_fields(section)}
    for name, value in values.items():
        if value is not None:
            check(spell(name), value, rules[name])


def hypotheses_per_source(*, nbest: int | None, beam_size: int | None, temperature: float, stored_beam_size: int,
                          spell: Callable[[str], str] = str, vocab_size: int | None = None) -> int:
    """The beams (or samples) a translation search keeps per source, ``nbest`` checked against it; ``beam_size`` None is
    the run's ``stored_beam_size``."""
    if nbest is not None and not (integer().test(nbest) and nbest >= 1):
        raise UserError(f"{spell('nbest')}={nbest!r}: must be an integer >= 1 (hypotheses per source)")
    if temperature:
        if beam_size is not None:
            raise UserError(f"{spell('beam_size')}={beam_size}: not used when sampling ({spell('temperature')}="
                            f"{temperature}); {spell('nbest')} sets the number of samples per source")
        if vocab_size is not None and nbest is not None and nbest > vocab_size - 1:
            raise UserError(f"{spell('nbest')}={nbest}: at most {vocab_size - 1} samples per source (the vocabulary's "
                            "size - 1, the beam's bound: samples are held as a beam's hypotheses are)")
        return nbest or 1
    beams = stored_beam_size if beam_size is None else beam_size
    if nbest is not None and nbest > beams:
        if vocab_size is not None and nbest > vocab_size - 1:  # no beam can be that wide: advise what can be passed
            raise UserError(f"{spell('nbest')}={nbest}: at most {vocab_size - 1} hypotheses per source (the widest "
                            "beam: the vocabulary's size - 1)")
        raise UserError(f"{spell('nbest')}={nbest}: must be at most the beam size ({beams}); pass "
                        f"{spell('beam_size')}={nbest} or more")
    return beams


def check_sampling(values: Mapping[str, Any], spell: Callable[[str], str] = str, *,
                   vocab_size: int | None = None, idle: bool = True) -> None:
    """Each given sampling setting of ``values`` by its rule; a filter or seed without a temperature is refused."""
    known = {f.name for f in schema_fields(SamplingSettings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"unknown sampling setting(s) {unknown}; known: {sorted(known)}")
    check_decode(values, spell, SamplingSettings)
    top_k = values.get("top_k")
    if vocab_size is not None and top_k is not None and top_k > vocab_size:
        raise UserError(f"{spell('top_k')}={top_k}: must be at most the model's vocabulary of {vocab_size} tokens "
                        "(0 = no top-k filter)")
    if idle and not values.get("temperature"):  # greedy (0 or not given): a filter or a seed would be ignored
        idle = [f"{spell(name)}={values[name]}" for name, off in (("top_k", 0), ("top_p", 1.0), ("seed", 0))
                if values.get(name) is not None and values[name] != off]
        if idle:
            raise UserError(f"{', '.join(idle)}: {'a sampling setting' if len(idle) == 1 else 'sampling settings'}"
                            f" for {spell('temperature')} > 0; at {spell('temperature')}=0 (greedy, or beam search) it "
                            "would be ignored")


_DOCS_HEADER = """# Config fields

Every field of a config, with its default, what it allows and what it does. Generated from the schema
(`lconv/run/schema.py`, `lconv/data/data_config.py`, `lconv/nn/model_config.py`) by
`python -m lconv.run.schema > docs/config.md`; a test keeps this file equal to it. Family configs
(`configs/*.py`) override values; any field can be set from the command line, e.g.
`python train.py --config=configs/default.py --config.model.dropout=0.2`. A config that lacks a field gets its
default, so a `config.json` written by an older lconv still loads.

A config is checked once, where it comes in (train.py's flags, a stored `config.json`, `lconv.load`'s arguments),
into a typed, frozen `RunConfig` (`lconv.run.schema.validate_config`); the code below reads that, or the section
it needs, and an override is `RunConfig.replace(data={...})`, checked by the same rules."""


def markdown() -> str:
    """docs/config.md: one table per section."""
    parts = [_DOCS_HEADER, "## Top level\n\n" + markdown_table(TopConfig, "config")]
    for name, section in SECTIONS.items():
        about = (section.__doc__ or "").strip().splitlines()[0]
        parts.append(f"## {name}\n\n{about}\n\n" + markdown_table(section, f"config.{name}"))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
