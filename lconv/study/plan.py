"""The study's runs: one training config per (task, mixer, seed), with parameter counts matched across mixers.

A task's config is its family config with the mixer's variant word applied (``lconv.configs.common.set_mixer``), then
the mode's and the per-mixer overrides. CoLT5 (encoder-only) gets an attention decoder and no LM run; every LM run reads
document streams. Parameters are matched to the reference mixer's by the FFN width alone (the count is affine in
``model.ffn_dim``: ``match_ffn``).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from lconv.configs import common
from lconv.errors import UserError
from lconv.nn import mixers, models
from lconv.run import model_setup

Config = ml_collections.ConfigDict

TASKS = ("translation", "lm", "summarization")


def mixer_name(word: str) -> str:
    """The registered mixer (or ``package.module:Class``) a study's mixer word picks (``common.mixer_variants``)."""
    return common.mixer_variants().get(word, word)


def label(word: str) -> str:
    """A mixer word's name in tables and plots: its class's ``label``."""
    return mixers.info(mixer_name(word)).label


def known_words() -> list[str]:
    """Every registered mixer's variant word, in registry order (a stable colour per mixer in the plots)."""
    return mixers.variant_words()
KNN_FIELDS = {"memory_size": 512, "num_neighbors": 32}  # configs/lm1b.py's ddtp values


@dataclasses.dataclass(frozen=True)
class RunKey:
    task: str
    mixer: str  # a variant word of lconv.configs.common.mixer_variants(), or package.module:Class
    seed: int

    @property
    def name(self) -> str:
        return f"{self.task}/{self.mixer}/seed{self.seed}"


@dataclasses.dataclass
class Planned:
    """One run of the study: its training config, or why it has none (the mixer does not fit, or ``error``)."""

    key: RunKey
    config: Config | None = None
    params: int | None = None
    reference_params: int | None = None
    note: str = ""  # what the mixer means in this task, shown in the report
    not_applicable: str | None = None
    error: str | None = None
    waiting: str | None = None  # why it cannot run yet (its mixer's tuning sweep is not complete)


def normalize(study: Config) -> Config:
    """An unlocked copy with ``mixers``, ``tasks`` and ``seeds`` as tuples, from the file or the command line."""
    def split(values: Any) -> list[str]:
        values = [values] if isinstance(values, (str, int)) else list(values)
        return [w.strip() for v in values for w in str(v).split(",") if w.strip()]

    c = ml_collections.ConfigDict(study.to_dict())
    c.mixers, c.tasks = tuple(split(study.mixers)), tuple(split(study.tasks))
    try:
        c.seeds = tuple(int(s) for s in split(study.seeds))
    except ValueError:
        raise UserError(f"config.seeds={study.seeds!r}: must be integers, e.g. --config.seeds=0,1,2") from None
    return c


