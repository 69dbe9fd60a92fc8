"""lconv.data on a URL data_dir / workdir / raw_dir: every file access goes through etils.epath, none through os.

``gs://`` is served by a stand-in for gcsfs (tests/buckets.py: an fsspec file system over a local folder, the route
epath takes to gs:// when TensorFlow is absent), so the tests run without network. Every os-level call on a
``gs:`` path is recorded: a single one would mean some code treated the URL as a local path. The one thing that
cannot go through epath is array_record's reader (C++; it opens local files and, with its own GCS client, gs://
objects): lconv reads copies it prepared from a local mirror, and the test of a catalog dataset on gs:// stands in
for array_record's GCS client.
"""
from __future__ import annotations

import json
import lzma
import os

import helpers
import numpy as np
import pytest
from buckets import REGISTRY
from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath

from lconv.data import ddtp, paths, pipeline, sources, tfds_ddtp
from lconv.errors import UserError

CONFIG = dict(dataset="ddtp/en_de", vocab_size=500, tokenizer_max_sentences=2000, batch_size=4, eval_batch_size=8,
              max_input_length=32, max_target_length=32, eval_max_input_length=48, eval_max_target_length=48,
              read_threads=1)


@pytest.fixture(autouse=True, scope="module")
def _quiet_tfds():
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()


def _run(data_dir: str, workdir: str) -> tuple[bytes, pipeline.Datasets]:
    config = {**CONFIG, "data_dir": data_dir}
    tokenizer = pipeline.load_or_train_tokenizer(config, workdir, process_index=0, process_count=1)
    return tokenizer.model_proto, pipeline.make_datasets(config, tokenizer, process_index=0, process_count=1)


def _assert_same_data(a: pipeline.Datasets, b: pipeline.Datasets) -> None:
    for _ in range(3):
        batch_a, batch_b = next(a.train_iter), next(b.train_iter)
        assert batch_a.keys() == batch_b.keys()
        for key in batch_a:
            np.testing.assert_array_equal(batch_a[key], batch_b[key], err_msg=key)
    assert a.eval_sets.keys() == b.eval_sets.keys()
    for split in a.eval_sets:
        assert a.eval_sets[split].examples == b.eval_sets[split].examples
        for x, y in zip(a.eval_sets[split], b.eval_sets[split]):
            for key in x:
                np.testing.assert_array_equal(x[key], y[key], err_msg=f"{split} {key}")
    assert a.source_report == b.source_report


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The same run on local paths: (its tokenizer's bytes, a function giving fresh Datasets of it)."""
    root = tmp_path_factory.mktemp("local")
    model, _ = _run(str(root / "tfds"), str(root / "run"))
    return model, lambda: _run(str(root / "tfds"), str(root / "run"))[1]


def _copy_files(bucket, name="ddtp_en_de"):
    """{path relative to the bucket: bytes} of the prepared copy stored under gs://bucket/tfds."""
    (copy,) = (bucket / "bucket" / "tfds" / tfds_ddtp.CACHE_DIRNAME).glob(f"{name}-*")
    return copy, {str(p.relative_to(copy)): p.read_bytes() for p in sorted(copy.rglob("*")) if p.is_file()}


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_tokenizer_and_data_on_a_url_match_the_local_run_with_no_os_call_on_the_url(bucket, local_run):
    local_model, local_data = local_run
    model, data = _run("gs://bucket/tfds", "gs://bucket/run")
    assert model == local_model and (bucket / "bucket" / "run" / "spm.model").read_bytes() == model
    _assert_same_data(data, local_data())
    copy, files = _copy_files(bucket)
    version = "ddtp/en_de/1.0.0"
    assert {f"{version}/{tfds_ddtp.REPORT_FILENAME}", f"{version}/dataset_info.json",
            f"{version}/ddtp-train.array_record-00000-of-00001"} <= set(files)
    assert json.loads(files[f"{version}/{tfds_ddtp.REPORT_FILENAME}"]) == data.source_report
    assert not (bucket / "bucket" / "tfds" / "ddtp").exists()  # no symlink for plain readers on an object store
    assert not [p for p in copy.parent.iterdir() if ".tmp-" in p.name]
    assert bucket.os_calls == []


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_a_copy_stored_under_the_url_is_fetched_by_another_machine_not_prepared_again(bucket, local_run, tmp_path,
                                                                                       monkeypatch):
    _run("gs://bucket/tfds", "gs://bucket/run")
    _, stored = _copy_files(bucket)
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "other_machine"))  # an empty local mirror

    def no_parsing(*args, **kwargs):
        raise AssertionError("prepared again instead of fetched")

    monkeypatch.setattr(tfds_ddtp, "_prepare_copy", no_parsing)
    model, data = _run("gs://bucket/tfds", "gs://bucket/run")
    _assert_same_data(data, local_run[1]())
    assert _copy_files(bucket)[1] == stored  # nothing uploaded again
    assert bucket.os_calls == []


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_an_interrupted_upload_is_not_taken_for_a_copy_and_is_completed_next_time(bucket, monkeypatch):
    real_write = epath.Path.write_bytes
    written = []

    def failing_write(self, data):
        if "lconv_prepared" in str(self) and len(written) == 2:
            raise ConnectionError("network lost")
        written.append(str(self))
        return real_write(self, data)

    monkeypatch.setattr(epath.Path, "write_bytes", failing_write)
    with pytest.raises(UserError, match=r"gs://bucket/tfds/lconv_prepared/ddtp_en_fr-\w+ .*network lost"):
        tfds_ddtp.prepare("ddtp/en_fr", "gs://bucket/tfds")
    copy, files = _copy_files(bucket, "ddtp_en_fr")
    assert len(files) == 2 and not any(tfds_ddtp.REPORT_FILENAME in f for f in files)  # the report goes last
    monkeypatch.setattr(epath.Path, "write_bytes", real_write)
    builder = tfds_ddtp.prepare("ddtp/en_fr", "gs://bucket/tfds")  # uploads again, from the local mirror
    assert f"ddtp/en_fr/1.0.0/{tfds_ddtp.REPORT_FILENAME}" in _copy_files(bucket, "ddtp_en_fr")[1]
    assert len(builder.as_data_source(split="test")) == 1844
    assert bucket.os_calls == []


