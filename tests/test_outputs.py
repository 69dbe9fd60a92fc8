"""The ownership rule of every lconv writer (``lconv.outputs``): each kind of output claims a new, empty or own
folder, and no file output lands on an input, on another command's output or in a checkout's committed docs/.
Each writer meets each foreign target here; the CLIs' tests check that they call these rules first."""
import json
import os
import pathlib
import stat

import helpers
import pytest

from lconv import outputs, shared_folders
from lconv.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _make(tmp_path, kind):
    """A folder holding ``kind`` output as its command leaves it (a marker-less one for the older kinds)."""
    folder = tmp_path / f"a_{kind}"
    folder.mkdir()
    if kind == "workdir":
        (folder / "config.json").write_text("{}")
        (folder / "spm.model").write_bytes(b"x")
        (folder / "checkpoints").mkdir()
    elif kind == "export":
        (folder / "lconv_export.json").write_text("{}")
        (folder / "params.npz").write_bytes(b"x")
    elif kind == "study":
        (folder / "records.json").write_text("[]")
    elif kind == "bench":
        outputs.claim_directory(str(folder), "bench", "--out")
        (folder / "mixers.csv").write_text("a,b\n")
    elif kind == "other":
        (folder / "notes.txt").write_text("mine")
    return folder


def _one_line_naming(info, *names):
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in names), message


@pytest.mark.parametrize("kind", sorted(outputs.KIND_NAMES))
@pytest.mark.parametrize("target", sorted(outputs.KIND_NAMES) + ["other"])
def test_a_directory_holds_only_its_own_kind_of_output(tmp_path, kind, target):
    folder = _make(tmp_path, target)
    before = sorted(p.name for p in folder.iterdir())
    if target == kind:
        assert outputs.claim_directory(str(folder), kind, "--out") == str(folder)
        assert outputs.kind_of(str(folder)) == kind
        return
    with pytest.raises(UserError) as info:
        outputs.claim_directory(str(folder), kind, "--out")
    _one_line_naming(info, "--out", str(folder))
    assert sorted(p.name for p in folder.iterdir()) == before  # refused before writing anything


@pytest.mark.parametrize("kind", sorted(outputs.KIND_NAMES))
def test_a_new_or_empty_folder_is_claimed_and_marked(tmp_path, kind):
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (tmp_path / "new" / "deeper", empty):
        outputs.claim_directory(str(folder), kind, "--out")
        assert json.loads((folder / outputs.MARKER).read_text()) == {"kind": kind}


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_flag_is_refused_not_the_current_directory(value):
    with pytest.raises(UserError) as info:
        outputs.claim_directory(value, "workdir", "--workdir")
    _one_line_naming(info, "--workdir")


def test_a_file_where_a_folder_goes_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError) as info:
        outputs.claim_directory(str(tmp_path / "f"), "export", "--out")
    _one_line_naming(info, "--out")


def test_a_pipe_where_a_folder_goes_is_named_a_pipe_not_a_file(tmp_path):
    """``--out=<a FIFO>`` was refused as "is a file"."""
    import os

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(UserError) as info:
        outputs.claim_directory(str(tmp_path / "pipe"), "export", "--out")
    _one_line_naming(info, "--out", str(tmp_path / "pipe"), "is a pipe, socket or device")


@pytest.mark.parametrize("relative", ["config.json", "spm.model", "checkpoints/10/x", "metrics.jsonl",
                                      "best/state", outputs.MARKER])
def test_a_file_output_never_lands_on_a_workdirs_core(tmp_path, relative):
    workdir = _make(tmp_path, "workdir")
    with pytest.raises(UserError) as info:
        outputs.check_output_file(str(workdir / relative), "--output_file")
    _one_line_naming(info, "--output_file", str(workdir))


def test_a_file_output_beside_a_workdirs_core_is_eval_pys_to_write(tmp_path):
    workdir = _make(tmp_path, "workdir")
    outputs.check_output_file(str(workdir / "test.hyp.txt"), "--output_file")
    outputs.check_output_file(str(tmp_path / "elsewhere.txt"), "--output_file")


@pytest.mark.parametrize("kind", ["export", "study", "bench"])
def test_a_file_output_never_lands_in_another_commands_folder(tmp_path, kind):
    folder = _make(tmp_path, kind)
    with pytest.raises(UserError) as info:
        outputs.check_output_file(str(folder / "out.txt"), "--output_file")
    _one_line_naming(info, "--output_file", outputs.KIND_NAMES[kind])