def quote_word_lists(argv: list[str]) -> list[str]:
    """``--config.mixers=a,pkg.mod:Class`` as a tuple literal (ml_collections takes plain words only)."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and name in ("--config.mixers", "--config.tasks") and value and value[0] not in "('\"[":
            arg = f"{name}={tuple(w.strip() for w in value.split(',') if w.strip())!r}"
        out.append(arg)
    return out


def check_study(study: Config) -> None:
    """The study config's own fields, one line each, before anything is built."""
    words = common.mixer_variants()
    unknown = sorted(w for w in set(study.mixers) - set(words) if not mixers.is_spec(w))
    if unknown or not study.mixers:
        raise UserError(f"config.mixers: unknown or empty {unknown or list(study.mixers)}; choose from "
                        f"{sorted(words)} or name a class as package.module:Class")
    picked: dict[str, str] = {}
    for word in study.mixers:
        mixers.mixer_class(mixer_name(word))  # a plugin that cannot be imported fails here, before any run
        if mixer_name(word) in picked:  # two runs of one mixer and seed would count as two seeds
            raise UserError(f"config.mixers names mixer {mixer_name(word)!r} twice ({picked[mixer_name(word)]!r} "
                            f"and {word!r}); name each mixer once")
        picked[mixer_name(word)] = word
    bad_tasks = sorted(set(study.tasks) - set(TASKS))
    if bad_tasks or not study.tasks:
        raise UserError(f"config.tasks: unknown or empty {bad_tasks or list(study.tasks)}; choose from {list(TASKS)}")
    seeds = list(study.seeds)
    if not seeds or len(set(seeds)) != len(seeds) or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise UserError(f"config.seeds={seeds}: must be distinct integers >= 0, at least one")
    if study.reference_mixer not in words and not mixers.is_spec(study.reference_mixer):
        raise UserError(f"config.reference_mixer={study.reference_mixer!r}: must be one of {sorted(words)}")
    checks = (("param_tolerance", 0 < study.param_tolerance < 1, "a fraction in (0, 1)"),
              ("ffn_multiple", isinstance(study.ffn_multiple, int) and study.ffn_multiple >= 1, "an integer >= 1"),
              ("average_last", isinstance(study.average_last, int) and study.average_last >= 1, "an integer >= 1"),
              ("run_timeout_minutes", study.run_timeout_minutes > 0, "a number > 0"),
              ("lm_generate_rows", study.lm_generate_rows >= 1, "an integer >= 1"),
              ("lm_generate_tokens", study.lm_generate_tokens >= 1, "an integer >= 1"))
    for name, ok, requirement in checks:
        if not ok:
            raise UserError(f"config.{name}={study[name]!r}: must be {requirement}")
    for task in study.tasks:
        if task not in study or "family" not in study[task]:
            raise UserError(f"config.{task} is missing: a task needs family, words and overrides")


def fit(task: str, mixer: str) -> tuple[str | None, str]:
    """``(reason the mixer cannot run this task or None, what the mixer means in this task)``."""
    info = mixers.info(mixer_name(mixer))
    sides = info.sides
    if info.layout is not None or info.state:
        where = (f"{info.label} in the {_layer_words(info.layout)}{' of the decoder' * (sides == ('decoder',))} "
                 f"(its layout rule), {info.layout_others} elsewhere" if info.layout is not None else info.label)
        if task == "lm" or not info.state:
            return None, where + (": it carries its state across the document's windows" if info.state else "")
        return None, where + ("; no document streams here, so its state starts empty at every example")
    if task == "lm" and "decoder" not in sides:
        return (f"{info.label} is {sides[0]}-only ({info.side_reason or 'see its class'}); a decoder-only LM has "
                f"no encoder layer for it"), ""
    if "decoder" not in sides:
        return None, f"{info.label} in the encoder, attention in the decoder (it is encoder-only)"
    return None, ""


def _layer_words(layout: tuple[int, ...]) -> str:
    """``(-2,)`` -> "second-to-last layer"; ``(0, -1)`` -> "layers 0 and last"."""
    words = [{-1: "last", -2: "second-to-last"}.get(i, str(i) if i >= 0 else f"{-i}th from the end") for i in layout]
    return f"{words[0]} layer" if len(words) == 1 else f"layers {', '.join(words[:-1])} and {words[-1]}"


def training_config(study: Config, key: RunKey) -> Config:
    """The full training config of one run (mixer applied, overrides, seed, the study's training fields)."""
    spec = study[key.task]
    module = importlib.import_module(f"lconv.configs.{spec.family}")
    words = [w for w in spec.words.split(",") if w.strip()]
    if key.task == "lm":  # lm1b.py applies the mixer word itself
        c = module.get_config(",".join([key.mixer] + words))
    else:
        c = common.set_mixer(module.get_config(",".join(words) or None), {key.mixer})
    c.update(_plain(spec.overrides))
    if mixers.info(mixer_name(key.mixer)).layout is not None:  # after the overrides: it depends on the layer count
        c = common.set_mixer(c, {key.mixer}, layout=True)
    if mixer_name(key.mixer) == "knn_memory":  # the study's memory size, on every task
        c.model.mixer_kwargs = {"knn_memory": dict(KNN_FIELDS)}
    c.update(_plain(dict(study.mixer_overrides).get(key.mixer, {})))
    c.seed = c.data.seed = key.seed
    c.data.data_dir = study.data_dir
    c.train.max_minutes = 0.0  # the same step budget for every mixer, whatever its speed
    c.train.eval_after_training = False  # the study scores the averaged checkpoints itself
    c.train.keep_checkpoints = max(study.average_last, 1)
    c.train.eval_every = c.train.num_steps  # one validation pass, at the end
    return c


