"""The study's report, written from the run records: ``results.md`` (tables, plots, the machine and budget, the
comparison with the paper) and ``results/`` (``results.json``, ``results.csv``, PNGs) for notebooks. What the numbers
say (orderings, the seed spread) is ``lconv.study.verdicts``."""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import ml_collections

from lconv import console, outputs
from lconv.bench import report as bench_report
from lconv.nn.model_config import ModelConfig
from lconv.study import archive, measure, plan, plots, speed
from lconv.study.verdicts import (
    METRICS,
    ORDER_KEY,
    compare_with_paper,
    fmt,
    leader,
    mean_pm,
    mean_sd,
    ordering,
    resolved,
    versus_reference,
)

logger = logging.getLogger(__name__)

Record = dict[str, Any]
TASK_TITLES = {"translation": "Translation, DDTP En→De (ddtp/en_de)", "lm": "Language modelling (ddtp/lm_en)",
               "summarization": "Summarization, description → synopsis (ddtp/summarize_en)"}
CSV_FIELDS = ("task", "mixer", "label", "seed", "status", "error", "params", "reference_params", "ffn_dim", "step",
              "bleu", "ppl", "ppl_word", "rouge1", "rouge2", "rougeL", "train_tokens_per_s", "train_tokens",
              "decode_sentences_per_s", "decode_tokens_per_s", "train_step_bytes", "peak_rss_bytes",
              "train_seconds", "evaluate_seconds", "wall_seconds", "workdir")


def aggregate(records: Sequence[Record]) -> list[Record]:
    """One row per (task, mixer): means and sds over its finished seeds, its failures and n/a reason."""
    rows = []
    for task in dict.fromkeys(r["task"] for r in records):
        for mixer in dict.fromkeys(r["mixer"] for r in records if r["task"] == task):
            runs = [r for r in records if r["task"] == task and r["mixer"] == mixer]
            ok = [r for r in runs if r["status"] == "ok"]
            row = {"task": task, "mixer": mixer, "label": plan.label(mixer), "seeds": len(runs), "ok": len(ok),
                   "params": runs[0].get("params"), "reference_params": runs[0].get("reference_params"),
                   "ffn_dim": runs[0].get("ffn_dim"), "note": runs[0].get("note", ""),
                   "failed": [f"seed {r['seed']}: {r.get('error', '')}" for r in runs if r["status"] == "failed"],
                   "not_run": [r["seed"] for r in runs if r["status"] == "not run"],
                   "not_applicable": next((r["error"] for r in runs if r["status"] == "n/a"), None)}
            for key in [m[0] for m in METRICS[task]] + ["train_tokens_per_s", "decode_sentences_per_s",
                                                        "decode_tokens_per_s", "train_step_bytes", "peak_rss_bytes",
                                                        "wall_seconds", "step"]:
                row[key], row[f"{key}_sd"], _ = mean_sd([r.get(key) for r in ok])
            rows.append(row)
    return rows


def task_table(rows: Sequence[Record], task: str) -> str:
    """The markdown table of one task: quality (mean ± sd, n), size, memory, wall time and each run's fate. Speeds
    are the one-process table's: each run's own, measured on whatever host and load it had, are in results.csv."""
    metrics = METRICS[task]
    head = ["mixer", "params (vs ref.)", "n"] + [title for _, title, _ in metrics] + [
        f"Δ {metrics[0][1]} vs {rows[0]['label'] if rows else ''}", "train step MiB", "peak RSS MiB", "notes"]
    key = metrics[0][0]
    ref = rows[0] if rows and rows[0]["ok"] else None  # the reference mixer comes first
    table = []
    for row in rows:
        params = "—" if row["params"] is None else (
            f"{row['params'] / 1e6:.3f}M ({row['params'] / row['reference_params'] - 1:+.1%})")
        delta = "—"
        if ref is not None and row["ok"] and row is not ref:
            mark = {True: " (> spread)", False: " (within spread)", None: ""}[resolved(ref, row, key)]
            delta = f"{row[key] - ref[key]:+.2f}{mark}"
        cells = [row["label"], params, f"{row['ok']}/{row['seeds']}"]
        cells += [mean_pm(row, k) for k, _, _ in metrics] + [delta]
        cells += [fmt(row["train_step_bytes"] / 2**20, 1) if row["ok"] else "—",
                  fmt(row["peak_rss_bytes"] / 2**20, 0) if row["ok"] else "—"]
        notes = [row["note"]] if row["note"] else []
        if row["not_applicable"]:
            notes = [f"**not applicable**: {row['not_applicable']}"]
        notes += [f"**failed** {f}" for f in row["failed"]]
        notes += [f"not run yet: seed {', '.join(map(str, row['not_run']))}"] if row["not_run"] else []
        cells.append("; ".join(n.replace("|", "/") for n in notes))
        table.append(cells)
    return bench_report.markdown_table(head, table)