@pytest.mark.slow  # two processes: CI runs it, the quick command skips it
def test_two_processes_preparing_one_url_copy_at_once_both_succeed(bucket, monkeypatch):
    """Another process prepares and uploads the same copy while this one is half way through parsing."""
    real_load_tasks, nested = ddtp.load_tasks, []

    def load_tasks(*args, **kwargs):
        if not nested:
            nested.append(True)
            monkeypatch.setenv(paths.CACHE_ENV, os.environ[paths.CACHE_ENV] + "_other")  # its own machine
            tfds_ddtp.prepare("ddtp/en_zh", "gs://bucket/tfds")
        return real_load_tasks(*args, **kwargs)

    monkeypatch.setattr(ddtp, "load_tasks", load_tasks)
    builder = tfds_ddtp.prepare("ddtp/en_zh", "gs://bucket/tfds")
    assert nested and len(builder.as_data_source(split="test")) == 106
    assert f"ddtp/en_zh/1.0.0/{tfds_ddtp.REPORT_FILENAME}" in _copy_files(bucket, "ddtp_en_zh")[1]
    assert bucket.os_calls == []


def test_raw_dir_on_a_url_gives_the_data_of_the_same_local_files(bucket, tmp_path):
    local_raw = tmp_path / "iwslt"
    local_raw.mkdir()
    for prefix, n in (("train", 5), ("valid", 2), ("test", 3)):
        for lang in ("de", "en"):
            text = "".join(f"{prefix} {lang} {i}\r\n" for i in range(n))
            (local_raw / f"{prefix}.{lang}").write_bytes(text.encode())
            (bucket / "bucket" / "iwslt").mkdir(parents=True, exist_ok=True)
            (bucket / "bucket" / "iwslt" / f"{prefix}.{lang}").write_bytes(text.encode())
    local = sources.get_source("iwslt14/de_en", "train", str(tmp_path / "tfds"), raw_dir=str(local_raw))[0]
    remote = sources.get_source("iwslt14/de_en", "train", "gs://bucket/tfds", raw_dir="gs://bucket/iwslt")[0]
    assert sorted(local[i]["de"] for i in range(5)) == sorted(remote[i]["de"] for i in range(5))
    report = sources.source_report("iwslt14/de_en", "gs://bucket/tfds", raw_dir="gs://bucket/iwslt")
    assert report["source"] == "raw_dir=gs://bucket/iwslt" and report["files"]["train.de"]["bytes"] == 5 * 12
    # ddtp's apt files: listed, read and hashed through epath as well
    en = "".join(f"Package: p\nDescription-md5: {i:032x}\nDescription-en: tool {i}\n\n" for i in range(60))
    de = en.replace("Description-en: tool", "Description-de: Werkzeug")
    (bucket / "bucket" / "apt").mkdir()
    (bucket / "bucket" / "apt" / "Translation-en.xz").write_bytes(lzma.compress(en.encode()))
    (bucket / "bucket" / "apt" / "Translation-de").write_bytes(de.encode())
    source = sources.get_source("ddtp/en_de", "train", "gs://bucket/tfds", raw_dir="gs://bucket/apt")[0]
    assert 0 < len(source) < 60 and source[0]["de"].startswith(b"Werkzeug")
    assert bucket.os_calls == []


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_a_catalog_dataset_prepared_under_gs_is_found_and_read(bucket, local_run, monkeypatch, tmp_path):
    """What tfds limits: array_record opens gs:// with its own GCS client (C++, not epath); here that client is
    stood in for by reading the same objects from the bucket's folder. Everything else goes through epath."""
    data_dir = tmp_path / "catalog"
    tfds_ddtp.prepare("ddtp/en_zh", str(data_dir))  # its files stand in for a `tfds build` output
    target = bucket / "bucket" / "tfds" / "ddtp" / "en_zh" / "1.0.0"
    target.mkdir(parents=True)
    for f in (data_dir / "ddtp" / "en_zh" / "1.0.0").iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    from array_record.python import array_record_data_source

    module = array_record_data_source.array_record_module
    real_reader, opened = module.ArrayRecordReader, []

    def reader(path, *args, **kwargs):
        opened.append(path)
        return real_reader(path.replace("gs://", str(bucket) + "/", 1), *args, **kwargs)

    monkeypatch.setattr(module, "ArrayRecordReader", reader)
    builder = sources._prepared_builder("ddtp/en_zh", "gs://bucket/tfds")
    assert str(builder.data_dir) == "gs://bucket/tfds/ddtp/en_zh/1.0.0"
    source = builder.as_data_source(split="test")
    assert len(source) == 106 and source[0]["zh"]
    assert opened and all(p.startswith("gs://bucket/tfds/ddtp/en_zh/1.0.0/") for p in opened)
    assert bucket.os_calls == []
    with pytest.raises(UserError, match="s3://"):  # s3://: nothing can read it
        target_s3 = bucket / "s3bucket" / "tfds" / "ddtp" / "en_zh" / "1.0.0"
        target_s3.mkdir(parents=True)
        (target_s3 / "dataset_info.json").write_bytes((target / "dataset_info.json").read_bytes())
        sources._prepared_builder("ddtp/en_zh", "s3://s3bucket/tfds")
    with pytest.raises(UserError, match=r"lm1b.*gs://bucket/tfds.*python -m lconv.data prepare lm1b --data_dir=gs://bucket/tfds"):
        sources.get_source("lm1b", "test", "gs://bucket/tfds")


