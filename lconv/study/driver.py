"""The study from start to end: tokenizers (``tokenizers/<task>-<vocab>/``), the plan, every run
(``runs/<task>/<mixer>/seed<k>/``, skipping finished ones; ``records.json``), then the report."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ml_collections

from lconv.run import compilation_cache
from lconv.study import archive, plan, report, retrain, speed, tuning
from lconv.study import run as run_lib

logger = logging.getLogger(__name__)


def run_dir(output_dir: str, key: plan.RunKey) -> str:
    return os.path.join(output_dir, "runs", key.task, key.mixer, f"seed{key.seed}")


def prepare_tokenizers(study: ml_collections.ConfigDict, output_dir: str) -> dict[str, tuple[str, int]]:
    """``{task: (spm.model path, vocab size)}``: one tokenizer per task, so every mixer and seed reads the same ids."""
    from lconv.data import pipeline

    tokenizers = {}
    for task in study.tasks:
        config = plan.training_config(study, plan.RunKey(task, study.reference_mixer, 0))
        directory = os.path.join(output_dir, "tokenizers", f"{task}-{config.data.vocab_size}")
        os.makedirs(directory, exist_ok=True)
        start = time.time()
        tokenizer = pipeline.load_or_train_tokenizer(config.data, directory)
        logger.info(f"tokenizer {task}: {tokenizer.vocab_size} pieces ({time.time() - start:.0f} s)")
        tokenizers[task] = (os.path.join(directory, "spm.model"), tokenizer.vocab_size)
    return tokenizers


def base_record(planned: plan.Planned, output_dir: str) -> dict[str, Any]:
    """What the plan knows of a run: its key, matched size and what the mixer means in the task."""
    key, config = planned.key, planned.config
    return {"task": key.task, "mixer": key.mixer, "label": plan.label(key.mixer), "kind": "seed", "seed": key.seed,
            "params": planned.params, "reference_params": planned.reference_params, "note": planned.note,
            "ffn_dim": config.model.ffn_dim if config is not None else None,
            "d_model": config.model.d_model if config is not None else None,
            "workdir": os.path.relpath(run_dir(output_dir, key), output_dir)}


def outcome(planned: plan.Planned, study: ml_collections.ConfigDict, output_dir: str,
            tokenizers: dict[str, tuple[str, int]], *, launch: bool) -> dict[str, Any]:
    """A run's record: n/a or a planning error as they are; else launched, or read from its workdir ("not run")."""
    record = base_record(planned, output_dir)
    if planned.not_applicable:
        return {**record, "status": "n/a", "error": planned.not_applicable}
    if planned.error:
        return {**record, "status": "failed", "error": planned.error, "stage": "plan"}
    workdir = run_dir(output_dir, planned.key)
    if not launch or planned.waiting:
        return run_lib.read_record(workdir, record, planned.waiting)
    spec = {"config": planned.config.to_dict(), "workdir": workdir, "record": record,
            "average_last": study.average_last, "prune_checkpoints": study.prune_checkpoints,
            "lm_generate_rows": study.lm_generate_rows, "lm_generate_tokens": study.lm_generate_tokens}
    return run_lib.launch(spec, workdir, tokenizers[planned.key.task][0], study.run_timeout_minutes)


