"""lconv.console: how the programs show lconv's log (the lines ``print`` wrote before lconv used ``logging``), and
the training progress when stderr is a file."""
import io
import logging
import sys

import pytest

from lconv import console


@pytest.fixture
def restored():
    logger = logging.getLogger("lconv")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield logger
    logger.handlers[:], logger.propagate = saved[0], saved[2]
    logger.setLevel(saved[1])


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_each_message_is_one_plain_line_on_the_chosen_stream_once(stream, restored, capsys):
    console.show_log(stream)
    console.show_log(stream)  # a second program in the process: still one handler
    seen_by_root = []
    root_handler = logging.Handler()
    root_handler.emit = seen_by_root.append
    logging.getLogger().addHandler(root_handler)
    try:
        logging.getLogger("lconv.train.loop").info("resumed from step %d", 12)
        logging.getLogger("lconv.run.workdir").warning("gs://b/run is remote")
        logging.getLogger("lconv.train.loop").debug("not shown")
    finally:
        logging.getLogger().removeHandler(root_handler)
    out, err = capsys.readouterr()
    shown, other = (out, err) if stream == "stdout" else (err, out)
    assert shown == "resumed from step 12\nwarning: gs://b/run is remote\n" and other == ""
    assert seen_by_root == []  # absl's handler on the root would print each line a second time


def test_a_stream_is_stdout_or_stderr(restored):
    with pytest.raises(ValueError, match="stdout"):
        console.show_log("stdin")


def test_a_warning_under_the_users_own_logging_config_says_warning_once(restored):
    """The message carries no level of its own: ``logging.basicConfig``'s ``WARNING:lconv...:`` prefix is the
    only one (issue 41: it read ``WARNING:lconv...:warning: ...``)."""
    record = logging.LogRecord("lconv.infer.source_lengths", logging.WARNING, __file__, 1, "1 input cut to %d "
                               "tokens", (32,), None)
    assert logging.Formatter(logging.BASIC_FORMAT).format(record) == \
        "WARNING:lconv.infer.source_lengths:1 input cut to 32 tokens"
    assert console.line(record) == "warning: 1 input cut to 32 tokens"


def test_a_training_log_redirected_to_a_file_has_plain_lines_not_a_bar(restored, capsys, monkeypatch):
    """Under ``> train.log 2>&1`` the progress bar's carriage returns and cursor moves (``\\r``, ``ESC[A``) would
    fill the file: a plain line per log window instead."""
    from lconv.train import logs

    console.show_log("stdout")
    progress = logs.Progress(0, 10, None)  # pytest's stderr is no terminal
    progress.advance(1)
    progress.set_postfix(loss="3.210", ppl="24.8")
    progress.close()
    out, err = capsys.readouterr()
    assert out == "step 1/10 train: loss=3.210 ppl=24.8\n" and "\r" not in err and "\x1b[" not in err, (out, err)



