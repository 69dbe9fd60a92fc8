"""What a run, a checkpoint manifest or an export names stays inside it, and every output goes through one atomic
writer (issue 56): no output lands through a symbolic link planted in a workdir, and a failed write (a full disk)
leaves the earlier file whole."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import helpers
import pytest
import tiny_config

from lconv import outputs
from lconv.cli import eval_program
from lconv.errors import UserError
from lconv.infer import reports
from lconv.run import restore


@pytest.fixture
def config_only(tmp_path, monkeypatch):
    """A workdir holding only a translation run's config.json, and a ``load_trained`` that fails the test."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(tiny_config.get_config().to_json())
    monkeypatch.setattr(restore, "load_trained", lambda *a, **k: pytest.fail("loaded before the check"))
    return workdir


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def test_eval_refuses_an_output_that_is_a_symlink_before_loading(config_only, victim, tmp_path, capsys):
    (config_only / "test.hyp.txt").symlink_to(victim)
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), split="test")
    helpers.one_line_error(error, str(config_only / "test.hyp.txt"), "symbolic link")
    source = tmp_path / "in.en"
    source.write_text("one line\n")
    link = tmp_path / "out.de"
    link.symlink_to(victim)
    helpers.one_line_error(helpers.run_cli(capsys, "eval.py", f"--workdir={config_only}", f"--source_file={source}",
                                           f"--output_file={link}"), str(link), "symbolic link")
    assert victim.read_text() == "precious\n"


def test_eval_refuses_an_output_that_is_a_fifo_naming_it_before_loading(config_only, tmp_path, capsys):
    """A FIFO as --output_file was "File or stream is not seekable", naming neither the pipe nor the fix."""
    source, pipe = tmp_path / "in.en", tmp_path / "out.fifo"
    source.write_text("one line\n")
    os.mkfifo(pipe)
    helpers.one_line_error(helpers.run_cli(capsys, "eval.py", f"--workdir={config_only}", f"--source_file={source}",
                                           f"--output_file={pipe}"), str(pipe), "pipe", "not a regular file")
    os.mkfifo(config_only / "test.hyp.txt")
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), split="test")
    helpers.one_line_error(error, str(config_only / "test.hyp.txt"), "pipe", "not a regular file")


def test_eval_prepares_a_splits_data_only_where_the_user_says(config_only, tmp_path):
    """A run from elsewhere whose config.json named ``"data_dir": "/etc"`` had eval.py --split=test prepare a dataset
    into /etc: a stored data_dir is read when its copy is there, and data is prepared only in --data_dir."""
    elsewhere = tmp_path / "elsewhere"
    stored = json.loads((config_only / "config.json").read_text())
    stored["data"]["data_dir"] = str(elsewhere)
    (config_only / "config.json").write_text(json.dumps(stored))
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), split="test")
    helpers.one_line_error(error, f"config.data.data_dir={elsewhere}", str(config_only / "config.json"),
                           "--data_dir")
    assert not elsewhere.exists()
    with pytest.raises(pytest.fail.Exception, match="loaded before the check"):  # past the check: loading
        eval_program.run(str(config_only), split="test", data_dir=str(tmp_path / "mine"))
    source = tmp_path / "in.en"
    source.write_text("one line\n")
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=str(source), data_dir=str(tmp_path / "mine"))
    helpers.one_line_error(error, "--data_dir", "--source_file")


def test_the_writers_refuse_a_link_planted_after_the_check(tmp_path, victim):
    """The split's writer itself refuses (a link made between eval.py's check and its write)."""
    (tmp_path / "test.scores.json").symlink_to(victim)
    with pytest.raises(UserError) as error:
        reports.write_outputs(str(tmp_path), "test", ["a"], {"bleu": 1.0})
    helpers.one_line_error(error, "test.scores.json", "symbolic link")
    assert victim.read_text() == "precious\n"


def test_a_failed_write_keeps_the_earlier_file_and_leaves_no_temporary(tmp_path):
    """``ulimit -f``: the write fails part-way (a full disk); the earlier output is whole, the error one line."""
    path = tmp_path / "output.txt"
    path.write_text("earlier\n")
    code = ("import resource, sys\nresource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
            "from lconv import outputs\nfrom lconv.errors import UserError\n"
            "try:\n    outputs.write_atomically(sys.argv[1], 'x' * 100000)\n"
            "except UserError as e:\n    print(e)\n    sys.exit(2)\n")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=helpers.ROOT,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stdout and len(result.stdout.strip().splitlines()) == 1
    assert path.read_text() == "earlier\n" and sorted(p.name for p in tmp_path.iterdir()) == ["output.txt"]
    outputs.write_atomically(path, "later\n")
    assert path.read_text() == "later\n"


