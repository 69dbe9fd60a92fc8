"""The study's run archive: every finished run, small enough to commit, and a later study resumed from it.

The report writes ``<docs_dir>/results/runs/<task>/<mixer>/seed<k>.json`` per finished run (its record, config and
``metrics.jsonl`` rows); ``--resume_from=<docs_dir>`` copies each archived run whose config equals the plan's back as a
finished run, so a study split over several sessions goes on where its archive ends.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from lconv import json_text, outputs, shared_folders
from lconv.data import paths
from lconv.errors import UserError, first_line
from lconv.study import figures, measure, plan
from lconv.study import run as run_lib

logger = logging.getLogger(__name__)

ARCHIVE_DIR = os.path.join("results", "runs")  # under the docs dir


def entry_name(record: dict[str, Any]) -> str:
    """A record's archive entry, ``<task>/<mixer>/<run>``: ``seed<k>``, ``tune_lr<rate>`` or ``lenpen_lr<rate>``."""
    kind, task, mixer = record.get("kind"), record["task"], record["mixer"]
    if kind in ("tune", "lenpen"):
        return f"{task}/{mixer}/{kind}_lr{float(record['learning_rate']):g}"
    return plan.RunKey(task, mixer, record["seed"]).name


def archive_path(archive_root: str, name: str) -> str:
    return os.path.join(archive_root, *name.split("/")) + ".json"


def write_archive(records: Sequence[dict[str, Any]], output_dir: str, docs_dir: str, *, prune: bool = False) -> int:
    """Archives every finished run of ``records``; returns how many. ``prune``: delete the entries of runs the plan
    no longer has; a planned run that did not finish in this output keeps its entry (a stopped or handed-over
    output folder never costs a committed result)."""
    root, written = os.path.join(docs_dir, ARCHIVE_DIR), 0
    kept = {os.path.abspath(archive_path(root, entry_name(record))) for record in records}
    for record in records:
        if record.get("status") != "ok":
            continue
        workdir = os.path.join(output_dir, record["workdir"])
        spec, damaged = run_lib.load_json(os.path.join(workdir, run_lib.SPEC))
        if spec is None:
            found = f"a damaged {run_lib.SPEC} ({damaged})" if damaged else f"no {run_lib.SPEC}"
            logger.info(f"archive: {record['workdir']} has {found}; not archived")
            continue
        entry = {"record": {k: v for k, v in record.items() if k not in ("skipped", "restored")},
                 "config": spec["config"], "metrics": measure.read_metrics(workdir)}
        path = archive_path(root, entry_name(record))
        if not paths.is_within(path, root):
            raise UserError(f"the study record of {record['workdir']} names the archive entry {path}, outside {root}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        run_lib.write_json(path, entry)
        written += 1
    if prune:
        for folder, _, names in os.walk(root):
            for name in names:
                if name.endswith(".json") and os.path.abspath(os.path.join(folder, name)) not in kept:
                    logger.info(f"archive: {os.path.join(folder, name)} is no run of this plan; removed")
                    os.remove(os.path.join(folder, name))
    return written


def resolve(resume_from: str) -> str:
    """The archive folder of ``--resume_from`` (a study's docs dir); a one-line error when it has none."""
    docs = os.path.abspath(os.path.expanduser(resume_from))
    root = os.path.join(docs, ARCHIVE_DIR)
    if not os.path.isdir(root):
        raise UserError(f"--resume_from={resume_from} has no {ARCHIVE_DIR}/ (the run archive a study's report "
                        "writes into its --docs_dir)")
    for folder in (os.path.join(docs, "results"), root):  # a linked archive was read from wherever it led
        if os.path.islink(folder):
            raise UserError(f"--resume_from={resume_from}: {folder} is a link; the archive is read from plain "
                            "folders (copy it there)")
    shared_folders.check(os.path.join(os.path.expanduser(resume_from), ARCHIVE_DIR), f"--resume_from={resume_from}")
    return root


ENTRY_LIMIT = 64 << 20  # bytes: an entry holds one run's record, config and metrics rows (tens of kB)


def restore(planned: Sequence[tuple[str, Any, str, dict[str, Any]]], archive_root: str, kind: str = "runs") -> int:
    """Copies each archived run of ``planned`` (name, config, workdir, the plan's record) into its workdir as a
    finished run unless it has a result; returns how many (the log line calls them ``kind``). Raises, before
    copying, on a config that differs from the plan's or an entry that is not one. An entry's figures are its own;
    what the run is and where it lives (task, mixer, seed, rate, workdir) are the plan's, never the entry's: an
    archive from elsewhere had a record name another folder, whose checkpoints the sweep then deleted."""
    todo = []
    for name, config, workdir, record in planned:
        path = archive_path(archive_root, name)
        if config is None or not os.path.lexists(path):
            continue
        if os.path.exists(os.path.join(workdir, run_lib.RESULT)):
            continue
        entry = read_entry(path, archive_root, record)
        todo.append((name, workdir, {**entry, "record": {**entry["record"], **record}}, config))
    plan.check_stored_configs([(name, entry["config"], config) for name, _, entry, config in todo],
                              f"--resume_from archive {archive_root} holds runs made with another study config",
                              "resume into a study with the config they were made with")
    for _, workdir, entry, _ in todo:
        _write_run(workdir, entry)
    if todo:
        logger.info(f"restored {len(todo)} finished {kind} from {archive_root}")
    return len(todo)


def read_entry(path: str, archive_root: str, record: dict[str, Any]) -> dict[str, Any]:
    """The archive entry at ``path``: a regular file inside the archive holding a record, a config and metrics rows,
    with the figures a run of ``record``'s kind reports as finite numbers; else one line naming it."""
    data = paths.read_bytes(path, "missing", within=archive_root, limit=ENTRY_LIMIT)
    try:
        entry = json_text.loads(data)
    except ValueError as err:
        raise UserError(f"{path}: not a study run archive entry ({first_line(err, 120)})") from None
    if not (isinstance(entry, dict) and isinstance(entry.get("record"), dict) and isinstance(entry.get("config"), dict)
            and isinstance(entry.get("metrics"), list) and all(isinstance(row, dict) for row in entry["metrics"])):
        raise UserError(f"{path} is not a study run archive entry (a record, a config and metrics rows)")
    if not all(isinstance(row.get("split"), str) and figures.is_number(row.get("step")) for row in entry["metrics"]):
        raise UserError(f"{path}: a metrics row without its split and step")
    figures.check_figures(entry["record"], record, path)
    return entry


def _write_run(workdir: str, entry: dict[str, Any]) -> None:
    """The files of a finished run the study reads: spec, metrics, and last the result, which marks it finished."""
    outputs.claim_directory(workdir, "workdir", "a study run's folder")
    run_lib.write_json(os.path.join(workdir, run_lib.SPEC),
                       {"config": entry["config"], "workdir": workdir, "record": entry["record"]})
    outputs.write_atomically(os.path.join(workdir, "metrics.jsonl"),
                             "".join(json.dumps(row) + "\n" for row in entry["metrics"]))
    run_lib.write_json(os.path.join(workdir, run_lib.RESULT), {**entry["record"], "restored": True})
