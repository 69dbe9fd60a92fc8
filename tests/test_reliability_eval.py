"""eval.py's reliability: every bad input is one line naming the flag or file (exit code 2), raised before
anything is loaded or compiled, and nothing in a text file is changed or dropped silently (non-UTF-8 bytes, blank
lines, over-long lines, an empty file)."""
from __future__ import annotations

import json
import pathlib

import helpers
import pytest
import sacrebleu
import tiny_config

from lconv.cli import eval_program
from lconv.data import tokenizer as tokenizer_lib
from lconv.data.data_config import DataConfig
from lconv.errors import UserError
from lconv.infer import scoring, source_lengths
from lconv.run import restore


@pytest.fixture
def trained(tiny_run):
    """The shared tiny translation run (tests/conftest.py), for every test here that decodes; read-only (every
    output below goes to tmp_path)."""
    return tiny_run.workdir


@pytest.fixture
def config_only(tmp_path, monkeypatch) -> pathlib.Path:
    """A workdir holding only a translation run's config.json, and a ``load_trained`` that fails the test: an
    error raised here was raised before anything was loaded."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(tiny_config.get_config().to_json())

    def load_trained(*args, **kwargs):
        raise AssertionError("load_trained was called before the input was checked")

    monkeypatch.setattr(restore, "load_trained", load_trained)
    return workdir


def _eval_py(capsys, *args: str) -> tuple[int, str, str]:
    """``python eval.py ARGS`` in this process (test_cli.py launches it as a process)."""
    return helpers.run_cli(capsys, "eval.py", *args)


# ----------------------------------------------------------------------------------------------------------------
# Flags: checked before the workdir is even read
# ----------------------------------------------------------------------------------------------------------------
_BAD_FLAGS = [
    (dict(beam_size=0), "--beam_size=0: must be >= 1 (1 = greedy)"),
    (dict(beam_size=-2), "--beam_size=-2: must be >= 1 (1 = greedy)"),
    (dict(lenpen=-0.5), "--lenpen=-0.5: must be a number in [0, 10]"),
    (dict(lenpen=float("nan")), "--lenpen=nan: must be a number in [0, 10]"),
    (dict(lenpen=float("inf")), "--lenpen=inf: must be a number in [0, 10]"),
    (dict(average_last=-3), "--average_last=-3: must be >= 1"),
    (dict(average_last=0), "--average_last=0: must be >= 1"),
]


@pytest.mark.parametrize("flags, message", _BAD_FLAGS)
def test_bad_flags_are_rejected_before_the_workdir_is_read(flags, message, tmp_path):
    with pytest.raises(UserError) as info:
        eval_program.run(str(tmp_path / "no_such_run"), **flags)  # a workdir read first would fail on its config.json
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("flag, message", [("--beam_size=0", "--beam_size=0: must be >= 1"),
                                           ("--lenpen=nan", "--lenpen=nan: must be a number in [0, 10]"),
                                           ("--average_last=-3", "--average_last=-3: must be >= 1")])
def test_eval_py_prints_a_bad_flag_in_one_line(flag, message, tmp_path, capsys):
    assert helpers.one_line_error(_eval_py(capsys, f"--workdir={tmp_path}", flag), flag).startswith(message)


def test_an_lm_run_refuses_references_for_its_prompts_before_loading(config_only):
    """An LM run continues --source_file's prompts; references have nothing to score against."""
    config = json.loads((config_only / "config.json").read_text())
    (config_only / "config.json").write_text(json.dumps({**config, "task": "lm"}))
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=str(config_only / "config.json"),
                     reference_file=str(config_only / "config.json"))
    assert helpers.one_line_error(error, "--reference_file", "--source_file").startswith("--reference_file")


def test_reference_and_output_files_without_a_source_file_are_not_ignored(config_only):
    for flag, value in (("reference_file", "ref.de"), ("output_file", "out.de")):
        with pytest.raises(UserError) as error:
            eval_program.run(str(config_only), split="validation", **{flag: value})
        assert helpers.one_line_error(error, f"--{flag}", "--source_file").startswith(f"--{flag}")


