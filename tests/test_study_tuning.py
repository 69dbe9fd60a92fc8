"""The fair-recipe sweep (``lconv.study.tuning``) without training: which processes it runs, what it chooses from
their validation figures, and how the seeds' configs take the choice. A fake launcher stands in for the run
processes; tests/test_study.py runs the sweep for real in the quick study."""
import pytest

from lconv.configs import study as study_config
from lconv.errors import UserError
from lconv.study import archive, driver, plan, report, tuning
from lconv.study import run as run_lib

VOCAB = {"translation": 512, "lm": 512}


@pytest.fixture(scope="module")
def quick_plan():
    study = plan.normalize(study_config.get_config("quick"))
    study.tasks, study.mixers, study.seeds = ("translation", "lm"), ("transformer", "dynamic"), (0, 1)
    return study, plan.templates(study, VOCAB)


class FakeLauncher:
    """Answers each sweep process from tables: validation NLL per (task, mixer, rate), validation scores per
    length penalty; ``fail`` names processes that fail. Records what was launched."""

    def __init__(self, nll, scores, fail=()):
        self.nll, self.scores, self.fail, self.launched = nll, scores, set(fail), []

    def __call__(self, sweep):
        self.launched.append(sweep.name)
        r = sweep.record
        if sweep.name in self.fail:
            return {**r, "status": "failed", "error": "boom"}
        if r["kind"] == "tune":
            return {**r, "status": "ok", "validation_nll": self.nll[(r["task"], r["mixer"], r["learning_rate"])]}
        return {**r, "status": "ok", "scores": self.scores[(r["task"], r["mixer"])]}


def _nll(best_translation_rate, best_lm_rate):
    """Lower NLL at the named rate, per task, for both mixers."""
    table = {}
    for task, best in (("translation", best_translation_rate), ("lm", best_lm_rate)):
        for mixer in ("transformer", "dynamic"):
            for rate in (3e-3, 6e-3):
                table[(task, mixer, rate)] = 4.0 if rate == best else 4.5
    return table


def test_each_mixer_gets_the_rate_with_the_lowest_validation_nll_and_the_best_length_penalty(quick_plan):
    study, templates = quick_plan
    sweeps = tuning.planned_sweeps(study, templates)
    scores = {("translation", "transformer"): {"1": 10.0, "1.5": 12.0},
              ("translation", "dynamic"): {"1": 11.0, "1.5": 11.0}}  # a tie: the first listed wins
    launch = FakeLauncher(_nll(6e-3, 3e-3), scores)
    choices, records = tuning.choose(study, sweeps, "/nowhere", launch)
    assert choices[("translation", "transformer")].learning_rate == 6e-3
    assert choices[("translation", "transformer")].lenpen == 1.5
    assert choices[("translation", "dynamic")].lenpen == 1.0
    assert choices[("lm", "dynamic")].learning_rate == 3e-3 and choices[("lm", "dynamic")].lenpen is None
    # Only the chosen rate's run is decoded, and never for the LM; each process once, none of the test split.
    assert launch.launched == [
        "translation/transformer/tune_lr0.003", "translation/transformer/tune_lr0.006",
        "translation/transformer/lenpen_lr0.006", "translation/dynamic/tune_lr0.003",
        "translation/dynamic/tune_lr0.006", "translation/dynamic/lenpen_lr0.006",
        "lm/transformer/tune_lr0.003", "lm/transformer/tune_lr0.006", "lm/dynamic/tune_lr0.003",
        "lm/dynamic/tune_lr0.006"]
    assert len(records) == len(launch.launched)
    for sweep in sweeps:  # short runs of the tuning seed at their rate, validated once at their end
        c = sweep.config
        assert c.train.num_steps == study.tuning.steps == c.train.eval_every and c.seed == study.tuning.seed
        assert c.optim.learning_rate == sweep.record["learning_rate"]
    # Every seed of a mixer trains and decodes at its choice; the matched FFN width is kept.
    planned = plan.expand(study, templates, _recipe(study, choices))
    assert len(planned) == 2 * 4
    for run in planned:
        choice = choices[(run.key.task, run.key.mixer)]
        assert run.config.optim.learning_rate == choice.learning_rate and run.waiting is None
        if run.key.task == "translation":
            assert run.config.decode.lenpen == choice.lenpen
        template = next(t for t in templates if t.key.task == run.key.task and t.key.mixer == run.key.mixer)
        assert run.config.model.ffn_dim == template.config.model.ffn_dim
    text = "\n".join(report.tuning_lines(study, records, choices))
    assert "| Transformer | 4.5000 | 4.0000 | **0.006** | 10.00 | 12.00 | **1.5** |" in text
    assert "| DynamicConv | 4.0000 | 4.5000 | **0.003** |" in text  # the LM table has no length penalty


