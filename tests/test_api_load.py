"""``lconv.load`` from where runs live, reading only: a read-only workdir loads, translates and scores (the API and
eval.py) with no file in it created or changed; a run and an export on ``gs://`` (tests/buckets.py's stand-in
store) load and give what the local ones give; a path that holds no run is one line naming it; and an over-long
input follows one rule on every surface (the API, eval.py, the exported program): cut, with a warning saying which
input and by how much."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys

import helpers
import jax
import numpy as np
import orbax.checkpoint
import pytest
import tiny_runs

import lconv
from lconv import export
from lconv.api import Model
from lconv.errors import UserError

SHORT = "A small tool to convert images."
LONG = " ".join(["Library for the X window system, with fonts and files."] * 6)  # > 32 tokens: the tiny runs' limit


def _snapshot(root) -> dict[str, tuple]:
    """Every file and folder under ``root``: (mode, size, mtime, SHA-256). Works as root too, whom permissions do
    not stop: any write shows up here."""
    out = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        out[str(path.relative_to(root))] = (stat.S_IMODE(info.st_mode), info.st_size, info.st_mtime_ns, digest)
    return out


def _chmod_tree(root, writable: bool) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture(scope="session")
def read_only(tiny_run, tmp_path_factory):
    """A copy of the tiny run made read-only (``chmod -R a-w``) and its snapshot from before; write access is given
    back afterwards, so the temporary folder can be removed."""
    root = helpers.copy_run(tiny_run, tmp_path_factory.mktemp("read_only") / "run")
    _chmod_tree(root, writable=False)
    before = _snapshot(root)
    yield root, before
    _chmod_tree(root, writable=True)


def _cut_warnings(messages: list[str]) -> list[str]:
    return [m for m in messages if m.startswith("warning:") and "cut to" in m]


def test_a_read_only_workdir_loads_translates_and_scores_and_nothing_in_it_changes(read_only, lconv_log, capsys,
                                                                                   tmp_path):
    root, before = read_only
    if os.geteuid() != 0:  # root writes through any permission: there the snapshot below is the whole check
        assert not os.access(root, os.W_OK)
    model = lconv.load(str(root))
    translations = model.translate([SHORT, LONG])
    (warning,) = _cut_warnings(lconv_log())  # the API's rule: cut, and say which input and by how much
    assert "sources[1] had" in warning and "cut to 32 tokens" in warning and "sources[0]" not in warning
    assert len(translations) == 2 and model.score([SHORT, LONG], ["Ein Werkzeug.", "Eine Bibliothek."])
    with pytest.raises(UserError, match=r"model\.translate|use translate"):  # an LM's method on a translation run
        model.generate("A small tool")
    # eval.py on the same workdir, outputs elsewhere: the same translations, and the same rule for the long line.
    (tmp_path / "sources.txt").write_text(f"{SHORT}\n{LONG}\n", encoding="utf-8")
    code, out, err = helpers.run_cli(capsys, "eval.py", f"--workdir={root}", f"--source_file={tmp_path}/sources.txt",
                                     f"--output_file={tmp_path}/out.txt")
    assert code == 0, err
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == translations
    (warning,) = _cut_warnings(out.splitlines())
    assert "line 2 had" in warning and "cut to 32 tokens" in warning
    assert _snapshot(root) == before  # nothing created, removed or changed: no checkpoint_errors.log either


def _tensorstore_reads_the_bucket(monkeypatch, bucket) -> None:
    """Orbax reads a gs:// checkpoint's arrays with tensorstore's own GCS client (C++, not epath): here that client
    is stood in for by its file driver over the bucket's folder, as tests/test_paths.py stands in for
    array_record's. Everything else (config, tokenizer, step listing, manifests, metadata) goes through epath."""
    def kvstore(path: str) -> dict:
        name, _, key = str(path).removeprefix("gs://").partition("/")
        return {"driver": "file", "path": f"{bucket / name}/{key}"}

    replaced = []
    # Where orbax builds that spec moved between releases (requirements.txt allows orbax-checkpoint >= 0.11; 0.12
    # has gcs_utils.get_kvstore_for_gcs, 0.11 a private _get_kvstore_for_gcs), and a module may hold its own
    # reference: the stand-in replaces every one in orbax's loaded modules. Finding none is a failure, not a skip.
    for module_name in [m for m in sys.modules if m.startswith("orbax.checkpoint")]:
        for name in ("get_kvstore_for_gcs", "_get_kvstore_for_gcs"):
            if callable(getattr(sys.modules[module_name], name, None)):
                monkeypatch.setattr(sys.modules[module_name], name, kvstore)
                replaced.append(f"{module_name}.{name}")
    assert replaced, f"orbax-checkpoint {orbax.checkpoint.__version__}: no kvstore_for_gcs function to stand in for"
    gcs_utils = sys.modules.get("orbax.checkpoint._src.path.gcs_utils")
    if hasattr(gcs_utils, "is_hierarchical_namespace_enabled"):  # 0.12 asks the bucket first
        monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)


