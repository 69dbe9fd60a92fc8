"""DDTP parsing/alignment on a hand-written bad corpus, splits, the bundled snapshot, tfds builders, sources,
tokenizer."""
import collections
import itertools
import json
import lzma
import os
import resource
import shutil
import tempfile

import numpy as np
import pytest

from lconv.data import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ddtp, sources
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError


def _md5s_in(split, n):
    """n md5-like keys that ddtp.split_of puts in ``split`` (so a tiny corpus fills every split)."""
    return list(itertools.islice((key for key in map("{:032x}".format, range(100000)) if ddtp.split_of(key) == split),
                                 n))


_TRAIN = _md5s_in("train", 6)
MD5 = {"good": _TRAIN[0], "badutf8": _TRAIN[1], "tabs": _md5s_in("validation", 1)[0], "empty": _TRAIN[2],
       "huge": _TRAIN[3], "mismatch": _md5s_in("test", 1)[0], "dup": _TRAIN[4], "onlyen": _TRAIN[5]}

EN = f"""Package: good
Description-md5: {MD5['good']}
Description-en: text editor
 A small text editor
 for the terminal.
 .
 Features:
   * syntax highlighting
   * undo

Package: badutf8
Description-md5: {MD5['badutf8']}
Description-en: checker

Package: tabs
Description-md5: {MD5['tabs']}
Description-en: tab\tseparated\x07 tool

Package: empty
Description-md5: {MD5['empty']}
Description-en: empty translation
 Long text.

Package: huge
Description-md5: {MD5['huge']}
Description-en: huge line
 Short paragraph.

Package: mismatch
Description-md5: {MD5['mismatch']}
Description-en: mismatch synopsis
 One.
 .
 Two.

Package: dup
Description-md5: {MD5['dup']}
Description-en: shared description

Package: dup-too
Description-md5: {MD5['dup']}
Description-en: shared description

Package: nomd5
Description-en: no md5 here

Package: onlyen
Description-md5: {MD5['onlyen']}
Description-en: untranslated
 Only English.
""".encode()

DE = f"""Package: good
Description-md5: {MD5['good']}
Description-de: Texteditor
 Ein kleiner Texteditor
 für das Terminal.
 \x0b
 .
 Funktionen:
   * Syntaxhervorhebung
   * Rückgängig

Package: badutf8
Description-md5: {MD5['badutf8']}
Description-de: Pr""".encode() + b"\xff\xfe" + f"""fer

Package: tabs
Description-md5: {MD5['tabs']}
Description-de: Werkzeug\tmit\x1b Tabs

Package: empty
Description-md5: {MD5['empty']}
Description-de: leere Übersetzung
 \x07\x1f

Package: huge
Description-md5: {MD5['huge']}
Description-de: riesige Zeile
 {'x' * 5000}

Package: mismatch
Description-md5: {MD5['mismatch']}
Description-de: Nichtübereinstimmung
 Eins. Zwei.

Package: dup
Description-md5: {MD5['dup']}
Description-de: geteilte Beschreibung

Package: dup-conflict
Description-md5: {MD5['dup']}
Description-de: andere Beschreibung
""".encode()


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("raw")
    (path / "Translation-en.xz").write_bytes(lzma.compress(EN))
    (path / "Translation-de").write_bytes(DE)  # plain text works too
    return str(path)