def test_a_url_without_its_file_system_package_is_one_line_naming_the_flag_and_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
    for protocol in ("gs", "gcs"):
        monkeypatch.delitem(REGISTRY._registry, protocol, raising=False)
        monkeypatch.setitem(REGISTRY.known_implementations, protocol,
                            {"class": "lconv_no_such_module.GCSFileSystem", "err": "Install gcsfs"})
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    try:
        for call, flag in ((lambda: sources.get_source("ddtp/en_de", "train", "gs://b/tfds"), "data_dir"),
                           (lambda: sources.get_source("lm1b", "test", "gs://b/tfds"), "data_dir"),
                           (lambda: pipeline.load_or_train_tokenizer({**CONFIG, "data_dir": str(tmp_path)},
                                                                     "gs://b/run", process_count=1,
                                                                     process_index=0), "workdir")):
            with pytest.raises(UserError) as error:
                call()
            message = str(error.value)
            assert "\n" not in message and f"{flag}='gs://b/" in message and "pip install gcsfs" in message
    finally:
        epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    with pytest.raises(UserError, match=r"^data_dir='foo://b/tfds'"):
        sources.get_source("ddtp/en_de", "train", "foo://b/tfds")


def test_preparing_a_catalog_dataset_into_gs_stages_locally_and_uploads_dataset_info_last(bucket, monkeypatch,
                                                                                            tmp_path, lconv_log):
    """``python -m lconv.data prepare lm1b --data_dir=gs://...``: tfds writes array_record to local files only, so
    the build is staged locally and uploaded; readers look for dataset_info.json, so it goes last."""
    import tensorflow_datasets as tfds

    from lconv.data import catalog

    built = tfds_ddtp.prepare("ddtp/en_zh", str(tmp_path / "built")).data_dir  # stands in for tfds's output

    def fake_download_and_prepare(self, **kwargs):
        assert kwargs["file_format"] == "array_record" and not paths.is_url(self.data_dir)
        os.makedirs(self.data_dir)
        for f in epath.Path(built).iterdir():
            (epath.Path(self.data_dir) / f.name).write_bytes(f.read_bytes())

    monkeypatch.setattr(catalog, "has_tensorflow", lambda: True)
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", fake_download_and_prepare)
    real_write, uploaded = epath.Path.write_bytes, []

    def recording_write(self, data):
        if str(self).startswith("gs://"):
            uploaded.append(self.name)
        return real_write(self, data)

    monkeypatch.setattr(epath.Path, "write_bytes", recording_write)
    assert catalog.prepare("lm1b", "gs://bucket/tfds/") == "gs://bucket/tfds/lm1b/1.1.0"
    assert uploaded[-1] == "dataset_info.json" and len(uploaded) == len(list(epath.Path(built).iterdir()))
    assert sorted(os.listdir(bucket / "bucket" / "tfds" / "lm1b" / "1.1.0")) == sorted(uploaded)
    assert os.listdir(os.environ[paths.CACHE_ENV]) == ["downloads"]  # the staging folder is gone
    assert catalog.prepare("lm1b", "gs://bucket/tfds") == "gs://bucket/tfds/lm1b/1.1.0"
    assert lconv_log()[-1] == "lm1b is already prepared in gs://bucket/tfds/lm1b/1.1.0"
    assert bucket.os_calls == []