def _recipe(study, choices):
    from lconv.study import driver

    return driver._recipe(study, choices)


def test_an_incomplete_sweep_leaves_its_seeds_waiting_not_run_at_another_recipe(quick_plan):
    study, templates = quick_plan
    sweeps = tuning.planned_sweeps(study, templates)
    launch = FakeLauncher(_nll(3e-3, 3e-3), {("translation", m): {"1": 1.0, "1.5": 2.0}
                                              for m in ("transformer", "dynamic")},
                          fail={"translation/dynamic/tune_lr0.006", "translation/transformer/lenpen_lr0.003"})
    choices, _ = tuning.choose(study, sweeps, "/nowhere", launch)
    assert ("translation", "dynamic") not in choices and ("translation", "transformer") not in choices
    assert "translation/dynamic/lenpen_lr0.003" not in launch.launched  # no decoding of an unfinished sweep
    planned = plan.expand(study, templates, _recipe(study, choices))
    waiting = {run.key.name for run in planned if run.waiting}
    assert waiting == {f"translation/{m}/seed{s}" for m in ("transformer", "dynamic") for s in (0, 1)}


def test_the_archive_names_each_sweep_process_and_a_task_runs_its_first_seeds(quick_plan):
    study, templates = quick_plan
    for sweep in tuning.planned_sweeps(study, templates):
        assert archive.entry_name(sweep.record) == sweep.name
        assert archive.archive_path("/a", sweep.name) == f"/a/{sweep.name}.json"
    assert archive.entry_name({"task": "lm", "mixer": "dynamic", "seed": 2}) == "lm/dynamic/seed2"
    limited = plan.normalize(study)
    limited.translation.max_seeds = 1
    runs = plan.expand(limited, templates)
    assert sorted(r.key.seed for r in runs if r.key.task == "translation") == [0, 0]
    assert sorted(r.key.seed for r in runs if r.key.task == "lm") == [0, 0, 1, 1]
    full = plan.normalize(study_config.get_config("full"))
    assert plan.task_seeds(full, "summarization") == (0, 1) and plan.task_seeds(full, "lm") == (0, 1, 2)


@pytest.mark.parametrize("field, value, message", [
    ("steps", -1, "config.tuning.steps=-1"), ("learning_rates", (), "config.tuning.learning_rates=[]"),
    ("lenpens", (1.0, 1.0), "config.tuning.lenpens=[1.0, 1.0]"), ("seed", -2, "config.tuning.seed=-2")])
def test_bad_tuning_fields_are_one_line_errors(field, value, message):
    study = plan.normalize(study_config.get_config("quick"))
    study.tuning[field] = value
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tuning.check(study)


def test_a_length_penalty_sweep_made_with_other_penalties_is_refused(quick_plan):
    study, templates = quick_plan
    sweeps = [s for s in tuning.planned_sweeps(study, templates) if s.record["task"] == "translation"]

    def launch(sweep):
        if sweep.record["kind"] == "tune":
            return {**sweep.record, "status": "ok", "validation_nll": 1.0}
        return {**sweep.record, "status": "ok", "lenpens": [1.0, 2.0], "scores": {"1": 1.0, "2": 2.0}}

    with pytest.raises(UserError, match=r"translation/transformer/lenpen_lr0.003 decoded at length penalties"):
        tuning.choose(study, sweeps, "/nowhere", launch)


