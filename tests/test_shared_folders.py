"""A folder another user could change while lconv works in it is refused in one line, on every surface that reads or
writes a run by path (docs/security.md): the class of race where a checked ``checkpoints/`` is swapped for a link."""
from __future__ import annotations

import os

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
    assert f"chmod -R go-w {run_folder}" in message and shared_folders.OPT_IN in message


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
    with pytest.raises(UserError, match="--out: .*can be written by other users"):
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
