"""lconv.data's reliability: prepared data is keyed by its source (never stale), a bad raw file is one line naming
it (and nothing is cached), the counts of skipped records are kept and exposed, files are written under unique
temporary names (processes preparing or saving together do not collide), and ``python -m lconv.data`` answers bad
input with one ``error:`` line and exit code 2."""
from __future__ import annotations

import json
import lzma
import os
import pathlib
import shutil
import subprocess
import sys

import helpers
import numpy as np
import pytest

from lconv.data import ddtp, pipeline, sources, tfds_ddtp
from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _quiet_tfds():
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()


def _md5s(split: str, n: int, start: int = 0) -> list[str]:
    """n md5-like keys that ddtp.split_of puts in ``split``, from the start-th on."""
    found = (f"{i:032x}" for i in range(200_000) if ddtp.split_of(f"{i:032x}") == split)
    return [key for i, key in enumerate(found) if i >= start][:n]


def _record(md5: str | None, lang: str, synopsis: str, paragraph: str | None = None) -> bytes:
    lines = ["Package: p"] + ([f"Description-md5: {md5}"] if md5 else []) + [f"Description-{lang}: {synopsis}"]
    if paragraph is not None:
        lines.append(f" {paragraph}")
    return ("\n".join(lines) + "\n").encode()


def _write_raw(path: pathlib.Path, en: list[bytes], de: list[bytes] | None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "Translation-en.xz").write_bytes(lzma.compress(b"\n".join(en)))
    if de is not None:
        (path / "Translation-de.xz").write_bytes(lzma.compress(b"\n".join(de)))
    return str(path)


def _simple_raw(path: pathlib.Path, word: str, with_de: bool = True) -> str:
    """4 train + 1 validation + 1 test descriptions, each one synopsis pair and one paragraph pair, using ``word``."""
    md5s = _md5s("train", 4) + _md5s("validation", 1) + _md5s("test", 1)
    en = [_record(m, "en", f"{word} tool {i}", f"The {word} text {i}.") for i, m in enumerate(md5s)]
    de = [_record(m, "de", f"{word} Werkzeug {i}", f"Der {word} Text {i}.") for i, m in enumerate(md5s)]
    return _write_raw(path, en, de if with_de else None)


def _texts(name: str, split: str, data_dir: str, raw_dir: str | None) -> set[str]:
    source, _, target_key = sources.get_source(name, split, data_dir, raw_dir=raw_dir)
    return {source[i][target_key].decode() for i in range(len(source))}


# ----------------------------------------------------------------------------------------------------------------
# 1. The prepared copy is keyed by its source
# ----------------------------------------------------------------------------------------------------------------
def test_a_different_raw_dir_or_a_changed_file_is_prepared_again_never_reused(tmp_path):
    data_dir = str(tmp_path / "tfds")
    raw_a, raw_b = _simple_raw(tmp_path / "a", "alpha"), _simple_raw(tmp_path / "b", "beta")
    assert all("alpha" in t for t in _texts("ddtp/en_de", "train", data_dir, raw_a))
    assert all("beta" in t for t in _texts("ddtp/en_de", "train", data_dir, raw_b))  # was alpha: the stale copy
    assert all("alpha" in t for t in _texts("ddtp/en_de", "train", data_dir, raw_a))  # both copies are kept
    # A file changed in place (same path, new content): a new copy, with the new description in it.
    extra = _record(_md5s("train", 1, start=10)[0], "de", "neues Werkzeug", "Neuer Text.")
    de_path = tmp_path / "a" / "Translation-de.xz"
    de_path.write_bytes(lzma.compress(lzma.decompress(de_path.read_bytes()) + b"\n" + extra))
    en_path = tmp_path / "a" / "Translation-en.xz"
    extra_en = _record(_md5s("train", 1, start=10)[0], "en", "new tool", "New text.")
    en_path.write_bytes(lzma.compress(lzma.decompress(en_path.read_bytes()) + b"\n" + extra_en))
    assert "neues Werkzeug" in _texts("ddtp/en_de", "train", data_dir, raw_a)
    prepared = sorted(os.listdir(os.path.join(data_dir, tfds_ddtp.CACHE_DIRNAME)))
    assert len(prepared) == 3 and not [p for p in prepared if ".tmp-" in p], prepared


