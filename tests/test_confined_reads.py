"""What a run from elsewhere names is read only inside its folder and within bounds: a checkpoint's metadata, a
workdir's config.json and checkpoint folders (issue 56). Each case is one line, never a hang or a MemoryError."""
from __future__ import annotations

import json
import os
import shutil
import stat

import helpers
import pytest

from lconv.errors import UserError


@pytest.fixture
def unverified_step(tmp_path):
    """A checkpoint step folder without a manifest (an older lconv's, or a crash before it was written)."""
    step = tmp_path / "checkpoints" / "5"
    (step / "state" / "d").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("{}")
    (step / "state" / "d" / "chunk").write_bytes(b"x" * 64)
    return step


@pytest.mark.parametrize("make", ["fifo", "dev_zero"])
def test_an_unverified_checkpoints_metadata_that_never_ends_is_refused_before_orbax_reads_it(unverified_step, make):
    """``state/_METADATA`` a pipe hung eval.py; linked to /dev/zero it was a MemoryError."""
    from lconv.run import integrity

    metadata = unverified_step / "state" / "_METADATA"
    metadata.unlink()
    os.mkfifo(metadata) if make == "fifo" else metadata.symlink_to("/dev/zero")
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        assert not integrity.verify_manifest(str(unverified_step))
    helpers.one_line_error(error, "state/_METADATA", "not a regular file" if make == "fifo" else "symbolic link")


def test_a_checkpoints_metadata_over_its_bound_is_refused_and_array_chunks_are_not_bounded(unverified_step,
                                                                                            monkeypatch):
    from lconv.run import integrity

    monkeypatch.setattr(integrity, "METADATA_MAX_BYTES", 16)
    assert integrity.check_plain(str(unverified_step)) == ["state/_METADATA", "state/d/chunk"]  # a 64-byte chunk
    (unverified_step / "state" / "_METADATA").write_text("{" + " " * 40 + "}")
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        integrity.verify_manifest(str(unverified_step))
    helpers.one_line_error(error, "state/_METADATA", "42 bytes")
    integrity.write_manifest(str(unverified_step))  # a verified checkpoint is bounded the same way
    with pytest.raises(integrity.CorruptCheckpoint):
        integrity.verify_manifest(str(unverified_step))