# ----------------------------------------------------------------------------------------------------------------
# A checkpoint's manifest names files inside its step folder, and those are plain files
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def step_dir(tmp_path):
    from lconv.run import integrity

    step = tmp_path / "checkpoints" / "5"
    (step / "state").mkdir(parents=True)
    (step / "state" / "a").write_bytes(b"abc")
    integrity.write_manifest(str(step))
    return step


def _tamper(step, change):
    import json

    from lconv.run import integrity

    path = step / integrity.MANIFEST_FILENAME
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("outside", ["../../outside.txt", "ABSOLUTE", "state/../../../outside.txt", "./state/a"])
def test_a_manifest_naming_a_path_outside_its_checkpoint_is_corrupt(step_dir, outside):
    """Even with the right size and digest (it was read and accepted): only paths inside the step folder count."""
    import hashlib

    from lconv.run import integrity

    target = step_dir.parents[1] / "outside.txt"
    target.write_bytes(b"abc")
    outside = str(target) if outside == "ABSOLUTE" else outside
    _tamper(step_dir, lambda m: m["sha256"].update({outside: [3, hashlib.sha256(b"abc").hexdigest()]}))
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        integrity.verify_manifest(str(step_dir))
    helpers.one_line_error(error, str(step_dir), outside, "outside the checkpoint")


def test_a_checkpoint_file_linked_out_or_to_a_device_is_corrupt_not_read(step_dir):
    """``state/a`` linked to /dev/zero hung eval.py forever (hashing an endless file)."""
    from lconv.run import integrity

    (step_dir / "state" / "a").unlink()
    (step_dir / "state" / "a").symlink_to("/dev/zero")
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        integrity.verify_manifest(str(step_dir))
    helpers.one_line_error(error, "state/a", "symbolic link")


@pytest.mark.parametrize("manifest", [[], {"sha256": []}, {"sha256": {"state/a": 3}}, {"sha256": {"state/a": [3]}},
                                      {"sha256": {"state/a": ["3", "x"]}}, "text"])
def test_a_malformed_manifest_is_one_line(step_dir, manifest):
    import json

    from lconv.run import integrity

    (step_dir / integrity.MANIFEST_FILENAME).write_text(json.dumps(manifest))
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        integrity.verify_manifest(str(step_dir))
    helpers.one_line_error(error, str(step_dir), integrity.MANIFEST_FILENAME)


# ----------------------------------------------------------------------------------------------------------------
# An export's sidecar names plain files in its folder; a workdir's tokenizer is its own; reads are bounded
# ----------------------------------------------------------------------------------------------------------------
def _export(folder, **changes):
    """A folder with an export's sidecar (the rest of the export is not needed to reach the checks)."""
    import json

    from lconv import export

    folder.mkdir(exist_ok=True)
    sidecar = {"format": export.FORMAT_VERSION, "task": "translation", "tokenizer": "spm.model",
               "params": "params.npz", "programs": [{"file": "translate_r1_w32.jax", "rows": 1, "width": 32}],
               "search": {"beam_size": 1, "lenpen": 0.6}}
    sidecar.update(changes)
    (folder / export.SIDECAR).write_text(json.dumps(sidecar))
    return folder


@pytest.mark.parametrize("field, name", [("tokenizer", "/etc/hostname"), ("params", "../outside/x.npz"),
                                         ("params", "/tmp/x.npz"), ("programs", "../p.jax"), ("tokenizer", "..")])
def test_an_export_sidecar_naming_a_file_outside_it_is_refused(tmp_path, field, name):
    from lconv import export

    value = [{"file": name, "rows": 1, "width": 32}] if field == "programs" else name
    folder = _export(tmp_path / "exported", **{field: value})
    with pytest.raises(UserError) as error:
        export.load(str(folder))
    helpers.one_line_error(error, export.SIDECAR, repr(name))