def test_a_file_output_is_never_an_input(tmp_path):
    source = tmp_path / "in.en"
    source.write_text("a\n")
    with pytest.raises(UserError) as info:
        outputs.check_output_file(str(tmp_path / "." / "in.en"), "--output_file",
                                  inputs=[("--source_file", str(source))])
    _one_line_naming(info, "--output_file", "--source_file")


def test_committed_docs_are_refused_from_any_directory_but_a_commands_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout
    docs = ROOT / "docs"
    assert outputs.checkout_docs(str(docs / "bench")) == str(docs)
    for call in (lambda: outputs.check_output_file(str(docs / "benchmarks.md"), "--doc"),
                 lambda: outputs.claim_directory(str(docs / "bench"), "bench", "--out")):
        with pytest.raises(UserError) as info:
            call()
        _one_line_naming(info, str(docs), "committed")
    assert outputs.checkout_docs(str(tmp_path / "docs" / "x")) is None  # a docs/ of no lconv checkout is not


def test_the_nearest_owner_decides(tmp_path):
    """A study's runs are workdirs inside the study's folder: eval.py may write beside a run's core there."""
    study = _make(tmp_path, "study")
    run = study / "translation" / "dynamic"
    run.mkdir(parents=True)
    outputs.claim_directory(str(run), "workdir", "--workdir")
    outputs.check_output_file(str(run / "test.hyp.txt"), "--output_file")
    with pytest.raises(UserError):
        outputs.check_output_file(str(run / "config.json"), "--output_file")
    with pytest.raises(UserError):
        outputs.check_output_file(str(study / "notes.txt"), "--output_file")


def test_a_workdir_seeded_with_its_pieces_is_still_a_workdir(tmp_path):
    """A tokenizer copied in to share it (notebook 03 does), or a first launch that failed before config.json."""
    seeded = tmp_path / "seeded"
    seeded.mkdir()
    (seeded / "spm.model").write_bytes(b"x")
    outputs.claim_directory(str(seeded), "workdir", "--workdir")
    with pytest.raises(UserError):
        outputs.claim_directory(str(seeded), "export", "--out")


# ---------------------------------------------------------------- each writer, as a user calls it
def _config_workdir(tmp_path):
    from lconv.configs import default

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(default.get_config().to_json())
    (workdir / "spm.model").write_bytes(b"tokenizer")
    return workdir


@pytest.mark.parametrize("target", ["config.json", "spm.model", "source", "reference"])
def test_eval_never_writes_over_a_runs_files_or_its_own_inputs(tmp_path, target):
    from lconv.cli import eval_program

    workdir = _config_workdir(tmp_path)
    source, reference = tmp_path / "in.en", tmp_path / "ref.de"
    source.write_text("A tool.\n")
    reference.write_text("Ein Werkzeug.\n")
    output = {"source": source, "reference": reference}.get(target, workdir / target)
    before = output.read_bytes()
    with pytest.raises(UserError) as info:
        eval_program.run(str(workdir), source_file=str(source), reference_file=str(reference),
                         output_file=str(output))
    _one_line_naming(info, "--output_file")
    assert output.read_bytes() == before


@pytest.mark.parametrize("target", ["workdir", "study", "other"])
def test_export_refuses_a_folder_it_does_not_own_before_reading_the_run(tmp_path, target):
    import types

    from lconv import export
    from lconv.configs import default

    folder = _config_workdir(tmp_path) if target == "workdir" else _make(tmp_path, target)
    before = sorted(p.name for p in folder.iterdir())
    trained = types.SimpleNamespace(config=default.get_config())  # refused before the params are touched
    with pytest.raises(UserError) as info:
        export.export(trained, str(folder))
    _one_line_naming(info, f"out={folder} ")  # the function's argument, not the CLI's --out
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize("target", ["export", "study", "other"])
def test_the_fairseq_importer_refuses_a_folder_it_does_not_own_before_reading_anything(tmp_path, target):
    from lconv.interop import fairseq_workdir

    folder = _make(tmp_path, target)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(UserError) as info:  # the checkpoint does not exist: the folder is refused first
        fairseq_workdir.import_checkpoint(str(tmp_path / "none.pt"), str(tmp_path / "dict.txt"), None, str(folder))
    _one_line_naming(info, "--workdir", str(folder))
    assert sorted(p.name for p in folder.iterdir()) == before


