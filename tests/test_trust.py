"""A run someone hands over is data, not code (issue 56): a ``"module:Class"`` plugin its stored config.json
names is imported only with ``trust_plugins=True`` / ``--trust_plugins``, or when this process has it already.
Every reader of a stored config refuses it in one line naming the module and the opt-in, before importing. A
compilation-cache entry a workdir carries (native code) is never read: the cache is this user's."""
import json
import os
import shutil
import sys
import uuid

import helpers
import ml_collections
import pytest

import lconv
from lconv.errors import UserError
from lconv.run import restore, schema


@pytest.fixture
def evil_run(tiny_run, tmp_path, monkeypatch):
    """A copy of the shared run's config whose encoder mixer names ``payload_<id>:X``, a module on sys.path that
    leaves a marker file when imported (what a downloaded run's payload would do)."""
    name = f"payload_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nX = 1\n")
    monkeypatch.syspath_prepend(str(plugins))
    workdir = tmp_path / "evil"
    shutil.copytree(tiny_run.workdir, workdir, ignore=shutil.ignore_patterns("checkpoints", "best", "tensorboard"))
    config = json.loads((workdir / "config.json").read_text())
    config["model"]["encoder_mixer"] = f"{name}:X"
    (workdir / "config.json").write_text(json.dumps(config))
    yield workdir, name, marker
    sys.modules.pop(name, None)


def test_every_reader_of_a_stored_config_refuses_an_unknown_plugin_without_running_it(evil_run, capsys):
    from lconv.train import init_from

    workdir, name, marker = evil_run
    for read in (lambda: restore.read_stored(str(workdir)), lambda: lconv.load(str(workdir)),
                 lambda: lconv.load([str(workdir), str(workdir)]),
                 lambda: init_from.Source(type("C", (), {"train": type("T", (), {"init_from": str(workdir)})})())):
        with pytest.raises(UserError) as info:
            read()
        helpers.one_line_error(info, name, "config.model.encoder_mixer", "--trust_plugins", "trust_plugins=True")
    for program, extra in (("eval.py", ()), ("lconv.export", (f"--out={workdir.parent / 'export'}",))):
        helpers.one_line_error(helpers.run_cli(capsys, program, f"--workdir={workdir}", *extra), name,
                               "--trust_plugins")
    assert not marker.exists() and name not in sys.modules


def test_the_opt_in_imports_the_plugin(evil_run):
    workdir, name, marker = evil_run
    with pytest.raises(UserError, match="not a flax.linen.Module"):  # imported, then found to be no mixer
        lconv.load(str(workdir), trust_plugins=True)
    assert marker.exists()


def test_the_programs_flag_is_the_opt_in(evil_run):
    workdir, name, marker = evil_run
    with restore.trusting_plugins(), pytest.raises(UserError, match="not a flax.linen.Module"):
        restore.read_stored(str(workdir))
    assert marker.exists()
    with pytest.raises(UserError, match="trust_plugins"):  # the opt-in ends with its block
        restore.check_plugins({"model": {"decoder_mixer": "another_payload:Y"}}, "config.json")


def test_a_plugin_this_process_has_already_needs_no_opt_in(monkeypatch):
    import toy_mixers  # noqa: F401  (the user imported their own mixers)

    from lconv.nn import mixers

    restore.check_plugins({"model": {"encoder_mixer": "toy_mixers:PrefixMean,lightconv"}}, "config.json")
    monkeypatch.setitem(mixers._MIXERS, "registered_by_user", "not_imported_yet_mixers:Gated")  # register_mixer
    restore.check_plugins({"model": {"decoder_mixer": ["attention", "not_imported_yet_mixers:Gated"]}}, "c.json")
    for model in ({"ffn_type": "evil_ffn:F"}, {"mixer_kwargs": {"evil_kw:M": {}}}):
        with pytest.raises(UserError, match="evil_"):
            restore.check_plugins({"model": model}, "config.json")


