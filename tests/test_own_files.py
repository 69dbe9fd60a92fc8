"""Your own data (``data.dataset="files"``, lconv/data/own_files.py): every format gives the examples its raw lines
hold, every bad file is one error line naming it, and a tiny run trains from a folder and names it in its log."""
import collections
import json
import os

import helpers
import pytest

from lconv.data import own_files, sources
from lconv.data.data_config import DataConfig
from lconv.errors import UserError

PAIRS = [("ka lo mi", "IM OL AK"), ("ze ta", "AT EZ"), ("", ""), ("ru po ne", "EN OP UR"), ("  si va ", "AV IS")]
KEPT = [("ka lo mi", "IM OL AK"), ("ze ta", "AT EZ"), ("ru po ne", "EN OP UR"), ("si va", "AV IS")]  # stripped


def _write_pairs(folder, fmt, pairs=PAIRS, stems=("train", "valid", "test"), codes=("xx", "yy")):
    folder.mkdir(exist_ok=True)
    for stem in stems:
        if fmt == "text":
            for side, code in enumerate(codes):
                (folder / f"{stem}.{code}").write_text("".join(f"{pair[side]}\n" for pair in pairs), "utf-8")
        elif fmt == "tsv":
            header = "\t".join(codes) + "\n"
            (folder / f"{stem}.tsv").write_text(header + "".join(f"{s}\t{t}\n" if s or t else "\n"
                                                                 for s, t in pairs), "utf-8")
        else:
            (folder / f"{stem}.jsonl").write_text("".join(
                json.dumps({codes[0]: s, codes[1]: t, "id": i}) + "\n" for i, (s, t) in enumerate(pairs)), "utf-8")
    return folder


def _config(folder, **fields):
    values = dict(dataset="files", raw_dir=str(folder), source_lang="xx", target_lang="yy",
                  data_dir=str(folder.parent / "tfds"))
    return DataConfig.from_config({**values, **fields})


def _read(config, split="train"):
    layout = sources.files_layout(config)
    counts = collections.Counter()
    examples = list(own_files.read_examples(layout, own_files.find_files(layout)[split], counts))
    return examples, counts


@pytest.mark.parametrize("fmt", ["text", "tsv", "jsonl"])
def test_each_pair_format_gives_the_raw_lines_as_examples(fmt, tmp_path):
    examples, counts = _read(_config(_write_pairs(tmp_path / fmt, fmt)))
    assert [(e["xx"], e["yy"]) for e in examples] == KEPT
    assert counts["empty_line" if fmt == "tsv" else "empty_pair"] == 1  # a blank TSV line; two empty texts
    assert counts["header_line"] == (fmt == "tsv")