def test_bench_never_writes_committed_results_from_another_directory(tmp_path, monkeypatch):
    import argparse

    from lconv.bench import __main__ as bench

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise UserError(message)

    monkeypatch.chdir(tmp_path)
    for out, doc in ((ROOT / "docs" / "bench", tmp_path / "b.md"), (tmp_path / "b", ROOT / "docs" / "benchmarks.md")):
        opts = argparse.Namespace(quick=False, out=str(out), doc=str(doc))
        with pytest.raises(UserError) as info:
            bench.resolve_outputs(opts, Parser())
        _one_line_naming(info, "committed")
    opts = argparse.Namespace(quick=True, out=None, doc=None)  # its own scratch folder: fine, and marked
    bench.resolve_outputs(opts, Parser())
    assert outputs.kind_of(opts.out) == "bench"


def test_train_refuses_an_empty_workdir_flag_and_a_folder_of_something_else(tmp_path):
    from lconv.run import workdir as workdir_lib

    for value in ("", str(_make(tmp_path, "export")), str(_make(tmp_path, "other"))):
        with pytest.raises(UserError) as info:
            workdir_lib.make_workdir(value)
        _one_line_naming(info, "--workdir")


@pytest.mark.parametrize("decode, flag", [({"lenpen": float("nan")}, "--lenpen"), ({"beam_size": 0}, "--beam_size"),
                                          ({"max_len_b": -1}, "--max_len_b")])
def test_the_fairseq_importer_checks_decode_settings_as_eval_py_does(tmp_path, decode, flag):
    """The importer's decode flags go through the config's own rules before anything is read or written."""
    from lconv.interop import fairseq_workdir

    with pytest.raises(UserError) as info:
        fairseq_workdir.import_checkpoint(str(tmp_path / "none.pt"), str(tmp_path / "dict.txt"), None,
                                          str(tmp_path / "run"), decode=decode)
    _one_line_naming(info, flag)
    assert not (tmp_path / "run").exists()


def test_an_output_written_over_keeps_its_permissions_and_a_folder_path_is_refused(tmp_path):
    """The atomic writer's rename replaces the file: a private (0600) output stays private; ``dir/`` that does
    not exist is refused rather than written as a file named ``dir``."""
    private = tmp_path / "out.txt"
    private.write_text("old\n")
    private.chmod(0o600)
    outputs.write_atomically(private, "new\n")
    assert private.read_text() == "new\n" and private.stat().st_mode & 0o777 == 0o600
    for folder in ("newdir/", "newdir/.", "newdir/sub/.."):  # dir/. was written as a file dir (round-9 campaign)
        with pytest.raises(UserError, match="names a folder"):
            outputs.write_atomically(f"{tmp_path}/{folder}", "text\n")
        assert not (tmp_path / "newdir").exists()


@pytest.mark.parametrize("folder", ["newdir/", "newdir/.", "newdir/sub/.."])
def test_an_output_file_naming_a_folder_is_refused_before_any_work(folder, tmp_path):
    with pytest.raises(UserError) as info:
        outputs.check_output_file(f"{tmp_path}/{folder}", "--output_file")
    _one_line_naming(info, "--output_file")
    assert "names a folder" in str(info.value)


def test_a_folder_output_inside_a_workdirs_own_entries_or_an_export_is_refused(tmp_path):
    """An export written into ``checkpoints/4/exp`` left checkpoint 4 unreadable (a file orbax did not write; round-9
    campaign). A folder beside a workdir's own entries is the user's to use."""
    workdir = pathlib.Path(outputs.claim_directory(str(tmp_path / "run"), "workdir", "--workdir"))
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    exported = pathlib.Path(outputs.claim_directory(str(tmp_path / "exp"), "export", "--out"))
    for inside in (workdir / "checkpoints" / "4" / "exp", workdir / "best" / "exp", exported / "again"):
        with pytest.raises(UserError) as info:
            outputs.claim_directory(str(inside), "export", "--out")
        _one_line_naming(info, "--out", "inside")
        assert not inside.exists()
    assert outputs.claim_directory(str(workdir / "exports"), "export", "--out")