def budget_lines(study: ml_collections.ConfigDict, rows: Sequence[Record], records: Sequence[Record]) -> list[str]:
    """What every run of each task was given: sizes, steps, batch, seeds, averaging, decoding."""
    lines = []
    for task in study.tasks:
        c = plan.training_config(study, plan.RunKey(task, study.reference_mixer, 0))
        m, d = c.model, c.data
        widths = ", ".join(f"{r['label']} {r['ffn_dim']}" for r in rows if r["task"] == task and r["ffn_dim"])
        layers = f"{m.decoder_layers} decoder" if task == "lm" else f"{m.encoder_layers}+{m.decoder_layers}"
        rows_text = (f"{d.batch_size} stream rows x {d.max_target_length}-token windows" if task == "lm" else
                     f"{d.batch_size} {'packed ' if d.pack else ''}rows of {d.max_input_length}/"
                     f"{d.max_target_length} tokens")
        cooldown = (f", a linear cooldown over the last {c.optim.cooldown_fraction:.0%}"
                    if c.optim.cooldown_fraction else "")
        tuned = bool(study.tuning.steps and study.tuning.learning_rates)
        lenpen = "the length penalty of its sweep" if tuned else f"length penalty {c.decode.lenpen}"
        decode = "" if task == "lm" else f"; beam {c.decode.beam_size}, {lenpen}"
        rate = "the peak rate of its sweep (Tuning, below)" if tuned else f"{c.optim.learning_rate:g}"
        scored = ("the final checkpoint scored" if study.average_last == 1 else
                  f"the last {study.average_last} averaged for the test score")
        sides = ModelConfig.from_config(m, vocab_size=d.vocab_size)
        width, heads = (sides.per_side(name, task == "lm") for name in ("d_model", "num_heads"))
        lines.append(f"- **{task}**: {c.train.num_steps} updates of {rows_text}; d {width}, {heads} heads, "
                     f"{layers} layers, kernels {tuple(m.decoder_kernel_sizes)}, vocabulary {d.vocab_size}; "
                     f"{c.optim.optimizer} at {rate}, {c.optim.schedule} after {c.optim.warmup_steps} warm-up "
                     f"steps{cooldown}; checkpoints every {c.train.checkpoint_every} updates, {scored}{decode}. "
                     "FFN width per mixer "
                     f"(matched parameters): {widths}.")
    return lines


def write_report(study: ml_collections.ConfigDict, records: Sequence[Record], docs_dir: str, meta: Record,
                 output_dir: str, sweep_records: Sequence[Record] = (), choices: dict | None = None) -> str:
    """Writes ``docs_dir/results.md`` and ``docs_dir/results/*``; returns the markdown."""
    choices = choices or {}
    from lconv.bench import timing

    results_dir = os.path.join(docs_dir, "results")
    os.makedirs(results_dir, exist_ok=True)
    rows = aggregate(records)
    meta = {**meta, "machine": timing.machine_info(), "mode": study.mode, "seeds": list(study.seeds),
            "runs_seconds": _wall_seconds(records), "tuning_seconds": _wall_seconds(sweep_records)}
    chosen = [{"task": t, "mixer": m, "learning_rate": c.learning_rate, "lenpen": c.lenpen}
              for (t, m), c in choices.items()]
    outputs.write_atomically(os.path.join(results_dir, "results.json"), json.dumps(_finite(
        {"study": meta, "config": study.to_dict(), "aggregate": rows, "runs": list(records),
         "tuning": {"chosen": chosen, "runs": list(sweep_records)}}), indent=1, default=str, allow_nan=False))
    outputs.write_atomically(os.path.join(results_dir, "results.csv"), csv_text(records))
    measured = speed.read(docs_dir)
    figures = plots.write_plots(records, rows, output_dir, results_dir, METRICS, measured)
    archive.write_archive(list(records) + list(sweep_records), output_dir, docs_dir, prune=True)
    text = markdown(study, rows, records, meta, figures,
                    tuning_lines(study, sweep_records, choices) + speed_lines(study, measured))
    # A committed page: a record's text (a machine's name, an error) shows its control characters as escapes.
    outputs.write_atomically(os.path.join(docs_dir, "results.md"), console.printable(text))
    logger.info(f"report: {os.path.join(docs_dir, 'results.md')} and {results_dir}/")
    return text


