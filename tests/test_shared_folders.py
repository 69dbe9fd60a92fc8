"""A folder another user could change while lconv works in it is refused in one line, on every surface that reads or
writes a run by path (docs/security.md): the class of race where a checked ``checkpoints/`` is swapped for a link."""
from __future__ import annotations

import inspect
import os
import sys

import helpers
import pytest

from lconv import outputs, shared_folders
from lconv.errors import UserError


@pytest.fixture
def enforced(monkeypatch):
    monkeypatch.delenv(shared_folders.OPT_IN, raising=False)


@pytest.fixture
def run_folder(tmp_path, enforced):
    """A folder shaped as a run (a config.json, a checkpoint step), private to this user."""
    run = tmp_path / "run"
    (run / "checkpoints" / "300").mkdir(parents=True, mode=0o755)
    (run / "config.json").write_text("{}")
    for path in (run, run / "checkpoints", run / "checkpoints" / "300"):
        path.chmod(0o755)
    return run


def _find_run(run) -> None:
    from lconv.run import restore

    restore.find_run(str(run), "--workdir")


def test_a_private_run_is_found(run_folder):
    _find_run(run_folder)


@pytest.mark.parametrize("inside", [".", "checkpoints", "checkpoints/300", "config.json"])
def test_anything_in_a_run_that_others_can_write_is_one_line_naming_it(run_folder, inside):
    """The round-16 race needs write access to a checked folder (or a file rewritten in place): refused before any
    read, with the fix for the whole run."""
    target = run_folder / inside
    target.chmod(0o775 if target.is_dir() else 0o664)
    with pytest.raises(UserError) as caught:
        _find_run(run_folder)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--workdir={run_folder}: ")
    assert f"{os.path.normpath(target)} can be written by other users" in message
    assert f"copy it into a folder only you can write (cp -r {run_folder} " in message
    assert shared_folders.OPT_IN in message


def test_the_opt_in_accepts_a_shared_run(run_folder, monkeypatch):
    (run_folder / "checkpoints").chmod(0o777)
    monkeypatch.setenv(shared_folders.OPT_IN, "1")
    _find_run(run_folder)


def test_a_folder_on_the_way_that_others_can_write_is_refused_unless_sticky(tmp_path, enforced):
    """Another user could rename the run itself out of a shared parent, unless the sticky bit (as on /tmp) keeps
    entries to their owners."""
    parent = tmp_path / "shared"
    parent.mkdir()
    run = parent / "run"
    run.mkdir(mode=0o755)
    (run / "config.json").write_text("{}")
    parent.chmod(0o777)
    with pytest.raises(UserError, match=f"{parent} can be written by other users .mode 777.*work in a folder only"):
        _find_run(run)
    parent.chmod(0o1777)
    _find_run(run)


def test_a_link_to_a_run_is_checked_where_it_leads(tmp_path, enforced):
    shared = tmp_path / "shared"
    (shared / "run").mkdir(parents=True)
    (shared / "run" / "config.json").write_text("{}")
    shared.chmod(0o777)
    (tmp_path / "mine").mkdir(mode=0o755)
    (tmp_path / "mine" / "run").symlink_to(shared / "run")
    with pytest.raises(UserError, match=f"{shared} can be written by other users"):
        _find_run(tmp_path / "mine" / "run")


def test_an_entry_another_user_owns_is_refused(run_folder, monkeypatch):
    """Its owner can change it whatever its mode. Root hands a step to another uid; any other user sees its own
    folders as another's by taking another uid."""
    real_uid = os.getuid()
    if real_uid == 0:
        os.chown(run_folder / "checkpoints" / "300", 4243, -1)
        expected = f"{run_folder / 'checkpoints' / '300'} belongs to another user .uid 4243.*chown -R 0 {run_folder}"
    else:
        monkeypatch.setattr(os, "getuid", lambda: 4243)
        expected = f"belongs to another user .uid {real_uid}."
    with pytest.raises(UserError, match=expected):
        _find_run(run_folder)


def test_a_claimed_output_stays_private_under_a_group_umask(tmp_path, enforced):
    """Under ``umask 002`` the folders orbax makes would be group-writable, and the next read of the run refused:
    claiming a folder adds go-w to the umask, so what the command then makes passes the check."""
    old = os.umask(0o002)
    try:
        out = outputs.claim_directory(str(tmp_path / "work"), "workdir", "--workdir")
        os.makedirs(os.path.join(out, "checkpoints", "300"))  # as orbax makes a step
        assert os.umask(0o002) & 0o022 == 0o022
        shared_folders.check(out, "--workdir")
    finally:
        os.umask(old)


def test_a_claimed_output_that_others_can_write_is_refused_before_anything_is_written(tmp_path, enforced):
    out = tmp_path / "work"
    out.mkdir(mode=0o755)
    out.chmod(0o775)
    with pytest.raises(UserError, match=f"--out={out}: {out} can be written by other users"):
        outputs.claim_directory(str(out), "export", "--out")
    assert os.listdir(out) == []


def test_a_study_archive_that_others_can_write_is_refused(tmp_path, enforced):
    from lconv.study import archive

    root = tmp_path / "docs" / archive.ARCHIVE_DIR
    root.mkdir(parents=True)
    root.chmod(0o777)
    with pytest.raises(UserError, match=f"--resume_from={tmp_path / 'docs'}: {root} can be written by other"):
        archive.resolve(str(tmp_path / "docs"))


def test_an_export_that_others_can_write_is_refused_before_its_files_are_read(tmp_path, enforced):
    import lconv.export
    from lconv.constants import EXPORT_SIDECAR

    export = tmp_path / "export"
    export.mkdir(mode=0o755)
    (export / EXPORT_SIDECAR).write_text("not even JSON")
    export.chmod(0o775)
    with pytest.raises(UserError, match=f"lconv.export.load.*{export} can be written by other users"):
        lconv.export.load(str(export))


def test_a_link_held_by_a_shared_folder_on_the_way_is_refused(tmp_path, enforced):
    """``mine/l1 -> shared/l2 -> private/run``: the folder holding the middle link is where a lookup happens, so
    it is checked, though neither the path as given nor the real path passes through it (round 18, r18-5)."""
    private, shared, mine = tmp_path / "private", tmp_path / "shared", tmp_path / "mine"
    (private / "run").mkdir(parents=True)
    (private / "run" / "config.json").write_text("{}")
    shared.mkdir()
    mine.mkdir()
    (shared / "l2").symlink_to(private)
    (mine / "l1").symlink_to(shared / "l2")
    _find_run(mine / "l1" / "run")
    shared.chmod(0o777)
    with pytest.raises(UserError, match=f"{shared} can be written by other users"):
        _find_run(mine / "l1" / "run")