def test_prepared_data_and_a_compilation_cache_never_go_among_a_workdirs_own_entries(tmp_path):
    """``--data_dir`` and ``--compilation_cache`` inside another run's checkpoint step wrote files its manifest does
    not list, so that step was refused after (round-10 campaign)."""
    from lconv.cli import runtime
    from lconv.data import tfds_ddtp

    workdir = pathlib.Path(outputs.claim_directory(str(tmp_path / "run"), "workdir", "--workdir"))
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    with pytest.raises(UserError) as info:
        tfds_ddtp.prepare("ddtp/en_de", str(workdir / "checkpoints" / "4" / "dd"))
    _one_line_naming(info, "data_dir", "inside")
    with pytest.raises(UserError) as info:
        runtime.enable_compilation_cache(str(tmp_path / "other"), str(workdir / "best" / "cc"))
    _one_line_naming(info, "--compilation_cache", "inside")
    assert sorted(p.name for p in workdir.rglob("*")) == sorted(["4", "checkpoints", outputs.MARKER])


@pytest.mark.parametrize("marker", ['{"kind": {"a": 1}}', '{"kind": ["workdir"]}', '{"kind": 5}', "[1]"])
def test_a_hand_written_marker_of_the_wrong_type_marks_no_kind(tmp_path, marker):
    folder = tmp_path / "o"
    folder.mkdir()
    (folder / outputs.MARKER).write_text(marker)
    assert outputs.kind_of(str(folder)) is None
    outputs.check_output_file(str(folder / "out.txt"), "--output_file")  # as any folder, the output may go there


@pytest.mark.parametrize("plant", ["pipe", "link_to_dev_zero", "another_users", "oversized"])
def test_a_marker_or_checkout_file_that_is_no_small_file_of_ours_is_ignored_without_a_wait(tmp_path, plant,
                                                                                         monkeypatch):
    """lconv reads the marker of every folder above an output, and each one's pyproject.toml (is it a checkout?),
    in folders it does not own: a pipe there hung eval.py, a link to /dev/zero ran it out of memory, and another
    user's export marker in /tmp refused every output below it (round-23 campaign), their pyproject.toml every
    output below its docs/ (round 25). Each is now no marker and no checkout at all."""
    monkeypatch.delenv(shared_folders.OPT_IN, raising=False)
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "lconv").mkdir()
    for name in (outputs.MARKER, "pyproject.toml"):
        planted = folder / name
        if plant == "pipe":  # behind a link, which a check of the name alone passes
            os.mkfifo(folder / f"{name}.fifo")
            planted.symlink_to(folder / f"{name}.fifo")
        elif plant == "link_to_dev_zero":
            planted.symlink_to("/dev/zero")
        elif plant == "oversized":
            planted.write_text('{"kind": "export"}' + " " * (1 << 20) + '\nname = "lconv"\n')
        else:
            planted.write_text('{"kind": "export"}\nname = "lconv"\n')
            helpers.make_another_users(planted, monkeypatch)
    assert outputs.kind_of(str(folder)) is None
    assert outputs.checkout_docs(str(folder / "docs" / "x")) is None  # another user's files make no checkout here
    outputs.check_output_file(str(folder / "out.txt"), "--output_file")
    outputs.check_directory(str(folder / "run"), "workdir", "--workdir")


@pytest.mark.parametrize("plant", ["linked_folder", "dangling_file_link", "pipe", "none"])
def test_a_study_folder_holding_a_link_or_a_pipe_anywhere_is_refused(tmp_path, plant):
    """The study writes and reads everything below --output_dir and --docs_dir by name: a ``results`` folder linked
    to another had a user's results.csv overwritten, a linked ``tokenizers`` folder had tokenizers written outside
    and read back (round-12 campaign N1). Any link or special file below them is now one line, before any work."""
    root, victim = tmp_path / "docs", tmp_path / "victim"
    (root / "results" / "runs").mkdir(parents=True)
    victim.mkdir()
    (root / "results" / "runs" / "a.json").write_text("{}")
    planted = root / "results" / "runs" / "b"
    if plant == "linked_folder":
        planted.symlink_to(victim)
    elif plant == "dangling_file_link":
        planted.symlink_to(victim / "spm.model")
    elif plant == "pipe":
        os.mkfifo(planted)
    if plant == "none":
        outputs.refuse_links_within(root, "--docs_dir")  # real folders and files: nothing to say
        return
    with pytest.raises(UserError) as error:
        outputs.refuse_links_within(root, "--docs_dir")
    helpers.one_line_error(error, str(planted), "--docs_dir")
    assert not os.listdir(victim)