def run_study(study: ml_collections.ConfigDict, output_dir: str, docs_dir: str, *, report_only: bool = False,
              resume_from: str | None = None, command: str = "", measure_speed: bool = False,
              retrain_runs: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Runs (or with ``report_only`` collects) the tuning sweeps, every planned run, then writes the report into
    ``docs_dir``; ``resume_from``: an archive to copy finished runs from; ``measure_speed``: the speed table first;
    ``retrain_runs``: train only these archived runs again and compare them with the archive (lconv.study.retrain).
    """
    compilation_cache.check_chosen()  # planning compiles in this process: never from a folder others could fill
    study = plan.normalize(study)
    plan.check_study(study)
    tuning.check(study)
    retrain_runs = retrain.check_flags(retrain_runs, resume_from, docs_dir, report_only)
    start = time.time()
    archive_root = archive.resolve(resume_from) if resume_from else None
    output_dir = os.path.abspath(os.path.expanduser(output_dir))
    os.makedirs(output_dir, exist_ok=True)
    tokenizers = prepare_tokenizers(study, output_dir)
    logger.info("planning: matching parameter counts")
    templates = plan.templates(study, {task: vocab for task, (_, vocab) in tokenizers.items()})
    if measure_speed:
        rows = speed.measure(study, templates, {t: os.path.dirname(path) for t, (path, _) in tokenizers.items()})
        logger.info(f"speed table: {speed.write(rows, docs_dir)}")
    sweeps = tuning.planned_sweeps(study, templates) if tuning.enabled(study) else []
    sweep_runs = [(s.name, s.config, os.path.join(output_dir, s.record["workdir"])) for s in sweeps]
    check_runs_match_plan(sweep_runs, output_dir)
    if archive_root:
        archive.restore([(*run, s.record) for run, s in zip(sweep_runs, sweeps, strict=True)], archive_root,
                        "tuning-sweep runs")

    def launch_sweep(sweep: tuning.Sweep) -> dict[str, Any]:
        workdir = os.path.join(output_dir, sweep.record["workdir"])
        spec = {"kind": sweep.record["kind"], "config": sweep.config.to_dict(), "workdir": workdir,
                "record": sweep.record}
        record = run_lib.launch(spec, workdir, tokenizers[sweep.record["task"]][0], study.run_timeout_minutes)
        if record["status"] == "ok" and not record.get("skipped"):
            archive.write_archive([record], output_dir, docs_dir)
        logger.info(f"[tuning] {sweep.name}: {describe(record)}")
        return record

    sweeping = not (report_only or retrain_runs)  # a retrained run takes the archived sweep's choice
    choices, sweep_records = tuning.choose(study, sweeps, output_dir, launch_sweep if sweeping else None)
    planned = plan.expand(study, templates, _recipe(study, choices) if sweeps else None)
    check_runs_match_plan([(p.key.name, p.config, run_dir(output_dir, p.key)) for p in planned], output_dir)
    if archive_root:
        retrain.check_planned(retrain_runs, planned, archive_root)
        retrain.check_not_finished(retrain_runs, [run_dir(output_dir, p.key) for name in retrain_runs
                                                  for p in planned if p.key.name == name])
        archive.restore([(p.key.name, p.config, run_dir(output_dir, p.key), base_record(p, output_dir))
                         for p in planned if not p.waiting and p.key.name not in retrain_runs], archive_root,
                        "seed runs")
    records = []
    for i, item in enumerate(planned, start=1):
        launch = not report_only and (not retrain_runs or item.key.name in retrain_runs)
        record = outcome(item, study, output_dir, tokenizers, launch=launch)
        records.append(record)
        if not report_only and record["status"] == "ok" and not record.get("skipped"):
            archive.write_archive([record], output_dir, docs_dir)  # committed as it goes: see archive.py
        logger.info(f"[{i}/{len(planned)}] {item.key.name}: {describe(record)}")
        run_lib.write_json(os.path.join(output_dir, "records.json"), records)
    if retrain_runs:
        compared = [retrain.compare(r, archive_root, plan.task_seeds(study, r["task"])) for r in records
                    if r.get("kind") == "seed"
                    and plan.RunKey(r["task"], r["mixer"], r["seed"]).name in retrain_runs]
        run_lib.write_json(os.path.join(output_dir, "retrained.json"), compared)
        for comparison in compared:
            logger.info(retrain.describe(comparison))
    meta = {"command": command, "output_dir": output_dir, "invocation_seconds": time.time() - start,
            "report_only": report_only}
    report.write_report(study, records, docs_dir, meta, output_dir, sweep_records, choices)
    return records


def _recipe(study: ml_collections.ConfigDict, choices: dict[tuple[str, str], tuning.Choice]):
    """``plan.expand``'s recipe: each template's chosen rate and length penalty, or why its runs wait."""
    def recipe(template: plan.Planned):
        choice = choices.get((template.key.task, template.key.mixer))
        if choice is None:
            return None, "its tuning sweep is not complete (docs/results.md, Tuning)"
        return (lambda config: tuning.apply(config, choice)), None
    return recipe


def check_runs_match_plan(planned: list[tuple[str, Any, str]], output_dir: str) -> None:
    """Raises when a run folder was made with another training config than the plan's."""
    specs = [(name, run_lib.read_json(os.path.join(workdir, run_lib.SPEC)), config)
             for name, config, workdir in planned if config is not None]
    plan.check_stored_configs([(name, spec["config"], config) for name, spec, config in specs if spec is not None],
                              f"--output_dir={output_dir} holds runs made with another study config",
                              "use a new --output_dir, or restore the config they were made with")


def describe(record: dict[str, Any]) -> str:
    """One progress line: the outcome and the headline number."""
    status = record.get("status")
    if status != "ok":
        return f"{status}: {record['error']}" if record.get("error") else str(status)
    if record.get("kind") == "tune":
        return f"validation NLL {record['validation_nll']:.4f}{' (finished before)' * bool(record.get('skipped'))}"
    if record.get("kind") == "lenpen":
        return f"validation {record['metric']} by length penalty {record['scores']}"
    skipped = (" (restored from the archive)" if record.get("restored") else
               " (finished before, skipped)" if record.get("skipped") else "")
    score = {"translation": lambda r: f"BLEU {r['bleu']:.2f}",
             "lm": lambda r: f"ppl {r['ppl']:.2f}/token, {r['ppl_word']:.2f}/word",
             "summarization": lambda r: f"ROUGE-1/2/L {r['rouge1']:.2f}/{r['rouge2']:.2f}/{r['rougeL']:.2f}"}
    return (f"{score[record['task']](record)}, {record.get('train_tokens_per_s', 0):.0f} train tokens/s, "
            f"{record.get('wall_seconds', 0):.0f} s{skipped}")