def test_a_manifest_listing_more_than_the_model_holds_is_refused_before_a_byte_is_hashed(tiny_run, tmp_path,
                                                                                           capsys):
    """A sparse file of terabytes added to a handed-over run, listed with its true size and digest: every load hashed
    it for hours (round 25). The manifest's total is bounded by what a checkpoint of the model can hold."""
    from lconv.run import integrity

    workdir = helpers.copy_run(tiny_run, tmp_path / "run")
    step = max((workdir / "checkpoints").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    hole = step / "state" / "d" / "zz_sparse"
    with open(hole, "wb") as f:
        f.truncate(1 << 40)  # 1 TiB, no block on disk
    manifest = step / integrity.MANIFEST_FILENAME
    listed = json.loads(manifest.read_text())
    listed["sha256"]["state/d/zz_sparse"] = [1 << 40, "0" * 64]  # the digest is never reached
    manifest.write_text(json.dumps(listed))
    outcome = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", "--split=validation")
    total = sum(size for size, _ in listed["sha256"].values())
    helpers.one_line_error(outcome, str(step), integrity.MANIFEST_FILENAME, f"lists {total:,} bytes")
    listed["sha256"]["state/d/zz_sparse"] = [-1, "0" * 64]  # nor can a negative size make room for it
    manifest.write_text(json.dumps(listed))
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        integrity.verify_manifest(str(step), max_bytes=1 << 30)
    helpers.one_line_error(error, "unreadable")


def test_a_step_folder_that_is_a_link_is_corrupt(unverified_step, tmp_path):
    from lconv.run import integrity

    elsewhere = tmp_path / "elsewhere"
    unverified_step.rename(elsewhere)
    unverified_step.symlink_to(elsewhere)
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        integrity.verify_manifest(str(unverified_step))
    helpers.one_line_error(error, str(unverified_step), "symbolic link")


def test_eval_of_a_run_whose_unverified_metadata_is_a_pipe_is_one_line(tiny_run, tmp_path, capsys):
    from lconv.run import integrity

    workdir = helpers.copy_run(tiny_run, tmp_path / "run")
    step = max((workdir / "checkpoints").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    (step / integrity.MANIFEST_FILENAME).unlink()
    (step / "state" / "_METADATA").unlink()
    os.mkfifo(step / "state" / "_METADATA")
    outcome = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", "--split=validation")
    helpers.one_line_error(outcome, str(step), "state/_METADATA", "not a regular file")


# ----------------------------------------------------------------------------------------------------------------
# config.json: a regular file of a sane size inside the workdir
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", ["dev_zero", "fifo", "huge"])
def test_a_config_json_that_never_ends_or_is_huge_is_one_line_for_readers_and_train(make, tmp_path, monkeypatch):
    """Linked to /dev/zero it was an unbounded read (a MemoryError traceback); a pipe hung the reader."""
    from lconv.run import restore
    from lconv.run import workdir as workdir_lib

    workdir = tmp_path / "run"
    workdir.mkdir()
    config = workdir / "config.json"
    if make == "dev_zero":
        config.symlink_to("/dev/zero")
    elif make == "fifo":
        os.mkfifo(config)
    else:
        config.write_text("{}" + " " * 100)
        monkeypatch.setattr(workdir_lib, "CONFIG_MAX_BYTES", 64)
    named = {"dev_zero": "leads out of", "fifo": "not a regular file", "huge": "102 bytes"}[make]
    with pytest.raises(UserError) as error:
        restore.read_stored(str(workdir))
    helpers.one_line_error(error, str(config), named)
    with pytest.raises(UserError) as error:  # train.py resuming the workdir
        workdir_lib.check_config_change(None, str(workdir), has_checkpoint=True)
    helpers.one_line_error(error, str(config), named)


# ----------------------------------------------------------------------------------------------------------------
# checkpoints/ or best/ a symbolic link out of the workdir: refused for reads and writes
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def linked_out(tiny_run, tmp_path):
    """A copy of the tiny run whose checkpoints/ is a link to a folder outside it."""
    workdir = helpers.copy_run(tiny_run, tmp_path / "run")
    outside = tmp_path / "outside"
    shutil.move(workdir / "checkpoints", outside)
    (workdir / "checkpoints").symlink_to(outside)
    return workdir


def test_a_checkpoints_folder_linked_out_of_the_workdir_is_refused_by_every_reader(linked_out, capsys):
    import lconv

    link = str(linked_out / "checkpoints")
    for program, extra in (("eval.py", ("--split=validation",)),
                           ("lconv.export", (f"--out={linked_out.parent / 'export'}",))):
        outcome = helpers.run_cli(capsys, program, f"--workdir={linked_out}", *extra)
        helpers.one_line_error(outcome, link, "leads out of the workdir")
    with pytest.raises(UserError) as error:
        lconv.load(str(linked_out))
    helpers.one_line_error(error, link, "leads out of the workdir")
    assert not (linked_out.parent / "export").exists()


def test_a_checkpoints_folder_linked_inside_the_workdir_is_followed(tmp_path):
    from lconv.run import checkpoints
    from lconv.run import workdir as workdir_lib

    (tmp_path / "run" / "kept").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints").symlink_to(tmp_path / "run" / "kept")
    workdir_lib.check_inside(str(tmp_path / "run" / "checkpoints"), str(tmp_path / "run"))
    (tmp_path / "run" / "best").symlink_to(tmp_path)  # the workdir's parent: out
    with pytest.raises(UserError) as error:
        checkpoints.Checkpointer(str(tmp_path / "run"), subdir="best")
    helpers.one_line_error(error, str(tmp_path / "run" / "best"), "leads out of the workdir")



def test_a_checkpoint_step_that_is_a_link_is_one_line_before_training(tmp_path):
    """Training went on two steps, then died in orbax's rmtree of the step it no longer kept (round-9 campaign)."""
    from lconv.run import workdir as workdir_lib

    (tmp_path / "elsewhere" / "1").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "1").symlink_to(tmp_path / "elsewhere" / "1")
    with pytest.raises(UserError) as error:
        workdir_lib.make_workdir(str(tmp_path / "run"))
    helpers.one_line_error(error, str(tmp_path / "run" / "checkpoints" / "1"), "symbolic link")
    assert (tmp_path / "elsewhere" / "1").is_dir()


def test_a_best_folder_linked_to_the_checkpoints_folder_is_refused_before_training(tmp_path):
    """``ln -s checkpoints best`` inside the workdir: two checkpoint managers in one folder (an orbax traceback,
    then a hang) become one line naming both, before any checkpoint is written."""
    from lconv.run import workdir as workdir_lib

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "best").symlink_to("checkpoints")
    with pytest.raises(UserError) as error:
        workdir_lib.make_workdir(str(tmp_path / "run"))
    helpers.one_line_error(error, str(tmp_path / "run" / "best"), str(tmp_path / "run" / "checkpoints"))
    assert (tmp_path / "run" / "best").is_symlink() and not os.listdir(tmp_path / "run" / "checkpoints")

def test_train_py_refuses_a_checkpoints_folder_linked_out_before_writing(linked_out, tiny_run, tmp_path, capsys):
    before = sorted(os.listdir(tmp_path / "outside"))
    outcome = helpers.run_cli(capsys, "train.py", "--config=tests/tiny_config.py", f"--workdir={linked_out}",
                              f"--config.data.data_dir={tiny_run.data_dir}", "--config.train.num_steps=8")
    helpers.one_line_error(outcome, str(linked_out / "checkpoints"), "leads out of the workdir")
    assert sorted(os.listdir(tmp_path / "outside")) == before


