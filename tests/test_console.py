"""lconv.console: how the programs show lconv's log (the lines ``print`` wrote before lconv used ``logging``)."""
import logging

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
        logging.getLogger("lconv.train.workdir").warning("warning: gs://b/run is remote")
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