def _plain(value: Any) -> Any:
    """A ConfigDict / mapping as nested plain dicts (``ConfigDict.update`` merges them field by field)."""
    if isinstance(value, Mapping) or hasattr(value, "to_dict"):
        items = value.to_dict().items() if hasattr(value, "to_dict") else value.items()
        return {k: _plain(v) for k, v in items}
    return copy.deepcopy(value)


def count_params(config: Config, vocab_size: int, length: int | None = 8) -> int:
    """The model's parameter count from its own ``init``, traced abstractly on ``length`` tokens."""
    # The model section alone: a run's other fields (checked when it launches) fail that run, not the plan.
    lm = config.task == "lm"
    model_cfg = models.ModelConfig.from_config(config.model, vocab_size=vocab_size, decoder_only=lm)
    model = models.DecoderOnlyLM(model_cfg) if lm else models.EncoderDecoder(model_cfg)
    sides = ("targets",) if lm else ("inputs", "targets")
    lengths = {"inputs": config.data.max_input_length, "targets": config.data.max_target_length}
    args = tuple(jnp.ones((1, length or lengths[side]), jnp.int32) for side in sides)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    return model_setup.count_params(shapes)


def match_ffn(config: Config, reference: int, tolerance: float, multiple: int,
              count: Callable[[Config], int]) -> int:
    """Sets ``config.model.ffn_dim`` so the model's count is within ``tolerance`` of ``reference``; returns it. One
    probe gives the slope; the rounded width is counted again."""
    if config.model.encoder_ffn_dim is not None or config.model.decoder_ffn_dim is not None:
        raise UserError("the study matches parameter counts through config.model.ffn_dim, which "
                        "config.model.encoder_ffn_dim / decoder_ffn_dim override; leave them unset (None)")
    f0 = int(config.model.ffn_dim)
    p0 = count(config)
    if p0 == reference:
        return p0
    config.model.ffn_dim = f0 + 16 * multiple
    slope = (count(config) - p0) / (16 * multiple)
    width = max(multiple, multiple * round((f0 + (reference - p0) / slope) / multiple))
    config.model.ffn_dim = width
    params = count(config)
    if abs(p0 - reference) <= abs(params - reference):  # rounding made it no better: keep the config's width
        config.model.ffn_dim, width, params = f0, f0, p0
    if abs(params / reference - 1) > tolerance:
        raise UserError(f"cannot match the parameter count: FFN width {width} gives {params:,} parameters, "
                        f"{params / reference - 1:+.1%} from the reference's {reference:,} (tolerance "
                        f"{tolerance:.0%}); change the task's model sizes")
    return params


def plan(study: Config, vocab_sizes: Mapping[str, int]) -> list[Planned]:
    """Every (task, mixer, seed) run at the study's own recipe (no tuning sweep): ``expand(templates(...))``."""
    return expand(study, templates(study, vocab_sizes))