class _Payload:
    """What a malicious pickle holds: unpickling it calls ``_touch(marker)``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (str(self.marker),))


def _touch(path):
    import pathlib

    pathlib.Path(path).touch()


def test_a_fairseq_checkpoint_that_would_run_code_is_refused_without_the_opt_in(tmp_path):
    import torch  # requirements.txt pins it (the [fairseq] extra)

    from lconv.interop import fairseq

    marker, path = tmp_path / "ran", tmp_path / "model.pt"
    torch.save({"model": {}, "payload": _Payload(marker)}, path)
    with pytest.raises(UserError) as error:
        fairseq.read_checkpoint(str(path))
    helpers.one_line_error(error, str(path), "--trust_checkpoint")
    assert not marker.exists()
    # Trusted, it is code: a file in a folder another user can add to is refused as a config there is (r32-16)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "model.pt").write_bytes(path.read_bytes())
    shared.chmod(0o1777)
    with pytest.MonkeyPatch.context() as env:
        env.delenv("LCONV_ALLOW_SHARED_FOLDERS", raising=False)
        with pytest.raises(UserError) as error:
            fairseq.read_checkpoint(str(shared / "model.pt"), trust=True)
    helpers.one_line_error(error, str(shared / "model.pt"), "lets other users add files")
    assert not marker.exists()


@pytest.mark.parametrize("special", ["pipe", "/dev/zero"])
def test_a_fairseq_checkpoint_or_dictionary_that_is_a_pipe_or_a_device_is_one_line(special, tmp_path):
    """A named pipe hung ``python -m lconv.import_fairseq``; /dev/zero reached torch's loader (round-9 campaign)."""
    from lconv.interop import fairseq, fairseq_vocab

    path = tmp_path / "special"
    os.mkfifo(path) if special == "pipe" else path.symlink_to(special)
    for read in (fairseq.read_checkpoint, fairseq_vocab.read_dictionary):
        with pytest.raises(UserError) as error:
            read(str(path))
        helpers.one_line_error(error, str(path), "not a regular file")


def test_a_compilation_cache_entry_planted_in_a_workdir_is_not_read(tmp_path, monkeypatch, lconv_log):
    """A downloaded workdir's compilation_cache/ held an entry copied over another program's name, and eval.py ran
    it: by default the cache is this user's folder, created for its owner alone, never the workdir's."""
    from lconv.cli import runtime

    workdir = tmp_path / "run"
    planted = workdir / runtime.COMPILATION_CACHE / "jit_hypotheses-0123abcd-cache"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"native code from elsewhere")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    user = tmp_path / "xdg" / "lconv" / runtime.COMPILATION_CACHE
    with helpers.jax_cache_config() as config:
        assert runtime.enable_compilation_cache(str(workdir)) == str(user)
        assert config.jax_compilation_cache_dir == str(user)
    assert os.listdir(user) == [] and os.stat(user).st_mode & 0o777 == 0o700
    (line,) = [m for m in lconv_log() if "is not read" in m]
    assert str(planted.parent) in line and str(user) in line
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime.user_compilation_cache() == str(tmp_path / "home" / ".cache" / "lconv" / runtime.COMPILATION_CACHE)


class _Loaded(Exception):
    """Raised by a stand-in ``load_trained``: ``lconv.load`` got as far as loading the run."""


def test_lconv_load_keeps_programs_in_this_users_cache_never_the_workdirs(tmp_path, monkeypatch):
    """``lconv.load`` sets this user's folder before it loads (and so before anything compiles), as eval.py does;
    a workdir's compilation_cache/ is never it, and the process's own choice (cache off, another folder) stands."""
    import jax

    import lconv
    from lconv.run import compilation_cache, restore

    workdir = tmp_path / "run"
    (workdir / compilation_cache.FOLDER_NAME).mkdir(parents=True)
    seen = []

    def load_trained(*args, **kwargs):
        seen.append((jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir))
        raise _Loaded

    monkeypatch.setattr(restore, "load_trained", load_trained)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    user = tmp_path / "xdg" / "lconv" / compilation_cache.FOLDER_NAME
    for enabled, folder in ((True, None), (False, None), (True, str(tmp_path / "mine"))):
        with helpers.jax_cache_config() as config:
            config.update("jax_enable_compilation_cache", enabled)
            config.update("jax_compilation_cache_dir", folder)
            with pytest.raises(_Loaded):
                lconv.load(str(workdir))
    assert seen == [(True, str(user)), (False, None), (True, str(tmp_path / "mine"))]
    assert os.stat(user).st_mode & 0o777 == 0o700 and os.listdir(workdir / compilation_cache.FOLDER_NAME) == []


