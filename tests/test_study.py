"""The study (``python -m lconv.study``) end to end in its quick mode, on a scratch output and docs folder: one
run per task finishes and is scored, a deliberately broken run is reported as failed with its one-line error while
the study goes on, a mixer that does not fit a task is reported with the reason, and a second invocation skips
finished runs and resumes an unfinished one from its checkpoint."""
import csv
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time

import helpers
import log_capture
import pytest

from lconv.configs import study as study_config
from lconv.errors import UserError
from lconv.study import driver, plan, report
from lconv.study import run as run_lib

# slow: the quick study trains a run per task (run by CI, skipped by the quick command).
# One xdist worker runs them all (pyproject:
# --dist loadgroup), so their shared fixture is built once, not once per worker. It is session-scoped: the
# worker may run other modules' tests between these, and a module fixture would then be torn down and built again.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("study")]


def _quick(data_dir, **fields):
    """The quick study: the Transformer on every task, and CoLT5 made to fail (an invalid training field) where it
    fits: translation and summarization; it does not fit the LM (encoder-only). No tuning sweep (its runs would
    triple the processes): ``test_the_tuning_sweep_...`` runs one."""
    c = plan.normalize(study_config.get_config("quick"))
    c.mixers = ("transformer", "colt5")
    c.data_dir = str(data_dir)
    c.mixer_overrides = {"colt5": {"train": {"log_every": 0}}}
    c.tuning.steps = 0
    c.update(fields)
    return c