def test_the_source_key_follows_file_contents_not_paths(tmp_path):
    raw = _simple_raw(tmp_path / "a", "alpha")
    key = tfds_ddtp.source_fingerprint("ddtp/en_de", raw)["key"]
    moved = shutil.copytree(raw, tmp_path / "elsewhere")
    assert tfds_ddtp.source_fingerprint("ddtp/en_de", str(moved))["key"] == key  # moving the files keeps the copy
    assert tfds_ddtp.source_fingerprint("ddtp/en_de", None)["key"] != key  # the bundled snapshot is another source
    assert tfds_ddtp.source_fingerprint("ddtp/en_fr", None)["key"] != tfds_ddtp.source_fingerprint(
        "ddtp/en_de", None)["key"]
    (moved / "Translation-de.xz").write_bytes((moved / "Translation-de.xz").read_bytes() + b"\0")
    assert tfds_ddtp.source_fingerprint("ddtp/en_de", str(moved))["key"] != key


def test_plain_tfds_readers_see_the_copy_in_use(tmp_path):
    import tensorflow_datasets as tfds

    data_dir = str(tmp_path / "tfds")
    for word in ("alpha", "beta"):
        raw = _simple_raw(tmp_path / word, word)
        sources.get_source("ddtp/en_de", "train", data_dir, raw_dir=raw)
        source = tfds.data_source("ddtp/en_de", split="train", data_dir=data_dir, download=False)
        assert all(word in source[i]["de"].decode() for i in range(len(source)))


def test_raw_dir_with_a_dataset_that_does_not_read_it_is_an_error(tmp_path):
    with pytest.raises(UserError) as error:
        sources.get_source("lm1b", "test", str(tmp_path), raw_dir=str(tmp_path))
    assert helpers.one_line_error(error, f"raw_dir={str(tmp_path)!r}", "ddtp/*", "iwslt14/*")


# ----------------------------------------------------------------------------------------------------------------
# 2-3. Missing and damaged files: one line naming the file, nothing cached
# ----------------------------------------------------------------------------------------------------------------
def _prepared_files(data_dir: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(data_dir) for f in files]


def test_a_missing_translation_file_is_one_line_naming_it_and_nothing_is_cached(tmp_path):
    data_dir, raw = str(tmp_path / "tfds"), _simple_raw(tmp_path / "raw", "alpha", with_de=False)
    with pytest.raises(UserError) as error:
        sources.get_source("ddtp/en_de", "train", data_dir, raw_dir=raw)
    message = helpers.one_line_error(error)
    assert "Translation-de" in message and raw in message
    assert _prepared_files(data_dir) == []
    assert len(_texts("ddtp/lm_en", "train", data_dir, raw)) == 4  # English alone is enough for lm_en
    _simple_raw(tmp_path / "raw", "alpha")  # the file added: now prepared, from it
    assert len(_texts("ddtp/en_de", "train", data_dir, raw)) == 8  # 4 descriptions x (synopsis + paragraph)
    with pytest.raises(UserError) as error:
        sources.get_source("ddtp/en_de", "train", data_dir, raw_dir=str(tmp_path / "nowhere"))
    assert "nowhere" in helpers.one_line_error(error)