def test_a_link_on_the_way_that_another_user_owns_is_refused(run_folder, monkeypatch):
    """A link another user made in a sticky folder (/tmp) is theirs to repoint (r18-6): its owner is checked, as
    ``lstat`` sees it, not the folder it leads to."""
    import tempfile

    link = tempfile.mktemp(prefix="lconv-test-link-", dir="/tmp")
    os.symlink(run_folder, link)
    try:
        if os.getuid() == 0:
            os.lchown(link, 4243, -1)
            owner = 4243
        else:
            owner = os.getuid()
            monkeypatch.setattr(os, "getuid", lambda: 4243)  # the link, made by this user, is now another's
        with pytest.raises(UserError, match=f"{link} is a link another user owns .uid {owner}."):
            _find_run(link)
    finally:
        os.remove(link)


def _acl(*entries: tuple[int, int]) -> bytes:
    """A ``system.posix_acl_default`` value as Linux stores it: version 2, then (tag, permissions, id) each."""
    import struct

    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, 65534) for tag, perm in entries)


@pytest.mark.parametrize("entries, refused", [
    (((0x01, 7), (0x02, 7), (0x04, 5), (0x10, 7), (0x20, 5)), True),   # a named user with write, the mask allows
    (((0x01, 7), (0x02, 7), (0x04, 5), (0x10, 5), (0x20, 5)), False),  # ... the mask takes write away
    (((0x01, 7), (0x04, 5), (0x20, 7)), True),                         # everyone else may write
    (((0x01, 7), (0x04, 5), (0x20, 5)), False),                        # only the owner writes
], ids=["named_user", "masked", "other", "owner_only"])
def test_a_default_acl_that_lets_others_write_new_entries_is_refused(run_folder, monkeypatch, entries, refused):
    """A default ACL gives what is made in a folder its entries whatever the umask (r18-9): the step folders
    train.py makes would be another user's to swap. The attribute is given by a stand-in, so the rule is checked
    on any file system."""
    target = str(run_folder / "checkpoints")
    real_getxattr = getattr(os, "getxattr", None)

    def getxattr(path, name, *, follow_symlinks=True):
        if os.fspath(path) == target and name == "system.posix_acl_default":
            return _acl(*entries)
        if real_getxattr is None:
            raise OSError("no extended attributes here")
        return real_getxattr(path, name, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(os, "getxattr", getxattr, raising=False)
    if not refused:
        _find_run(run_folder)
        return
    with pytest.raises(UserError, match=f"{target} has a default ACL .*setfacl -R -k {run_folder}"):
        _find_run(run_folder)


def test_reading_a_run_keeps_what_the_process_writes_next_private(run_folder):
    """eval.py writes its outputs into the run it read: under ``umask 002`` they were group-writable, and the next
    eval.py of one's own run was refused (r18-21)."""
    old = os.umask(0o002)
    try:
        _find_run(run_folder)
        assert os.umask(0o002) & 0o022 == 0o022
    finally:
        os.umask(old)


def test_a_foreign_entry_is_fixed_by_a_copy_when_not_root(monkeypatch):
    """``chown`` to oneself needs root: anyone else is told to copy the run; either only once they know its contents
    are theirs (adopting a folder another user planted would trust what they put there)."""
    monkeypatch.setattr(os, "getuid", lambda: 4243)
    assert shared_folders._inside_fix("belongs to another user (uid 5)", "/runs/x") == \
        "if you did not put its contents there, remove it (another user may have planted them); if you trust them, " \
        "copy /runs/x into a folder of your own"


def test_evals_output_file_in_a_shared_folder_is_refused_before_decoding(tmp_path, enforced):
    """The output's folder swapped for a link moved the output into a folder only root could write (r18-16)."""
    from lconv.cli import eval_program

    shared = tmp_path / "shared"
    (shared / "out").mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(UserError, match=f"--output_file=.*: {shared} can be written by other users"):
        eval_program._check_writable(str(shared / "out" / "o.txt"), f"--output_file={shared / 'out' / 'o.txt'}")
    eval_program._check_writable("/dev/null", "--output_file=/dev/null")  # a device in root's /dev: written into


def test_the_benchmarks_doc_in_a_shared_folder_is_refused(tmp_path, capsys, enforced):
    """``--doc`` is read, then rewritten: a link swapped in between read a root-only file (r18-17)."""
    import argparse

    from lconv import console
    from lconv.bench import __main__ as bench_main

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    opts = argparse.Namespace(quick=True, out=str(tmp_path / "out"), doc=str(shared / "bench.md"))
    with pytest.raises(SystemExit) as exit_:
        bench_main.resolve_outputs(opts, console.OneLineParser(prog="python -m lconv.bench"))
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and f"{shared} can be written by other users" in line


def test_a_compilation_cache_another_user_can_change_is_refused_or_off(tmp_path, monkeypatch, enforced, lconv_log):
    """A cache entry is code (r18-18): a chosen ``--compilation_cache`` under a shared folder is one line; this
    user's own cache under a shared ``$XDG_CACHE_HOME`` is one warning, and programs are compiled every time."""
    from lconv.cli import runtime

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError, match=f"--compilation_cache=.*{shared} can be written by other users.*plant"):
        runtime.enable_compilation_cache(str(tmp_path / "run"), str(shared / "cc"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared / "xdg"))
    with helpers.jax_cache_config() as config:
        assert runtime.enable_compilation_cache(str(tmp_path / "run")) is None
        assert config.jax_enable_compilation_cache is False
    (line,) = [m for m in lconv_log() if "compiled programs" in m]
    assert f"{shared} can be written by other users" in line


@pytest.mark.parametrize("shared", ["data_dir_parent", "lconv_prepared"])
def test_data_is_prepared_only_where_no_other_user_can_move_it(tmp_path, enforced, shared):
    """tfds writes a copy by path: ``lconv_prepared`` swapped for a link mid-write would put it where the link led.
    Refused before anything is written (a copy already there is checked as a run is: below)."""
    from lconv.data import tfds_ddtp

    data_dir = tmp_path / "shared" / "data"
    (data_dir / "lconv_prepared").mkdir(parents=True)
    target = tmp_path / "shared" if shared == "data_dir_parent" else data_dir / "lconv_prepared"
    target.chmod(0o777)
    with pytest.raises(UserError, match=f"data_dir={data_dir}: {target} can be written by other users"):
        tfds_ddtp.prepare("ddtp/en_de", str(data_dir))
    assert os.listdir(data_dir / "lconv_prepared") == []


