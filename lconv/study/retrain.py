"""``--retrain``: archived runs trained again, each new figure set against the archived one and the spread of the
archived seeds, so a reader can check a committed result on their own machine (docs/results.md)."""
from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

from lconv.errors import UserError
from lconv.study import archive, plan, verdicts
from lconv.study import run as run_lib


def check_flags(names: Sequence[str], resume_from: str | None, docs_dir: str, report_only: bool) -> tuple[str, ...]:
    """The runs to train again, once each; one line when there is no archive to compare with, when the report
    would be written over it, or with ``--report_only``, which trains nothing."""
    names = tuple(dict.fromkeys(names))
    if not names:
        return ()
    if report_only:
        raise UserError("--retrain trains the runs it names; it does not go with --report_only")
    if resume_from is None:
        raise UserError("--retrain goes with --resume_from: the archive whose runs are trained again and compared")
    same = os.path.realpath(os.path.expanduser(docs_dir)) == os.path.realpath(os.path.expanduser(resume_from))
    if same:
        raise UserError(f"--retrain: pass a --docs_dir other than --resume_from={resume_from}, so that the archive "
                        "the runs are compared with stays as it is")
    return names


def check_planned(names: Sequence[str], planned: Sequence[plan.Planned], archive_root: str) -> None:
    """Each name is a run of the plan, ready to train (its sweep archived), with an archived result."""
    runs = {p.key.name: p for p in planned}
    for name in names:
        item = runs.get(name)
        if item is None:
            raise UserError(f"--retrain={name}: no run of this study has that name (task/mixer/seedK, e.g. "
                            f"{next(iter(runs), 'lm/transformer/seed0')}; --config.tasks, mixers and seeds "
                            "choose the plan)")
        why = item.not_applicable or item.error or item.waiting
        if why:
            raise UserError(f"--retrain={name}: it cannot be trained here: {why}")
        if not os.path.lexists(archive.archive_path(archive_root, name)):
            raise UserError(f"--retrain={name}: {archive_root} has no result of it to compare with")


def check_not_finished(names: Sequence[str], run_dirs: Sequence[str]) -> None:
    """A run folder that already holds a finished result (restored there by an earlier ``--resume_from``, or trained
    there before it was archived) would be skipped as finished, and the comparison would set the archive against
    itself."""
    for name, workdir in zip(names, run_dirs, strict=True):
        result = run_lib.read_json(os.path.join(workdir, run_lib.RESULT))
        if result is not None:
            how = "restored there by an earlier command" if result.get("restored") else "trained there"
            raise UserError(f"--retrain={name}: {workdir} already holds a finished result of it ({how}), which would "
                            "be skipped, not trained; retrain into a new --output_dir")


def compare(record: dict[str, Any], archive_root: str, planned_seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """The retrained run's headline figure, the archived run's, and the archived seeds' mean, sd and count (of
    ``planned_seeds`` alone when given: an archived seed the study does not plan is not in its spread)."""
    key, label, _ = verdicts.METRICS[record["task"]][0]
    folder = os.path.join(archive_root, record["task"], record["mixer"])
    planned = None if planned_seeds is None else {f"seed{k}.json" for k in planned_seeds}
    seeds = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "seed*.json"))):
        if planned is not None and os.path.basename(path) not in planned:
            continue
        entry = archive.read_entry(path, archive_root, {"kind": "seed", "task": record["task"]})
        seeds[os.path.basename(path)[:-len(".json")]] = entry["record"][key]
    archived = seeds.get(f"seed{record['seed']}")
    mean, sd, n = verdicts.mean_sd(list(seeds.values()))
    found = record.get(key) if record.get("status") == "ok" and not record.get("skipped") else None
    return {"run": plan.RunKey(record["task"], record["mixer"], record["seed"]).name, "figure": label,
            "retrained": found, "archived": archived, "archived_seeds": seeds, "mean": mean,
            "sd": sd if n >= 2 else None, "n": n,  # JSON has no NaN: no spread is None
            "within_spread": None if found is None or n < 2 else abs(found - archived) <= sd}


def describe(comparison: dict[str, Any]) -> str:
    """One line: the two figures, their difference and whether it is within the archived seeds' spread."""
    c = comparison
    if c["retrained"] is None:
        return f"retrained {c['run']}: did not finish; archived {c['figure']} {c['archived']:.2f}"
    change = c["retrained"] - c["archived"]
    relative = f", {change / c['archived']:+.2%}" if c["archived"] else ""
    line = (f"retrained {c['run']}: {c['figure']} {c['retrained']:.2f}, archived {c['archived']:.2f} "
            f"({change:+.2f}{relative})")
    if c["within_spread"] is None:
        return f"{line}; one archived seed, so no spread to compare with yet"
    verdict = "within" if c["within_spread"] else "outside"
    return f"{line}; {verdict} the archived seeds' spread ({c['mean']:.2f} ± {c['sd']:.2f}, n={c['n']})"