@pytest.mark.parametrize("url", ["foo://bucket/x", "/tmp/lconv-test/a://b"])
def test_an_output_on_a_file_system_epath_does_not_know_is_one_line_before_any_work(tmp_path, url, monkeypatch):
    """A scheme epath has no file system for (or a local name holding "://", which reads as one) was a KeyError
    traceback after decoding from eval.py, at the first compile from --compilation_cache, and from train.py's
    --workdir and export's --out (round-23 campaign)."""
    from lconv.cli import runtime

    for check in (lambda: outputs.check_output_file(f"{url}/o.txt", "--output_file"),
                  lambda: outputs.check_directory(url, "workdir", "--workdir"),
                  lambda: outputs.claim_directory(url, "export", "--out"),
                  lambda: runtime.enable_compilation_cache(str(tmp_path), url)):
        with pytest.raises(UserError) as error:
            check()
        helpers.one_line_error(error, url, "has no")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", url)
    with pytest.raises(UserError) as error:
        runtime.enable_compilation_cache(str(tmp_path))
    helpers.one_line_error(error, "$JAX_COMPILATION_CACHE_DIR", url)


@pytest.mark.parametrize("inside", ["ddtp_en_de-f809964a084ce9ed/ddtp/en_de/1.0.0/dataset_info.json",
                                    "tokenizers/kept.json"])
def test_an_output_among_prepared_copies_and_kept_tokenizers_is_refused(tmp_path, inside):
    """eval.py's --output_file over a prepared copy's dataset_info.json left the copy unreadable (round 23,
    r23-16); a folder output there (a compilation cache, a workdir) the same."""
    target = tmp_path / "data" / outputs.PREPARED_DIRNAME / inside
    with pytest.raises(UserError) as error:
        outputs.check_output_file(str(target), "--output_file")
    helpers.one_line_error(error, str(target), str(tmp_path / "data" / outputs.PREPARED_DIRNAME))
    with pytest.raises(UserError):
        outputs.check_directory(str(target.parent / "run"), "workdir", "--workdir")
    outputs.check_output_file(str(tmp_path / "data" / "out.txt"), "--output_file")  # beside them: fine


def test_a_private_file_replaced_is_never_readable_by_others_while_its_new_contents_are_written(tmp_path,
                                                                                                monkeypatch):
    """The temporary file was made with the umask's 0644, written whole, then narrowed to the old 0600: another
    user who opened it meanwhile read the new contents (round 24, r24-37). It is owner-only from its creation."""
    target = tmp_path / "private.md"
    target.write_text("old")
    target.chmod(0o600)
    seen = []
    real_fdopen = os.fdopen

    def watching(fd, *args, **kwargs):  # the temporary file's mode as its contents are written
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", watching)
    outputs.write_atomically(str(target), "new secret")
    assert seen == [0o600] and target.read_text() == "new secret" and stat.S_IMODE(target.stat().st_mode) == 0o600


@pytest.mark.parametrize("plant", ["another_users_signature_file", "link_to_my_own_marker"])
def test_no_other_user_can_claim_the_outputs_below_a_folder_they_can_write_into(tmp_path, plant, monkeypatch):
    """Another user's ``lconv_export.json`` (a command's signature file) in /tmp refused every output below /tmp, as
    did their link to one of this user's own export markers (round 24, r24-25/26)."""
    monkeypatch.delenv(shared_folders.OPT_IN, raising=False)
    folder, mine = tmp_path / "shared", tmp_path / "my_export"
    folder.mkdir()
    mine.mkdir()
    (mine / outputs.MARKER).write_text('{"kind": "export"}')
    if plant == "link_to_my_own_marker":
        (folder / outputs.MARKER).symlink_to(mine / outputs.MARKER)
        assert outputs.kind_of(str(mine)) == "export"
    else:
        (folder / "lconv_export.json").write_text("{}")
        if os.getuid() == 0:
            os.chown(folder / "lconv_export.json", 4243, -1)
        else:
            monkeypatch.setattr(os, "getuid", lambda: 4243)
    assert outputs.kind_of(str(folder)) is None
    outputs.check_output_file(str(folder / "o.txt"), "--output_file")
    outputs.check_directory(str(folder / "run"), "workdir", "--workdir")
