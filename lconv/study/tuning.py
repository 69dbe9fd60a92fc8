"""The fair recipe: each mixer's peak learning rate (lowest validation NLL of short runs) and length penalty (best
validation BLEU / ROUGE-L of that run), never reading the test split. docs/results.md shows the sweep."""
from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from lconv.errors import UserError
from lconv.study import plan

Record = dict[str, Any]
LENPEN_METRIC = {"translation": "bleu", "summarization": "rougeL"}  # higher is better; the LM has no length penalty


@dataclasses.dataclass(frozen=True)
class Choice:
    """A (task, mixer)'s chosen recipe and the records it was chosen from."""

    learning_rate: float
    lenpen: float | None
    runs: tuple[Record, ...] = ()  # one per rate tried
    lenpen_scores: dict[str, float] | None = None  # str(lenpen) -> validation metric


def enabled(study: ml_collections.ConfigDict) -> bool:
    return bool(study.tuning.steps) and bool(study.tuning.learning_rates)


def check(study: ml_collections.ConfigDict) -> None:
    """The tuning fields, one line each."""
    t = study.tuning
    if not (isinstance(t.steps, int) and t.steps >= 0):
        raise UserError(f"config.tuning.steps={t.steps!r}: must be an integer >= 0 (0: no tuning)")
    for name in ("learning_rates", "lenpens"):
        values = list(t[name])
        if not values or not all(isinstance(v, (int, float)) and v > 0 for v in values) or len(set(values)) != len(
                values):
            raise UserError(f"config.tuning.{name}={values}: must be distinct numbers > 0, at least one")
    if not (isinstance(t.seed, int) and t.seed >= 0):
        raise UserError(f"config.tuning.seed={t.seed!r}: must be an integer >= 0")


def tuning_config(study: ml_collections.ConfigDict, template: plan.Planned,
                  learning_rate: float) -> ml_collections.ConfigDict:
    """A template's config (matched FFN width) shortened to ``tuning.steps`` at one peak rate, seed ``tuning.seed``."""
    key = dataclasses.replace(template.key, seed=study.tuning.seed)
    config = plan.training_config(study, key)
    config.model.ffn_dim = template.config.model.ffn_dim
    config.optim.learning_rate = float(learning_rate)
    config.train.num_steps = config.train.eval_every = config.train.checkpoint_every = study.tuning.steps
    config.train.keep_checkpoints = 1
    return config


def best_rate(runs: Sequence[Record]) -> float | None:
    """The rate of the finished run with the lowest validation NLL; None when none finished."""
    done = [r for r in runs if r.get("status") == "ok" and r.get("validation_nll") is not None]
    return min(done, key=lambda r: r["validation_nll"])["learning_rate"] if done else None


def best_lenpen(scores: dict[str, float], lenpens: Sequence[float]) -> float:
    """The length penalty with the highest validation score; a tie goes to the first in ``lenpens``."""
    return max(lenpens, key=lambda p: (scores[f"{float(p):g}"], -list(lenpens).index(p)))


def planned_sweeps(study: ml_collections.ConfigDict, templates: Sequence[plan.Planned]) -> list[Sweep]:
    """Every process the sweeps may run: each rate's run and its decoding sweep (only the chosen rate's is launched)."""
    sweeps = []
    for template in templates:
        if template.config is None:
            continue
        key, base = template.key, os.path.join("runs", template.key.task, template.key.mixer)
        for kind in ("tune", "lenpen") if key.task in LENPEN_METRIC else ("tune",):
            for rate in study.tuning.learning_rates:
                run = f"{kind}_lr{float(rate):g}"  # its folder, as archive.entry_name names it
                fields = ({"seed": study.tuning.seed, "learning_rate": float(rate), "params": template.params}
                          if kind == "tune" else {"learning_rate": float(rate), "metric": LENPEN_METRIC[key.task],
                                                  "lenpens": [float(p) for p in study.tuning.lenpens]})
                record = {"task": key.task, "mixer": key.mixer, "label": plan.label(key.mixer), "kind": kind,
                          **fields, "workdir": os.path.join(base, run)}
                config = tuning_config(study, template, rate)
                if kind == "lenpen":
                    config.decode.lenpen = 0.0  # the sweep's own: the stored config names the run it decodes
                sweeps.append(Sweep(f"{key.task}/{key.mixer}/{run}", record, config))
    return sweeps


@dataclasses.dataclass
class Sweep:
    """One process of a sweep: its name (also its archive entry), its record so far and its config."""

    name: str
    record: Record
    config: ml_collections.ConfigDict


def choose(study: ml_collections.ConfigDict, sweeps: Sequence[Sweep], output_dir: str,
           launch: Callable[[Sweep], Record] | None) -> tuple[dict[tuple[str, str], Choice], list[Record]]:
    """Runs (``launch``: ``lconv.study.run.launch``) or only reads each (task, mixer)'s sweep; returns ``{(task, mixer):
    Choice}`` for the complete ones, and every process's records."""
    choices, records = {}, []
    by_pair: dict[tuple[str, str], list[Sweep]] = {}
    for sweep in sweeps:
        by_pair.setdefault((sweep.record["task"], sweep.record["mixer"]), []).append(sweep)
    for (task, mixer), items in by_pair.items():
        runs = [_outcome(s, output_dir, launch) for s in items if s.record["kind"] == "tune"]
        records += runs
        rate = best_rate(runs)
        if rate is None or any(r.get("status") != "ok" for r in runs):
            continue
        lenpen, scores = None, None
        if task in LENPEN_METRIC:
            sweep = next(s for s in items if s.record["kind"] == "lenpen" and s.record["learning_rate"] == rate)
            found = _outcome(sweep, output_dir, launch)
            records.append(found)
            if found.get("status") != "ok":
                continue
            scores = found["scores"]
            lenpen = best_lenpen(scores, study.tuning.lenpens)
            if launch is not None and study.prune_checkpoints:
                for s in items:  # the sweep is decided: the tuning runs' checkpoints are no longer needed
                    for name in ("checkpoints", "best", "xla_cache"):  # in the plan's folders, never a record's
                        if s.record["kind"] == "tune":
                            shutil.rmtree(os.path.join(output_dir, s.record["workdir"], name), ignore_errors=True)
        choices[(task, mixer)] = Choice(rate, lenpen, tuple(runs), scores)
    return choices, records


def _outcome(sweep: Sweep, output_dir: str, launch: Callable[[Sweep], Record] | None) -> Record:
    found = launch(sweep) if launch is not None else _read(os.path.join(output_dir, sweep.record["workdir"]),
                                                            sweep.record)
    if sweep.record["kind"] == "lenpen" and found.get("status") == "ok" and found["lenpens"] != sweep.record[
            "lenpens"]:
        raise UserError(f"{sweep.name} decoded at length penalties {found['lenpens']}, the study config asks for "
                        f"{sweep.record['lenpens']}; use a new --output_dir, or restore config.tuning.lenpens")
    return found


def _read(workdir: str, record: Record) -> Record:
    from lconv.study import run as run_lib

    return run_lib.read_record(workdir, record)


def apply(config: ml_collections.ConfigDict, choice: Choice | None) -> None:
    """A planned run's config at its mixer's chosen recipe."""
    if choice is None:
        return
    config.optim.learning_rate = choice.learning_rate
    if choice.lenpen is not None:
        config.decode.lenpen = choice.lenpen