@pytest.mark.parametrize("owner", ["another_user", "writable_by_others"])
def test_a_prepared_copy_already_there_is_read_only_when_no_other_user_can_change_it(tiny_data, tmp_path,
                                                                                     monkeypatch, enforced, owner):
    """A complete copy is found by a name every user's copy takes: another user planted one in a data_dir they
    made first (/tmp/tfds), its test split the validation set's, and eval.py and train.py read it as the run's
    (round 23, r23-2/3/4). Read only as a run is: no other user's, nothing others can write."""
    import shutil

    from lconv.data import tfds_ddtp

    data_dir = tmp_path / "tfds"
    shutil.copytree(tiny_data.data_dir, data_dir, symlinks=True)
    tfds_ddtp.prepare("ddtp/en_de", str(data_dir))  # one's own copy: read
    (copy,) = (data_dir / "lconv_prepared").glob("ddtp_en_de-*")
    if owner == "another_user":
        helpers.make_another_users(copy, monkeypatch)
    else:
        copy.chmod(0o777)
    with pytest.raises(UserError) as error:
        tfds_ddtp.prepare("ddtp/en_de", str(data_dir))
    helpers.one_line_error(error, f"data_dir={data_dir}", "another user", shared_folders.OPT_IN)


def _iwslt_files(folder):
    folder.mkdir(mode=0o755)
    for stem in ("train", "valid", "test"):
        for lang in ("de", "en"):
            (folder / f"{stem}.{lang}").write_text("".join(f"{stem} {lang} line {i}\n" for i in range(8)))
    return folder


@pytest.mark.parametrize("shared", ["another_users_folder", "a_file_others_can_write", "a_sticky_folder"])
def test_a_raw_dir_another_user_can_change_is_never_prepared_from(tmp_path, monkeypatch, enforced, shared):
    """The raw files are hashed (the copy's name), then listed and parsed again by path: another user who could
    change them swapped the test split in between (round 25, r25-48), or in a sticky folder such as /tmp added a file
    the builder picks before the hashed one and removed it after (round 26, r26-21/23); the copy kept the honest
    files' name and digests with their data, read by every later run from the user's own honest files. Refused
    before a byte is hashed."""
    from lconv.data import tfds_ddtp

    raw = _iwslt_files(tmp_path / "raw")
    if shared == "another_users_folder":
        helpers.make_another_users(raw, monkeypatch)
    elif shared == "a_file_others_can_write":
        (raw / "test.de").chmod(0o666)
    else:
        raw.chmod(0o1777)
    with pytest.raises(UserError) as error:
        tfds_ddtp.prepare("iwslt14/de_en", str(tmp_path / "tfds"), raw_dir=str(raw))
    message = helpers.one_line_error(error, f"config.data.raw_dir={raw}", shared_folders.OPT_IN)
    assert "chown" not in message  # adopting another user's files would trust what they planted
    assert not (tmp_path / "tfds").exists()


def test_a_raw_dir_whose_subfolders_others_can_change_is_prepared_from(tmp_path, enforced):
    """The builders read a raw_dir's top level only. apt's lists folder, the ddtp corpus's home, keeps a
    ``partial/`` that apt's own user owns and writes: it changes nothing lconv reads (round 27, r27-24)."""
    from lconv.data import tfds_ddtp

    raw = _iwslt_files(tmp_path / "raw")
    partial = raw / "partial"
    partial.mkdir()
    (partial / "test.de").write_text("planted\n")
    (partial / "test.de").chmod(0o666)
    partial.chmod(0o777)
    builder = tfds_ddtp.prepare("iwslt14/de_en", str(tmp_path / "tfds"), raw_dir=str(raw))
    assert len(builder.as_data_source(split="test")) == 8
    (raw / "test.de").unlink()  # a link of yours at the top level into that subfolder reads theirs (r30-22)
    (raw / "test.de").symlink_to(partial / "test.de")
    with pytest.raises(UserError) as error:
        tfds_ddtp.prepare("iwslt14/de_en", str(tmp_path / "tfds2"), raw_dir=str(raw))
    helpers.one_line_error(error, str(raw / "test.de"), "leads where another user could change it")
    (raw / "test.de").unlink()  # ... or through a link in it that leads back to the top level (r31-7)
    (raw / "own.de").write_text("mine\n")
    (partial / "hop").symlink_to(raw / "own.de")
    (raw / "test.de").symlink_to(partial / "hop")
    with pytest.raises(UserError) as error:
        tfds_ddtp.prepare("iwslt14/de_en", str(tmp_path / "tfds2"), raw_dir=str(raw))
    helpers.one_line_error(error, str(raw / "test.de"), f"{partial} can be written by other users")


def test_a_raw_file_changed_while_its_copy_is_built_leaves_no_copy(tmp_path, monkeypatch, enforced):
    """A file edited between its hash (the copy's name) and the end of the parse: nothing is kept under that name."""
    import contextlib

    from lconv.data import copy_guards, tfds_ddtp

    raw = _iwslt_files(tmp_path / "raw")
    quiet = copy_guards.no_progress_bars

    @contextlib.contextmanager
    def edited_meanwhile():
        with quiet():
            yield
        for lang in ("de", "en"):  # a line added to the pair
            with open(raw / f"test.{lang}", "a") as f:
                f.write(f"an edited line {lang}\n")

    monkeypatch.setattr(copy_guards, "no_progress_bars", edited_meanwhile)
    with pytest.raises(UserError) as error:
        tfds_ddtp.prepare("iwslt14/de_en", str(tmp_path / "tfds"), raw_dir=str(raw))
    helpers.one_line_error(error, str(raw / "test.de"), "changed while")
    assert os.listdir(tmp_path / "tfds" / "lconv_prepared") == []
    monkeypatch.setattr(copy_guards, "no_progress_bars", quiet)
    builder = tfds_ddtp.prepare("iwslt14/de_en", str(tmp_path / "tfds"), raw_dir=str(raw))  # the file is final now
    assert len(builder.as_data_source(split="test")) == 9
    # A file that appeared or went meanwhile (an optional split of your own files): one line, not a KeyError
    fingerprint = tfds_ddtp.source_fingerprint("iwslt14/de_en", str(raw))
    fewer = {**fingerprint, "files": {k: v for k, v in fingerprint["files"].items() if k != "test.de"}}
    with pytest.raises(UserError) as error:
        tfds_ddtp._check_unchanged("iwslt14/de_en", fewer, {"raw_dir": str(raw)})
    helpers.one_line_error(error, str(raw), "test.de", "appeared or went")