# ----------------------------------------------------------------------------------------------------------------
# Input files: read whole and checked before loading
# ----------------------------------------------------------------------------------------------------------------
def test_a_non_utf8_byte_names_the_file_line_and_byte_offset(config_only, tmp_path, capsys):
    source = tmp_path / "latin1.en"
    source.write_bytes("first line\nsecond line, café ok\n".encode("latin-1"))
    expected = (f"--source_file={source}: line 2, byte offset 16: 0xe9 is not UTF-8 (invalid continuation byte); "
                f"convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    with pytest.raises(UserError) as info:
        eval_program.run(str(config_only), source_file=str(source))
    assert str(info.value) == expected
    assert helpers.one_line_error(_eval_py(capsys, f"--workdir={config_only}", f"--source_file={source}")) == expected


def test_a_bad_reference_file_is_named_too(config_only, tmp_path):
    (tmp_path / "in.en").write_text("one\ntwo\n")
    (tmp_path / "ref.de").write_bytes(b"eins\n\xffzwei\n")
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=str(tmp_path / "in.en"), reference_file=str(tmp_path / "ref.de"))
    helpers.one_line_error(error, f"--reference_file={tmp_path / 'ref.de'}", "line 2", "byte offset 0", "0xff")
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=str(tmp_path / "missing.en"))
    helpers.one_line_error(error, f"--source_file={tmp_path / 'missing.en'}", "No such file")
    (tmp_path / "short.de").write_text("eins\n")
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=str(tmp_path / "in.en"),
                         reference_file=str(tmp_path / "short.de"))
    helpers.one_line_error(error, "--reference_file", "1 lines", "2 source lines", str(tmp_path / "short.de"))


def test_lines_end_at_newlines_and_a_crlf_loses_its_cr(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes("a b\r\nc\rd\n\n  \nlast, no newline: ü".encode())
    assert eval_program.read_lines(str(path), "--source_file") == ["a b", "c\rd", "", "  ", "last, no newline: ü"]
    path.write_bytes(b"")
    assert eval_program.read_lines(str(path), "--source_file") == []


# ----------------------------------------------------------------------------------------------------------------
# Outputs: writability checked before loading, not after decoding
# ----------------------------------------------------------------------------------------------------------------
def test_an_output_file_that_cannot_be_written_is_an_error_before_loading(config_only, tmp_path, capsys):
    (tmp_path / "in.en").write_text("one line\n")
    source = str(tmp_path / "in.en")
    missing = tmp_path / "no_such_dir" / "out.de"
    expected = f"cannot write --output_file={missing}: the directory {missing.parent} does not exist"
    with pytest.raises(UserError) as info:
        eval_program.run(str(config_only), source_file=source, output_file=str(missing))
    assert str(info.value) == expected
    assert helpers.one_line_error(_eval_py(capsys, f"--workdir={config_only}", f"--source_file={source}",
                                           f"--output_file={missing}")) == expected
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=source, output_file=str(tmp_path))
    helpers.one_line_error(error, f"--output_file={tmp_path}:", "a directory")
    (config_only / "output.txt").mkdir()  # the default output, <workdir>/output.txt, cannot be a file
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=source)
    helpers.one_line_error(error, f"--output_file={config_only / 'output.txt'}")



def test_an_existing_output_in_a_folder_that_takes_no_new_file_is_an_error_before_loading(config_only, tmp_path,
                                                                                           monkeypatch):
    """The writer puts a temporary file beside the output and renames it over: a writable file in a folder that
    takes no new file (read-only to this user, or /proc) failed only after decoding, naming the wrong reason."""
    import tempfile

    (tmp_path / "in.en").write_text("one line\n")
    (tmp_path / "out.de").write_text("earlier\n")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=str(tmp_path / "in.en"), output_file=str(tmp_path / "out.de"))
    helpers.one_line_error(error, f"cannot write --output_file={tmp_path / 'out.de'}", "Permission denied")
    assert (tmp_path / "out.de").read_text() == "earlier\n"

def test_a_split_whose_outputs_cannot_be_written_is_an_error_before_loading(config_only):
    (config_only / "validation.hyp.txt").mkdir()
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), split="validation")
    helpers.one_line_error(error, str(config_only / "validation.hyp.txt"), "--workdir", "a directory")


def test_a_read_only_directory_is_an_error_before_loading(config_only, tmp_path):
    # /sys is read-only for every user, root included (a chmod'ed directory would not stop root).
    (tmp_path / "in.en").write_text("one line\n")
    with pytest.raises(UserError) as error:
        eval_program.run(str(config_only), source_file=str(tmp_path / "in.en"), output_file="/sys/out.de")
    helpers.one_line_error(error, "--output_file=/sys/out.de", "Permission denied")


# ----------------------------------------------------------------------------------------------------------------
# Decoding a text file: empty files, blank lines and over-long lines are reported, outputs stay line-aligned
# ----------------------------------------------------------------------------------------------------------------
def test_an_empty_source_file_gives_an_empty_output_and_no_score(trained, tmp_path, lconv_log):
    (tmp_path / "empty.en").write_text("")
    (tmp_path / "empty.de").write_text("")
    scores = eval_program.run(str(trained), source_file=str(tmp_path / "empty.en"),
                          reference_file=str(tmp_path / "empty.de"), output_file=str(tmp_path / "out.de"))
    assert (tmp_path / "out.de").read_text() == ""
    assert scores["examples"] == 0 and "bleu" not in scores
    assert any("has no lines" in m and "nothing to score" in m for m in lconv_log()), lconv_log()
    assert f"outputs written to {tmp_path / 'out.de'}" in lconv_log()  # where, said (issue 41)