@pytest.mark.parametrize("make, problem", [
    (lambda folder: folder.parent.mkdir(parents=True) or folder.write_text("x"), "is not a folder"),
    (lambda folder: folder.mkdir(parents=True) or folder.chmod(0o777), "can be written by other users"),
    (lambda folder: folder.mkdir(parents=True, mode=0o700) or folder.parent.chmod(0o777), "can be written by other"),
    (lambda folder: folder.parent.mkdir(parents=True) or folder.symlink_to(folder.parent), "is a link"),
], ids=["a_file", "writable_by_others", "lconv_folder_writable_by_others", "a_link"])
def test_a_user_cache_that_cannot_hold_code_safely_is_one_warning_and_the_cache_off(make, problem, tmp_path,
                                                                                    monkeypatch, lconv_log):
    """The default folder unusable, or open to other users' planted entries: one warning, compiling every time."""
    from lconv.cli import runtime

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    make(tmp_path / "xdg" / "lconv" / runtime.COMPILATION_CACHE)
    with helpers.jax_cache_config() as config:
        assert runtime.enable_compilation_cache(str(tmp_path / "run")) is None
        assert config.jax_enable_compilation_cache is False
    (line,) = [m for m in lconv_log() if "compiled programs" in m]
    assert problem in line and "--compilation_cache" in line


def test_a_mixer_given_as_a_json_object_is_refused_before_anything_is_imported(evil_run, capsys, tmp_path):
    """``"decoder_mixer": {"payload:X": 1}``: a JSON object is no mixer list (``list()`` of it gave its keys,
    resolved past the trust check). Every reader refuses it in one line naming the field, trusted or not, and so
    does the schema for train.py's own config."""
    import tiny_config

    from lconv.run.schema import validate_config
    from lconv.train import init_from

    workdir, name, marker = evil_run
    config = json.loads((workdir / "config.json").read_text())
    config["model"]["encoder_mixer"] = "dynamicconv"
    for field, value in (("decoder_mixer", {f"{name}:X": 1}), ("decoder_mixer", [{f"{name}:X": 1}]),
                         ("ffn_type", {f"{name}:F": 1})):
        stored = {**config, "model": {**config["model"], field: value}}
        (workdir / "config.json").write_text(json.dumps(stored))
        for read in (lambda: lconv.load(str(workdir)), lambda: lconv.load(str(workdir), trust_plugins=True),
                     lambda: init_from.prepare(schema.validate_config(tiny_config.training_config(
                         tmp_path, 1, init_from=str(workdir))), str(tmp_path / "new"))):
            with pytest.raises(UserError) as info:
                read()
            helpers.one_line_error(info, f"config.model.{field}=")
        for program, extra in (("eval.py", ()), ("lconv.export", (f"--out={workdir.parent / 'export'}",))):
            helpers.one_line_error(helpers.run_cli(capsys, program, f"--workdir={workdir}", *extra),
                                   f"config.model.{field}=")
        own = tiny_config.training_config(tmp_path, 1).to_dict()
        own["model"][field] = value  # train.py's own config (a ConfigDict: its repr spans lines)
        own = ml_collections.ConfigDict(own)
        with pytest.raises(UserError) as info:
            validate_config(own)
        helpers.one_line_error(info, f"config.model.{field}=")
    assert not marker.exists() and name not in sys.modules


@pytest.mark.parametrize("given", ["false", "no", 1, None])
def test_the_opt_in_is_true_or_false_and_nothing_that_looks_like_one(given, tmp_path):
    """``trust_plugins="false"`` is a non-empty string, so it read as an opt-in: the payload ran."""
    with pytest.raises(UserError) as error:
        lconv.load(str(tmp_path / "never_read"), trust_plugins=given)
    helpers.one_line_error(error, "trust_plugins: must be True or False")


@pytest.mark.parametrize("named", ["flax.linen:Module", "flax.linen:RNNCellBase", "lconv.nn.attention:AttentionFields"])
def test_an_imported_class_that_passes_the_checks_but_cannot_trace_is_one_line(tiny_run, tmp_path, named):
    """A stored mixer naming a class this process already has (so no opt-in is asked) that the config's contract
    check lets through but flax cannot build: a 53-59-line traceback from eval.py and lconv.load (round-12 f12)."""
    workdir = tmp_path / "run"
    shutil.copytree(tiny_run.workdir, workdir, ignore=shutil.ignore_patterns("tensorboard"))
    config = json.loads((workdir / "config.json").read_text())
    config["model"]["decoder_mixer"] = named
    (workdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as info:
        lconv.load(str(workdir))
    helpers.one_line_error(info, named, "cannot be built")