@pytest.mark.parametrize("bad", ["another_users_data_dir", "unknown_dataset", "another_users_raw_dir",
                                 "no_raw_dir"])
def test_train_refuses_a_data_dir_or_dataset_before_its_workdir_is_made(tmp_path, monkeypatch, enforced, bad):
    """Refused at the data's first read, train.py had already made the workdir and stored its config there
    (round 25, r25-3 and r25-35): a rerun with the fix then met a config it had never trained."""
    import tiny_config

    from lconv.train import loop

    config = tiny_config.get_config()
    config.data.data_dir = str(tmp_path / "tfds")
    (tmp_path / "tfds").mkdir()
    named = {"another_users_data_dir": "another user", "unknown_dataset": "evil:X",
             "another_users_raw_dir": "config.data.raw_dir", "no_raw_dir": "no such folder"}[bad]
    if bad == "another_users_data_dir":
        helpers.make_another_users(tmp_path / "tfds", monkeypatch)
    elif bad == "unknown_dataset":
        config.data.dataset = "evil:X"
    else:
        config.data.dataset, config.data.raw_dir = "iwslt14/de_en", str(tmp_path / "raw")
        if bad == "another_users_raw_dir":
            helpers.make_another_users(_iwslt_files(tmp_path / "raw"), monkeypatch)
    with pytest.raises(UserError) as error:
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    helpers.one_line_error(error, named)
    assert not (tmp_path / "run").exists()


def test_a_catalog_dataset_is_prepared_only_where_no_other_user_can_move_it(tmp_path, enforced):
    from lconv.data import catalog

    data_dir = tmp_path / "shared" / "tfds"
    data_dir.mkdir(parents=True)
    data_dir.chmod(0o777)
    with pytest.raises(UserError, match=f"--data_dir={data_dir}: {data_dir} can be written by other users"):
        catalog.prepare("wmt14/en_de", str(data_dir))
    assert os.listdir(data_dir) == []


@pytest.mark.parametrize("dataset", ["ddtp/en_de", "wmt14/en_de"])
def test_what_a_url_data_dir_stages_locally_is_staged_only_in_a_folder_of_this_users(bucket, tmp_path, monkeypatch,
                                                                                     enforced, dataset):
    """The local mirror of a gs:// data_dir (and a catalog dataset's staging beside it) is read back by path and
    uploaded as the stored copy: in a folder another user can write, their planted mirror went into the user's
    bucket (rounds 23 and 24). Refused before anything is read, downloaded or written."""
    from lconv.data import catalog, paths, tfds_ddtp

    mirror = tmp_path / "shared_mirror"
    mirror.mkdir()
    mirror.chmod(0o777)
    monkeypatch.setenv(paths.CACHE_ENV, str(mirror))
    with pytest.raises(UserError) as error:
        (tfds_ddtp.prepare if dataset.startswith("ddtp") else catalog.prepare)(dataset, "gs://bucket/tfds")
    helpers.one_line_error(error, paths.CACHE_ENV, str(mirror), "can be written by other users")
    assert os.listdir(mirror) == [] and not (bucket / "bucket").exists()


def test_a_catalog_staging_beside_ones_own_downloads_checks_them_not_everything_beside(bucket, tmp_path,
                                                                                      monkeypatch, enforced):
    """``--download_dir=~/dl`` for a gs:// data_dir: the whole home folder was walked, and any group-writable file in
    it refused the staging (round 25, r25-49). The downloads' folder is checked whole, its parent as a way."""
    from lconv.data import catalog

    home = tmp_path / "home"
    (home / "projects").mkdir(parents=True)
    (home / "projects" / "notes.txt").write_text("unrelated")
    (home / "projects" / "notes.txt").chmod(0o664)
    monkeypatch.setattr(catalog, "has_tensorflow", lambda: False)  # stops right after the staging checks
    with pytest.raises(UserError, match="needs TensorFlow"):
        catalog.prepare("lm1b", "gs://bucket/tfds", download_dir=str(home / "dl"))
    (home / "dl" / "planted").write_text("x")
    (home / "dl" / "planted").chmod(0o666)  # inside the downloads: read back by path, so refused
    with pytest.raises(UserError) as error:
        catalog.prepare("lm1b", "gs://bucket/tfds", download_dir=str(home / "dl"))
    helpers.one_line_error(error, str(home / "dl" / "planted"), "can be written by other users")


def test_a_dotdot_after_a_link_that_leads_elsewhere_than_it_reads_is_refused(tmp_path, enforced):
    """``lk/../x`` with ``lk -> other/sub``: lconv makes paths absolute as text (``x`` beside ``lk``) while the
    system reads ``..`` after the link (``other/x``); checks on one and writes to the other let another user's
    folder in (round 19, r19-3/6/17/26). Refused, whoever can write either place."""
    (tmp_path / "other" / "sub").mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "lk").symlink_to(tmp_path / "other" / "sub")
    given = str(tmp_path / "mine" / "lk" / ".." / "x")
    with pytest.raises(UserError, match=f"leads to {tmp_path / 'other' / 'x'}, though read as text it names "
                                        f"{tmp_path / 'mine' / 'x'} .a '..' after a link.; name the folder without"):
        outputs.claim_directory(given, "export", "--out")
    assert not (tmp_path / "other" / "x").exists() and not (tmp_path / "mine" / "x").exists()
    outputs.claim_directory(str(tmp_path / "mine" / "plain" / ".." / "x"), "export", "--out")  # no link: as text


def test_an_output_is_never_written_over_another_users_file(tmp_path, monkeypatch, enforced):
    """A file another user made in a sticky folder at the output's name: replacing it gave root's output that
    user's mode (setuid, world-writable) and let them write into it (r19-24)."""
    target = tmp_path / "out.txt"
    target.write_text("theirs")
    helpers.make_another_users(target, monkeypatch)
    with pytest.raises(UserError, match=f"{target}: belongs to another user .uid [0-9]+.; lconv replaces no other"):
        outputs.write_atomically(str(target), "mine")
    assert target.read_text() == "theirs" and os.listdir(tmp_path) == ["out.txt"]