def test_a_language_model_reads_lines_or_blank_line_separated_documents(tmp_path):
    folder = tmp_path / "lm"
    folder.mkdir()
    lines = ["the first line", "its second line", "", "", "another document"]
    for stem in ("train", "valid", "test"):
        (folder / f"{stem}.txt").write_bytes("".join(f"{line}\r\n" for line in lines).encode())  # Windows ends
    texts, counts = _read(_config(folder, source_lang=None, target_lang=None))
    assert [e["text"] for e in texts] == ["the first line", "its second line", "another document"]
    assert counts["empty_line"] == 2 and counts["records_train.txt"] == len(lines)
    documents, _ = _read(_config(folder, source_lang=None, target_lang=None, stream=True))
    assert [e["text"] for e in documents] == ["the first line its second line", "another document"]
    for stem in ("train", "valid", "test"):  # JSON lines for a language model: {"text": ...}
        (folder / f"{stem}.txt").unlink()
        (folder / f"{stem}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines if t))
    assert _read(_config(folder, source_lang=None, target_lang=None))[0] == texts


def test_prepared_files_keep_their_order_and_name_the_data_in_the_report(tmp_path):
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    folder = _write_pairs(tmp_path / "zed", "text", stems=("train", "validation", "test"))
    config = _config(folder)
    source, input_key, target_key = sources.config_source(config, "test")
    assert (input_key, target_key) == ("xx", "yy")
    assert [(source[i]["xx"].decode(), source[i]["yy"].decode()) for i in range(len(source))] == KEPT
    report = sources.config_report(config)
    assert report["dataset"] == "zed" and report["skipped"] == {s: {"empty_pair": 1} for s in ("train", "validation",
                                                                                              "test")}
    assert sources.describe_report(report)[0].startswith("zed prepared from raw_dir=")
    named = _config(folder, name="my corpus")
    assert sources.display_name(named) == "my corpus" and "files_my_corpus-" in sources.config_data_path(named)


def _bad(tmp_path, case):
    """A folder with one bad file (case), and the names its error must hold."""
    folder = _write_pairs(tmp_path / "bad", "text")
    train_xx = folder / "train.xx"
    if case == "ragged":
        train_xx.write_text("one more\n" + train_xx.read_text())
        return folder, ["train.xx", "6 lines", "train.yy", "5"]
    if case == "not utf-8":
        train_xx.write_bytes(b"ka lo\nze \xe9t\xe9\n" + b"x\n" * 3)
        return folder, ["train.xx", "line 2", "UTF-8"]
    if case == "empty split":
        (folder / "valid.xx").write_text("\n\n")
        (folder / "valid.yy").write_text("\n\n")
        return folder, ["valid.xx", "valid.yy", "no example"]
    if case == "missing split":
        (folder / "test.xx").unlink()
        (folder / "test.yy").unlink()
        return folder, ["no test split", "test.xx + test.yy", "eval_splits"]
    if case == "half a pair":
        (folder / "train.yy").unlink()
        return folder, ["train.xx", "train.yy"]
    if case == "two formats":
        (folder / "train.tsv").write_text("a\tb\n")
        return folder, ["train.xx", "train.tsv", "keep one"]
    if case == "wrong codes":
        return folder, ["no train split", "train.de + train.en", "train.xx"]
    if case == "a device":  # a link to /dev/zero: hashed or read, it never ends
        train_xx.unlink()
        train_xx.symlink_to("/dev/zero")
        return folder, ["train.xx", "not a regular file"]
    if case == "a link out":  # a run from elsewhere naming its raw_dir: /etc/hostname was read and shown
        (tmp_path / "outside.txt").write_text("secret\n")
        (folder / "test.xx").unlink()
        (folder / "test.xx").symlink_to(tmp_path / "outside.txt")
        return folder, ["test.xx", "leads out of", str(folder)]
    (folder / "train.xx").unlink()
    (folder / "train.yy").unlink()
    if case == "tsv columns":
        (folder / "train.tsv").write_text("a\tb\nc\td\te\n")
        return folder, ["train.tsv", "line 2", "3 tab-separated columns"]
    if case == "not json":
        (folder / "train.jsonl").write_text('{"xx": "a", "yy": "b"}\n{"xx": "a",\n')
        return folder, ["train.jsonl", "line 2", "not JSON"]
    if case == "lone surrogate":  # valid JSON, no valid text: an 81-line tfds UnicodeEncodeError (round 13)
        (folder / "train.jsonl").write_text('{"xx": "a", "yy": "b"}\n{"xx": "a\\u0000b\\ud800", "yy": "x"}\n')
        return folder, ["train.jsonl", "line 2", "'xx'", "lone surrogate"]
    (folder / "train.jsonl").write_text('{"xx": "a", "yy": "b"}\n{"xx": "a", "target": "b"}\n')
    return folder, ["train.jsonl", "line 2", "'yy'"]


@pytest.mark.parametrize("case", ["ragged", "not utf-8", "empty split", "missing split", "half a pair", "two formats",
                                  "wrong codes", "a device", "a link out", "tsv columns", "not json", "lone surrogate",
                                  "missing key"])
def test_each_bad_file_is_one_error_line_naming_it(case, tmp_path, capsys):
    folder, named = _bad(tmp_path, case)
    codes = ("de", "en") if case == "wrong codes" else ("xx", "yy")
    # python -m lconv.data files ...: the folder prepared as training prepares it (tfds writing it), in this process
    outcome = helpers.run_cli(capsys, "lconv.data", "files", f"--raw_dir={folder}", f"--source_lang={codes[0]}",
                              f"--target_lang={codes[1]}", f"--data_dir={tmp_path / 'tfds'}",
                              f"--workdir={tmp_path / 'tokenizer'}")
    helpers.one_line_error(outcome, *named)
    assert not list((tmp_path / "tfds" / "lconv_prepared").glob("*/files"))  # no half-prepared copy left


def test_the_config_says_what_your_files_need(tmp_path):
    from lconv.configs import files
    from lconv.run import schema

    with pytest.raises(UserError) as error:  # translation without its codes
        schema.validate_config(files.get_config())
    helpers.one_line_error(error, "config.task='translation'", "source_lang", "target_lang")
    with pytest.raises(UserError) as error:
        config = files.get_config("lm")
        config.data.source_lang = "xx"
        schema.validate_config(config)
    helpers.one_line_error(error, "config.data.source_lang='xx'", "task=lm")
    with pytest.raises(ValueError) as error:
        _config(tmp_path, source_lang="a.b")
    helpers.one_line_error(error, "source_lang")
    with pytest.raises(UserError) as error:
        sources.files_layout(_config(tmp_path, raw_dir=None))
    helpers.one_line_error(error, "config.data.raw_dir")


@pytest.mark.slow  # trains a tiny model in this process and runs train.py in it: compiles for many seconds
def _pairs_folder(root, sizes, target):
    """``root/zed`` holding train/valid/test ``.src`` files of ``sizes`` of the tiny runs' sentences and ``.tgt``
    files of ``target(sentence)``, line by line."""
    import tiny_runs

    folder = root / "zed"
    folder.mkdir()
    texts, start = tiny_runs.sentences(sum(sizes)), 0
    for stem, size in zip(("train", "valid", "test"), sizes):
        part, start = texts[start:start + size], start + size
        (folder / f"{stem}.src").write_text("".join(f"{text}\n" for text in part))
        (folder / f"{stem}.tgt").write_text("".join(f"{target(text)}\n" for text in part))
    return folder


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_a_tiny_run_trains_from_a_folder_and_names_it_everywhere(tmp_path, lconv_log, capsys):
    import jax
    import tiny_config

    from lconv.train import loop

    folder = _pairs_folder(tmp_path, (200, 20, 20), lambda text: " ".join(reversed(text.split())))
    config = tiny_config.training_config(tmp_path / "tfds", num_steps=3, eval_every=3)
    config.data.update(dict(dataset="files", raw_dir=str(folder), source_lang="src", target_lang="tgt"))
    result = loop.train_and_evaluate(config, str(tmp_path / "run"), devices=jax.devices("cpu")[:1])
    log = "\n".join(lconv_log())
    assert "SentencePiece model on up to 2,000 training texts of zed ..." in log and "tokenizer: trained in" in log
    assert "not the 512 config.data.vocab_size asks for" in log  # 200 short sentences give fewer pieces
    assert "zed prepared from raw_dir=" in log
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["dataset"] == "zed" and report["examples"] == {"train": 200, "validation": 20, "test": 20}
    assert 0 < result["validation"]["loss"] < 20
    # The same folder through train.py with a ragged pair: one error line naming both files.
    (folder / "train.tgt").write_text("one line\n")
    outcome = helpers.run_cli(capsys, "train.py", "--config=tests/tiny_config.py", f"--workdir={tmp_path / 'bad'}",
                              f"--config.data.data_dir={tmp_path / 'tfds'}", "--config.data.dataset=files",
                              f"--config.data.raw_dir={folder}", "--config.data.source_lang=src",
                              "--config.data.target_lang=tgt")
    helpers.one_line_error(outcome, "train.src", "200 lines", "train.tgt")


def test_a_small_corpus_tokenizer_kept_for_later_runs_is_reused_though_it_has_fewer_pieces(tmp_path, lconv_log):
    """SentencePiece gives a small corpus fewer pieces than asked; the copy kept under data_dir was refused for
    that (its size is not data.vocab_size) and trained again, with a warning, on every later run."""

    from lconv.data import pipeline

    folder = _pairs_folder(tmp_path, (40, 10, 10), str.upper)
    config = _config(folder, source_lang="src", target_lang="tgt", vocab_size=2000)
    first = pipeline.load_or_train_tokenizer(config, str(tmp_path / "run1"))
    assert first.vocab_size < 2000
    second = pipeline.load_or_train_tokenizer(config, str(tmp_path / "run2"))
    log = lconv_log()
    assert second.to_bytes() == first.to_bytes()
    assert len([line for line in log if "tokenizer: training" in line]) == 1 and any("reused" in line for line in log)
    assert not [line for line in log if "not used" in line]


def _memory(monkeypatch, available):
    from lconv.data import paths

    monkeypatch.setattr(paths, "available_memory", lambda: available)


def test_a_file_too_big_for_memory_is_one_line_before_it_is_hashed_or_read(tmp_path, capsys, monkeypatch):
    """A 15 GB train.en under READ_LIMIT: eval.py of a stored run hashed it for 53 s, then read it whole into a
    71-line MemoryError traceback (round-9 campaign). With no copy of the folder yet in data_dir, nothing is hashed."""
    from lconv.data import tfds_ddtp

    folder = _write_pairs(tmp_path / "big", "text")
    os.truncate(folder / "train.xx", 1 << 20)  # sparse: nothing is written, and nothing may read it
    _memory(monkeypatch, 4 * (1 << 19))  # room for half of it, held own_files.READ_COPIES times over
    monkeypatch.setattr(tfds_ddtp, "_sha256", lambda path: pytest.fail("a file was hashed"))
    outcome = helpers.run_cli(capsys, "lconv.data", "files", f"--raw_dir={folder}", "--source_lang=xx",
                              "--target_lang=yy", f"--data_dir={tmp_path / 'tfds'}", f"--workdir={tmp_path / 'tok'}")
    helpers.one_line_error(outcome, str(folder / "train.xx"), "1,048,576 bytes", "memory")
    assert not (tmp_path / "tfds").exists()


def test_with_a_copy_in_data_dir_a_file_too_big_is_refused_before_any_split_is_read(tmp_path, monkeypatch):
    """Another copy of the folder may be the one asked for (only the hashes tell): the files are hashed, and a split
    too big for memory is refused before any split's file is read."""
    from lconv.data import tfds_ddtp

    folder = _write_pairs(tmp_path / "big", "text")
    config = _config(folder)
    (tmp_path / "tfds" / tfds_ddtp.CACHE_DIRNAME / "files_big-0123456789abcdef").mkdir(parents=True)
    _memory(monkeypatch, 4 * 20)  # the split's two files together are 62 bytes
    monkeypatch.setattr(own_files, "_split_lines", lambda *a: pytest.fail("a file was read"))
    with pytest.raises(UserError) as error:
        sources.config_source(config, "test")
    helpers.one_line_error(error, "big/train.", "with its partner", "memory")
    assert not list((tmp_path / "tfds").glob(f"{tfds_ddtp.CACHE_DIRNAME}/*/files"))


def test_running_out_of_memory_reading_a_file_is_one_line(tmp_path, monkeypatch):
    from lconv.data import paths

    folder = _write_pairs(tmp_path / "oom", "text")
    assert paths.memory_read_limit(4) <= paths.READ_LIMIT
    _memory(monkeypatch, None)  # not known: lconv's READ_LIMIT alone
    assert paths.memory_read_limit(4) == paths.READ_LIMIT

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(paths, "read_bytes", no_memory)
    with pytest.raises(UserError) as error:
        own_files.read_lines(str(folder / "train.xx"), collections.Counter())
    helpers.one_line_error(error, str(folder / "train.xx"), "out of memory")