def test_the_recorder_sees_os_calls_on_urls(bucket):
    """The check the tests above rely on: an os-level call on a gs:// path is recorded."""
    assert not os.path.isfile("gs://bucket/tfds/x") and not os.path.isdir("gs://bucket")
    with pytest.raises(FileNotFoundError):
        open("gs://bucket/tfds/x", "rb")
    assert bucket.os_calls == ["stat('gs://bucket/tfds/x')", "stat('gs://bucket')", "open('gs://bucket/tfds/x')"]


def test_a_data_dir_that_is_a_file_is_one_line_naming_it(tmp_path):
    """``--config.data.data_dir=<a file>`` (or a folder under one) was tfds' NotADirectoryError traceback."""
    (tmp_path / "notes.txt").write_text("not a folder")
    for data_dir in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "tfds"):
        with pytest.raises(UserError) as error:
            sources.get_source("ddtp/en_de", "train", str(data_dir))
        helpers.one_line_error(error, "config.data.data_dir", "notes.txt")


def test_lconvs_default_scratch_folders_are_this_users_not_the_shared_temporary_one(monkeypatch, tmp_path):
    """A folder in /tmp is anyone's: a link planted there had ``python -m lconv.data`` write its tokenizer where
    the link pointed."""
    import tempfile

    from lconv.bench import __main__ as bench_main
    from lconv.data import __main__ as data_main
    from lconv.run import compilation_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(paths.CACHE_ENV, raising=False)
    mine = str(tmp_path / "cache" / "lconv")
    assert data_main._parse(["en_de"]).workdir == f"{mine}/data_tokenizers"
    assert paths.local_cache_dir() == f"{mine}/data_cache"
    assert compilation_cache.user_folder() == f"{mine}/compilation_cache"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: ignored
    assert paths.user_cache_folder("x") == os.path.join(os.path.expanduser("~"), ".cache", "lconv", "x")
    for folder in (bench_main.QUICK_DIR, bench_main.INSTALLED_DIR):
        assert not folder.startswith(tempfile.gettempdir() + os.sep)