def _wall_seconds(records: Sequence[Record]) -> float:
    """The runs' own wall time, start-up to result, of those that ran here or in the archive's invocation."""
    return sum(r.get("wall_seconds") or 0 for r in records if r.get("status") in ("ok", "failed"))


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (no spread, no run) as None: strict JSON has neither."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def csv_text(records: Sequence[Record]) -> str:
    """``results/results.csv``: one row per run. It is read in terminals and notebooks as often as results.md, so a
    record's text (an error, a machine's name) shows its control characters as escapes there too."""
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({key: console.printable(value) if isinstance(value, str) else value
                      for key, value in record.items()} for record in records)
    return table.getvalue()


def tuning_lines(study: ml_collections.ConfigDict, sweep_records: Sequence[Record], choices: dict) -> list[str]:
    """The sweep behind each mixer's recipe: validation NLL per rate, the chosen run's score per length penalty."""
    if not sweep_records:
        return []
    rates, lenpens = [float(r) for r in study.tuning.learning_rates], [float(p) for p in study.tuning.lenpens]
    lines = ["## Tuning: each mixer's recipe, chosen on the validation split\n",
             f"Per task and mixer, {study.tuning.steps}-update runs of seed {study.tuning.seed} at each peak rate; the "
             "lowest validation NLL chose the rate. That run's checkpoint then decoded the validation split at each "
             "length penalty (translation: BLEU, summarization: ROUGE-L), and the best chose the penalty (ties: the "
             "first). Every seed trained and decoded at the chosen pair; the test split was not read.\n"]
    for task in study.tasks:
        runs = [r for r in sweep_records if r["task"] == task]
        if not runs:
            continue
        head = ["mixer"] + [f"NLL @ {r:g}" for r in rates] + ["rate"]
        if task != "lm":
            head += [f"{LENPEN_TITLES[task]} @ lp {p:g}" for p in lenpens] + ["length penalty"]
        table = []
        for mixer in dict.fromkeys(r["mixer"] for r in runs):
            mine = {(r["kind"], r["learning_rate"]): r for r in runs if r["mixer"] == mixer}
            choice = choices.get((task, mixer))
            cells = [plan.label(mixer)]
            for rate in rates:
                r = mine.get(("tune", rate))
                cells.append(fmt(r["validation_nll"], 4) if r and r.get("status") == "ok" else
                             (r or {}).get("status", "—"))
            cells.append(f"**{choice.learning_rate:g}**" if choice else "—")
            if task != "lm":
                scores = (choice.lenpen_scores or {}) if choice else {}
                cells += [fmt(scores.get(f"{p:g}")) for p in lenpens]
                cells.append(f"**{choice.lenpen:g}**" if choice and choice.lenpen is not None else "—")
            table.append(cells)
        lines += [f"**{task}**\n", bench_report.markdown_table(head, table), ""]
    return lines


def limited_seeds(study: ml_collections.ConfigDict) -> str:
    """``"; summarization runs the first 2"`` for the tasks that run fewer than the study's seeds."""
    limited = [f"{task} runs the first {len(plan.task_seeds(study, task))}" for task in study.tasks
               if len(plan.task_seeds(study, task)) < len(study.seeds)]
    return "".join(f"; {text}" for text in limited)


def speed_lines(study: ml_collections.ConfigDict, measured: Record | None) -> list[str]:
    """The speed table of ``lconv.study.speed``: per task, each mixer's medians and its ratio to the reference."""
    if not measured:
        return ["## Speed, side by side in one process\n",
                "Not measured yet: `python -m lconv.study --config=... --report_only --speed` (on an idle host).\n"]
    lines = ["## Speed, side by side in one process\n",
             f"Measured by `--speed` on {timing_line(measured['machine'])}: every mixer of a task built in one "
             "process at the study's sizes with random weights, taking turns (one train step on the same batch, "
             "then one decoding pass over the same validation sources: beam search that runs to the length limit, "
             "or the LM's greedy generation); medians over the rounds (lconv/study/speed.py).\n"]
    for task in study.tasks:
        rows = [r for r in measured["rows"] if r["task"] == task]
        ref = next((r for r in rows if r["mixer"] == study.reference_mixer), None)
        if not rows:
            continue
        versus = f"vs {plan.label(study.reference_mixer)}"
        head = ["mixer", "train tokens/s", versus, "decode rows/s" if task == "lm" else "decode sentences/s", versus]
        table = [[r["label"], fmt(r["train_tokens_per_s"], 0), _ratio(r, ref, "train_tokens_per_s"),
                  fmt(r["decode_sentences_per_s"], 1), _ratio(r, ref, "decode_sentences_per_s")] for r in rows]
        lines += [f"**{task}**\n", bench_report.markdown_table(head, table), ""]
    return lines