def test_an_export_file_linked_out_of_its_folder_or_not_a_file_is_refused(tmp_path, tiny_data):
    import shutil

    from lconv import export

    folder = _export(tmp_path / "exported")
    (tmp_path / "elsewhere.model").write_bytes(tiny_data.spm.read_bytes())
    (folder / "spm.model").symlink_to(tmp_path / "elsewhere.model")
    with pytest.raises(UserError) as error:
        export.load(str(folder))
    helpers.one_line_error(error, "spm.model", "leads out of")
    (folder / "spm.model").unlink()
    shutil.copy(tiny_data.spm, folder / "spm.model")
    os.mkfifo(folder / "params.npz")  # would block the reader forever
    with pytest.raises(UserError) as error:
        export.load(str(folder))
    helpers.one_line_error(error, "params.npz", "not a regular file")


def test_a_workdirs_tokenizer_linked_to_a_device_or_out_of_it_is_one_line(tmp_path, tiny_data):
    from lconv.data import tokenizer as tokenizer_lib

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "spm.model").symlink_to("/dev/zero")
    with pytest.raises(UserError) as error:
        tokenizer_lib.load_tokenizer(str(workdir))
    helpers.one_line_error(error, "spm.model")
    (workdir / "spm.model").unlink()
    (workdir / "spm.model").symlink_to(tiny_data.spm)
    with pytest.raises(UserError) as error:
        tokenizer_lib.load_tokenizer(str(workdir))
    helpers.one_line_error(error, "spm.model", "leads out of")