# ----------------------------------------------------------------------------------------------------------------
# Special files and hard links where a run writes (the round-6 campaign)
# ----------------------------------------------------------------------------------------------------------------
def _workdir_with(tmp_path, name):
    """A workdir (its config.json marks it) and the path ``name`` inside it."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text("{}")
    return workdir, workdir / name


@pytest.mark.parametrize("name", ["metrics.jsonl", "train.lock", "checkpoint_errors.log"])
def test_a_pipe_planted_among_a_workdirs_own_files_is_one_line_not_a_hang(tmp_path, name):
    from lconv import outputs
    from lconv.run import workdir as workdir_lib

    workdir, planted = _workdir_with(tmp_path, name)
    os.mkfifo(planted)
    with pytest.raises(UserError) as error:
        workdir_lib.make_workdir(str(workdir))
    helpers.one_line_error(error, str(planted), "pipe")
    with pytest.raises(UserError) as error:  # and the writer itself, past the check: refused at the open
        outputs.open_append(planted)
    helpers.one_line_error(error, str(planted), "pipe")


def test_a_tensorboard_folder_linked_out_of_the_workdir_is_refused(tmp_path):
    from lconv.run import workdir as workdir_lib

    workdir, link = _workdir_with(tmp_path, "tensorboard")
    (tmp_path / "outside").mkdir()
    link.symlink_to(tmp_path / "outside")
    with pytest.raises(UserError) as error:
        workdir_lib.make_workdir(str(workdir))
    helpers.one_line_error(error, str(link), "leads out of the workdir")


def test_a_hard_linked_log_is_appended_to_in_this_workdir_alone(tmp_path):
    """A run copied with ``cp -al`` (or a link planted to a file elsewhere): the other link keeps its content."""
    from lconv import outputs

    workdir, log = _workdir_with(tmp_path, "metrics.jsonl")
    elsewhere = tmp_path / "other_runs_metrics.jsonl"
    elsewhere.write_text("theirs\n")
    os.chmod(elsewhere, 0o600)  # private: its copy is too (it was made with the umask's mode)
    os.link(elsewhere, log)
    with outputs.open_append(log) as f:
        f.write("ours\n")
    assert elsewhere.read_text() == "theirs\n" and log.read_text() == "theirs\nours\n"
    assert os.stat(log).st_nlink == 1 and os.stat(elsewhere).st_nlink == 1
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600


def test_an_output_named_as_a_device_is_written_into_and_a_pipe_refused(tmp_path):
    """``--output_file=/dev/null`` replaced the host's /dev/null by a file (written beside it, renamed over it)."""
    from lconv import outputs

    controller, terminal = os.openpty()  # a character device this user owns, in place of /dev/null
    try:
        device = os.ttyname(terminal)
        outputs.write_atomically(device, "a line")
        assert stat.S_ISCHR(os.stat(device).st_mode) and os.read(controller, 100).startswith(b"a line")
        # a terminal: a run's escape sequences are shown escaped (they set the title and cleared the screen; r26-26)
        outputs.write_atomically(device, "\x1b]0;PWNED\x07\x1b[2J\n")
        assert os.read(controller, 100).startswith(b"\\x1b]0;PWNED\\x07\\x1b[2J")
    finally:
        os.close(controller)
        os.close(terminal)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(UserError) as error:
        outputs.write_atomically(pipe, "a line")
    helpers.one_line_error(error, str(pipe), "pipe")
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)


def test_a_lock_file_that_is_a_folder_is_one_line_naming_it(tmp_path):
    """A train.lock planted as a folder was "--workdir=... is not writable (Is a directory)", naming no file."""
    from lconv.run import workdir as workdir_lib

    (tmp_path / workdir_lib.LOCK_FILENAME).mkdir()
    with pytest.raises(UserError) as error:
        with workdir_lib.lock(str(tmp_path)):
            pass
    helpers.one_line_error(error, str(tmp_path / workdir_lib.LOCK_FILENAME), "is a folder")


def test_a_huge_metrics_log_is_one_line_before_it_is_read(tmp_path, monkeypatch):
    """A workdir's metrics.jsonl is read whole on resume: one planted as a 20 GB sparse file was a MemoryError
    traceback. Over the limit (lowered here, so the test reads little) it is one line naming it."""
    from lconv.train import eval_control, logs

    monkeypatch.setattr(logs, "METRICS_READ_LIMIT", 1 << 20, raising=False)
    log = tmp_path / "metrics.jsonl"
    with open(log, "wb") as f:
        f.truncate(2 << 20)
    for read in (lambda: logs.MetricWriter(str(tmp_path), resumed_step=4),
                 lambda: eval_control.validation_values(str(tmp_path), 4, "loss")):
        with pytest.raises(UserError) as error:
            read()
        helpers.one_line_error(error, str(log), "more than")


def test_a_huge_pending_final_evaluation_record_is_not_read(tmp_path, monkeypatch):
    """final_evaluation_pending.json holds {"step": N}: one planted as a 20 GB sparse file was read whole on
    resume (a MemoryError). Too large to be the record, it is a damaged one: training goes on as usual."""
    from etils import epath

    from lconv.train import loop

    with open(tmp_path / loop.FINAL_EVALUATION, "wb") as f:
        f.truncate(1 << 20)
    monkeypatch.setattr(epath.Path, "read_text", lambda *a, **k: pytest.fail("the record was read"))
    assert loop.pending_final_evaluation(str(tmp_path)) is None


def test_a_damaged_step_metadata_is_not_echoed_to_the_terminal(tmp_path, caplog):
    """Orbax logged a step's damaged _CHECKPOINT_METADATA with its content, raw, at every open of the workdir: a
    file from elsewhere printed (escape sequences included) into the user's terminal."""
    import logging

    import numpy as np

    from lconv.run import checkpoints

    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1, async_save=False)
    ckpt.save(1, {"w": np.zeros(4, np.float32)}, {"process_count": 1, "processes": [None]})
    ckpt.close()
    (tmp_path / "checkpoints" / "1" / "_CHECKPOINT_METADATA").write_text('{"x": \x1b[2J\x1b]0;owned\x07')
    with caplog.at_level(logging.INFO):
        reader = checkpoints.Checkpointer(str(tmp_path), read_only=True)
    assert reader.all_steps() == [1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "\x1b" in r.getMessage()]