def _ratio(row: Record, ref: Record | None, key: str) -> str:
    return f"{row[key] / ref[key]:.2f}x" if ref else "—"


def timing_line(machine: Record) -> str:
    return f"{machine.get('cpu', '?')}; {machine.get('device', '?')}; {machine.get('jax', '?')}"


LENPEN_TITLES = {"translation": "BLEU", "summarization": "ROUGE-L"}


def markdown(study: ml_collections.ConfigDict, rows: Sequence[Record], records: Sequence[Record], meta: Record,
             figures: Sequence[str], tuning: Sequence[str] = ()) -> str:
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "failed", "n/a", "not run")}
    machine = meta["machine"]
    parts = [
        "# The reproduction study: every mixer, same data, same budget\n",
        f"Written by `{meta['command'] or 'python -m lconv.study'}` (mode `{study.mode}`) from the runs in its "
        "output directory; nothing here is edited by hand. Machine-readable: [results/results.json]"
        "(results/results.json), [results/results.csv](results/results.csv).\n",
        f"{machines_line(records, machine)} **Runs**: {counts['ok']} finished, {counts['failed']} failed, "
        f"{counts['n/a']} not applicable, {counts['not run']} not run. **Wall time**: {wall_time(meta)}; this "
        f"invocation took {meta['invocation_seconds'] / 3600:.2f} hours"
        f"{' (report only)' if meta['report_only'] else ''}.{restored_line(records)}\n",
        "## Budget\n",
        f"Every mixer of a task gets the same step budget, data order, tokenizer and seeds "
        f"({', '.join(map(str, study.seeds))}: each sets the init/dropout seed and the data-shuffling seed"
        f"{limited_seeds(study)}); "
        f"parameter counts are matched to the {plan.label(study.reference_mixer)}'s within "
        f"{study.param_tolerance:.0%} by the FFN width alone (lconv/study/plan.py).\n",
        *budget_lines(study, rows, records),
        "",
        "**How it is measured** (in each run's own process): train step MiB = XLA `memory_analysis()` of the run's "
        "compiled train step (arguments + outputs + temporaries − donated); peak RSS = the run process's "
        "`ru_maxrss` (runtime, data and compilations included). Speeds are the one-process table's (below): the "
        "runs were spread over hosts, loads and interruptions, so each run's own wall time, train tokens/s "
        "(the median over its training log windows, the first left out) and decode rate (beam search over the "
        "whole test split, compilation included, or for the LM greedy generation from BOS, the median of "
        f"{measure.LM_DECODE_REPEATS} calls after a compiling one) are in results.csv, not compared here. Spread: "
        "± sample standard deviation over n finished seeds; \"> spread\" = the gap exceeds the sum of the two "
        "sds.\n",
        "**Checking a result**: `--resume_from=<this docs dir> --retrain=<task>/<mixer>/seed<k>` (with another "
        "`--docs_dir`) trains that run again and sets its figure against the archived one and the spread of its "
        "archived seeds.\n",
        *tuning,
    ]
    for task in study.tasks:
        task_rows = [r for r in rows if r["task"] == task]
        ref = next((r for r in task_rows if r["mixer"] == study.reference_mixer), None)
        task_rows = ([ref] if ref else []) + [r for r in task_rows if r is not ref]
        parts += [f"## {TASK_TITLES[task]}\n", task_table(task_rows, task) + "\n", *machines_caveat(records, task),
                  f"Ordering by {METRICS[task][0][1]} ({ORDER_KEY}): {ordering(task_rows, task)}. "
                  f"{versus_reference(task_rows, task, study.reference_mixer)}. "
                  + "".join(f"{line}.\n" for line in [leader(task_rows, task)] if line)]
    parts += ["## Plots\n"] + [f"![{os.path.basename(f)}](results/{os.path.basename(f)})\n" for f in figures]
    parts += ["## Against the paper's ordering\n",
              "Wu et al. (2019) report BLEU on IWSLT14 De-En (Transformer 34.4, LightConv 34.8, DynamicConv 35.2) "
              "and WMT14 En-De (Transformer 28.9, DynamicConv 29.7). Each ordered pair of theirs, against this "
              "study's translation runs:\n", *compare_with_paper(rows), "",
              caveat(study, rows), "## Headline\n", *headline(study, rows, records, meta)]
    return "\n".join(parts)