def test_a_damaged_tokenizer_is_one_line_however_it_is_damaged(tmp_path, tiny_data):
    """A byte piece damaged into bytes that are not UTF-8 made SentencePiece's own error undecodable: a
    UnicodeDecodeError traceback from eval.py and import_fairseq (round 27, r27-29); a cut file is the same line."""
    from lconv.data import tokenizer as tokenizer_lib

    model = pathlib.Path(tiny_data.spm).read_bytes()
    assert model.count(b"<0x33>") == 1
    workdir = tmp_path / "run"
    workdir.mkdir()
    for damaged in (model.replace(b"<0x33>", b"<0x\xf23>"), model[:len(model) // 2]):
        (workdir / "spm.model").write_bytes(damaged)
        with pytest.raises(UserError) as error:
            tokenizer_lib.load_tokenizer(str(workdir))
        helpers.one_line_error(error, "spm.model", "not a SentencePiece model", "truncated or damaged")


def test_a_source_file_that_never_ends_is_one_line(monkeypatch, tmp_path):
    """``--source_file=/dev/zero`` was a MemoryError traceback (or took the host), then read 1 GiB before the bound
    refused it (r30-16): a device is refused at once; a file or a pipe is read up to a bound."""
    with pytest.raises(UserError) as error:
        eval_program.read_lines("/dev/zero", "--source_file")
    helpers.one_line_error(error, "--source_file=/dev/zero", "a device")
    monkeypatch.setattr(eval_program, "TEXT_FILE_LIMIT", 1 << 20)
    (tmp_path / "long.txt").write_bytes(b"x" * (1 << 20) + b"\n")  # one line past the bound
    with pytest.raises(UserError) as error:
        eval_program.read_lines(str(tmp_path / "long.txt"), "--source_file")
    helpers.one_line_error(error, "long.txt", "bytes")
    (tmp_path / "short.txt").write_bytes(b"a\n" * ((1 << 20) // 60))  # 35 kB of lines, each held as a string
    with pytest.raises(UserError) as error:  # yes | eval.py --source_file=/dev/stdin held 16 GB by 1 GiB (r31-17)
        eval_program.read_lines(str(tmp_path / "short.txt"), "--source_file")
    helpers.one_line_error(error, "short.txt", "bytes to hold")
    monkeypatch.setattr(eval_program, "TEXT_LINE_LIMIT", 10)  # 15.5 million short lines held 4.7 GB once tokenized
    (tmp_path / "lines.txt").write_text("a\n" * 11)  # (r32-13)
    with pytest.raises(UserError) as error:
        eval_program.read_lines(str(tmp_path / "lines.txt"), "--source_file")
    helpers.one_line_error(error, "lines.txt", "more than 10 lines")


def test_a_compilation_cache_that_cannot_be_a_folder_is_one_line_not_a_warning_per_compile(tmp_path, capsys,
                                                                                          monkeypatch, lconv_log):
    """A bad --compilation_cache leaked JAX's raw warnings on every run (at every compile)."""
    import jax

    from lconv.cli import runtime

    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for bad in (a_file, a_file / "cache"):
        helpers.one_line_error(helpers.run_cli(capsys, "eval.py", f"--workdir={tmp_path / 'run'}",
                                               f"--compilation_cache={bad}"), f"--compilation_cache={bad}", "folder")
    saved = {name: getattr(jax.config, name) for name in ("jax_compilation_cache_dir", "jax_enable_compilation_cache")}
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(a_file / "cache"))
    try:
        assert runtime.enable_compilation_cache(str(tmp_path / "run")) is None
        assert jax.config.jax_enable_compilation_cache is False
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
    (line,) = [m for m in lconv_log() if "compiled programs" in m]
    assert "JAX_COMPILATION_CACHE_DIR" in line and str(a_file) in line


def test_a_cache_entry_that_cannot_be_written_is_one_lconv_warning_per_process(monkeypatch, lconv_log, recwarn,
                                                                               tmp_path):
    """A full disk when JAX writes a cache entry leaked JAX's raw UserWarning, once per compiled program: one lconv
    line naming the cache folder instead, and other warnings still shown."""
    import warnings

    import jax
    import jax.numpy as jnp
    from jax._src import compilation_cache as jax_cache
    from jax.experimental.compilation_cache import compilation_cache as jax_cache_api

    # A cache in use whatever earlier tests of this process did: JAX decides at a compile whether it uses one
    config = contextlib.ExitStack()
    config.enter_context(helpers.jax_cache_config()).update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
    jax_cache_api.reset_cache()
    config.callback(jax_cache_api.reset_cache)

    from lconv.run import compilation_cache

    monkeypatch.setattr(compilation_cache, "_reported", [])
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # put back after the test
    compilation_cache.report_cache_errors("/the/cache")
    compilation_cache.report_cache_errors("/the/cache")  # installed once however often it is called

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jax_cache, "put_executable_and_time", disk_full)
    saved = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    with config:
        try:
            for scale in (2.5, 3.5):  # two programs, two failed writes
                jax.jit(lambda x, s=scale: x * s + 0.125)(jnp.ones(3)).block_until_ready()
        finally:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)
    warnings.warn("another warning", UserWarning, stacklevel=1)
    (line,) = [m for m in lconv_log() if "compilation cache" in m]
    assert "/the/cache" in line and "No space left on device" in line
    assert [str(w.message) for w in recwarn] == ["another warning"]


# ----------------------------------------------------------------------------------------------------------------
# The files train.py writes inside a workdir: never through a symbolic link
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["train.lock", "metrics.jsonl", "checkpoint_errors.log"])
def test_train_py_resuming_a_workdir_refuses_a_planted_link_before_writing(tiny_run, tmp_path, victim, name,
                                                                           capsys):
    """A link planted in a workdir handed over: the lock was emptied into its target, the logs appended to theirs."""
    workdir = helpers.copy_run(tiny_run, tmp_path / "run")
    (workdir / name).unlink(missing_ok=True)
    (workdir / name).symlink_to(victim)
    outcome = helpers.run_cli(capsys, "train.py", "--config=tests/tiny_config.py", f"--workdir={workdir}",
                              f"--config.data.data_dir={tiny_run.data_dir}")
    helpers.one_line_error(outcome, str(workdir / name), "is a symbolic link", "regular files in a workdir")
    assert victim.read_text() == "precious\n"


def test_each_workdir_writer_refuses_a_link_planted_after_the_check(tmp_path, victim):
    """The writers themselves refuse (a link made after ``make_workdir``'s check): the lock, metrics.jsonl (read,
    rewritten and appended), and the appended logs (checkpoint_errors.log, config_changes.jsonl)."""
    from etils import epath

    from lconv.run import workdir as workdir_lib
    from lconv.train import logs

    for name in ("train.lock", "metrics.jsonl", "checkpoint_errors.log"):
        (tmp_path / name).symlink_to(victim)
    attempts = {"train.lock": lambda: workdir_lib.lock(str(tmp_path)).__enter__(),
                "metrics.jsonl": lambda: logs.MetricWriter(str(tmp_path)),
                "checkpoint_errors.log": lambda: workdir_lib.append_text(epath.Path(tmp_path) /
                                                                         "checkpoint_errors.log", "details\n")}
    for name, attempt in attempts.items():
        with pytest.raises(UserError) as error:
            attempt()
        helpers.one_line_error(error, str(tmp_path / name), "is a symbolic link")
    with pytest.raises(UserError):
        outputs.open_append(tmp_path / "metrics.jsonl")
    assert victim.read_text() == "precious\n"