def _nested(path):
    path.write_text("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("damage, named", [
    (_nested, "nested deeper"),
    (lambda path: os.truncate(path, 2 << 20), "2,097,152 bytes"),
    (lambda path: (path.unlink(), path.symlink_to("/dev/zero")), "symbolic link"),
    (lambda path: (path.unlink(), os.mkfifo(path)), "not a regular file"),
    (lambda path: (path.unlink(), path.mkdir()), "not a regular file"),
    (lambda path: path.write_text('{"commit_timestamp_nsecs": "soon"}'), "not orbax's step metadata"),
    (lambda path: (path.parent / "metrics").mkdir(), "metrics item"),  # orbax reads one at each open too
], ids=["nested", "huge", "dev_zero", "fifo", "folder", "wrong_types", "metrics_item"])
def test_a_step_metadata_orbax_cannot_read_is_a_corrupt_step_the_others_still_read(tmp_path, damage, named):
    """Orbax reads every step's _CHECKPOINT_METADATA when a checkpoint folder is opened: nested 100,000 deep it died
    of a RecursionError (a 79-line traceback from eval.py, round-9 campaign), of a ValueError on a field of the wrong
    type; a pipe or /dev/zero never ends. The step is listed but kept from orbax, and reading it is the one-line
    ``CorruptCheckpoint``."""
    import numpy as np

    from lconv.run import checkpoints, integrity

    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1, async_save=False)
    for step in (1, 2):
        ckpt.save(step, {"w": np.zeros(4, np.float32)}, {"process_count": 1, "processes": [step]})
    ckpt.close()
    damage(tmp_path / "checkpoints" / "2" / integrity.STEP_METADATA_FILENAME)
    reader = checkpoints.Checkpointer(str(tmp_path), read_only=True)
    assert reader.all_steps() == [1, 2] and reader.latest_step() == 2
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        reader.read_data(2)
    helpers.one_line_error(error, str(tmp_path / "checkpoints" / "2"), named)
    assert reader.read_data(1)["processes"] == [1]
    reader.close()