def test_parser_skips_and_counts_bad_data_and_aligns_the_rest(raw_dir):
    counts = collections.Counter()
    corpus = ddtp.load_raw_corpus(raw_dir, langs=("en", "de"), counts=counts)
    records = ddtp.align_corpus(corpus, counts)
    pairs = {r["md5"]: ddtp.translation_pairs(r, "de", counts) for r in records}
    assert pairs[MD5["good"]] == [
        ("text editor", "Texteditor"),
        ("A small text editor for the terminal.", "Ein kleiner Texteditor für das Terminal."),
        ("Features: * syntax highlighting * undo", "Funktionen: * Syntaxhervorhebung * Rückgängig")]
    assert pairs[MD5["tabs"]] == [("tab separated tool", "Werkzeug mit Tabs")]
    assert pairs[MD5["badutf8"]] == []  # the German record was skipped, so there is no pair
    assert pairs[MD5["empty"]] == [("empty translation", "leere Übersetzung")]  # empty paragraph dropped -> 1 vs 2
    assert pairs[MD5["huge"]] == [("huge line", "riesige Zeile")]  # the truncated line's pair is skipped
    assert pairs[MD5["mismatch"]] == [("mismatch synopsis", "Nichtübereinstimmung")]
    assert pairs[MD5["dup"]] == [("shared description", "geteilte Beschreibung")]  # first record wins
    assert pairs[MD5["onlyen"]] == []
    assert counts["invalid_utf8_record_de"] == 1
    assert counts["tab_replaced"] == 2 and counts["control_chars_removed"] == 3
    assert counts["empty_paragraph_skipped"] == 1 and counts["whitespace_line_skipped"] == 1
    assert counts["line_truncated"] == 1 and counts["pair_too_long_de"] == 1
    assert counts["paragraph_count_mismatch_de"] == 2  # "mismatch" and "empty"
    assert counts["duplicate_md5_en"] == 1 and counts["conflicting_duplicate_md5_de"] == 1
    assert counts["record_without_md5"] == 1
    assert counts["unique_descriptions_en"] == 8 and counts["unique_descriptions_de"] == 6


def test_empty_side_pairs_are_skipped_and_counted():
    counts = collections.Counter()
    record = {"md5": MD5["empty"], "en": ["synopsis", "para"], "de": ["", "Absatz"]}
    assert ddtp.translation_pairs(record, "de", counts) == [("para", "Absatz")]
    assert counts["empty_side_de"] == 1


def test_cjk_lines_join_without_spaces():
    assert ddtp.join_lines(["古代战争实时策略游戏。简而言之，它是一款基于历史的战争/经", "济游戏 A.D. x", " y"]) == \
        "古代战争实时策略游戏。简而言之，它是一款基于历史的战争/经济游戏 A.D. x y"


def test_split_is_a_stable_hash_of_the_md5():
    assert ddtp.split_of("d943033bedada21853d2ae54a2578a7b") == ddtp.split_of("d943033bedada21853d2ae54a2578a7b")
    splits = collections.Counter(ddtp.split_of(f"{i:032x}") for i in range(20000))
    assert abs(splits["test"] / 20000 - ddtp.TEST_PER_MILLE / 1000) < 0.01
    assert abs(splits["validation"] / 20000 - ddtp.VALIDATION_PER_MILLE / 1000) < 0.01


@pytest.fixture(scope="module")
def snapshot_tasks():
    return ddtp.build_tasks(ddtp.load_snapshot_records())


def test_snapshot_has_the_documented_counts(snapshot_tasks):
    with open(os.path.join(ddtp.SNAPSHOT_DIR, "counts.json")) as f:
        documented = json.load(f)["examples"]
    with open(os.path.join(ddtp.SNAPSHOT_DIR, "README.md")) as f:
        readme = f.read()
    assert set(snapshot_tasks) == set(ddtp.TASKS) == set(documented)
    for task, splits in snapshot_tasks.items():
        counts = {split: len(examples) for split, examples in splits.items()}
        assert counts == documented[task]
        assert f"| `{task}` | {counts['train']} | {counts['validation']} | {counts['test']} |" in readme
    assert 1100 <= documented["en_de"]["test"] <= 1400  # the design's ~1.2k En-De test pairs
    size = sum(os.path.getsize(ddtp.snapshot_file(ddtp.SNAPSHOT_DIR, s)) for s in ddtp.SPLITS)
    assert size < 15e6


def test_no_description_or_text_crosses_splits(snapshot_tasks):
    for task, splits in snapshot_tasks.items():
        md5s = {split: {e["md5"] for e in examples} for split, examples in splits.items()}
        texts = {split: {v for e in examples for k, v in e.items() if k != "md5"} for split, examples in splits.items()}
        for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
            assert not md5s[a] & md5s[b], (task, a, b)
            assert not texts[a] & texts[b], (task, a, b)
        for split, examples in splits.items():
            assert all(ddtp.split_of(e["md5"]) == split for e in examples)


@pytest.fixture(scope="module")
def tfds_quiet():
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    return tfds