@pytest.mark.parametrize("damage", ["first 64 bytes", "first 64 lines", "half", "not xz at all"])
def test_a_damaged_xz_file_is_one_line_naming_it_and_nothing_is_cached(tmp_path, damage):
    data_dir = str(tmp_path / "tfds")
    md5s = _md5s("train", 300)  # big enough that the xz data has more than 64 lines
    rng = np.random.default_rng(0)
    _write_raw(tmp_path / "raw", [_record(m, "en", f"tool {i}") for i, m in enumerate(md5s)],
               [_record(m, "de", " ".join(f"w{w}" for w in rng.integers(0, 10**6, 20))) for m in md5s])
    path = tmp_path / "raw" / "Translation-de.xz"
    data = path.read_bytes()
    assert data.count(b"\n") > 64
    path.write_bytes({"first 64 bytes": data[:64], "first 64 lines": b"\n".join(data.split(b"\n")[:64]),
                      "half": data[: len(data) // 2], "not xz at all": b"<html>Not Found</html>\n"}[damage])
    with pytest.raises(UserError) as error:
        sources.get_source("ddtp/en_de", "train", data_dir, raw_dir=str(tmp_path / "raw"))
    message = helpers.one_line_error(error)
    assert str(path) in message and ("truncated" in message or "not xz" in message), message
    assert _prepared_files(data_dir) == []


def test_a_file_with_no_description_is_one_line_naming_it(tmp_path):
    raw = _simple_raw(tmp_path / "raw", "alpha")
    (tmp_path / "raw" / "Translation-de.xz").unlink()
    (tmp_path / "raw" / "Translation-de").write_bytes(b"<html>Not Found</html>\n")
    with pytest.raises(UserError) as error:
        sources.get_source("ddtp/en_de", "train", str(tmp_path / "tfds"), raw_dir=raw)
    assert "Translation-de" in helpers.one_line_error(error)


# ----------------------------------------------------------------------------------------------------------------
# 4. The skip counts are kept beside the data and exposed by the pipeline
# ----------------------------------------------------------------------------------------------------------------
def _planted_corpus(path: pathlib.Path, seed: int = 1) -> dict:
    """A raw dir with a known number of each kind of bad record (drawn at random); returns those numbers."""
    rng = np.random.default_rng(seed)
    n = {kind: int(rng.integers(1, 5)) for kind in ("utf8", "no_md5_en", "no_md5_de", "orphan", "dup")}
    n["long"] = {split: int(rng.integers(1, 4)) for split in ddtp.SPLITS}
    n["overlap"] = int(rng.integers(1, 4))
    good = {split: _md5s(split, 6) for split in ddtp.SPLITS}
    spare = iter(_md5s("train", 40, start=6))
    en, de = [], []
    for split, md5s in good.items():
        for i, m in enumerate(md5s):
            en.append(_record(m, "en", f"{split} tool {i}", f"The {split} text {i}."))
            de.append(_record(m, "de", f"{split} Werkzeug {i}", f"Der {split} Text {i}."))
    for i in range(n["utf8"]):  # the English side is fine, the German one unreadable
        m = next(spare)
        en.append(_record(m, "en", f"utf8 tool {i}"))
        de.append(_record(m, "de", f"kaputt {i}").replace(b"kaputt", b"kap\xff\xfeutt"))
    en += [_record(None, "en", f"no md5 {i}") for i in range(n["no_md5_en"])]
    de += [_record(None, "de", f"ohne md5 {i}") for i in range(n["no_md5_de"])]
    de += [_record(next(spare), "de", f"Waise {i}") for i in range(n["orphan"])]  # no English description
    for _ in range(n["dup"]):  # the same texts as train description 0, another md5: two duplicate pairs each
        m = next(spare)
        en.append(_record(m, "en", "train tool 0", "The train text 0."))
        de.append(_record(m, "de", "train Werkzeug 0", "Der train Text 0."))
    for split, count in n["long"].items():  # a German paragraph over MAX_LINE_CHARS: cut, then its pair skipped
        for i, m in enumerate(_md5s(split, count, start=50)):
            en.append(_record(m, "en", f"long {split} {i}", "Short."))
            de.append(_record(m, "de", f"lang {split} {i}", "x" * (ddtp.MAX_LINE_CHARS + 100)))
    for i, m in enumerate(_md5s("validation", n["overlap"], start=20)):  # English synopsis seen in train
        en.append(_record(m, "en", f"train tool {i + 1}", f"Unique validation text {i}."))
        de.append(_record(m, "de", f"anders {i}", f"Eindeutiger Text {i}."))
    _write_raw(path, en, de)
    return n


def test_skip_counts_are_kept_beside_the_data_and_exposed_by_the_pipeline(tmp_path):
    n = _planted_corpus(tmp_path / "raw")
    config = dict(dataset="ddtp/en_de", data_dir=str(tmp_path / "tfds"), raw_dir=str(tmp_path / "raw"),
                  batch_size=2, eval_batch_size=2, max_input_length=16, max_target_length=16, read_threads=1)
    data = pipeline.make_datasets(config, _CharTokenizer(), process_index=0, process_count=1)
    report = data.source_report
    assert report["skipped"] == {
        "parse": {"invalid_utf8_record_de": n["utf8"], "record_without_md5": n["no_md5_en"] + n["no_md5_de"],
                  "no_english_source_de": n["orphan"]},
        "train": {"en_de_duplicate": 2 * n["dup"], "pair_too_long_de": n["long"]["train"]},
        "validation": {"en_de_validation_overlap": n["overlap"], "pair_too_long_de": n["long"]["validation"]},
        "test": {"pair_too_long_de": n["long"]["test"]}}
    assert report["altered"] == {"parse": {"line_truncated": sum(n["long"].values())}}
    descriptions = 18 + n["utf8"] + n["dup"] + sum(n["long"].values()) + n["overlap"]
    assert report["records"] == {"en": descriptions, "de": descriptions - n["utf8"] + n["orphan"]}
    assert report["source"] == f"raw_dir={tmp_path / 'raw'}" and set(report["files"]) == {"en", "de"}
    # 6 good descriptions per split give 2 pairs each; a long one keeps its synopsis pair, an overlapping one its
    # paragraph pair; unreadable, duplicate and orphan records give none.
    expected = {"train": 12 + n["long"]["train"], "validation": 12 + n["long"]["validation"] + n["overlap"],
                "test": 12 + n["long"]["test"]}
    assert report["examples"] == expected
    for split, count in expected.items():
        assert len(sources.get_source("ddtp/en_de", split, config["data_dir"], config["raw_dir"])[0]) == count
    (beside,) = pathlib.Path(config["data_dir"]).glob(f"{tfds_ddtp.CACHE_DIRNAME}/*/ddtp/en_de/1.0.0/"
                                                      f"{tfds_ddtp.REPORT_FILENAME}")
    assert json.loads(beside.read_text()) == report
    json.dumps(report)  # plain JSON
    # A second run reads the same counts from the copy (nothing is parsed again).
    again = pipeline.make_datasets(config, _CharTokenizer(), process_index=0, process_count=1)
    assert again.source_report == report


def test_the_bundled_snapshot_reports_its_recorded_counts(tmp_path):
    report = sources.source_report("ddtp/en_zh", str(tmp_path))
    with open(os.path.join(ddtp.SNAPSHOT_DIR, "counts.json")) as f:
        recorded = json.load(f)
    assert report["source"] == "the bundled snapshot"
    assert report["examples"] == recorded["examples"]["en_zh"]
    processing = recorded["processing"]
    assert report["skipped"]["parse"]["duplicate_md5_zh_CN"] == processing["duplicate_md5_zh_CN"]
    assert sum(report["skipped"][s].get("en_zh_duplicate", 0) for s in ddtp.SPLITS) == processing["en_zh_duplicate"]
    assert report["skipped"]["test"]["en_zh_test_overlap"] == processing["en_zh_test_overlap"]
    assert report["records"] == {"en": processing["records_en"], "zh_CN": processing["records_zh_CN"]}
    assert sources.source_report("lm1b", str(tmp_path)) == {}  # prepared by tfds build: nothing lconv parsed


class _CharTokenizer:
    def encode(self, text):
        return np.asarray([4 + ord(c) % 200 for c in text], np.int32)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


# ----------------------------------------------------------------------------------------------------------------
# 5. Unique temporary names: processes writing together do not collide
# ----------------------------------------------------------------------------------------------------------------
def test_two_processes_saving_the_tokenizer_at_once_do_not_collide(tmp_path, monkeypatch):
    """Another process's save runs between this one's write and rename (the window of a fixed temp name)."""
    tokenizer = tokenizer_lib.train_tokenizer([f"word{i % 50} and more words {i}" for i in range(300)], 300)
    renames = {"os.rename": os.rename, "os.replace": os.replace}
    interleaved = []

    def interleave(real):
        def move(src, dst, *args, **kwargs):
            if not interleaved:
                interleaved.append(src)
                tokenizer.save(str(tmp_path))  # the other process, start to end
            return real(src, dst, *args, **kwargs)
        return move

    monkeypatch.setattr(os, "rename", interleave(renames["os.rename"]))
    monkeypatch.setattr(os, "replace", interleave(renames["os.replace"]))
    tokenizer.save(str(tmp_path))
    assert interleaved
    assert os.listdir(tmp_path) == ["spm.model"]  # no temporary file left
    assert tokenizer_lib.load_tokenizer(str(tmp_path)).model_proto == tokenizer.model_proto


def test_two_processes_preparing_one_copy_at_once_both_succeed(tmp_path, monkeypatch):
    """Another process prepares the same copy from start to end while this one is half way."""
    data_dir, raw = str(tmp_path / "tfds"), _simple_raw(tmp_path / "raw", "alpha")
    real_load_tasks, nested = ddtp.load_tasks, []

    def load_tasks(*args, **kwargs):
        if not nested:
            nested.append(True)
            tfds_ddtp.prepare("ddtp/en_de", data_dir, raw_dir=raw)  # the other process
        return real_load_tasks(*args, **kwargs)

    monkeypatch.setattr(ddtp, "load_tasks", load_tasks)
    builder = tfds_ddtp.prepare("ddtp/en_de", data_dir, raw_dir=raw)
    assert nested and len(builder.as_data_source(split="train")) == 8
    assert [p for p in os.listdir(os.path.join(data_dir, tfds_ddtp.CACHE_DIRNAME)) if ".tmp-" in p] == []


@pytest.mark.slow  # launches processes: the slow tier
def test_two_real_processes_preparing_one_copy_at_once(tmp_path):
    raw = _simple_raw(tmp_path / "raw", "alpha")
    code = ("import sys, time; from lconv.data import tfds_ddtp; time.sleep(max(0, float(sys.argv[1]) - time.time()));"
            " b = tfds_ddtp.prepare('ddtp/en_de', sys.argv[2], raw_dir=sys.argv[3]);"
            " print(len(b.as_data_source(split='train')))")
    import time

    start = time.time() + 6  # both import tensorflow_datasets first, then start preparing together
    runs = [subprocess.Popen([sys.executable, "-c", code, str(start), str(tmp_path / "tfds"), raw], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == ["8", "8"]


@pytest.mark.slow  # launches processes: the slow tier
def test_two_real_processes_training_one_tokenizer_at_once_both_succeed(tmp_path):
    """Two runs (one process each) sharing data_dir and workdir, started together: both prepare the data and train,
    both save through their own temporary file, and both end with the same model, the one on disk."""
    code = ("import hashlib, sys, time; from lconv.data import pipeline;"
            " time.sleep(max(0, float(sys.argv[1]) - time.time()));"
            " config = dict(dataset='ddtp/en_zh', data_dir=sys.argv[2], vocab_size=1600, tokenizer_max_sentences=500);"
            " t = pipeline.load_or_train_tokenizer(config, sys.argv[3], process_index=0, process_count=1);"
            " print(hashlib.sha256(t.model_proto).hexdigest())")
    import hashlib
    import time

    start = time.time() + 6
    runs = [subprocess.Popen([sys.executable, "-c", code, str(start), str(tmp_path / "tfds"), str(tmp_path / "run")],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=240) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    digests = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert digests == {hashlib.sha256((tmp_path / "run" / "spm.model").read_bytes()).hexdigest()}
    assert os.listdir(tmp_path / "run") == ["spm.model"]


_JAX_PROCESS = """
import hashlib, json, os, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from lconv.data import pipeline
from lconv.errors import UserError
config, workdir = json.loads(sys.argv[3]), sys.argv[4]
for vocab_size in (config["vocab_size"], config["vocab_size"] + 1):  # then one the saved model was not trained for
    try:
        tokenizer = pipeline.load_or_train_tokenizer({**config, "vocab_size": vocab_size}, workdir)
        print("model", hashlib.sha256(tokenizer.model_proto).hexdigest(), flush=True)
    except UserError as e:
        print("error", e, flush=True)
"""


@pytest.mark.slow  # launches processes: the slow tier
def test_several_jax_processes_train_the_tokenizer_once_on_process_0_and_all_hold_it(tmp_path):
    """Process 1 has a data_dir with no data and a workdir of its own (hosts need not share one): it reads and
    writes nothing, receives process 0's model, and raises process 0's one-line error when there is one."""
    import hashlib
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    # 1,600: room for the ~1,100 Chinese characters of a sample of both sides (every k-th text once kept English only)
    config = dict(dataset="ddtp/en_zh", vocab_size=1600, tokenizer_max_sentences=500)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": helpers.xla_flags(2)}  # several devices per process, as in training
    runs = [subprocess.Popen([sys.executable, "-c", _JAX_PROCESS, f"localhost:{port}", str(i),
                              json.dumps({**config, "data_dir": str(tmp_path / f"tfds{i}")}),
                              str(tmp_path / f"run{i}")],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    lines = [[line for line in out.splitlines() if line.startswith(("model", "error"))] for out, _ in outputs]
    saved = hashlib.sha256((tmp_path / "run0" / "spm.model").read_bytes()).hexdigest()
    assert lines[0] == lines[1] and lines[0][0] == f"model {saved}", outputs
    assert lines[0][1] == (f"error vocab_size=1601 but {tmp_path / 'run0' / 'spm.model'} was trained for 1600; use "
                           "the same vocab_size or a fresh workdir")  # process 0's message, on both
    assert not (tmp_path / "tfds1").exists() and not (tmp_path / "run1").exists()  # process 1 touched nothing


# ----------------------------------------------------------------------------------------------------------------
# 6. python -m lconv.data: one line and exit code 2; the tokenizer's and the pipeline's own checks
# ----------------------------------------------------------------------------------------------------------------
def _data_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m lconv.data ARGS`` in this process: (exit code, stdout, stderr)."""
    return helpers.run_cli(capsys, "lconv.data", *args)


@pytest.mark.parametrize("args, named", [
    (["nonsense"], "'nonsense'"),
    (["en_de", "--vocab_size=0"], "--vocab_size=0"),
    (["en_de", "--batch_size=0"], "--batch_size=0"),
    (["en_de", "--max_sentences=0"], "--max_sentences=0"),
    (["en_de", "--batch_size=two"], "--batch_size"),
])
def test_data_cli_bad_arguments_are_one_line(tmp_path, args, named, capsys):
    helpers.one_line_error(_data_cli(capsys, *args, f"--data_dir={tmp_path}", f"--workdir={tmp_path / 'tok'}"),
                           named)
    assert not (tmp_path / "tok").exists()  # rejected before any work


def test_data_cli_defaults_are_the_ones_training_reads():
    """It prepared a second copy in /tmp with a 2,000-piece vocabulary while training read ~/tensorflow_datasets
    with the default config's 4,000 (issue 41)."""
    from lconv.configs import default
    from lconv.data import __main__ as data_main

    args, data = data_main._parse(["en_de"]), default.get_config().data
    assert (args.data_dir, args.vocab_size, args.max_sentences) == (data.data_dir, data.vocab_size,
                                                                      data.tokenizer_max_sentences)


@pytest.mark.slow  # launches processes: the slow tier
def test_python_m_lconv_data_as_a_process_is_one_line_with_exit_code_2(tmp_path):
    """The process boundary itself (the cases around it call the same main in this process)."""
    result = helpers.launch("-m", "lconv.data", "en_de", "--vocab_size=0", f"--data_dir={tmp_path}")
    helpers.one_line_error(result, "--vocab_size=0", str(tokenizer_lib.MIN_VOCAB_SIZE))


def test_data_cli_unprepared_catalog_dataset_is_one_line_with_the_command(tmp_path, capsys):
    message = helpers.one_line_error(_data_cli(capsys, "wmt14/en_de", f"--data_dir={tmp_path}",
                                               f"--workdir={tmp_path / 'tok'}"), "not prepared")
    assert f"tfds build wmt14_translate/de-en --data_dir={tmp_path}" in message


def test_data_cli_bad_raw_file_is_one_line_and_skip_counts_are_printed(tmp_path, capsys):
    n = _planted_corpus(tmp_path / "raw")
    common = [f"--raw_dir={tmp_path / 'raw'}", f"--data_dir={tmp_path / 'tfds'}", "--vocab_size=300"]
    code, out, err = _data_cli(capsys, "en_de", *common, f"--workdir={tmp_path / 'tok'}")
    assert code == 0, err
    assert f"invalid_utf8_record_de {n['utf8']}" in out
    assert f"en_de_validation_overlap {n['overlap']}" in out
    path = tmp_path / "raw" / "Translation-de.xz"
    path.write_bytes(path.read_bytes()[:64])
    helpers.one_line_error(_data_cli(capsys, "en_de", *common, f"--workdir={tmp_path / 'tok2'}"), str(path))


def test_tokenizer_minimum_vocab_size_is_the_real_one():
    texts = ["a"] * 20  # the fewest characters any text has: one, and the word boundary
    assert tokenizer_lib.train_tokenizer(texts, tokenizer_lib.MIN_VOCAB_SIZE).vocab_size == \
        tokenizer_lib.MIN_VOCAB_SIZE
    for vocab_size in (0, tokenizer_lib.MIN_VOCAB_SIZE - 1):
        with pytest.raises(UserError) as error:
            tokenizer_lib.train_tokenizer(texts, vocab_size)
        helpers.one_line_error(error, f"vocab_size={vocab_size}", str(tokenizer_lib.MIN_VOCAB_SIZE))
    with pytest.raises(UserError) as error:
        tokenizer_lib.train_tokenizer(texts, 300, max_sentences=0)
    assert "max_sentences=0" in helpers.one_line_error(error)


@pytest.mark.parametrize("field", ["batch_size", "eval_batch_size"])
def test_pipeline_rejects_zero_rows_in_one_line(tmp_path, field):
    config = {"dataset": "ddtp/en_de", "data_dir": str(tmp_path), field: 0}
    with pytest.raises(UserError) as error:
        pipeline.make_datasets(config, _CharTokenizer(), process_index=0, process_count=1)
    assert f"{field}=0" in helpers.one_line_error(error)
    assert os.listdir(tmp_path) == []  # checked before any data is read


def test_a_data_dir_that_is_a_file_is_one_line(tmp_path):
    """It was a 42-line NotADirectoryError traceback (named in round 4, still there in round 5)."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    for name, data_dir in (("ddtp/en_de", a_file), ("wmt14/en_de", a_file), ("ddtp/en_de", a_file / "below")):
        with pytest.raises(UserError) as error:
            sources.prepared_data_path(name, str(data_dir))
        helpers.one_line_error(error, f"config.data.data_dir={data_dir}", "not a directory")


@pytest.mark.slow  # a process launched and stopped mid-preparation: CI runs it, the quick command skips it
def test_sigterm_during_preparation_leaves_no_temporary_copy(tmp_path):
    """SIGTERM while a corpus was being prepared left its temporary folder behind forever."""
    import signal
    import time

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.Popen([sys.executable, "-m", "lconv.data", "en_de", f"--data_dir={tmp_path / 'tfds'}",
                            f"--workdir={tmp_path / 'tok'}"], cwd=helpers.ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    for line in run.stdout:  # the temporary copy exists once this is printed
        if line.startswith("Preparing"):
            break
    time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    prepared = tmp_path / "tfds" / tfds_ddtp.CACHE_DIRNAME
    assert run.returncode == -signal.SIGTERM, err[-2000:]
    assert not [p.name for p in prepared.iterdir() if ".tmp-" in p.name]