def run_machines(records: Sequence[Record]) -> dict[str, int]:
    """``{machine: finished runs measured on it}``, from each run's record."""
    machines: dict[str, int] = {}
    for r in records:
        if r["status"] == "ok":
            m = r.get("machine")
            name = timing_line(m) if m else "not recorded"
            machines[name] = machines.get(name, 0) + 1
    return machines


def machines_line(records: Sequence[Record], report_machine: Record) -> str:
    """Where the runs were measured (one machine, or which runs on which), and the load as the report was written."""
    machines = run_machines(records)
    load = f"1-minute load at the report {report_machine['load']}."
    if len(machines) <= 1:
        name = next(iter(machines), "no finished run")
        if name in ("not recorded", "no finished run"):
            name = f"{timing_line(report_machine)} (the report's)"
        return f"**Machine**: {name}; {load}"
    listed = "; ".join(f"{name} ({n} run{'s' if n != 1 else ''})" for name, n in machines.items())
    return f"**Machines** (wall times and memory compare only within one): {listed}. {load}"


def wall_time(meta: Record) -> str:
    """The seed runs' hours, and the tuning sweep's beside them when it ran."""
    text = f"the seed runs took {meta['runs_seconds'] / 3600:.2f} hours in all"
    tuning = meta.get("tuning_seconds") or 0
    text += f", and the tuning sweep's runs {tuning / 3600:.2f} hours more" if tuning else ""
    return text + (" (each run's last process, start-up to result: a run resumed after an interruption counts only "
                   "the process that finished it)")


def machines_caveat(records: Sequence[Record], task: str) -> list[str]:
    """A line under a task's table whose finished runs were measured on more than one machine: its memory columns
    then mix machines, and compare across mixers only where the machines match."""
    machines = run_machines([r for r in records if r["task"] == task])
    if len(machines) <= 1:
        return []
    return [f"Its runs were measured on {len(machines)} machines (listed at the top): the peak RSS column is a mean "
            "over each mixer's own runs, so it compares across mixers only where the machines match.\n"]


def restored_line(records: Sequence[Record]) -> str:
    restored = sum(bool(r.get("restored")) for r in records if r["status"] == "ok")
    if not restored:
        return ""
    return (f" {restored} finished runs were restored from an earlier invocation's run archive (`--resume_from`, "
            "lconv/study/archive.py): their figures are as measured then, on the machine listed for them.")


def caveat(study: ml_collections.ConfigDict, rows: Sequence[Record]) -> str:
    """Why agreement or disagreement at this scale is weak evidence about the paper, with this study's sizes."""
    ref = next((r for r in rows if r["task"] == "translation" and r["params"]), None)
    if ref is None or "translation" not in study.tasks:
        return "No translation runs: nothing to set against the paper.\n"
    steps = plan.training_config(study, plan.RunKey("translation", study.reference_mixer, 0)).train.num_steps
    return (f"What this is evidence of: these models have {ref['params'] / 1e6:.2f}M parameters and train for "
            f"{steps} updates on ~30k DDTP En→De pairs, not the paper's 40-200M-parameter models trained to "
            "convergence on IWSLT/WMT. Agreement here says the paper's ordering already shows early in training at "
            "small scale; disagreement says it does not show there, which does not contradict the paper's "
            "converged results. The paper's gaps (0.4-0.8 BLEU) are small next to the seed spread of short runs, "
            "so only gaps that exceed the spread count either way.\n")


def headline(study: ml_collections.ConfigDict, rows: Sequence[Record], records: Sequence[Record],
             meta: Record) -> list[str]:
    """The closing note: each task's ordering, its mixers against the reference, and the wall time, from the
    numbers."""
    lines = []
    for task in study.tasks:
        task_rows = [r for r in rows if r["task"] == task]
        lines.append(f"- {task}: {ordering(task_rows, task)}. "
                     f"{versus_reference(task_rows, task, study.reference_mixer)}.")
    machines = " and ".join(m for m in run_machines(records) if m != "not recorded") or meta["machine"]["cpu"]
    seeds = f"{len(study.seeds)} seed{'s' if len(study.seeds) != 1 else ''} per mixer{limited_seeds(study)}"
    lines.append(f"- Wall time: {wall_time(meta)}, on {machines}; mode `{study.mode}`, {seeds}.")
    lines.append(f"- Orderings mark neighbours only ({ORDER_KEY}).")
    return lines