@pytest.mark.parametrize("planted", ["linked_folder", "linked_version", "file"])
def test_the_plain_readers_link_goes_only_through_real_folders_and_replaces_only_lconvs_own(tmp_path, planted):
    from lconv.data import tfds_ddtp

    data_dir, victim = tmp_path / "data", tmp_path / "victim"
    version_dir = data_dir / tfds_ddtp.CACHE_DIRNAME / "ddtp_en_de-key" / "ddtp" / "en_de" / "1.0.0"
    version_dir.mkdir(parents=True)
    victim.mkdir()
    if planted == "linked_folder":  # <data_dir>/ddtp leads elsewhere
        (data_dir / "ddtp").symlink_to(victim)
    elif planted == "linked_version":  # the user's own link where lconv's would go
        (data_dir / "ddtp" / "en_de").mkdir(parents=True)
        (data_dir / "ddtp" / "en_de" / "1.0.0").symlink_to(victim)
    else:
        (data_dir / "ddtp").write_text("mine")
    before = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    tfds_ddtp._point_plain_readers(str(data_dir), "ddtp/en_de", str(version_dir))
    assert {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")} == before
    assert not list(victim.iterdir())
    if planted == "linked_version":
        assert os.readlink(data_dir / "ddtp" / "en_de" / "1.0.0") == str(victim)
        old = data_dir / tfds_ddtp.CACHE_DIRNAME / "ddtp_en_de-old" / "ddtp" / "en_de" / "1.0.0"
        old.mkdir(parents=True)  # a link lconv made to an older copy is moved on to the new one
        link = data_dir / "ddtp" / "en_de" / "1.0.0"
        link.unlink()
        link.symlink_to(os.path.relpath(old, link.parent))
        tfds_ddtp._point_plain_readers(str(data_dir), "ddtp/en_de", str(version_dir))
        assert link.resolve() == version_dir.resolve()


def test_the_plain_readers_link_is_made_in_the_folders_opened_not_through_one_swapped_in(tmp_path, monkeypatch):
    """The folders were checked by name, then written by name: ``<data_dir>/ddtp`` swapped for a link in between
    had the link made in the victim's folder (a race shown at function level in the round-11 campaign, R1)."""
    from lconv.data import tfds_ddtp

    data_dir, victim = tmp_path / "data", tmp_path / "victim"
    version_dir = data_dir / tfds_ddtp.CACHE_DIRNAME / "ddtp_en_de-key" / "ddtp" / "en_de" / "1.0.0"
    version_dir.mkdir(parents=True)
    (data_dir / "ddtp" / "en_de").mkdir(parents=True)
    victim.mkdir()
    real_open = os.open

    def open_then_swap(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if str(path) == str(data_dir):  # the data_dir is open: its ddtp/ becomes a link to the victim
            shutil.rmtree(data_dir / "ddtp")
            (data_dir / "ddtp").symlink_to(victim)
        return fd

    monkeypatch.setattr(os, "open", open_then_swap)
    tfds_ddtp._point_plain_readers(str(data_dir), "ddtp/en_de", str(version_dir))
    monkeypatch.undo()
    assert not list(victim.iterdir()) and (data_dir / "ddtp").is_symlink()


def test_preparing_from_a_raw_dir_named_with_escape_sequences_shows_them_as_escapes(raw_dir, tmp_path, capsys):
    from lconv.data import tfds_ddtp

    hostile = tmp_path / "raw\x1b]0;TITLE\x07\x1b[2J\x1b[31m"  # a run's stored raw_dir could name such a folder
    shutil.copytree(raw_dir, hostile)
    tfds_ddtp.prepare("ddtp/en_de", str(tmp_path / "data"), raw_dir=str(hostile))
    out = capsys.readouterr().out
    assert "Preparing ddtp/en_de from raw_dir=" in out and "Prepared ddtp/en_de" in out
    assert "raw\\x1b]0;TITLE\\x07\\x1b[2J\\x1b[31m" in out and not set(out) & {"\x1b", "\x07"}


def test_a_file_size_limit_while_a_copy_is_prepared_is_one_line_naming_the_copy(raw_dir, tmp_path, capsys):
    """``ulimit -f`` (the campaign's full disk): Python ignores SIGXFSZ, so tfds's writes fail with EFBIG, which was a
    66-line RuntimeError traceback from eval.py."""
    from lconv.data import tfds_ddtp

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200, limits[1]))  # under the copy's shards and records
    try:
        with pytest.raises(UserError) as error:
            tfds_ddtp.prepare("ddtp/en_de", str(tmp_path / "data"), raw_dir=raw_dir)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    message = str(error.value)
    assert message.startswith("the file size limit (ulimit -f) was reached while preparing ddtp/en_de in "
                              f"{tmp_path / 'data'}") and "\n" not in message
    assert not [p for p in (tmp_path / "data").rglob("*") if p.is_file()]  # nothing of the copy is kept
    assert "Traceback" not in capsys.readouterr().err