def test_eval_refuses_another_users_file_as_its_output_before_decoding(tmp_path, monkeypatch, enforced):
    """The writer refused it only after the decoding, so the decoding was lost (round 23): eval.py's up-front check
    of its outputs now refuses it too."""
    from lconv.cli import eval_program

    target = tmp_path / "out.txt"
    target.write_text("theirs")
    helpers.make_another_users(target, monkeypatch)
    with pytest.raises(UserError, match="belongs to another user"):
        eval_program._check_writable(str(target), f"--output_file={target}")
    assert target.read_text() == "theirs"


def test_a_replaced_output_keeps_its_owner_bits_but_never_setuid_or_others_write(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    target.chmod(0o6777)
    outputs.write_atomically(str(target), "new")
    assert target.read_text() == "new" and os.stat(target).st_mode & 0o7777 == 0o755
    target.chmod(0o600)
    outputs.write_atomically(str(target), "newer")
    assert os.stat(target).st_mode & 0o7777 == 0o600  # a private file stays private


def test_a_default_acl_where_lconv_makes_or_writes_a_folder_is_refused(tmp_path, monkeypatch, enforced):
    """The folder an output goes into, or that a new workdir is made in, with a default ACL letting another user
    write: what lconv makes there inherits it, whatever the umask (r19-39/40)."""
    acl_folder = tmp_path / "acl"
    acl_folder.mkdir()
    real_getxattr = getattr(os, "getxattr", None)

    def getxattr(path, name, *, follow_symlinks=True):
        if os.fspath(path) == str(acl_folder) and name == "system.posix_acl_default":
            return _acl((0x01, 7), (0x02, 7), (0x04, 5), (0x10, 7), (0x20, 5))
        if real_getxattr is None:
            raise OSError("no extended attributes here")
        return real_getxattr(path, name, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(os, "getxattr", getxattr, raising=False)
    with pytest.raises(UserError, match=f"{acl_folder} has a default ACL"):
        shared_folders.check_way(str(acl_folder), "--output_file")
    with pytest.raises(UserError, match=f"{acl_folder} has a default ACL"):
        outputs.claim_directory(str(acl_folder / "new_run"), "workdir", "--workdir")
    assert not (acl_folder / "new_run").exists()


def test_an_exported_program_carrying_its_own_kernel_is_refused_at_load():
    """``tpu_custom_call`` and ``mosaic_gpu_v2`` are on jax's stable list, but their operand is a kernel the file
    brings: on a TPU or GPU, loading a handed-over export would run it (r19-19). lconv's exports hold none."""
    import jax
    import jax.numpy as jnp

    from lconv.export import files

    for target in ("tpu_custom_call", "mosaic_gpu_v2"):
        def calls(x, target=target):
            return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

        data = jax.export.export(jax.jit(calls), platforms=("cpu",))(jax.ShapeDtypeStruct((2,), jnp.float32))
        with pytest.raises(ValueError, match=f"it calls '{target}', which runs a kernel the file itself carries"):
            files.parse_program(data.serialize())


def test_a_kept_tokenizer_another_user_could_replace_is_not_used(tmp_path, enforced):
    """A data_dir another user owns or can write: they could plant a tokenizer with a matching record, which later
    runs would reuse as their own (r19-54/55). The kept cache is then not read or written (a warning; the run
    trains its own)."""
    from lconv.data import tokenizer_files

    kept = tmp_path / "data" / "lconv_prepared" / tokenizer_files.KEPT_TOKENIZERS / "ddtp_en_de-x"
    kept.mkdir(parents=True)
    assert tokenizer_files.kept_folder_problem(str(kept)) is None
    kept.parent.chmod(0o777)
    assert f"{kept.parent} can be written by other users" in tokenizer_files.kept_folder_problem(str(kept))


def test_the_data_commands_tokenizer_folder_is_checked_before_it_is_written(tmp_path, enforced):
    """``python -m lconv.data --workdir=DIR`` writes its tokenizer into DIR and reads it back (r19-38)."""
    from lconv.data import __main__ as data_main

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError, match=f"--workdir={shared}: {shared} can be written by other users"):
        data_main.show("en_de", str(tmp_path / "data"), str(shared), vocab_size=256, max_sentences=100,
                       batch_size=8)


def test_a_dotdot_after_a_folder_not_made_yet_is_followed_as_mkdir_would_make_it(tmp_path, enforced):
    """``new/../lk/../x``: ``new`` does not exist, so the rest was once read as text (``x``); ``mkdir -p`` then
    makes ``new`` and the system follows ``lk`` (round 20, r20-16/17/18). Refused before anything is made."""
    (tmp_path / "other" / "sub").mkdir(parents=True)
    (tmp_path / "lk").symlink_to(tmp_path / "other" / "sub")
    given = str(tmp_path / "new" / ".." / "lk" / ".." / "x")
    with pytest.raises(UserError, match=f"leads to {tmp_path / 'other' / 'x'}, though read as text"):
        outputs.claim_directory(given, "export", "--out")
    assert not (tmp_path / "new").exists() and not (tmp_path / "other" / "x").exists()


def test_a_dotdot_out_of_another_users_folder_is_refused(tmp_path, monkeypatch, enforced):
    """``theirs/../x``: the system looks ``..`` up in ``theirs``, which its owner may swap for a link (r20-23)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if os.getuid() == 0:
        os.chown(theirs, 4243, -1)
        expected = f"{theirs} belongs to another user .uid 4243."
    else:
        monkeypatch.setattr(os, "getuid", lambda: 4243)
        expected = "belongs to another user"
    with pytest.raises(UserError, match=expected):
        outputs.claim_directory(str(theirs / ".." / "x"), "export", "--out")
    assert not (tmp_path / "x").exists()


def test_a_run_or_output_named_with_a_dotdot_after_a_link_is_checked_as_given(tmp_path, enforced):
    """eval.py checked the run and its output's folder made absolute as text, then wrote to the path as given, which
    the system followed through the link (r20-3/4/22)."""
    from lconv.cli import eval_program

    (tmp_path / "other" / "sub").mkdir(parents=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    (tmp_path / "lk").symlink_to(tmp_path / "other" / "sub")
    with pytest.raises(UserError, match="a '..' after a link"):
        _find_run(str(tmp_path / "lk" / ".." / "run"))
    with pytest.raises(UserError, match="a '..' after a link"):
        eval_program._check_writable(str(tmp_path / "lk" / ".." / "o.txt"), "--output_file")


@pytest.fixture
def shared_cache(tmp_path, enforced):
    """``$JAX_COMPILATION_CACHE_DIR`` chosen in a folder every user can write: ``(folder, jax.config)``, the settings
    put back after."""
    shared = tmp_path / "shared"
    (shared / "cc").mkdir(parents=True)
    shared.chmod(0o777)
    with helpers.jax_cache_config() as config:
        config.update("jax_enable_compilation_cache", True)
        config.update("jax_compilation_cache_dir", str(shared / "cc"))
        yield shared / "cc", config


def test_the_apis_compilation_cache_is_never_one_another_user_could_fill(shared_cache, lconv_log):
    """``lconv.load`` took ``$JAX_COMPILATION_CACHE_DIR`` (or this process's choice) unchecked, and a program another
    user planted there ran (r20-24). One warning, and programs are compiled every time."""
    from lconv.run import compilation_cache

    folder, config = shared_cache
    assert compilation_cache.use_user_folder() is None
    assert config.jax_enable_compilation_cache is False
    (line,) = [m for m in lconv_log() if "compiled programs" in m]
    assert f"{folder.parent} can be written by other users" in line


def test_the_mixer_contract_check_compiles_nothing_into_a_cache_another_user_could_fill(shared_cache, monkeypatch,
                                                                                         lconv_log):
    """``lconv.testing.check_mixer``, the README's check of a plugin, compiled with ``$JAX_COMPILATION_CACHE_DIR``
    unchecked and read entries another user could have swapped (r29-26). The check comes before anything compiles."""
    import lconv.testing

    folder, config = shared_cache
    monkeypatch.setattr(lconv.testing._Checker, "run", lambda self: None)
    lconv.testing.check_mixer("lightconv")
    assert config.jax_enable_compilation_cache is False
    assert any(f"{folder.parent} can be written by other users" in m for m in lconv_log())


def test_a_refused_compilation_cache_is_left_even_where_the_process_compiled_before(shared_cache, lconv_log):
    """A notebook's earlier cell compiled with ``$JAX_COMPILATION_CACHE_DIR`` another user can fill: JAX had then
    taken the folder as its cache for good, and ``lconv.load``'s refusal ("not kept") left it in use: the decode
    program was written there and read back (round 26, r26-19)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    from lconv.run import compilation_cache

    folder, config = shared_cache
    min_seconds = config.jax_persistent_cache_min_compile_time_secs
    try:
        config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax_cache.reset_cache()
        jax.jit(lambda x: x * 5.0 + 1.0)(jnp.ones(3))  # the earlier cell: the folder is JAX's cache now
        kept = sorted(os.listdir(folder))
        assert kept  # (so the folder was in use)
        assert compilation_cache.use_user_folder() is None
        jax.jit(lambda x: x * 7.0 - 2.0)(jnp.ones(3))
        assert sorted(os.listdir(folder)) == kept
    finally:
        config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
        jax_cache.reset_cache()  # the next test's programs go to the suite's own cache again
    assert any("compiled programs are not kept" in m for m in lconv_log())


def test_an_export_loaded_keeps_no_program_in_a_cache_another_user_could_fill(shared_cache, tmp_path, lconv_log):
    """``lconv.export.load`` (and ``python -m lconv.export``, ``lconv.import_fairseq``) compiled with
    ``$JAX_COMPILATION_CACHE_DIR`` unchecked: another user swapped the cached program, and the export returned their
    program's outputs (round 26, r26-18). The same check as ``lconv.load``'s, before anything compiles."""
    from lconv import export

    _, config = shared_cache
    with pytest.raises(UserError):  # checked before the folder is read: the cache is off by then
        export.load(str(tmp_path / "no_export"))
    assert config.jax_enable_compilation_cache is False
    assert any("compiled programs are not kept" in m for m in lconv_log())


def test_the_benchmarks_doc_another_user_owns_is_refused_before_any_suite(tmp_path, capsys, monkeypatch, enforced):
    """It was refused only at the report's write, after the benchmarks ran, as a traceback (r20-13)."""
    import argparse

    from lconv import console
    from lconv.bench import __main__ as bench_main

    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n")
    helpers.make_another_users(doc, monkeypatch)
    opts = argparse.Namespace(quick=True, out=str(tmp_path / "out"), doc=str(doc))
    with pytest.raises(SystemExit) as exit_:
        bench_main.resolve_outputs(opts, console.OneLineParser(prog="python -m lconv.bench"))
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and "belongs to another user" in line


def test_a_folder_not_made_yet_where_others_may_make_it_first_is_refused_unless_made_here(tmp_path, enforced):
    """In a sticky folder others can write (/tmp), another user could make the name between the check and lconv's
    first write (round 21, r21-18/19/20/21). A command that makes the folder and checks it again passes."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with pytest.raises(UserError, match=f"{sticky} lets other users make that name first.*new is not made yet"):
        shared_folders.check(str(sticky / "new"), "--workdir")
    outputs.claim_directory(str(sticky / "new"), "workdir", "--workdir")
    assert os.stat(sticky / "new").st_uid == os.getuid()


def test_a_chosen_compilation_cache_not_made_yet_is_made_private_before_use(tmp_path, enforced, lconv_log):
    """``--compilation_cache`` / ``$JAX_COMPILATION_CACHE_DIR`` naming a folder not made yet in /tmp: another user
    made it first and planted a program that then ran (r21-18/19). lconv makes it (owner-only) before the check;
    the benchmarks check the folder they were given too (r21-23/24)."""
    from lconv.bench import gpu
    from lconv.cli import runtime

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with helpers.jax_cache_config() as config:
        assert runtime.enable_compilation_cache(str(tmp_path / "run"), str(sticky / "cc")) == str(sticky / "cc")
        assert os.stat(sticky / "cc").st_mode & 0o777 == 0o700 and config.jax_enable_compilation_cache
        (sticky / "cc").chmod(0o777)  # as if another user's
        config.update("jax_enable_compilation_cache", True)
        gpu.use_compilation_cache(str(sticky / "cc"))
        assert config.jax_enable_compilation_cache is False
    assert any(f"{sticky / 'cc'} can be written by other users" in m for m in lconv_log())


def test_a_compilation_cache_spelled_with_a_tilde_is_checked_and_used_in_the_home_folder(tmp_path, monkeypatch,
                                                                                          enforced):
    """``~/cc`` was checked as ``$HOME/cc`` while JAX took it literally, as ``./~/cc`` in the working folder, where
    another user had made ``~`` and planted a program (round 22, r22-20..23)."""
    from lconv.cli import runtime
    from lconv.run import compilation_cache

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    (cwd / "~").mkdir(parents=True)
    (cwd / "~").chmod(0o777)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    with helpers.jax_cache_config() as config:
        assert runtime.enable_compilation_cache(str(tmp_path / "run"), "~/cc") == str(home / "cc")
        assert config.jax_compilation_cache_dir == str(home / "cc")
        config.update("jax_compilation_cache_dir", "~/cc2")  # as $JAX_COMPILATION_CACHE_DIR would set it
        config.update("jax_enable_compilation_cache", True)
        assert compilation_cache.check_chosen() and config.jax_compilation_cache_dir == str(home / "cc2")
    assert os.listdir(cwd / "~") == []


def test_a_tree_deeper_than_pythons_recursion_limit_is_walked_to_its_bottom(tmp_path, enforced):
    """Python 3.11's ``os.walk`` recurses once a folder: a run holding a tree 1,200 folders deep was a RecursionError
    traceback from eval.py, train.py and ``lconv.load`` (round-23 campaign). The walk now reaches the bottom and names
    what it finds there. Here the limit is lowered below the tree's depth instead (so that pytest, whose clean-up
    recurses too, can remove the tree)."""
    run = tmp_path / "run"
    deep = run / "tensorboard"
    deep.mkdir(parents=True)
    for _ in range(300):
        deep = deep / "a"
        deep.mkdir()
    (deep / "planted").write_text("")
    (deep / "planted").chmod(0o666)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 150)
    try:
        found = shared_folders.problem(str(run))
    finally:
        sys.setrecursionlimit(limit)
    assert found[0].startswith(str(deep / "planted")) and "written by other users" in found[0]


def test_a_config_file_another_user_could_have_written_is_refused(tmp_path, monkeypatch, enforced):
    """A config file is code train.py runs (r27-13): another user's file (or where a link leads, r28-4), a pipe
    (r28-3), a file in a folder others can add files to, even a sticky one (a planted ``__pycache__`` ran instead of
    the source, r28-34), or a ``__pycache__`` another user owns: one line each. The user's own file in a private
    folder loads. A packaged config's name never reads the working folder (tests/test_cli.py -k packaged_config)."""
    from lconv.cli import runtime

    def refused(config, *named):
        with pytest.raises(UserError) as error:
            runtime.resolve_config_argument(["p", f"--config={config}"])
        helpers.one_line_error(error, *named)

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "mine.py").write_text("")
    for mode, named in ((0o777, "can be written by other users"), (0o1777, "lets other users add files")):
        shared.chmod(mode)
        refused(shared / "mine.py", f"--config={shared / 'mine.py'}", named)
        # not there when checked, another user could add it before the load (r29-23 ran theirs in 3 of 6 tries)
        refused(shared / "missing.py", f"--config={shared / 'missing.py'}",
                "can be written by other users" if mode == 0o777 else "lets other users make that name first")
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    (own / "mine.py").write_text("")
    assert runtime.resolve_config_argument(["p", f"--config={own / 'mine.py'}:x"]) == [
        "p", f"--config={os.path.realpath(own / 'mine.py')}:x"]
    # What is loaded is the file checked: a link on the way is not followed again after the check, when another user
    # could have flipped it in between (r29-6 ran nobody's file in 2 of 8 tries).
    (tmp_path / "via").symlink_to(own)
    assert runtime.resolve_config_argument(["p", "--config", str(tmp_path / "via" / "mine.py")]) == [
        "p", "--config", os.path.realpath(own / "mine.py")]
    os.mkfifo(own / "pipe.py")
    refused(own / "pipe.py", "not a regular file")
    refused("/dev/stdin", "not a regular file")  # a pipe or a device, whatever it leads to (r29-23)
    (shared / "dangling.py").symlink_to(tmp_path / "nothing.py")
    shared.chmod(0o755)
    refused(shared / "dangling.py", "no such file", "leads to")  # never left for ml_collections to open (r30-2)
    (own / "__pycache__").mkdir()
    (own / "__pycache__").chmod(0o777)
    refused(own / "mine.py", str(own / "__pycache__"), "can be written by other users")
    (own / "__pycache__").chmod(0o755)
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir(mode=0o755)
    (elsewhere / "cfg.py").write_text("")
    (own / "link.py").symlink_to(elsewhere / "cfg.py")
    real_uid = os.getuid()
    if real_uid == 0:
        os.chown(elsewhere / "cfg.py", 4243, -1)
    else:
        monkeypatch.setattr(os, "getuid", lambda: 4243)
    refused(own / "link.py", f"{elsewhere / 'cfg.py'} belongs to another user", "a config file is code")
    if real_uid == 0:  # another user's link on the way is refused, as on the way to a run
        os.chown(elsewhere / "cfg.py", 0, -1)
        (tmp_path / "their_link").symlink_to(elsewhere)
        os.chown(tmp_path / "their_link", 4243, -1, follow_symlinks=False)
        refused(tmp_path / "their_link" / "cfg.py", str(tmp_path / "their_link"), "another user")
        (own / "their_cfg.py").symlink_to(elsewhere / "cfg.py")  # the last name: their link in your folder (r30-2)
        os.chown(own / "their_cfg.py", 4243, -1, follow_symlinks=False)
        refused(own / "their_cfg.py", f"{own / 'their_cfg.py'} is a link another user owns")
        # A link of yours into another user's folder, whose file they make a link to a root-owned file holding
        # their text (/proc/<pid>/cmdline of their non-dumpable process): refused on the way (r31-15)
        team = tmp_path / "team"
        team.mkdir()
        (team / "cfg.py").write_text("")
        os.chown(team, 4243, -1)
        (own / "team_cfg.py").symlink_to(team / "cfg.py")
        refused(own / "team_cfg.py", f"{team} belongs to another user")
    # A file whose size is not what it holds (/proc's): never taken for what was checked
    refused("/proc/self/cmdline", "holds other than its size says")