def test_blank_and_overlong_lines_are_kept_in_place_counted_and_reported(trained, tmp_path, lconv_log):
    long_line = " ".join(["word"] * 5000)
    sources = ["This package contains the documentation.", "", long_line, "   ", "A library for parsing XML."]
    references = ["Dieses Paket enthält die Dokumentation.", "Leer.", "Wort", "", "Eine Bibliothek für XML."]
    (tmp_path / "in.en").write_text("\n".join(sources) + "\n")
    (tmp_path / "ref.de").write_text("\n".join(references) + "\n")
    scores = eval_program.run(str(trained), source_file=str(tmp_path / "in.en"),
                              reference_file=str(tmp_path / "ref.de"), output_file=str(tmp_path / "out.de"),
                              beam_size=2)
    hypotheses = (tmp_path / "out.de").read_text().split("\n")[:-1]
    assert len(hypotheses) == 5 and hypotheses[1] == hypotheses[3] == ""  # blank in, blank out, in place
    assert all(hypotheses[i] for i in (0, 2, 4))  # the others were decoded (the tiny model never stops at once)
    limit = tiny_config.get_config().data.eval_max_input_length
    longest = len(tokenizer_lib.load_tokenizer(str(trained)).encode(long_line)) + 1  # EOS included
    assert longest > 5000 > limit
    assert {k: scores[k] for k in ("examples", "blank_sources", "truncated_sources", "longest_source_tokens",
                                   "source_token_limit")} == {
        "examples": 5, "blank_sources": 2, "truncated_sources": 1, "longest_source_tokens": longest,
        "source_token_limit": limit}
    # Blank sources stay in the scored corpus as empty hypotheses.
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    assert "2 blank source lines (lines 2, 4): empty outputs in place; scored as empty hypotheses" in lconv_log()
    (cut,) = [m for m in lconv_log() if "cut to" in m]  # the rule of every surface: which line, how much
    assert f"line 3 had {longest}" in cut and f"cut to {limit} tokens" in cut and cut.startswith("warning:")
    assert json.loads(lconv_log()[-1])["blank_sources"] == 2  # the log's JSON line carries the counts too


def test_measure_sources_counts_what_decoding_cuts(trained):
    tokenizer = tokenizer_lib.load_tokenizer(str(trained))
    lengths = [len(tokenizer.encode(s)) + 1 for s in ("a", "a b c d e f g", "word " * 40)]
    limit = lengths[1]  # exactly at the limit is not cut
    measured = source_lengths.measure_sources(tokenizer, ["a", "a b c d e f g", "word " * 40], limit)
    assert measured.truncated == [2] and measured.longest == lengths[2] > limit and measured.cut_from == [lengths[2]]
    assert measured.counts() == {"truncated_sources": 1, "longest_source_tokens": lengths[2],
                                 "source_token_limit": limit}
    assert source_lengths.measure_sources(tokenizer, [], 8).counts()["longest_source_tokens"] == 0
    assert scoring.score_texts("translation", [], []) == {}


def test_a_split_holding_other_examples_than_the_run_recorded_is_said_and_kept_in_the_scores(tiny_run, tmp_path,
                                                                                              lconv_log):
    """A data_dir prepared by someone else, its test and validation swapped, was scored as the run's test split
    without a word (round-23 campaign, r23-8): the split's count against the run's data_report.json is now a
    warning and a pair of counts in the scores."""
    workdir = helpers.copy_run(tiny_run, tmp_path / "run")
    data = DataConfig.from_config(json.loads((workdir / "config.json").read_text())["data"])
    assert eval_program._split_as_recorded(data, str(workdir), "test") == {}  # the run's own copy: nothing to say
    report = json.loads((workdir / "data_report.json").read_text())
    recorded = report["examples"]["test"]
    report["examples"]["test"] = recorded + 28
    (workdir / "data_report.json").write_text(json.dumps(report))
    assert eval_program._split_as_recorded(data, str(workdir), "test") == {
        "examples_in_split": recorded, "examples_recorded_by_run": recorded + 28}
    assert any(f"holds {recorded:,} examples, where this run's data_report.json recorded {recorded + 28:,}" in line
               for line in lconv_log())
    (workdir / "data_report.json").unlink()  # a run with no report (a catalog dataset's): nothing to compare
    assert eval_program._split_as_recorded(data, str(workdir), "test") == {}