def test_the_speed_table_alternates_the_mixers_in_one_process_and_drops_the_compiling_round(quick_plan,
                                                                                             monkeypatch):
    """Turns, not blocks: every round times each mixer once (train, then decode), so a change in the host's load
    falls on all of them; round 0 compiles and is not counted. Fake programs that advance a fake clock."""
    from lconv.bench import timing
    from lconv.study import speed

    study, templates = quick_plan
    study = plan.normalize(study)
    study.tasks = ("translation",)
    clock, calls = [0.0], []
    cost = {("transformer", "train"): 2.0, ("dynamic", "train"): 1.0, ("transformer", "decode"): 4.0,
            ("dynamic", "decode"): 1.0}

    def program(mixer, kind):
        def call():
            calls.append((mixer, kind))
            clock[0] += cost[(mixer, kind)] * (10 if len(calls) <= 4 else 1)  # the first round compiles: slow
        return call

    monkeypatch.setattr(speed, "_shared_inputs", lambda config, directory: (None, None))
    monkeypatch.setattr(speed, "_contender", lambda t, batch, sources, study: speed._Contender(
        t.key.mixer, program(t.key.mixer, "train"), program(t.key.mixer, "decode"), 1000, 64))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])  # timing.alternate's clock
    rows = speed.measure(study, templates, {"translation": "/nowhere"}, rounds=3)
    assert calls == [(m, k) for _ in range(4) for m in ("transformer", "dynamic") for k in ("train", "decode")]
    by_mixer = {r["mixer"]: r for r in rows}
    assert [by_mixer[m]["train_tokens_per_s"] for m in ("transformer", "dynamic")] == [500, 1000]
    assert [by_mixer[m]["decode_sentences_per_s"] for m in ("transformer", "dynamic")] == [16, 64]
    text = "\n".join(report.speed_lines(study, {"machine": {"cpu": "test cpu"}, "rows": rows}))
    assert "| DynamicConv | 1,000 | 2.00x | 64.0 | 4.00x |" in text and "test cpu" in text
    assert "Not measured yet" in "\n".join(report.speed_lines(study, None))


# ----------------------------------------------------------------------------------------------------------------
# A --resume_from archive from elsewhere: its figures are read, what a run is and where it lives are the plan's
# ----------------------------------------------------------------------------------------------------------------
def _hostile_archive(tmp_path, quick_plan, **record_fields):
    """An archive holding the first planned tuning run, its record edited by ``record_fields``."""
    import json

    study, templates = quick_plan
    sweep = tuning.planned_sweeps(study, templates)[0]
    root = tmp_path / "docs" / "results" / "runs"
    path = tmp_path / "docs" / archive.archive_path("results/runs", sweep.name)
    path.parent.mkdir(parents=True)
    record = {**sweep.record, "status": "ok", "validation_nll": 1.5, "step": 6, **record_fields}
    path.write_text(json.dumps({"record": record, "config": sweep.config.to_dict(), "metrics": []}))
    workdir = tmp_path / "out" / sweep.record["workdir"]
    return sweep, str(root), path, (sweep.name, sweep.config, str(workdir), sweep.record)


def test_a_restored_record_names_the_plans_folder_not_the_archives(quick_plan, tmp_path):
    """An archived record naming another folder ("workdir": a victim run, "task": ../..) had the sweep delete that
    run's checkpoints and the report overwrite a file outside the archive."""
    import json

    victim = tmp_path / "victim"
    (victim / "checkpoints").mkdir(parents=True)
    sweep, root, _, planned = _hostile_archive(tmp_path, quick_plan, workdir=str(victim), task="../../../victim",
                                               mixer="x")
    assert archive.restore([planned], root) == 1
    restored = json.loads((tmp_path / "out" / sweep.record["workdir"] / "study_result.json").read_text())
    assert {k: restored[k] for k in sweep.record} == sweep.record and restored["validation_nll"] == 1.5
    assert archive.entry_name(restored) == sweep.name
    # A result file edited in the output folder itself: the study reads its figures, and the plan's folder.
    result = tmp_path / "out" / sweep.record["workdir"] / "study_result.json"
    result.write_text(json.dumps({**restored, "workdir": str(victim)}))
    assert run_lib.read_record(str(result.parent), sweep.record)["workdir"] == sweep.record["workdir"]
    skipped = run_lib.launch({"record": sweep.record}, str(result.parent), "unused", 1.0)
    assert skipped["workdir"] == sweep.record["workdir"] and skipped["skipped"]
    assert (victim / "checkpoints").is_dir()


@pytest.mark.parametrize("damage", ["fifo", "nested", "figure_a_string", "not_an_object", "speed_a_string",
                                    "metrics_row_without_split"])