def test_the_study_and_the_fairseq_replay_keep_no_program_in_a_cache_another_user_could_fill(shared_cache,
                                                                                            tmp_path, lconv_log):
    """The study's driver (its planning compiles) and ``python -m lconv.interop.fairseq_replay`` compiled with
    ``$JAX_COMPILATION_CACHE_DIR`` unchecked: another user's swapped train step turned the replay's PASS into a FAIL
    (round 27, r27-14/15). Both make ``lconv.load``'s check before anything compiles."""
    from lconv.configs import study as study_config
    from lconv.interop import fairseq_replay
    from lconv.study import driver

    _, config = shared_cache
    with pytest.raises(UserError):  # refused after the check: nothing is planned or compiled
        driver.run_study(study_config.get_config("quick"), str(tmp_path / "out"), str(tmp_path / "docs"),
                         resume_from=str(tmp_path / "no_docs"))
    assert config.jax_enable_compilation_cache is False
    config.update("jax_enable_compilation_cache", True)
    assert fairseq_replay.main([str(tmp_path / "no_recording")]) == 2
    assert config.jax_enable_compilation_cache is False
    assert sum("compiled programs are not kept" in m for m in lconv_log()) == 2


def test_the_snapshot_script_reads_and_writes_only_folders_no_other_user_can_change(tmp_path, enforced):
    """``scripts/make_ddtp_snapshot.py`` wrote with plain ``open``: a link another user planted in its output folder
    overwrote a private file outside it, and it read a raw_dir another user could change (round 27, r27-16)."""
    import importlib.util

    from lconv.data import ddtp

    spec = importlib.util.spec_from_file_location("make_ddtp_snapshot", helpers.ROOT / "scripts" /
                                                  "make_ddtp_snapshot.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    shared = tmp_path / "shared"
    (shared / "raw").mkdir(parents=True)
    (tmp_path / "raw").mkdir()
    shared.chmod(0o777)
    for args, flag in ((["--raw_dir", str(shared / "raw"), "--out_dir", str(tmp_path / "out")], "--raw_dir"),
                       (["--raw_dir", str(tmp_path / "raw"), "--out_dir", str(shared / "out")], "--out_dir")):
        with pytest.raises(SystemExit, match=f"^error: {flag}.*can be written by other users"):
            script.main(args)
    private = tmp_path / "private.txt"
    private.write_text("mine\n")
    (tmp_path / "out").mkdir(exist_ok=True)
    planted = tmp_path / "out" / os.path.basename(ddtp.snapshot_file(str(tmp_path / "out"), "train"))
    planted.symlink_to(private)
    with pytest.raises(UserError, match="link"):
        ddtp.write_snapshot([], str(tmp_path / "out"))
    assert private.read_text() == "mine\n"


def test_a_local_data_dirs_refused_download_dir_is_named_as_given(tmp_path, monkeypatch, enforced):
    """``--download_dir`` others can write, for a local data_dir, was refused under the label ``--data_dir=``
    (round 27, r27-32)."""
    from lconv.data import catalog

    monkeypatch.setattr(catalog, "has_tensorflow", lambda: False)
    (tmp_path / "data").mkdir()
    shared = tmp_path / "shared"
    (shared / "dl").mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(UserError) as error:
        catalog.prepare("lm1b", str(tmp_path / "data"), download_dir=str(shared / "dl"))
    helpers.one_line_error(error, f"--download_dir={shared / 'dl'}", "can be written by other users")


def test_a_child_process_pythonpath_holds_no_empty_entry(monkeypatch):
    """Python reads an empty PYTHONPATH entry as the working folder, even under ``-P`` (r29-7, r29-22)."""
    for given, expected in (("", "/pkg"), (":", "/pkg"), (":/a::/b:", "/pkg:/a:/b"), (None, "/pkg")):
        if given is None:
            monkeypatch.delenv("PYTHONPATH", raising=False)
        else:
            monkeypatch.setenv("PYTHONPATH", given.replace(":", os.pathsep))
        assert shared_folders.child_environment("/pkg")["PYTHONPATH"] == expected.replace(":", os.pathsep)
    monkeypatch.setenv("PYTHONPATH", os.pathsep)
    assert "PYTHONPATH" not in shared_folders.child_environment(HOME="/h")
    assert shared_folders.child_environment(HOME="/h")["HOME"] == "/h"


def _plant_lconv(folder, package="lconv"):
    planted = folder / package
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('x')\n")
    return planted


@pytest.mark.slow  # launches two Python processes: the process boundary is what it checks
def test_the_processes_lconv_starts_never_import_an_lconv_planted_in_the_working_folder(tmp_path, monkeypatch):
    """``python -m`` puts the working folder first on sys.path: the study's run processes and the GPU bench's stages
    imported another user's ``lconv/`` planted in /tmp, as root (round 28, r28-38). They start with ``-P`` and find
    this lconv by PYTHONPATH, which holds no empty entry: Python reads one as the working folder (r29-7)."""
    from lconv.bench import gpu
    from lconv.study import run as run_lib

    monkeypatch.setenv("PYTHONPATH", os.pathsep + os.environ.get("PYTHONPATH", ""))
    planted = _plant_lconv(tmp_path / "cwd")
    (planted / "study").mkdir()
    (planted / "study" / "__init__.py").write_text("")
    (planted / "study" / "run.py").write_text("import pathlib\npathlib.Path('RAN').write_text('x')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    (tmp_path / "run").mkdir()
    code, _ = run_lib._run_process(str(tmp_path / "run"), 5.0)  # no study_spec.json: the real module says so
    assert code != 0 and "study_spec.json" in (tmp_path / "run" / run_lib.LOG).read_text()
    command = [sys.executable, "-P", "-c", "import lconv, sys; sys.exit(0 if 'cwd' not in lconv.__file__ else 3)"]
    assert gpu.launch_stage(command, 120) == 0
    assert not (planted / "RAN").exists() and not (tmp_path / "cwd" / "RAN").exists()


@pytest.mark.slow  # launches a Python process that compiles: the process boundary is what it checks
def test_the_rate_probe_of_concurrent_runs_imports_and_compiles_nothing_another_user_could_plant(
        shared_cache, tmp_path, monkeypatch):
    """``scripts/concurrent_runs.py``'s matmul probe imported an ``lconv/`` planted in the working folder when
    PYTHONPATH was unset (r29-7), and compiled into ``$JAX_COMPILATION_CACHE_DIR`` unchecked: another user's
    swapped entry ran as its matmul and reported 1,807 GFLOP/s (r29-8)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("concurrent_runs", helpers.ROOT / "scripts" / "concurrent_runs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folder, _ = shared_cache
    planted = [_plant_lconv(tmp_path / "cwd", package) for package in ("lconv", "jax")]  # jax: after lconv's root
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(folder))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    monkeypatch.setattr(script, "RATE_SNIPPET", script.RATE_SNIPPET.replace("matmul_flops_per_s()",
                                                                            "matmul_flops_per_s(256, 3)"))
    rates = script.measure_rates([{"name": "c", "cpus": "0", "platform": "cpu"}], str(helpers.ROOT))
    assert rates["c"] > 0
    assert not any((p / "RAN").exists() for p in planted) and os.listdir(folder) == []