def test_a_run_on_gs_loads_and_translates_as_the_local_one(tiny_run, bucket, monkeypatch):
    shutil.copytree(tiny_run.workdir, bucket / "bucket" / "runs" / "tiny")
    _tensorstore_reads_the_bucket(monkeypatch, bucket)
    before = _snapshot(bucket)
    model = lconv.load("gs://bucket/runs/tiny")
    local = lconv.load(str(tiny_run.workdir))
    assert model.workdir == "gs://bucket/runs/tiny" and model.steps == local.steps == [6]
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(local.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert model.translate([SHORT, LONG]) == local.translate([SHORT, LONG])
    assert _snapshot(bucket) == before  # a read writes nothing (a read-only bucket would refuse it)
    assert bucket.os_calls == []  # every read of the URL went through epath (or the kvstore above)


def test_an_export_on_gs_runs_and_cuts_an_input_wider_than_its_buckets_as_the_model_does(bucket, lconv_log):
    """The exported program's widest bucket is 32 tokens, the model's input limit: a long source no longer fails
    its batch; it is cut with the same warning, and the short one beside it is translated as the model does."""
    trained = tiny_runs.in_memory(tiny_runs.translation_config())
    export.export(trained, "gs://bucket/exported", rows=(2,), widths=(32,))
    assert bucket.os_calls == []
    served = lconv.export.load("gs://bucket/exported")
    live = Model(trained).translate([SHORT, LONG])
    assert served([SHORT, LONG]) == live
    (warning,) = _cut_warnings(lconv_log()[-1:])
    assert "inputs[1] had" in warning and "cut to 32 tokens" in warning and "--widths" in warning


def test_a_path_that_holds_no_run_is_one_line_naming_it(tmp_path, monkeypatch, tiny_run):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").mkdir()
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / export.SIDECAR).write_text("{}")
    for path, fact in (("runs/nope", "no such directory"), ("plain", "config.json"),
                       ("exported", "lconv.export.load"), ("https://example.com/runs/x", "https://")):
        with pytest.raises(UserError) as error:
            lconv.load(path)
        helpers.one_line_error(error, f"lconv.load('{path}')", fact)
    for path, fact in (("nope", "no such directory"), (str(tiny_run.workdir), "lconv.load")):
        with pytest.raises(UserError) as error:
            lconv.export.load(path)
        helpers.one_line_error(error, path, fact)
    with pytest.raises(UserError) as error:  # a control character in the name is shown as its escape
        lconv.export.load("nope\x1b[2J\x00")
    assert "(" + str(tmp_path / "nope") + "\\x1b[2J\\x00)" in str(error.value), str(error.value)
    assert "\x1b" not in str(error.value) and "\x00" not in str(error.value)  # the label's repr escapes them too


@pytest.mark.parametrize("options, named", [(dict(average_last=0), "average_last=0"),
                                             (dict(average_last=2, checkpoint="best"), "checkpoint=best"),
                                             (dict(checkpoint="first"), "checkpoint='first'")])
def test_the_apis_checkpoint_errors_name_its_arguments_not_the_flags(tmp_path, options, named):
    """``lconv.load``'s errors name ``average_last`` / ``checkpoint`` as its caller passed them, never eval.py's
    ``--average_last`` (checked before anything is read: the path holds no run)."""
    with pytest.raises(UserError) as error:
        lconv.load(str(tmp_path), **options)
    line = helpers.one_line_error(error, named)
    assert "--" not in line, line


def test_averaging_more_checkpoints_than_there_are_is_one_line(tiny_run, tmp_path, capsys):
    """``average_last`` above the checkpoints kept averaged fewer without a word (issue 41)."""
    with pytest.raises(UserError) as error:
        lconv.load(str(tiny_run.workdir), average_last=50)
    helpers.one_line_error(error, "average_last=50", "5 checkpoints")
    outcome = helpers.run_cli(capsys, "eval.py", f"--workdir={tiny_run.workdir}", "--average_last=50",
                              f"--source_file={tiny_run.workdir}/config.json", f"--output_file={tmp_path}/out.txt")
    helpers.one_line_error(outcome, "--average_last=50", "5 checkpoints")


def test_the_installed_evaluate_program_documents_itself():
    """``python -m lconv.evaluate --help`` prints lconv/evaluate.py's docstring: its own usage, not "see eval.py"
    (an installed user has no eval.py)."""
    from lconv import evaluate

    assert "see eval.py" not in evaluate.__doc__
    for usage in ("python -m lconv.evaluate --workdir=", "--source_file=", "--interactive", "--checkpoint=best"):
        assert usage in evaluate.__doc__


@pytest.mark.slow  # compiles the tiny run's beam search, n-best, scoring and sampling programs: ~1 minute
def test_the_readmes_python_api_block_runs_as_written(tiny_run, tmp_path, monkeypatch):
    """README.md's Python API block, on the shared tiny run in place of runs/default and runs/other (issue 41: a
    new user's first day walks it), and an untrained tiny LM, in memory, in place of runs/lm (no LM run is trained
    for the tests; loading an LM workdir is test_fairseq_lm_import's)."""
    text = (helpers.ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("```python", text.index("## Python API")) + len("```python")
    block = text[start:text.index("```", start)]
    assert 'lconv.load("runs/default")' in block and 'lconv.load("runs/lm")' in block
    monkeypatch.chdir(tmp_path)  # "runs/default" -> the tiny run, through a link named so
    (tmp_path / "runs").mkdir()
    for name in ("default", "other"):
        (tmp_path / "runs" / name).symlink_to(tiny_run.workdir)
    real_load = lconv.load
    monkeypatch.setattr(lconv, "load", lambda workdir, **kwargs: Model(tiny_runs.in_memory(tiny_runs.lm_config()))
                        if workdir == "runs/lm" else real_load(workdir, **kwargs))
    exec(compile(block, "README.md", "exec"), {})


@pytest.mark.parametrize("workdir", [b"runs/tiny", bytearray(b"runs/tiny"), [b"runs/tiny"]])
def test_a_workdir_given_as_bytes_is_one_line_asking_for_a_path(workdir):
    """bytes are a Sequence: lconv.load read them as a list of workdirs and said "got 47" (the first byte)."""
    with pytest.raises(UserError) as error:
        lconv.load(workdir)
    helpers.one_line_error(error, "workdir", "str or os.PathLike", "runs/tiny")