def test_a_damaged_archive_entry_is_one_line(quick_plan, tmp_path, damage):
    """A FIFO entry hung the study; JSON nested 100,000 deep was a RecursionError traceback; a string figure a
    TypeError in the report."""
    import json
    import os

    import helpers

    fields = {"figure_a_string": {"validation_nll": "low"}, "speed_a_string": {"train_tokens_per_s": "fast"}}
    _, root, path, planned = _hostile_archive(tmp_path, quick_plan, **fields.get(damage, {}))
    if damage == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif damage == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "not_an_object":
        path.write_text("[1, 2]")
    elif damage == "metrics_row_without_split":  # a 31-line KeyError in the report, after the study's training
        entry = json.loads(path.read_text())
        path.write_text(json.dumps({**entry, "metrics": [{}]}))
    with pytest.raises(UserError) as error:
        archive.restore([planned], root)
    helpers.one_line_error(error, str(path))


def test_a_result_or_failure_file_gives_figures_never_what_the_run_is(quick_plan, tmp_path):
    """Round 14: a seed's result saying ``"kind": "tune"`` had the report prune that seed's archive entry; a failure
    file naming ``"mixer": "payload:X"`` had the report import it; a string figure was a ValueError traceback."""
    import json

    from lconv.study import driver

    study, templates = quick_plan
    planned = plan.expand(study, templates, None)[0]
    record = driver.base_record(planned, str(tmp_path))
    workdir = tmp_path / "seed0"
    workdir.mkdir()
    (workdir / run_lib.RESULT).write_text(json.dumps({**record, "status": "ok", "kind": "tune", "bleu": 1.0,
                                                      "validation_nll": 0.5, "mixer": "payload:X"}))
    found = run_lib.read_record(str(workdir), record)
    assert found["kind"] == "seed" and found["mixer"] == record["mixer"] and found["bleu"] == 1.0
    (workdir / run_lib.RESULT).write_text(json.dumps({**record, "status": "ok", "bleu": 1.0,
                                                      "train_tokens_per_s": "x"}))
    found = run_lib.read_record(str(workdir), record)
    assert found["status"] == "failed" and "train_tokens_per_s" in found["error"] and "\n" not in found["error"]
    (workdir / run_lib.RESULT).unlink()
    (workdir / run_lib.FAILURE).write_text(json.dumps({"error": "x", "stage": "train", "mixer": "payload:X",
                                                       "workdir": "/elsewhere"}))
    found = run_lib.read_record(str(workdir), record)
    assert found["status"] == "failed" and (found["mixer"], found["workdir"]) == (record["mixer"], record["workdir"])


def test_the_length_penalty_sweep_decodes_only_the_plans_tuning_run(quick_plan, tmp_path):
    """Round 14: a trained run planted as the tuning folder (its config.json naming other data) was decoded, and
    tfds imported what that data named. Its config.json must be its spec's, which the study checks against the plan."""
    import json

    import helpers

    from lconv.run import workdir as workdir_lib

    study, templates = quick_plan
    sweep = tuning.planned_sweeps(study, templates)[0]
    folder = tmp_path / "tune"
    folder.mkdir()
    (folder / run_lib.SPEC).write_text(json.dumps({"config": sweep.config.to_dict(), "record": sweep.record}))
    (folder / "config.json").write_text(json.dumps(workdir_lib.as_record(sweep.config)))
    run_lib._check_plans_run(str(folder))  # the plan's run: decoded
    planted = workdir_lib.as_record(sweep.config)
    planted["data"]["data_dir"] = "/tmp/elsewhere"
    (folder / "config.json").write_text(json.dumps(planted))
    with pytest.raises(UserError) as error:
        run_lib._check_plans_run(str(folder))
    helpers.one_line_error(error, str(folder), "data.data_dir")


def test_round_15_study_files_are_one_line_or_their_text_alone(quick_plan, tmp_path):
    """A failure file's numbers (``"wall_seconds": "x"``: a TypeError in the report), a record's ``machine`` that is
    no object (an AttributeError), a metrics row without its split or with a string loss (a KeyError, or the string
    plotted and archived), and a --resume_from whose results/ is a link (read from wherever it led)."""
    import json
    import os

    import helpers

    from lconv.study import driver, measure

    study, templates = quick_plan
    record = driver.base_record(plan.expand(study, templates, None)[0], str(tmp_path))
    workdir = tmp_path / "seed0"
    workdir.mkdir()
    (workdir / run_lib.FAILURE).write_text(json.dumps({"error": "x", "stage": "train", "wall_seconds": "x"}))
    found = run_lib.read_record(str(workdir), record)
    assert found["status"] == "failed" and "wall_seconds" not in found and found["error"] == "x"
    (workdir / run_lib.RESULT).write_text(json.dumps({**record, "status": "ok", "bleu": 1.0, "machine": [1, 2]}))
    found = run_lib.read_record(str(workdir), record)
    assert found["status"] == "failed" and "machine" in found["error"]
    for row in ({"x": 1}, {"split": "train", "step": 1, "loss": "x"}):
        (workdir / "metrics.jsonl").write_text(json.dumps({"split": "train", "step": 0, "loss": 1.0}) + "\n" +
                                               json.dumps(row) + "\n")
        with pytest.raises(UserError) as error:
            measure.read_metrics(str(workdir))
        helpers.one_line_error(error, str(workdir / "metrics.jsonl"), "line 2")
    (tmp_path / "theirs" / "results" / "runs").mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    os.symlink(tmp_path / "theirs" / "results", tmp_path / "mine" / "results")
    with pytest.raises(UserError) as error:
        archive.resolve(str(tmp_path / "mine"))
    helpers.one_line_error(error, "is a link")