def test_eval_of_a_run_whose_latest_step_metadata_is_nested_too_deep_is_one_line(tiny_run, tmp_path, capsys):
    from lconv.run import integrity

    workdir = helpers.copy_run(tiny_run, tmp_path / "run")
    step = max((workdir / "checkpoints").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    (step / integrity.MANIFEST_FILENAME).unlink()
    _nested(step / integrity.STEP_METADATA_FILENAME)
    outcome = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", "--split=validation")
    helpers.one_line_error(outcome, str(step), integrity.STEP_METADATA_FILENAME, "nested deeper")


@pytest.fixture
def en_de_copy(tiny_data, tmp_path):
    """``(data_dir, version folder)``: a private copy of the shared tiny data's prepared ddtp/en_de alone, to damage."""
    from lconv.data import tfds_ddtp

    (prepared,) = (tiny_data.data_dir / tfds_ddtp.CACHE_DIRNAME).glob("ddtp_en_de-*")
    data_dir = tmp_path / "data"
    shutil.copytree(prepared, data_dir / tfds_ddtp.CACHE_DIRNAME / prepared.name, symlinks=True)
    return data_dir, data_dir / tfds_ddtp.CACHE_DIRNAME / prepared.name / "ddtp" / "en_de" / "1.0.0"


@pytest.mark.parametrize("damage", ["shard a pipe", "report a pipe", "report linked out", "shard linked out",
                                    "version folder linked out"])
def test_a_prepared_copy_holding_a_pipe_or_a_link_out_is_one_line_before_tfds_reads_it(damage, en_de_copy,
                                                                                        tmp_path):
    """A data_dir a run's config names comes from elsewhere: each of these hung eval.py, had it read a file outside
    (a report linked to /etc/hostname), or score a split from outside (round-9 campaign)."""
    from lconv.data import sources, tfds_ddtp

    data_dir, version = en_de_copy
    shard, report = next(version.glob("*test.array_record*")), version / tfds_ddtp.REPORT_FILENAME
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = {"shard a pipe": shard, "report a pipe": report, "report linked out": report,
               "shard linked out": shard, "version folder linked out": version}[damage]
    shutil.move(planted, outside / planted.name)
    if "pipe" in damage:
        os.mkfifo(planted)
    else:
        planted.symlink_to(outside / planted.name)
    with pytest.raises(UserError) as error:
        sources.get_source("ddtp/en_de", "test", str(data_dir))
    helpers.one_line_error(error, str(planted))


@pytest.mark.parametrize("where", ["checkpoint", "prepared copy"])
def test_folders_nested_a_thousand_deep_are_one_line_not_a_recursion_error(where, unverified_step, request):
    """Python 3.11's ``os.walk`` recurses: a planted tree 1,200 folders deep was a RecursionError traceback."""
    from lconv.data import sources
    from lconv.run import integrity

    en_de_copy = None if where == "checkpoint" else request.getfixturevalue("en_de_copy")
    root = unverified_step / "state" if where == "checkpoint" else en_de_copy[1]
    folders = [os.path.join(root, *["a"] * depth) for depth in range(1, 1201)]
    try:
        for folder in folders:  # os.makedirs and shutil.rmtree recurse too: pytest could not remove the tree
            os.mkdir(folder)
        with pytest.raises(UserError) as error:
            if where == "checkpoint":
                integrity.verify_manifest(str(unverified_step))
            else:
                sources.get_source("ddtp/en_de", "test", str(en_de_copy[0]))
    finally:
        for folder in reversed(folders):
            if os.path.isdir(folder):
                os.rmdir(folder)
    helpers.one_line_error(error, "nested")


def test_a_prepared_copys_report_nested_too_deep_or_not_json_is_one_line(en_de_copy):
    """Python's JSON reader fails on deep nesting with a RecursionError, which no reader caught (round-9 campaign:
    the same traceback from a report, config.json, a manifest, metrics.jsonl, the pending record, an output marker);
    they all parse through ``lconv.json_text``."""
    from lconv import json_text
    from lconv.data import sources, tfds_ddtp

    with pytest.raises(ValueError, match="nested deeper"):
        json_text.loads("[" * 100_000 + "]" * 100_000)
    data_dir, version = en_de_copy
    report = version / tfds_ddtp.REPORT_FILENAME
    good = json.loads(report.read_text())
    confused = [json.dumps({**good, field: value}) for field, value in  # python -m lconv.data: AttributeError
                (("skipped", 5), ("examples", {"test": "many"}), ("altered", {"parse": [1]}), ("source", None))]
    for text in ("[" * 100_000 + "]" * 100_000, "not json", "[1, 2]", *confused):
        report.write_text(text)
        with pytest.raises(UserError) as error:
            sources.source_report("ddtp/en_de", str(data_dir))
        helpers.one_line_error(error, str(report))


def test_a_prepared_copys_report_text_reaches_the_terminal_as_escapes():
    """A copy's report is text from whoever made the copy: its ``source`` holding ``ESC ] 0 ; ... BEL ESC [ 2 J`` set
    the terminal's title and cleared it from ``python -m lconv.data`` and train.py's log (round 15, r15-8)."""
    from lconv.data import sources

    report = {"dataset": "ddtp/en_de", "source": "\x1b]0;OWNED\x07\x1b[2J src", "examples": {"test": 3},
              "records": 3, "skipped": {"read\x1b[2J": {"empty\x07": 1}}, "altered": {}}
    lines = sources.describe_report(report)
    assert not any(ch in line for line in lines for ch in "\x1b\x07"), lines
    assert "prepared from \\x1b]0;OWNED\\x07\\x1b[2J src" in lines[0] and "empty\\x07 1" in lines[1]

def test_a_prepared_copys_dataset_info_tfds_cannot_parse_is_one_line(en_de_copy):
    """tfds parses it with protobuf: nested too deep or of the wrong types, a 74-79-line ParseError traceback."""
    from lconv.data import sources

    data_dir, version = en_de_copy
    for text in ("[" * 100_000 + "]" * 100_000, '{"name": 5, "splits": "x"}'):
        (version / "dataset_info.json").write_text(text)
        with pytest.raises(UserError) as error:
            sources.get_source("ddtp/en_de", "test", str(data_dir))
        helpers.one_line_error(error, "dataset_info.json", str(version.parents[2]))


@pytest.mark.parametrize("damage", ["random bytes", "random records", "empty records"])
def test_a_damaged_shard_in_a_prepared_copy_is_one_line_naming_it(damage, en_de_copy, tiny_data):
    """A shard of random bytes: array_record's RuntimeError was a 34-line traceback from eval.py (round-9 campaign);
    well-formed records that are not examples, a protobuf DecodeError traceback; empty ones scored every source and
    reference as the text "None", without a word (round-10)."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    from lconv.data import pipeline, sources
    from lconv.data import tokenizer as tokenizer_lib

    data_dir, version = en_de_copy
    shard = next(version.glob("*test.array_record*"))
    if damage == "random bytes":
        shard.write_bytes(os.urandom(shard.stat().st_size))
    else:
        count = ArrayRecordReader(str(shard)).num_records()
        shard.unlink()
        writer = ArrayRecordWriter(str(shard), "group_size:1")
        for _ in range(count):
            writer.write(os.urandom(40) if damage == "random records" else b"")
        writer.close()
    source, input_key, target_key = sources.get_source("ddtp/en_de", "test", str(data_dir))
    tokenizer = tokenizer_lib.load_tokenizer(str(tiny_data.spm.parent))
    with pytest.raises(UserError) as error:
        pipeline.make_eval_set(source, input_key, target_key, tokenizer, {"inputs": 32, "targets": 32}, rows=4)
    helpers.one_line_error(error, str(version), "damaged")


def test_a_shard_swapped_for_a_link_out_after_the_check_is_never_read(en_de_copy, tmp_path):
    """array_record opens a shard at its first read, long after lconv's check: a planter who can write into the copy
    swapped the shard for a link to an outside one in that window, and the outside records were read (round 15,
    r15-2). The source reads the file that was checked, held open, whatever the name points at later."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from lconv.data import sources

    data_dir, version = en_de_copy
    shard = next(version.glob("*test.array_record*"))
    source, _, _ = sources.get_source("ddtp/en_de", "test", str(data_dir))
    outside = tmp_path / "outside.array_record"
    writer = ArrayRecordWriter(str(outside), "group_size:1")
    for _ in range(len(source)):
        writer.write(b"outside")
    writer.close()
    shard.rename(tmp_path / "moved_away")
    shard.symlink_to(outside)
    first = source[0]
    assert sorted(first) == ["de", "en", "md5"] and first["en"], first
    assert len(source[len(source) - 1]["de"]) > 0


def test_a_link_turned_back_into_a_file_while_its_path_resolves_is_one_line(tmp_path, monkeypatch):
    """``os.path.realpath`` raised EINVAL when a link became a file between its lstat and its readlink: a 20-line
    OSError traceback from the shard-swap race, about 1 run in 40 (round 16, r16-1)."""
    import errno

    from lconv.data import paths

    corpus = tmp_path / "test.en"
    corpus.write_text("a line\n")

    def swapped(path, *args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os.path, "realpath", swapped)
    with pytest.raises(UserError) as error:
        paths.check_file(corpus, within=tmp_path)
    helpers.one_line_error(error, str(corpus), "changed while it was checked")

@pytest.mark.parametrize("swap", ["link_out", "pipe"])
def test_a_file_swapped_after_its_check_is_refused_on_what_was_opened(tmp_path, monkeypatch, swap):
    """A read checked the name, then opened it by name: a file swapped for a link out of its folder (or a pipe) in
    between was read (a race shown at function level in the round-11 campaign, R1). What was opened is checked."""
    from etils import epath

    from lconv.data import paths

    folder, outside = tmp_path / "raw", tmp_path / "secret.txt"
    folder.mkdir()
    outside.write_text("secret")
    corpus = folder / "test.en"
    corpus.write_text("a line\n")
    checked = paths.check_file

    def check_then_swap(path, **kwargs):
        checked(path, **kwargs)
        corpus.unlink()
        corpus.symlink_to(outside) if swap == "link_out" else os.mkfifo(corpus)

    monkeypatch.setattr(paths, "check_file", check_then_swap)
    for read in (lambda: paths.read_bytes(epath.Path(corpus), "missing", within=folder),
                 lambda: paths.sha256(corpus, within=folder)):
        with pytest.raises(UserError) as error:
            read()
        helpers.one_line_error(error, str(corpus), "leads out of" if swap == "link_out" else "not a regular file")
        corpus.unlink()
        corpus.write_text("a line\n")


@pytest.mark.parametrize("reader", ["iwslt14_lines", "ddtp_index"])
def test_the_corpus_readers_read_only_files_inside_their_folder(tmp_path, reader):
    """IWSLT'14's lines and DDTP's index were read by name with no check: a corpus file swapped for a link out after
    the copy's fingerprint was read into the prepared copy, and scored later (round-12 campaign N2)."""
    from lconv.data import ddtp, tfds_ddtp

    folder, outside = tmp_path / "raw", tmp_path / "secret.txt"
    folder.mkdir()
    outside.write_text("a line from elsewhere\n")
    (folder / "test.en").symlink_to(outside)
    read = {"iwslt14_lines": tfds_ddtp._read_lines, "ddtp_index": ddtp.read_index_bytes}[reader]
    with pytest.raises(UserError) as error:
        read(str(folder / "test.en"))
    helpers.one_line_error(error, str(folder / "test.en"), "leads out of")


def test_a_files_hash_has_no_size_bound_while_a_whole_read_has(tmp_path, monkeypatch):
    """``paths.sha256`` streams a file of any size (a checkpoint's can pass the whole-read bound); only reading a
    file whole is bounded. The hash had taken the read bound too."""
    import hashlib

    from etils import epath

    from lconv.data import paths

    big = tmp_path / "chunk"
    big.write_bytes(b"x" * 64)
    monkeypatch.setattr(paths, "READ_LIMIT", 16)
    assert paths.sha256(big, within=tmp_path) == hashlib.sha256(b"x" * 64).hexdigest()
    with pytest.raises(UserError) as error:
        paths.read_bytes(epath.Path(big), "missing", limit=16)
    helpers.one_line_error(error, str(big), "64 bytes", "more than the 16")


def _open_copy(reader, data_dir):
    """What each reader does first with a copy: lconv's own through ``get_source``, a catalog dataset's through the
    read-only builder of a ``tfds build`` output."""
    from lconv.data import sources

    if reader == "catalog copy":
        return sources._prepared_builder("wmt14_translate/de-en", str(data_dir))
    return sources.get_source("ddtp/en_de", "test", str(data_dir))

def _catalog_copy(version, root):
    """``(data_dir, version folder)``: the ddtp/en_de files laid out as a `tfds build` output of wmt14_translate/de-en,
    read by ``sources._prepared_builder`` (no builder code)."""
    target = root / "wmt14_translate" / "de-en" / "1.0.0"
    target.mkdir(parents=True)
    info = json.loads((version / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "name": "wmt14_translate", "configName": "de-en"}))
    shutil.copy(version / "features.json", target)
    for shard in version.glob("ddtp-*.array_record-*"):
        shutil.copy(shard, target / shard.name.replace("ddtp-", "wmt14_translate-"))
    return root, target