def test_tfds_builder_prepares_from_raw_files_and_data_source_reads_it(raw_dir, tmp_path, tfds_quiet, monkeypatch):
    from lconv.data import tfds_ddtp

    system_temp = tmp_path / "system_temp"
    system_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_temp))
    tfds_ddtp.prepare("ddtp/en_de", str(tmp_path), raw_dir=raw_dir)
    assert not list(system_temp.iterdir())  # tfds's bucket lookup left an empty tmp*tfds folder at each preparation
    assert list((tmp_path / "ddtp" / "en_de" / "1.0.0").glob("*.array_record*"))
    expected = ddtp.load_tasks(raw_dir, tasks=["en_de"])["en_de"]
    for split in ddtp.SPLITS:
        source = tfds_quiet.data_source("ddtp/en_de", split=split, data_dir=str(tmp_path), download=False)
        got = sorted((r["en"].decode(), r["de"].decode(), r["md5"].decode()) for r in source)
        assert got == sorted((e["en"], e["de"], e["md5"]) for e in expected[split])
    total = sum(len(v) for v in expected.values())
    assert total == 8  # good (3 pairs), tabs, empty, huge, mismatch, dup (1 pair each)
    # Reading a copy already there (a data_dir a run's config names) adds nothing to its data_dir.
    shutil.rmtree(tmp_path / "ddtp")
    tfds_ddtp.prepare("ddtp/en_de", str(tmp_path), raw_dir=raw_dir)
    assert not (tmp_path / "ddtp").exists()
    assert {split: len(v) for split, v in expected.items()} == {"train": 6, "validation": 1, "test": 1}
    # get_source gives the same, in both directions
    source, input_key, target_key = sources.get_source("ddtp/de_en", "train", str(tmp_path), raw_dir=raw_dir)
    assert (input_key, target_key) == ("de", "en") and len(source) == len(expected["train"])


def test_iwslt14_local_files_builder(tmp_path, tfds_quiet):
    raw = tmp_path / "raw"
    raw.mkdir()
    for prefix, n in (("train", 5), ("valid", 2), ("test", 3)):
        (raw / f"{prefix}.de").write_text("".join(f"hallo {i}\n" for i in range(n)))
        (raw / f"{prefix}.en").write_text("".join(f"hello {i}\n" for i in range(n)))
    source, input_key, target_key = sources.get_source("iwslt14/de_en", "test", str(tmp_path / "d"), raw_dir=str(raw))
    assert (input_key, target_key, len(source)) == ("de", "en", 3)
    assert sorted(source[i]["en"] for i in range(3)) == [b"hello 0", b"hello 1", b"hello 2"]


@pytest.mark.parametrize("name, tfds_name", [("wmt14/en_de", "wmt14_translate/de-en"),
                                             ("wmt14/fr_en", "wmt14_translate/fr-en"),
                                             ("wmt17/zh_en", "wmt17_translate/zh-en"),
                                             ("lm1b", "lm1b"), ("cnn_dailymail", "cnn_dailymail")])