def test_a_records_control_characters_reach_the_results_csv_as_escapes(quick_plan, tmp_path):
    """A failure's error holding ``ESC ] 0 ; ... BEL ESC [ 2 J`` reached results.csv raw, to set a terminal's title
    and clear it when the file is shown (round 15, r15-8); results.md already escaped it."""
    import csv
    import io

    from lconv.study import driver, report

    study, templates = quick_plan
    record = {**driver.base_record(plan.expand(study, templates, None)[0], str(tmp_path)), "status": "failed",
              "error": "\x1b]0;OWNED\x07\x1b[2J lost"}
    text = report.csv_text([record])
    assert "\x1b" not in text and "\x07" not in text
    (row,) = csv.DictReader(io.StringIO(text, newline=""))
    assert row["error"] == "\\x1b]0;OWNED\\x07\\x1b[2J lost" and row["status"] == "failed"


def test_the_report_keeps_the_archive_entry_of_a_planned_run_that_did_not_finish_here(quick_plan, tmp_path):
    """An output folder whose seed had no result (stopped, or handed over) had the report delete that seed's
    committed archive entry without a word (round 15, r15-3). Only entries of runs the plan no longer has go."""
    from lconv.study import driver

    study, templates = quick_plan
    record = {**driver.base_record(plan.expand(study, templates, None)[0], str(tmp_path)), "status": "failed"}
    docs = tmp_path / "docs"
    planned = docs / archive.archive_path(archive.ARCHIVE_DIR, archive.entry_name(record))
    dropped = docs / archive.archive_path(archive.ARCHIVE_DIR, "translation/no_such_mixer/seed0")
    for entry in (planned, dropped):
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text("{}")
    assert archive.write_archive([record], str(tmp_path / "out"), str(docs), prune=True) == 0
    assert planned.exists() and not dropped.exists()


def test_round_16_a_runs_damaged_pipe_or_endless_files_are_named_never_waited_on(quick_plan, tmp_path):
    """A result that is not JSON showed as "not run: " (and would be trained again unseen); a result or metrics log
    swapped for a pipe hung the report, one linked to /dev/zero was read to 7.6 GB (round 16, r16-11 and r16-13)."""
    import os

    import helpers

    from lconv.study import driver, measure

    study, templates = quick_plan
    record = driver.base_record(plan.expand(study, templates, None)[0], str(tmp_path))
    workdir = tmp_path / "seed0"
    workdir.mkdir()
    result = workdir / run_lib.RESULT
    result.write_text("not json")
    found = run_lib.read_record(str(workdir), record)
    assert found["status"] == "failed" and f"{run_lib.RESULT} is damaged" in found["error"]
    result.unlink()
    os.mkfifo(result)
    found = run_lib.read_record(str(workdir), record)
    assert found["status"] == "failed" and "not a regular file" in found["error"]
    os.symlink("/dev/zero", workdir / "metrics.jsonl")
    with pytest.raises(UserError) as error:
        measure.read_metrics(str(workdir))
    helpers.one_line_error(error, str(workdir / "metrics.jsonl"), "not a regular file")
    (workdir / "metrics.jsonl").unlink()  # a sparse file of 7 GB took 7.4 GB to a MemoryError (round 17)
    with open(workdir / "metrics.jsonl", "wb") as f:
        f.truncate(measure.METRICS_LIMIT + 1)
    with pytest.raises(UserError) as error:
        measure.read_metrics(str(workdir))
    helpers.one_line_error(error, str(workdir / "metrics.jsonl"), "more than")