class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_evaluation_pass_has_a_bar_with_its_eta_on_a_terminal_and_none_in_a_file(monkeypatch):
    for stream, shown in ((_Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        bar = console.pass_bar(4, "loss pass", "batch")
        bar.update(1)
        bar.refresh()
        text = stream.getvalue()
        bar.close()
        if shown:  # tqdm's "n/total [elapsed<remaining": the ETA
            assert "loss pass" in text and "1/4 [" in text and "<" in text.split("1/4 [", 1)[1], text
        else:
            assert stream.getvalue() == ""


@pytest.fixture
def bars(monkeypatch):
    """The bars ``console.pass_bar`` makes, each recording its arguments, its updates and whether it closed."""
    made = []

    class Bar:
        def __init__(self, total, desc, unit):
            self.args, self.done, self.closed = (total, desc, unit), 0, False
            made.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(console, "pass_bar", Bar)
    return made


def test_a_splits_decoding_pass_counts_its_sentences_on_the_bar(monkeypatch, bars):
    """score_split's decoding (the final evaluation's and eval.py --split's) feeds a ``pass_bar`` of the split's
    sentences, padding rows not counted, and closes it when a time budget stops the pass."""
    import types

    import numpy as np

    from lconv.deadline import Deadline
    from lconv.infer import batching, split_scoring

    batches = [({"example_index": np.array([2, 0, -1])}, [[5], [6], [0]]),
               ({"example_index": np.array([1, 3, -1])}, [[7], [8], [0]])]
    monkeypatch.setattr(batching, "decode_batches", lambda *args, **kwargs: iter(batches))
    eval_set = types.SimpleNamespace(tokens=[None] * 4)
    tokenizer = types.SimpleNamespace(detokenize=lambda ids: f"w{ids[0]}")
    found = split_scoring._decode(None, None, None, tokenizer, eval_set, None, "test", None, None)
    assert found == {2: "w5", 0: "w6", 1: "w7", 3: "w8"}
    assert bars[0].args == (4, "decoding test", "sentence") and bars[0].done == 4 and bars[0].closed
    stopped = split_scoring._decode(None, None, None, tokenizer, eval_set, None, "test", None,
                                    Deadline(0.0, "train.max_minutes", clock=lambda: 1.0))
    assert len(stopped) == 2 and bars[1].done == 2 and bars[1].closed


def test_eval_pys_file_decoding_counts_its_lines_on_a_bar_and_the_apis_has_none(monkeypatch, bars):
    """``per_line.translate_lines`` with ``progress`` (eval.py --source_file) feeds a bar of the lines it decodes
    (a blank line is not decoded); without it (the API's calls) no bar is made."""
    import types

    import numpy as np
    import tiny_config
    import tiny_runs

    from lconv.decode_settings import DecodeSettings
    from lconv.infer import batching, per_line
    from lconv.run import schema

    def decode_batches(config, model, params, eval_set, settings, translator=None, per_batch=None):
        found = types.SimpleNamespace(tokens=np.array([[[5, 1]], [[6, 1]], [[0, 0]]]))
        yield {"example_index": np.array([1, 0, -1])}, found

    monkeypatch.setattr(batching, "decode_batches", decode_batches)
    config, translator = schema.validate_config(tiny_config.get_config()), types.SimpleNamespace(hypotheses=None)
    settings = DecodeSettings.build(config.decode)
    sources = ["Fast tool.", "", "A library."]
    for progress in ("decoding in.txt", None):
        per_line.translate_lines(config.infer, None, None, tiny_runs.tokenizer(), sources, settings,
                                 translator=translator, progress=progress)
    assert len(bars) == 1 and bars[0].args == (2, "decoding in.txt", "line") and bars[0].done == 2 and bars[0].closed


def test_sample_outputs_show_the_escape_sequences_of_a_text_and_never_send_them():
    from lconv.infer import reports

    text = "hello \x1b]0;TITLE\x07\x1b[2J\x1b[31mred\tend"
    scores = {"split": "test", "bleu": 1.0, "bleu_signature": "s", "examples": 1, "sentences_per_s": 1.0}
    report = reports.format_report(scores, [text], [text], [text], num_print=1)
    assert not set(report) & {"\x1b", "\x07"}
    assert "hello \\x1b]0;TITLE\\x07\\x1b[2J\\x1b[31mred\tend" in report
    assert reports.lines_text([text]) == text + "\n"  # the hypothesis file keeps the text as it is


def test_a_log_line_shows_the_escape_sequences_of_a_name_and_never_sends_them(restored, capsys):
    console.show_log("stdout")
    logging.getLogger("lconv.data.catalog").info("Prepared %s in %s", "wmt\x1b]0;TITLE\x07", "/data/\x1b[2Jred\x9b")
    out, _ = capsys.readouterr()
    assert out == "Prepared wmt\\x1b]0;TITLE\\x07 in /data/\\x1b[2Jred\\x9b\n"


def test_printable_escapes_control_characters_and_keeps_lines():
    """What the CLIs print and the study's results.md hold: a record's ESC sequences shown, never acted on."""
    assert console.printable("cpu \x1b[2J done\ttab\nnext\x7f") == "cpu \\x1b[2J done\ttab\nnext\\x7f"