def test_unprepared_paper_dataset_gives_one_line_error_with_the_command(name, tfds_name, tmp_path):
    with pytest.raises(ValueError) as error:
        sources.get_source(name, "test", str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "not prepared" in message
    assert f"tfds build {tfds_name} --data_dir={tmp_path} --file_format=array_record" in message


def test_every_dataset_name_maps_to_keys():
    for name, spec in sources.DATASETS.items():
        assert spec.target_key and (spec.input_key is None) == (spec.kind == "lm"), name
    with pytest.raises(ValueError, match="dataset="):
        sources.dataset_spec("wmt99")


def test_tokenizer_round_trip_ids_and_reuse(tmp_path):
    assert (PAD_ID, EOS_ID, UNK_ID, BOS_ID) == (0, 1, 2, 3)
    texts = [f"Paket {i} enthält die Bibliothek für Python {i % 7}." for i in range(300)] + \
            [f"package {i} provides the library for Python {i % 7}; 中文软件包" for i in range(300)]
    tokenizer = tokenizer_lib.load_or_train(str(tmp_path), iter(texts), vocab_size=400, max_sentences=500)
    for text in ("Paket 12 enthält die Bibliothek.", "package for Python; 中文软件包", "ünïcödé ☃ ok"):
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int32 and ids.min() > BOS_ID
        assert tokenizer.detokenize(np.concatenate([ids, [EOS_ID, 57, PAD_ID]])) == text  # stops at EOS
    # A small corpus gives fewer pieces than asked for (339 here); a resume asking for the same size reuses it.
    assert tokenizer.vocab_size < 400 and tokenizer.requested_vocab_size == 400
    again = tokenizer_lib.load_or_train(str(tmp_path), iter(()), vocab_size=400)
    assert again.model_proto == tokenizer.model_proto
    with pytest.raises(ValueError, match=f"vocab_size={tokenizer.vocab_size}.*400"):
        tokenizer_lib.load_or_train(str(tmp_path), iter(texts), vocab_size=tokenizer.vocab_size)


def test_the_tokenizers_sample_keeps_both_sides_of_alternating_source_and_target_texts():
    texts = [f"{side}{i}" for i in range(6000) for side in ("en", "de")]  # as pipeline.tokenizer_texts yields them
    for max_sentences in (2000, 3000, 5999):  # strides of 6, 4 and 2 would each keep one side alone
        sample = tokenizer_lib.sample_sentences(iter(texts), max_sentences)
        sides = collections.Counter(t[:2] for t in sample)
        assert len(sample) == max_sentences and len(set(sample)) == max_sentences
        assert abs(sides["en"] - sides["de"]) < 0.1 * max_sentences, sides
        position = {text: i for i, text in enumerate(texts)}
        assert sample == sorted(sample, key=position.get)  # in the corpus's order
    assert tokenizer_lib.sample_sentences(iter(texts), 12000) == texts  # all of them when they fit
    assert tokenizer_lib.sample_sentences(iter(texts), 2000) == tokenizer_lib.sample_sentences(iter(texts), 2000)


# ----------------------------------------------------------------------------------------------------------------
# The paper's datasets: `python -m lconv.data prepare NAME` (lconv.data.catalog)
# ----------------------------------------------------------------------------------------------------------------
CATALOG = ["wmt14/en_de", "wmt14/en_fr", "wmt17/zh_en", "lm1b", "cnn_dailymail"]


def _prepare_cli(capsys, *argv):
    """``python -m lconv.data prepare ...`` in this process: (exit code, stdout, stderr)."""
    from lconv.data import __main__ as data_main

    try:
        data_main.main(["prepare", *argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", CATALOG)
def test_prepare_without_tensorflow_is_one_line_naming_what_to_install(name, tmp_path, capsys, monkeypatch):
    from lconv.data import catalog

    monkeypatch.setattr(catalog, "has_tensorflow", lambda: False)
    code, _, err = _prepare_cli(capsys, name, f"--data_dir={tmp_path / 'tfds'}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: preparing {name} needs TensorFlow (") and "pip install tensorflow-cpu" in err
    assert not (tmp_path / "tfds").exists()  # checked before anything is downloaded or written


def test_tfds_needs_tensorflow_to_unpack_downloads_and_its_lm1b_and_cnn_builders_use_it(tmp_path, monkeypatch):
    """The facts catalog.TENSORFLOW_NEEDED states, from tfds itself: every catalog builder downloads archives, and
    tfds cannot unpack one without TensorFlow; lm1b and cnn_dailymail also call tf.io.gfile themselves."""
    import inspect
    import sys
    import tarfile

    import tensorflow_datasets as tfds
    from tensorflow_datasets.core.download import extractor
    from tensorflow_datasets.datasets.lm1b import lm1b_dataset_builder
    from tensorflow_datasets.summarization import cnn_dailymail

    from lconv.data import catalog

    archive = tmp_path / "a.tgz"
    (tmp_path / "a.txt").write_text("x")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "a.txt", arcname="a.txt")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # as where TensorFlow is not installed
    manager = tfds.download.DownloadManager(download_dir=tmp_path / "downloads")
    with pytest.raises(extractor.ExtractError, match="tensorflow") as error:
        manager.extract(archive)
    assert isinstance(error.value.__cause__, ModuleNotFoundError)
    for module in (lm1b_dataset_builder, cnn_dailymail):
        assert "tf.io.gfile." in inspect.getsource(module)
    assert set(catalog.TENSORFLOW_NEEDED) == {sources.DATASETS[n].tfds_name.split("/")[0] for n in CATALOG}


@pytest.mark.parametrize("name", CATALOG)
def test_prepare_reaches_the_download_and_a_failed_download_is_one_line(name, tmp_path, monkeypatch):
    """Up to the download step with tfds's real builder (TensorFlow is only needed after it); the network is
    absent here, so the download fails, as it does on a machine without network."""
    import requests
    import tensorflow_datasets as tfds

    from lconv.data import catalog

    monkeypatch.setattr(catalog, "has_tensorflow", lambda: True)
    asked, prepared_with = [], {}
    real = tfds.core.DatasetBuilder.download_and_prepare

    def spy(self, **kwargs):
        prepared_with.update(kwargs)
        return real(self, **kwargs)

    def flat(urls):
        if isinstance(urls, dict):
            return [u for v in urls.values() for u in flat(v)]
        return [u for v in urls for u in flat(v)] if isinstance(urls, (list, tuple)) else [urls]

    def no_network(self, urls, *args, **kwargs):
        asked.extend(flat(urls))
        raise requests.ConnectionError("Failed to resolve 'www.statmt.org' (Name or service not known)")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", spy)
    for method in ("download", "download_and_extract"):
        monkeypatch.setattr(tfds.download.DownloadManager, method, no_network)
    with pytest.raises(UserError) as error:
        catalog.prepare(name, str(tmp_path / "tfds"))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"downloading {name} failed (ConnectionError: Failed to")
    assert "run this where there is network" in message
    assert asked and all(str(url).startswith(("http", "ftp")) for url in asked)
    assert prepared_with["file_format"] == "array_record"
    assert catalog.prepared_dir(sources.DATASETS[name].tfds_name, str(tmp_path / "tfds")) is None


def test_prepare_cli_prepares_ddtp_and_reuses_a_prepared_catalog_dataset(tmp_path, capsys, tfds_quiet):
    code, out, err = _prepare_cli(capsys, "ddtp/de_en", f"--data_dir={tmp_path}")
    assert code == 0, err
    assert "ddtp/de_en: examples {'train': 30249, 'validation': 1244, 'test': 1216} in " in out
    # ddtp/en_de's files under the lm1b name stand in for a finished `tfds build lm1b` (dataset_info.json there)
    os.makedirs(tmp_path / "lm1b")
    os.symlink(tmp_path / "ddtp" / "en_de" / "1.0.0", tmp_path / "lm1b" / "1.1.0")
    code, out, err = _prepare_cli(capsys, "lm1b", f"--data_dir={tmp_path}")
    assert code == 0 and out == f"lm1b is already prepared in {tmp_path / 'lm1b' / '1.1.0'}\n", err


@pytest.mark.parametrize("argv, named", [
    (["nonsense"], "unknown task 'nonsense'"),
    (["lm1b", "--raw_dir=/x"], "--raw_dir is read by ddtp/* and iwslt14/* only; lm1b is downloaded by tfds"),
    ([], "the following arguments are required: name"),
])
def test_prepare_cli_bad_arguments_are_one_line(argv, named, tmp_path, capsys):
    code, _, err = _prepare_cli(capsys, *argv, f"--data_dir={tmp_path / 'tfds'}")
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "tfds").exists()


@pytest.mark.parametrize("name, tfds_name", [("wmt14/en_de", "wmt14_translate/de-en"), ("lm1b", "lm1b"),
                                             ("cnn_dailymail", "cnn_dailymail")])
def test_unprepared_paper_dataset_error_gives_the_prepare_command(name, tfds_name, tmp_path):
    with pytest.raises(ValueError) as error:
        sources.get_source(name, "test", str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and f"python -m lconv.data prepare {name} --data_dir={tmp_path} " in message
    assert "pip install tensorflow-cpu" in message