def test_a_retrained_figure_is_set_against_the_archived_seeds_spread(tmp_path):
    """``--retrain``'s comparison (lconv.study.retrain): the archived seed's figure, and the sample sd of every
    archived seed of that mixer and task, as the report computes it; within the spread when the change is at most
    one sd. The end to end retraining: tests/test_study.py -k retrained."""
    import json
    import statistics

    from lconv.study import retrain

    root = tmp_path / "results" / "runs"
    (root / "translation" / "dynamic").mkdir(parents=True)
    archived = {0: 19.32, 1: 18.40, 2: 20.10}
    for seed, bleu in archived.items():
        entry = {"record": {"task": "translation", "mixer": "dynamic", "seed": seed, "bleu": bleu}, "config": {},
                 "metrics": []}
        (root / "translation" / "dynamic" / f"seed{seed}.json").write_text(json.dumps(entry))
    sd = statistics.stdev(archived.values())
    for retrained, within in ((19.32 + sd * 0.99, True), (19.32 - sd * 1.01, False)):
        found = retrain.compare({"task": "translation", "mixer": "dynamic", "seed": 0, "status": "ok",
                                 "bleu": retrained}, str(root))
        assert (found["archived"], found["n"], found["within_spread"]) == (19.32, 3, within)
        assert found["sd"] == pytest.approx(sd, rel=1e-12) and found["mean"] == pytest.approx(57.82 / 3, rel=1e-12)
        assert retrain.describe(found).startswith(f"retrained translation/dynamic/seed0: test BLEU {retrained:.2f}, "
                                                  "archived 19.32")
        assert ("within the archived seeds' spread" in retrain.describe(found)) == within
    unplanned = {"record": {"task": "translation", "mixer": "dynamic", "seed": 7, "bleu": 40.0}, "config": {},
                 "metrics": []}
    (root / "translation" / "dynamic" / "seed7.json").write_text(json.dumps(unplanned))  # a seed the study lacks
    planned = retrain.compare({"task": "translation", "mixer": "dynamic", "seed": 0, "status": "ok", "bleu": 19.0},
                              str(root), planned_seeds=(0, 1, 2))
    assert (planned["n"], planned["sd"]) == (3, pytest.approx(sd, rel=1e-12))
    assert retrain.compare({"task": "translation", "mixer": "dynamic", "seed": 0, "status": "ok", "bleu": 19.0},
                           str(root))["n"] == 4  # without the plan, every archived seed file counts
    (root / "translation" / "dynamic" / "seed7.json").unlink()
    failed = retrain.compare({"task": "translation", "mixer": "dynamic", "seed": 2, "status": "failed"}, str(root))
    assert failed["retrained"] is None and "did not finish; archived test BLEU 20.10" in retrain.describe(failed)
    for seed in (1, 2):
        (root / "translation" / "dynamic" / f"seed{seed}.json").unlink()
    entry = {"record": {"task": "translation", "mixer": "dynamic", "seed": 0, "bleu": 0.0}, "config": {},
             "metrics": []}
    (root / "translation" / "dynamic" / "seed0.json").write_text(json.dumps(entry))
    alone = retrain.compare({"task": "translation", "mixer": "dynamic", "seed": 0, "status": "ok", "bleu": 0.5},
                            str(root))  # one archived seed, at 0: no spread, no relative change (r28-30, r28-33)
    assert (alone["sd"], alone["within_spread"]) == (None, None) and json.loads(json.dumps(alone, allow_nan=False))
    assert retrain.describe(alone) == ("retrained translation/dynamic/seed0: test BLEU 0.50, archived 0.00 (+0.50); "
                                       "one archived seed, so no spread to compare with yet")