def templates(study: Config, vocab_sizes: Mapping[str, int]) -> list[Planned]:
    """One Planned per (task, mixer), seed 0's with the matched FFN; a config that fails is its runs' error."""
    found = []
    for task in study.tasks:
        vocab = vocab_sizes[task]
        reference = _reference_count(study, task, vocab)
        for mixer in study.mixers:
            reason, note = fit(task, mixer)
            config, error, params = None, None, None
            if reason is None:
                try:
                    config = training_config(study, RunKey(task, mixer, 0))
                    params = match_ffn(config, reference, study.param_tolerance, study.ffn_multiple,
                                       lambda c, vocab=vocab: count_params(c, vocab))
                except (UserError, ValueError, TypeError) as err:
                    config, error = None, _one_line(err)
            if config is not None and task == "lm":
                check_generation_fits(study, config)
            found.append(Planned(RunKey(task, mixer, 0), config, params, reference, note, reason, error))
    return found


def task_seeds(study: Config, task: str) -> tuple[int, ...]:
    """The seeds a task runs: the study's, or its first ``max_seeds`` of them."""
    limit = study[task].get("max_seeds", 0)
    return tuple(study.seeds[:limit] if limit else study.seeds)


def expand(study: Config, found: Sequence[Planned],
           recipe: Callable[[Planned], tuple[Callable[[Config], None] | None, str | None]] | None = None
           ) -> list[Planned]:
    """Every (task, mixer, seed) run of the templates, seeds outermost; ``recipe(template)``: ``(adjust, waiting)``."""
    runs = []
    for seed in study.seeds:
        for template in found:
            if seed not in task_seeds(study, template.key.task):
                continue
            key = dataclasses.replace(template.key, seed=seed)
            config, waiting = None, None
            if template.config is not None:
                adjust, waiting = recipe(template) if recipe else (None, None)
                config = training_config(study, key)
                config.model.ffn_dim = template.config.model.ffn_dim
                if adjust is not None:
                    adjust(config)
            runs.append(dataclasses.replace(template, key=key, config=config, waiting=waiting))
    return runs


def check_generation_fits(study: Config, config: Config) -> None:
    """The LM speed measure's ``lm_generate_tokens`` positions must fit a Fixed or Hadamard table's ``max_len``."""
    if study.lm_generate_tokens > config.model.max_len:
        raise UserError(f"config.lm_generate_tokens={study.lm_generate_tokens}: more than the LM's model.max_len="
                        f"{config.model.max_len} positions (the decoding-speed measure feeds BOS and every "
                        f"generated token but the last); at most {config.model.max_len}")


def stored_config_changes(stored: dict[str, Any], config: Config) -> dict[str, tuple[Any, Any]]:
    """``{dotted field: (stored, planned)}`` where a run's stored training config differs from the plan's."""
    from lconv.run import workdir as workdir_lib

    changes = workdir_lib.config_changes(stored, workdir_lib.as_record(config))
    for added in workdir_lib.fields_added_at_their_defaults(stored, changes):
        del changes[added]
    return changes


def check_stored_configs(stored: Sequence[tuple[str, dict[str, Any], Config]], problem: str, remedy: str) -> None:
    """Raises ``"<problem>: <run> (config.<field>: old -> new)[ and N more]; <remedy>"`` when any of ``(name, stored
    config, planned config)`` differ."""
    stale = []
    for name, stored_config, config in stored:
        changes = stored_config_changes(stored_config, config)
        if changes:
            field, (old, new) = next(iter(changes.items()))
            stale.append(f"{name} (config.{field}: {old!r} -> {new!r})")
    if stale:
        more = f" and {len(stale) - 1} more" if len(stale) > 1 else ""
        raise UserError(f"{problem}: {stale[0]}{more}; {remedy}")


def _reference_count(study: Config, task: str, vocab: int) -> int:
    try:
        return count_params(training_config(study, RunKey(task, study.reference_mixer, 0)), vocab)
    except (UserError, ValueError, TypeError) as err:
        raise UserError(f"the reference mixer {study.reference_mixer!r} cannot be built for {task}: "
                        f"{_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}" if not isinstance(err, UserError) else text[0]


def spread(values: Sequence[float]) -> float:
    """The largest relative distance of ``values`` from their mean (the matched counts' spread)."""
    mean = sum(values) / len(values)
    return max(abs(v / mean - 1) for v in values) if values and mean else math.nan