@pytest.mark.parametrize("opened", ["lconv", "data_tokenizers", "none"])
def test_the_data_tokenizer_folder_another_user_could_write_is_refused_not_written_through(opened, monkeypatch,
                                                                                        tmp_path, capsys):
    """``~/.cache/lconv`` (or ``data_tokenizers`` below it) left writable by every user: another user planted
    ``data_tokenizers/ddtp_en_de -> victim`` and ``python -m lconv.data en_de`` wrote its tokenizer there. Every
    folder from ``lconv/`` down is now this user's alone, and the dataset's folder no link: else one line."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    mine = tmp_path / "cache" / "lconv"
    (mine / "data_tokenizers").mkdir(parents=True, mode=0o700)
    mine.chmod(0o700)
    if opened != "none":
        (mine.parent / opened if opened == "lconv" else mine / opened).chmod(0o777)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "spm.model").write_text("another user's file")
    link = mine / "data_tokenizers" / "ddtp_en_de"
    link.symlink_to(victim)

    outcome = helpers.run_cli(capsys, "lconv.data", "en_de", f"--data_dir={tmp_path / 'tfds'}")

    named = {"lconv": (str(mine), "other users"), "data_tokenizers": (str(mine / "data_tokenizers"), "other users"),
             "none": (f"{link} is a link (to {victim})",)}[opened]
    helpers.one_line_error(outcome, str(link), *named)
    assert os.listdir(victim) == ["spm.model"] and (victim / "spm.model").read_text() == "another user's file"
    assert not (tmp_path / "tfds").exists()  # refused before any data is prepared


def test_a_link_at_the_tokenizer_folder_in_a_named_workdir_is_refused_not_written_through(tmp_path, capsys):
    """``python -m lconv.data en_de --workdir=WK`` with ``WK/ddtp_en_de -> victim``: the tokenizer was written into
    the victim folder (round-11 campaign e107)."""
    workdir, victim = tmp_path / "wk", tmp_path / "victim"
    workdir.mkdir()
    victim.mkdir()
    (workdir / "ddtp_en_de").symlink_to(victim)
    outcome = helpers.run_cli(capsys, "lconv.data", "en_de", f"--data_dir={tmp_path / 'tfds'}", f"--workdir={workdir}")
    helpers.one_line_error(outcome, str(workdir / "ddtp_en_de"), f"is a link (to {victim})")
    assert not os.listdir(victim) and not (tmp_path / "tfds").exists()


def test_a_cache_home_that_is_a_file_is_one_line_naming_the_variable(monkeypatch, tmp_path, capsys):
    """``XDG_CACHE_HOME`` naming a regular file: ``python -m lconv.data en_de`` (the tokenizer's default folder is
    under it) was a 28-line NotADirectoryError traceback."""
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    outcome = helpers.run_cli(capsys, "lconv.data", "en_de", f"--data_dir={tmp_path / 'tfds'}")

    helpers.one_line_error(outcome, f"$XDG_CACHE_HOME={tmp_path / 'cache'}", "not a folder")
    assert (tmp_path / "cache").read_text() == "not a folder"


def test_every_folder_of_this_users_cache_is_made_private_and_checked_from_lconv_down(monkeypatch, tmp_path):
    """The rule the compilation cache and the data tokenizers share (``paths.private_cache_problem``): folders it
    makes are owner-only; a link, a file or a folder others can write, at any level from ``lconv/`` down, is named."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = paths.user_cache_folder("data_tokenizers") + "/ddtp_en_de"
    assert paths.private_cache_problem(folder) is None
    for level in (tmp_path / "cache" / "lconv", tmp_path / "cache" / "lconv" / "data_tokenizers", folder):
        assert os.stat(level).st_mode & 0o777 == 0o700
    os.rmdir(folder)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", folder)
    assert paths.private_cache_problem(folder) == f"is a link (to {tmp_path / 'elsewhere'})"
    assert os.listdir(tmp_path / "elsewhere") == []
    os.unlink(folder)
    (tmp_path / "cache" / "lconv" / "data_tokenizers").chmod(0o770)
    assert paths.private_cache_problem(folder) == (
        f"is inside {tmp_path / 'cache' / 'lconv' / 'data_tokenizers'}, which can be written by other users (chmod "
        f"go-w {tmp_path / 'cache' / 'lconv' / 'data_tokenizers'})")
    assert not os.path.lexists(folder)