@pytest.fixture(scope="session")
def studied(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("study")
    # The suite's prepared corpus: translation and the LM read the copies prepared once, and the study prepares
    # what is missing, the summarization copy, beside them.
    study = _quick(tiny_data.data_dir, prune_checkpoints=False)  # kept, so the re-run below can resume from them
    collect = log_capture.Collect()  # caplog is per test; this fixture is per module
    with log_capture.attached(collect), pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", helpers.xla_flags())  # conftest's 8 virtual devices are for this process, not the runs
        records = driver.run_study(study, str(root / "out"), str(root / "docs"), command="test")
    return root, study, records, collect.messages


def _by_name(records):
    return {f"{r['task']}/{r['mixer']}": r for r in records}


def test_every_task_has_a_scored_run(studied):
    _, _, records, _ = studied
    runs = _by_name(records)
    assert {runs[f"{t}/transformer"]["status"] for t in plan.TASKS} == {"ok"}
    translation, lm, summary = (runs[f"{t}/transformer"] for t in plan.TASKS)
    assert 0 <= translation["bleu"] <= 100 and translation["bleu_signature"].startswith("nrefs:1")
    assert translation["test_examples"] == 1216  # the whole test split is decoded
    assert 1 < lm["ppl"] < 512 * 4  # an untrained model is near the uniform guess over its 512 pieces
    # The same summed NLL over fewer units: words hold several pieces, so a word costs more than a piece.
    assert lm["test_words"] < lm["test_tokens"] and lm["ppl_word"] > lm["ppl"]
    assert math.isclose(math.log(lm["ppl_word"]) * lm["test_words"], math.log(lm["ppl"]) * lm["test_tokens"],
                        rel_tol=1e-4)
    assert all(0 <= summary[k] <= 100 for k in ("rouge1", "rouge2", "rougeL"))
    for record in (translation, lm, summary):
        assert record["step"] == 12 and record["averaged_steps"] == [8, 12]  # the last 2 checkpoints averaged
        assert record["train_tokens_per_s"] > 0 and record["decode_tokens_per_s"] > 0
        assert record["train_step_bytes"] > 0 and record["train_step_memory_source"] == "memory_analysis"
        assert record["peak_rss_bytes"] > 100 * 2**20  # a whole JAX process
        assert record["params"] == record["reference_params"]  # the reference is the Transformer itself
        assert record["machine"]["cpu"] and record["machine"]["jax"].startswith("jax ")  # measured where, kept


def test_a_failing_run_is_reported_and_the_study_goes_on(studied):
    root, _, records, lines = studied
    runs = _by_name(records)
    for task in ("translation", "summarization"):
        failed = runs[f"{task}/colt5"]
        assert failed["status"] == "failed"
        assert failed["error"] == "config.train.log_every=0: must be an integer >= 1"
        assert failed["stage"] == "train"
        assert os.path.exists(root / "out" / failed["workdir"] / "study_failure.json")
    assert runs["lm/colt5"]["status"] == "n/a" and "encoder-only" in runs["lm/colt5"]["error"]
    assert runs["summarization/transformer"]["status"] == "ok"  # planned after the first failure
    assert any("translation/colt5/seed0: failed: config.train.log_every=0" in line for line in lines)


def test_the_report_files(studied):
    root, _, records, _ = studied
    docs = root / "docs"
    text = (docs / "results.md").read_text()
    for task in plan.TASKS:
        assert report.TASK_TITLES[task] in text
    assert "**failed** seed 0: config.train.log_every=0: must be an integer >= 1" in text
    assert "**not applicable**: CoLT5 is encoder-only" in text
    assert "## Against the paper's ordering" in text and "Not compared" in text  # no LightConv/DynamicConv runs
    assert "3 finished, 2 failed, 1 not applicable, 0 not run" in text.replace("**", "")
    saved = json.loads((docs / "results" / "results.json").read_text())
    assert len(saved["runs"]) == len(records) == 6
    assert {(r["task"], r["mixer"]) for r in saved["aggregate"]} == {(t, m) for t in plan.TASKS
                                                                     for m in ("transformer", "colt5")}
    with open(docs / "results" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows].count("ok") == 3
    for name in ("quality_vs_speed.png", "training_curves.png"):
        assert (docs / "results" / name).read_bytes()[:4] == b"\x89PNG"


def test_a_rerun_skips_finished_runs_and_resumes_unfinished_ones(studied):
    root, study, _, _ = studied
    out = root / "out"
    finished = out / "runs" / "lm" / "transformer" / "seed0" / "study_result.json"
    before = finished.stat().st_mtime_ns
    unfinished = out / "runs" / "translation" / "transformer" / "seed0"
    (unfinished / "study_result.json").unlink()  # as if the run had been stopped after its last checkpoint
    study.mixers = ("transformer",)
    records = driver.run_study(study, str(out), str(root / "docs2"), command="test")
    runs = _by_name(records)
    assert runs["lm/transformer"].get("skipped") and runs["summarization/transformer"].get("skipped")
    assert finished.stat().st_mtime_ns == before
    assert not runs["translation/transformer"].get("skipped") and runs["translation/transformer"]["status"] == "ok"
    log = (unfinished / "study.log").read_text()
    assert "resumed from step 12" in log  # train.py's own resume: no step was trained again
    train_rows = [json.loads(line) for line in (unfinished / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in train_rows if r["split"] == "train") == 12


def test_a_study_config_edited_since_its_runs_were_made_is_refused(studied):
    """Otherwise an edited study would skip (or resume) runs trained with the old config and report them as its
    own: every run folder's stored config is compared with the plan before anything runs."""
    root, study, _, _ = studied
    edited = plan.normalize(study)
    edited.mixer_overrides = {**edited.mixer_overrides.to_dict(), "transformer": {"model": {"dropout": 0.25}}}
    with pytest.raises(UserError, match=r"translation/transformer/seed0.*config\.model\.dropout.*0\.1.*0\.25"):
        driver.run_study(edited, str(root / "out"), str(root / "docs3"), command="test")
    assert not (root / "docs3").exists()


def test_a_study_resumed_from_its_archive_trains_nothing_and_reports_the_same_runs(studied, tmp_path,
                                                                                   monkeypatch, lconv_log):
    """The scratch output dir is gone (a new machine, a session cut off): the archive the report wrote into the
    docs dir, a few KB per finished run, stands in for the finished runs, figures and training curves intact."""
    root, study, records, _ = studied
    archive_root = root / "docs" / "results" / "runs"
    assert sorted(p.relative_to(archive_root).as_posix() for p in archive_root.rglob("*.json")) == [
        f"{task}/transformer/seed0.json" for task in sorted(plan.TASKS)]  # the finished runs; not the failed ones
    out = tmp_path / "out"
    shutil.copytree(root / "out" / "tokenizers", out / "tokenizers")  # no tokenizer to train again
    monkeypatch.setattr(run_lib, "_run_process", lambda *args: pytest.fail("a restored run was trained again"))
    only = plan.normalize(study)
    only.mixers = ("transformer",)
    resumed = driver.run_study(only, str(out), str(tmp_path / "docs"), resume_from=str(root / "docs"),
                               command="test")
    assert any(line.startswith("restored 3 finished seed runs from") for line in lconv_log())
    before, after = _by_name(records), _by_name(resumed)
    for name, record in after.items():
        assert record["status"] == "ok" and record["restored"]
        for key in ("bleu", "ppl", "ppl_word", "rougeL", "train_tokens_per_s", "decode_tokens_per_s", "machine",
                    "wall_seconds", "step", "params"):
            assert record.get(key) == before[name].get(key), (name, key)
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "3 finished runs were restored from an earlier invocation's run archive" in text
    assert (tmp_path / "docs" / "results" / "training_curves.png").read_bytes()[:4] == b"\x89PNG"
    rewritten = tmp_path / "docs" / "results" / "runs" / "lm" / "transformer" / "seed0.json"
    original = json.loads((archive_root / "lm" / "transformer" / "seed0.json").read_text())
    assert json.loads(rewritten.read_text()) == original  # archiving a restored run gives back the same entry

    edited = plan.normalize(only)
    edited.mixer_overrides = {**edited.mixer_overrides.to_dict(), "transformer": {"model": {"dropout": 0.25}}}
    shutil.copytree(root / "out" / "tokenizers", tmp_path / "out2" / "tokenizers")
    with pytest.raises(UserError, match=r"translation/transformer/seed0.*config\.model\.dropout.*0\.1.*0\.25"):
        driver.run_study(edited, str(tmp_path / "out2"), str(tmp_path / "docs2"), resume_from=str(root / "docs"),
                         command="test")
    assert not (tmp_path / "out2" / "runs").exists()  # refused before anything was copied
    with pytest.raises(UserError, match=r"^--resume_from=.*results/runs/"):
        driver.run_study(only, str(tmp_path / "out3"), str(tmp_path / "docs3"), resume_from=str(tmp_path),
                         command="test")


def test_a_retrained_run_gives_its_archived_figure(studied, tmp_path, lconv_log):
    """``--retrain``: one archived run trained again in a new output folder while the others are restored and
    nothing else trains; with the same code on the same host its figure is the archived one, and the comparison
    says so. Asked for without an archive to compare with, or over it, or for a run the archive lacks: one line."""
    root, shared, records, _ = studied
    study = plan.normalize(shared)
    study.mixers = ("transformer", "colt5")  # the fixture's plan (another test narrows the shared config)
    out = tmp_path / "out"
    shutil.copytree(root / "out" / "tokenizers", out / "tokenizers")
    archived, docs = str(root / "docs"), str(tmp_path / "docs")
    for changed, message in [(dict(resume_from=None), "^--retrain goes with --resume_from"),
                             (dict(docs_dir=archived), "a --docs_dir other than --resume_from"),
                             (dict(retrain_runs=["lm/transformer/seed9"]), "no run of this study has that name"),
                             (dict(retrain_runs=["translation/colt5/seed0"]), "has no result of it to compare"),
                             (dict(report_only=True), "does not go with --report_only")]:
        call = {"docs_dir": docs, "resume_from": archived, "retrain_runs": ["lm/transformer/seed0"], **changed}
        with pytest.raises(UserError, match=message):
            driver.run_study(study, str(out), call.pop("docs_dir"), command="test", **call)
    restored = tmp_path / "restored"  # an earlier --resume_from put the archived result there (r28-36)
    shutil.copytree(root / "out" / "tokenizers", restored / "tokenizers")
    with pytest.MonkeyPatch.context() as env:
        env.setattr(run_lib, "_run_process", lambda *args: pytest.fail("nothing is trained"))
        driver.run_study(study, str(restored), str(tmp_path / "docs_r"), resume_from=archived, command="test",
                         report_only=True)  # restores the archived runs, trains nothing
        with pytest.raises(UserError, match="lm/transformer/seed0.*already holds.*restored there.*new --output_dir"):
            driver.run_study(study, str(restored), str(tmp_path / "docs_r"), resume_from=archived, command="test",
                             retrain_runs=["lm/transformer/seed0"])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", helpers.xla_flags())
        again = _by_name(driver.run_study(study, str(out), docs, resume_from=archived, command="test",
                                          retrain_runs=["lm/transformer/seed0"]))
    (compared,) = json.loads((out / "retrained.json").read_text())
    assert compared["run"] == "lm/transformer/seed0" and compared["n"] == 1 and compared["within_spread"] is None
    assert compared["retrained"] == compared["archived"] == _by_name(records)["lm/transformer"]["ppl"]
    assert again["lm/transformer"]["status"] == "ok" and not again["lm/transformer"].get("restored")
    assert again["translation/transformer"]["restored"] and again["translation/colt5"]["status"] == "not run"
    assert any(line.startswith("retrained lm/transformer/seed0: test ppl/token") for line in lconv_log())
    # The folder now holds a run trained there, as the one an archive was made from does: skipped, it would
    # "reproduce" the archived figure exactly without training (r29-18).
    with pytest.raises(UserError, match="lm/transformer/seed0.*already holds.*trained there.*new --output_dir"):
        driver.run_study(study, str(out), docs, resume_from=archived, command="test",
                         retrain_runs=["lm/transformer/seed0"])


def test_the_tuning_sweep_chooses_on_validation_and_its_archive_resumes_it(studied, tmp_path, monkeypatch,
                                                                          lconv_log):
    """One rate's short run, its checkpoint decoded on the validation split at two length penalties, then the seed
    trained and decoded at the choice (tests/test_study_tuning.py checks the choosing itself). A study resumed from
    the archive the sweep wrote trains and decodes nothing."""
    root = studied[0]
    study = _quick(studied[1].data_dir, mixers=("transformer",), tasks=("translation",))
    study.tuning.update({"steps": 6, "learning_rates": (6e-3,), "lenpens": (1.0, 1.5)})
    out = tmp_path / "out"
    shutil.copytree(root / "out" / "tokenizers", out / "tokenizers")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", helpers.xla_flags())
        records = driver.run_study(study, str(out), str(tmp_path / "docs"), command="test")
    saved = json.loads((tmp_path / "docs" / "results" / "results.json").read_text())
    tune, lenpen = saved["tuning"]["runs"]
    assert tune["status"] == "ok" and tune["step"] == 6 and 0 < tune["validation_nll"] < 10
    assert lenpen["status"] == "ok" and set(lenpen["scores"]) == {"1", "1.5"}
    chosen = 1.0 if lenpen["scores"]["1"] >= lenpen["scores"]["1.5"] else 1.5
    assert saved["tuning"]["chosen"] == [{"task": "translation", "mixer": "transformer", "learning_rate": 6e-3,
                                          "lenpen": chosen}]
    spec = json.loads((out / "runs" / "translation" / "transformer" / "seed0" / "study_spec.json").read_text())
    assert spec["config"]["optim"]["learning_rate"] == 6e-3 and spec["config"]["decode"]["lenpen"] == chosen
    assert records[0]["status"] == "ok" and records[0]["test_examples"] == 1216
    decoded = (out / "runs" / "translation" / "transformer" / "tune_lr0.006" / "validation.hyp.txt")
    assert decoded.exists() and not (decoded.parent / "test.hyp.txt").exists()  # the sweep never reads test
    assert "## Tuning: each mixer's recipe" in (tmp_path / "docs" / "results.md").read_text()
    archive_dir = tmp_path / "docs" / "results" / "runs" / "translation" / "transformer"
    archived = sorted(p.name for p in archive_dir.iterdir())
    assert archived == ["lenpen_lr0.006.json", "seed0.json", "tune_lr0.006.json"]

    # An archive holding the tuning run but not its length-penalty sweep (a study stopped between them, resumed on
    # another machine): the restored run keeps no checkpoint, so it trains again and the sweep decodes the same.
    partial = tmp_path / "docs_partial"
    shutil.copytree(tmp_path / "docs", partial)
    (partial / "results" / "runs" / "translation" / "transformer" / "lenpen_lr0.006.json").unlink()
    shutil.copytree(out / "tokenizers", tmp_path / "out3" / "tokenizers")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", helpers.xla_flags())
        driver.run_study(study, str(tmp_path / "out3"), str(tmp_path / "docs3"), resume_from=str(partial),
                         command="test")
    again = json.loads((tmp_path / "docs3" / "results" / "results.json").read_text())["tuning"]
    assert again["runs"][1]["scores"] == lenpen["scores"] and again["chosen"] == saved["tuning"]["chosen"]

    monkeypatch.setattr(run_lib, "_run_process", lambda *args: pytest.fail("a restored run was run again"))
    shutil.copytree(out / "tokenizers", tmp_path / "out2" / "tokenizers")
    resumed = driver.run_study(study, str(tmp_path / "out2"), str(tmp_path / "docs2"),
                               resume_from=str(tmp_path / "docs"), command="test")
    assert resumed[0]["restored"] and resumed[0]["bleu"] == records[0]["bleu"]
    again = json.loads((tmp_path / "docs2" / "results" / "results.json").read_text())["tuning"]
    assert again["chosen"] == saved["tuning"]["chosen"]
    assert any(line.startswith("restored 2 finished tuning-sweep runs from") for line in lconv_log())


def test_the_speed_table_is_measured_in_the_study_process_and_reported(studied, tmp_path):
    """``--report_only --speed``: every mixer's real train step and decoding pass, in this process, into
    results/speed.json and the report's speed table (tests/test_study_tuning.py checks the turns and medians)."""
    root, study, _, _ = studied
    only = plan.normalize(study)
    only.tasks, only.mixers = ("translation", "lm"), ("transformer", "colt5")  # an earlier test narrows `study`
    driver.run_study(only, str(root / "out"), str(tmp_path / "docs"), report_only=True, command="test",
                     measure_speed=True)
    measured = json.loads((tmp_path / "docs" / "results" / "speed.json").read_text())
    assert {(r["task"], r["mixer"]) for r in measured["rows"]} == {("translation", "transformer"),
                                                                   ("translation", "colt5"), ("lm", "transformer")}
    for row in measured["rows"]:
        assert row["train_tokens_per_s"] > 0 and row["decode_sentences_per_s"] > 0 and row["rounds"] == 5
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "## Speed, side by side in one process" in text and "| CoLT5 |" in text


def _processes_running(text: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains ``text``, from ``ps``."""
    command = ["ps", "-ww", "-eo", "pid=,stat=,args="]  # -ww: whole command lines whatever COLUMNS says
    listing = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 2) for line in listing.splitlines()]
    return [int(row[0]) for row in rows if len(row) == 3 and text in row[2] and not row[1].startswith("Z")]


def test_sigterm_to_the_study_stops_the_run_it_is_waiting_for(studied, tmp_path):
    """``kill <study>`` (or a scheduler's SIGTERM to the main process) must not leave the run training on unseen:
    the study passes the signal on, waits for the run to exit, and ends with one line."""
    root = studied[0]
    out = tmp_path / "out"
    shutil.copytree(root / "out" / "tokenizers", out / "tokenizers")  # no tokenizer to train again
    spec = out / "runs" / "lm" / "transformer" / "seed0" / "study_spec.json"
    env = {**os.environ, "XLA_FLAGS": helpers.xla_flags()}
    study = subprocess.Popen([sys.executable, "-m", "lconv.study", "--config=configs/study.py:quick",
                              "--config.tasks=lm", "--config.mixers=transformer", "--config.tuning.steps=0",
                              f"--config.data_dir={studied[1].data_dir}",
                              f"--output_dir={out}", f"--docs_dir={tmp_path / 'docs'}"],
                             cwd=pathlib.Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not _processes_running(str(spec)) and study.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    run_pids = _processes_running(str(spec))
    assert run_pids, "the run's process never started"
    study.terminate()
    _, stderr = study.communicate(timeout=120)
    assert study.returncode == 2 and stderr.strip().splitlines()[-1].startswith(
        "error: stopped by SIGTERM while running"), stderr[-800:]
    assert not _processes_running(str(spec)), "the run outlived the study"