@pytest.mark.parametrize("swapped", ["version folder", "shard"])
def test_a_folder_or_shard_swapped_for_a_link_after_the_checks_is_refused_not_read(swapped, en_de_copy, tmp_path,
                                                                                     monkeypatch):
    """The checks go by path; the reads came later, by path again: the version folder exchanged for a link to an
    outside copy in between had that copy read as the test split (round 16, r16-12: 1-8 of 40 runs). The folder
    is entered from data_dir without following a link, and each shard opened in it."""
    from lconv.data import paths, sources

    data_dir, version = en_de_copy
    outside = tmp_path / "outside_copy"
    shutil.copytree(version, outside)
    entered = paths.open_folder_below

    def swap_then_enter(root, folder):
        name = None if swapped == "version folder" else next(version.glob("*test.array_record*")).name
        target = version if name is None else version / name
        target.rename(tmp_path / "moved_away")
        target.symlink_to(outside if name is None else outside / name)
        return entered(root, folder)

    monkeypatch.setattr(paths, "open_folder_below", swap_then_enter)
    with pytest.raises(UserError) as error:
        sources.get_source("ddtp/en_de", "test", str(data_dir))
    helpers.one_line_error(error, str(version), "plain")

def test_a_split_of_more_shards_than_files_may_be_open_is_one_line(en_de_copy, monkeypatch):
    """Each shard is held open while its source lives: a split listing more shards than the process may open
    (``ulimit -n``) is one line, not an OSError traceback; below the hard limit the soft one is raised instead."""
    import errno
    import resource

    from lconv.data import paths, prepared_files, sources

    data_dir, version = en_de_copy
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + 64
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        prepared_files._allow_open_files(1000)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(hard, low + 1000)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def no_more_files(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(paths, "open_in_folder", no_more_files)
    with pytest.raises(UserError) as error:
        sources.get_source("ddtp/en_de", "test", str(data_dir))
    helpers.one_line_error(error, str(version), "ulimit -n")


@pytest.mark.parametrize("damage", ["shard_lengths negative", "shard_lengths empty", "file_format parquet",
                                    "template_spec", "template_attribute"])
def test_a_copy_whose_info_lists_shard_lengths_or_a_format_lconv_cannot_read_is_one_line(damage, en_de_copy,
                                                                                           tmp_path):
    """Shard lengths of -5 or none were a 42-56-line ValueError from tfds's slicing or array_record; a fileFormat of
    parquet sent the copy to tfds's parquet reader, which reads whole shards by path (a decompression bomb took 5 GB;
    round 16, r16-3 and r16-4); a template's format spec built a 3 GB name from a 1 kB file (r16-5)."""
    from lconv.data import sources

    data_dir, version = _catalog_copy(en_de_copy[1], tmp_path / "catalog")
    info = json.loads((version / "dataset_info.json").read_text())
    test = next(split for split in info["splits"] if split["name"] == "test")
    if damage == "file_format parquet":  # its shards named as that format names them
        info["fileFormat"] = "parquet"
        for shard in version.glob("*.array_record-*"):
            shard.rename(version / shard.name.replace(".array_record-", ".parquet-"))
    elif damage.startswith("template"):
        field = "{DATASET:>100000000}" if damage == "template_spec" else "{DATASET.__class__}"
        test["filepathTemplate"] = field + "-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
    else:
        test["shardLengths"] = ["-5"] if damage == "shard_lengths negative" else []
    (version / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(UserError) as error:
        sources.get_source("wmt14/en_de", "test", str(data_dir))
    expected = {"file_format parquet": ["not array_record"], "template_spec": ["dataset_info.json", "plain fields"],
                "template_attribute": ["dataset_info.json", "plain fields"]}.get(damage, [str(version)])
    helpers.one_line_error(error, *expected)


@pytest.mark.parametrize("file_format", ["tfrecord", "parquet", "bogus"])
def test_lconvs_own_copy_whose_info_names_another_format_is_one_line(file_format, en_de_copy):
    """lconv opens its own copies as array_record: tfds's ValueError at another fileFormat was a 41-50-line traceback
    from ``python -m lconv.data`` and eval.py (round 17, after r16-4's fix for catalog copies)."""
    from lconv.data import sources

    data_dir, version = en_de_copy
    info = json.loads((version / "dataset_info.json").read_text())
    info["fileFormat"] = file_format
    (version / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(UserError) as error:
        sources.get_source("ddtp/en_de", "test", str(data_dir))
    helpers.one_line_error(error, str(version.parents[2]), "dataset_info.json")

_NOT_TEXT = {
    "an image": {"pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
                 "image": {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "uint8", "encodingFormat": "png"}},
    "an integer tensor": {"pythonClassName": "tensorflow_datasets.core.features.tensor_feature.Tensor",
                          "tensor": {"shape": {}, "dtype": "int64", "encoding": "none"}},
}


@pytest.mark.parametrize("damage", ["an image", "an integer tensor", "a field missing", "many fields"])
def test_a_catalog_copy_whose_features_are_not_the_text_lconv_reads_is_one_line(damage, en_de_copy, tmp_path):
    """tfds decodes every field with the decoder its features.json names: a text field turned into an image ran PIL
    on the copy's bytes (a 33-line traceback, and an image decoder fed by whoever made the copy), an integer one a
    22-line ValueError, a missing field a KeyError (round 15, r15-6); 100,000 extra text fields took 1.9 s an
    example, without a word (round 16, r16-14)."""
    from lconv.data import sources

    data_dir, version = _catalog_copy(en_de_copy[1], tmp_path / "catalog")
    features = json.loads((version / "features.json").read_text())
    fields = features["featuresDict"]["features"]
    if damage == "a field missing":
        del fields["de"]
    elif damage == "many fields":
        fields.update({f"x{i}": fields["en"] for i in range(40)})
    else:
        fields["en"] = _NOT_TEXT[damage]
    (version / "features.json").write_text(json.dumps(features))
    with pytest.raises(UserError) as error:
        sources.get_source("wmt14/en_de", "test", str(data_dir))
    expected = {"a field missing": "lack ['de']", "many fields": "more than 16 fields"}.get(damage, "text only")
    helpers.one_line_error(error, str(version), expected)

@pytest.mark.parametrize("reader", ["lconv's copy", "catalog copy"])
@pytest.mark.parametrize("damage", ["feature class of another module", "split files outside", "shard linked out"])
def test_a_prepared_copys_json_naming_code_or_files_outside_is_one_line(damage, reader, en_de_copy, tmp_path):
    """tfds imports the module a features.json class name gives (round 13: a marker module ran through eval.py,
    train.py and python -m lconv.data), opens the files a dataset_info.json's template names (an outside shard
    was scored), and catalog copies had none of lconv's copies' checks (a shard linked out was scored)."""
    import sys


    data_dir, version = en_de_copy
    if reader == "catalog copy":
        data_dir, version = _catalog_copy(version, tmp_path / "catalog")
    outside = tmp_path / "outside.array_record"
    shard = next(version.glob("*test.array_record*"))
    shutil.copy(shard, outside)
    if damage == "feature class of another module":
        path = version / "features.json"
        path.write_text(json.dumps({"pythonClassName": "lconv_r13_marker_module.X", "featuresDict": {}}))
    elif damage == "split files outside":
        path = version / "dataset_info.json"
        info = json.loads(path.read_text())
        for split in info["splits"]:
            split["filepathTemplate"] = f"../../../../../../../..{tmp_path}/outside.array_record"
        path.write_text(json.dumps(info))
    else:
        path = shard
        shard.unlink()
        shard.symlink_to(outside)
    if reader == "lconv's copy" and damage == "feature class of another module":  # its features are code
        assert len(_open_copy(reader, data_dir)[0]) > 0
    else:
        with pytest.raises(UserError) as error:
            _open_copy(reader, data_dir)
        helpers.one_line_error(error, str(data_dir), "would import" if "feature" in damage else "")
    assert "lconv_r13_marker_module" not in sys.modules


@pytest.mark.parametrize("reader", ["lconv's copy", "catalog copy"])
@pytest.mark.parametrize("damage", ["legacy type key", "snake_case class key", "name reaching outside",
                                    "snake_case template", "version folder linked", "shard missing"])
def test_whatever_spelling_a_copy_uses_tfds_imports_nothing_and_reads_only_inside(damage, reader, en_de_copy,
                                                                                  tmp_path, monkeypatch):
    """Round 14: the class under the legacy ``type`` key or ``python_class_name`` was imported, and a ``name`` or a
    ``filepath_template`` of ../.. (tfds expands both into the shard paths) or a linked version folder had an
    outside split scored. The guard is where tfds resolves a class; the check is on the paths it expanded."""
    import sys


    data_dir, version = en_de_copy
    if reader == "catalog copy":
        data_dir, version = _catalog_copy(version, tmp_path / "catalog")
    (tmp_path / "importable").mkdir()  # the marker module can be imported: only the guard keeps it out
    (tmp_path / "importable" / "lconv_r14_marker_module.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "importable"))
    outside = tmp_path / "outside"
    outside.mkdir()
    for shard in version.glob("*.array_record*"):
        shutil.copy(shard, outside / shard.name)
    info_path, features_path = version / "dataset_info.json", version / "features.json"
    info = json.loads(info_path.read_text())
    named = [str(data_dir)]
    if damage == "legacy type key":
        features_path.write_text(json.dumps({"type": "lconv_r14_marker_module.X", "content": {}}))
        named.append("would import")
    elif damage == "snake_case class key":
        features_path.write_text(json.dumps({"python_class_name": "lconv_r14_marker_module.X"}))
        named.append("would import")
    elif damage == "name reaching outside":
        info["name"] = os.path.relpath(outside, version) + "/" + info["name"]
        info_path.write_text(json.dumps(info))
        named.append(str(outside))
    elif damage == "snake_case template":
        for split in info["splits"]:
            split.pop("filepathTemplate", None)
            split["filepath_template"] = os.path.relpath(outside, version) + "/{DATASET}-{SPLIT}.{FILEFORMAT}-" \
                                                                               "{SHARD_X_OF_Y}"
        info_path.write_text(json.dumps(info))
        named.append(str(outside))
    elif damage == "shard missing":  # round 15: array_record's 49-line RuntimeError at the first read
        next(version.glob("*test.array_record*")).unlink()
        named.append("missing")
    else:
        moved = tmp_path / "elsewhere"
        shutil.move(str(version), moved)
        version.symlink_to(moved)
        named.append("a link")
    if reader == "lconv's copy" and damage in ("legacy type key", "snake_case class key"):  # its features are code
        assert len(_open_copy(reader, data_dir)[0]) > 0
    else:
        with pytest.raises(UserError) as error:
            _open_copy(reader, data_dir)
        helpers.one_line_error(error, *named)
    assert "lconv_r14_marker_module" not in sys.modules


def test_a_stream_runs_carried_state_counts_in_what_its_manifest_may_list(tmp_path, monkeypatch):
    """A kNN memory can outweigh the params many times over: bounded by the params alone, a legitimate stream run's
    checkpoint was refused at lconv.load and init_from. What a checkpoint holds beside the params is counted."""
    import jax
    import numpy as np

    from lconv.run import checkpoints, integrity

    params = {"w": np.ones((4,), np.float32)}
    memory = {"keys": np.random.default_rng(0).standard_normal((256, 256), np.float32)}  # 256 kB beside 16 bytes
    saver = checkpoints.Checkpointer(str(tmp_path))
    saver.save(1, {"params": params, "mixer_state": memory}, {}, force=True)
    saver.close()
    monkeypatch.setattr(integrity, "METADATA_MAX_BYTES", 4096)  # the metadata allowance, small enough to see
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    reader = checkpoints.Checkpointer(str(tmp_path), read_only=True)
    with pytest.raises(integrity.CorruptCheckpoint, match="more than"):
        reader.restore_params(abstract(params), 1)
    restored = reader.restore_params(abstract(params), 1, also_held=abstract(memory))
    reader.close()
    assert np.array_equal(restored["w"], params["w"])


def test_a_compressed_index_that_inflates_past_memory_is_one_line(tmp_path, monkeypatch):
    """A 1.4 MB ``Translation-de.xz`` of zeros inflated to 9 GiB and ended in a MemoryError (round 27, r27-18): the
    decompression stops past what the host can parse. A whole, honest file still reads, and a truncated one is one
    line."""
    import lzma

    from lconv.data import ddtp, paths

    text = b"Package: a\nDescription-md5: 0\nDescription-de: x\n\n" * 2000
    path = tmp_path / "Translation-de.xz"
    path.write_bytes(lzma.compress(text))
    assert ddtp.read_index_bytes(str(path)) == text
    monkeypatch.setattr(paths, "memory_read_limit", lambda copies: len(text) - 1)
    with pytest.raises(UserError) as error:
        ddtp.read_index_bytes(str(path))
    helpers.one_line_error(error, str(path), f"decompresses to more than {len(text) - 1:,} bytes")
    monkeypatch.undo()
    path.write_bytes(lzma.compress(text)[:-40])
    with pytest.raises(UserError) as error:
        ddtp.read_index_bytes(str(path))
    helpers.one_line_error(error, str(path), "damaged or truncated xz file")