def test_the_report_counts_the_sweeps_hours_and_says_where_speeds_mix_machines(quick_plan, tmp_path):
    """results.md gave the seed runs' hours as the study's whole wall time (the sweep's runs, most of the compute,
    left out), averaged speeds over runs on different machines without a word, and results.json held bare NaN
    (no spread) that strict JSON readers refuse."""
    import json

    from lconv.study import driver, report

    study, templates = quick_plan
    machines = [{"cpu": "host A", "device": "cpu", "jax": "j"}, {"cpu": "host B", "device": "cpu", "jax": "j"}]
    records, bleus = [], {("transformer", 0): 9.0, ("transformer", 1): 9.2, ("dynamic", 0): 11.0, ("dynamic", 1): 11.4}
    for planned in plan.expand(study, templates, None):
        record = driver.base_record(planned, str(tmp_path / "out"))
        key = (record["mixer"], record["seed"])
        if record["task"] != "translation" or key not in bleus:
            records.append({**record, "status": "not run"})
            continue
        records.append({**record, "status": "ok", "bleu": bleus[key], "wall_seconds": 1800.0, "step": 10,
                        "train_tokens_per_s": 1000.0, "decode_sentences_per_s": 5.0, "decode_tokens_per_s": 90.0,
                        "train_step_bytes": 2**20, "peak_rss_bytes": 2**30, "machine": machines[record["seed"]]})
    sweep = [{"task": "translation", "mixer": "dynamic", "kind": "tune", "learning_rate": 3e-3, "status": "ok",
              "validation_nll": 4.0, "wall_seconds": 7200.0, "workdir": "tune"}]
    meta = {"command": "python -m lconv.study", "invocation_seconds": 1.0, "report_only": True}
    text = report.write_report(study, records, str(tmp_path / "docs"), meta, str(tmp_path / "out"), sweep)
    assert "the seed runs took 2.00 hours in all, and the tuning sweep's runs 2.00 hours more" in text
    assert "{" not in text.split("## Budget")[0]  # every field of the summary filled in
    assert "host A; cpu; j (2 runs); host B; cpu; j (2 runs)" in text
    assert "Its runs were measured on 2 machines" in text  # under the translation table, not the LM's
    assert text.count("Its runs were measured on") == 1
    assert "Against Transformer (9.10 ± 0.14, n 2): ahead beyond the spread: DynamicConv (+2.10)" in text
    assert "2 seeds per mixer" in text
    assert "| mixer | params (vs ref.) | n | test BLEU | Δ test BLEU vs Transformer | train step MiB |" in text

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    saved = json.loads((tmp_path / "docs" / "results" / "results.json").read_text(), parse_constant=refuse)
    assert {row["mixer"]: row["ppl_sd"] for row in saved["aggregate"] if row["task"] == "lm"} == {
        "transformer": None, "dynamic": None}


def test_the_quality_vs_speed_plot_takes_the_one_process_speeds_where_it_has_every_mixer(tmp_path, monkeypatch):
    """Each run's own tokens/s was measured on whatever host and load it had; the plot's x is the speed table's
    (one process, side by side) when that table has every mixer of the task, and says which it is."""
    import matplotlib

    from lconv.study import plots, verdicts

    matplotlib.use("Agg")
    import matplotlib.axes

    drawn = []
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", lambda self, x, y, **kw: drawn.append((kw["label"], x)))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel", lambda self, text, **kw: drawn.append(("x", text)))
    monkeypatch.setattr(matplotlib.axes.Axes, "legend", lambda self, **kw: None)  # nothing drawn to label
    rows = [{"task": "translation", "mixer": m, "label": plan.label(m), "ok": 1, "params": 10**6, "bleu": b,
             "bleu_sd": float("nan"), "train_tokens_per_s": run_speed}
            for m, b, run_speed in (("transformer", 10.0, 900.0), ("dynamic", 12.0, 400.0))]
    both = {("translation", "transformer"): 3000.0, ("translation", "dynamic"): 3300.0}
    for speeds, expected, where in ((both, [3000.0, 3300.0], "one process, side by side"),
                                    ({("translation", "dynamic"): 3300.0}, [900.0, 400.0], "as each run ran")):
        drawn.clear()
        plots.quality_vs_speed(rows, ["translation"], verdicts.METRICS, str(tmp_path / "q.png"), speeds)
        assert [x for label, x in drawn if label != "x"] == expected
        assert ("x", f"training target tokens/s ({where})") in drawn


def test_a_progress_line_says_why_only_where_there_is_a_why(tmp_path):
    """A run the report only reads is "not run", with the wait's reason where the plan gave one, never a bare colon."""
    record = {"task": "lm", "mixer": "dynamic", "seed": 1}
    assert driver.describe(run_lib.read_record(str(tmp_path), record)) == "not run"
    waiting = run_lib.read_record(str(tmp_path), record, "its tuning sweep is not complete")
    assert driver.describe(waiting) == "not run: its tuning sweep is not complete"
    assert driver.describe({"status": "n/a", "error": "CoLT5 is encoder-only"}) == "n/a: CoLT5 is encoder-only"
