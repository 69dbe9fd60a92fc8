"""Faults during a run, in-process on a copy of the shared tiny run (tests/conftest.py): a disk that fills up is
one line naming the last good checkpoint, and SIGTERM during the final validation or test decoding stops the run
cleanly (the final checkpoint is saved before them) instead of killing it."""
from __future__ import annotations

import _thread
import errno
import os
import resource
import signal
import sys
import threading

import helpers
import jax
import pytest
import tiny_config

from lconv.errors import UserError
from lconv.run import checkpoints, integrity, loss_pass
from lconv.train import loop

_ONE_DEVICE = jax.devices("cpu")[:1]  # the shared run's


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_a_full_disk_is_one_line_naming_the_last_good_checkpoint(tiny_run, tmp_path, monkeypatch, capsys):
    workdir = helpers.copy_run(tiny_run, tmp_path / "full")
    write_manifest = integrity.write_manifest

    def no_space_from_step_8(step_dir):  # the device fills up while step 8 is written
        if int(os.path.basename(step_dir)) >= 8:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(step_dir, integrity.MANIFEST_FILENAME))
        write_manifest(step_dir)

    monkeypatch.setattr(integrity, "write_manifest", no_space_from_step_8)
    with pytest.raises(UserError) as error:
        loop.train_and_evaluate(tiny_config.training_config(tiny_run.data_dir, 9), str(workdir), devices=_ONE_DEVICE)
    last = checkpoints.Checkpointer(str(workdir)).latest_step()
    line = helpers.one_line_error(error, "no space left", f"step {last}", str(workdir / "checkpoints" / str(last)))
    assert isinstance(error.value, checkpoints.DiskFull) and last in (7, 8), line
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow  # trains a step with async saves under ulimit -f: CI runs it, the quick command skips it
def test_a_file_size_limit_during_an_async_save_is_the_same_one_line(tiny_run, tmp_path, capsys):
    """``ulimit -f`` (the campaign's full disk): Python ignores SIGXFSZ, so the async save's writes fail in orbax's
    threads with EFBIG and surface at the next save or close, which was a 356-line traceback."""
    workdir = helpers.copy_run(tiny_run, tmp_path / "limited")
    config = tiny_config.training_config(tiny_run.data_dir, 7, async_checkpoints=True)  # step 7: over the limit
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32_000, limits[1]))  # under a checkpoint's files, over the logs
    try:
        with pytest.raises(UserError) as error:
            loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    last = checkpoints.Checkpointer(str(workdir)).latest_step()
    line = helpers.one_line_error(error, "file size limit", f"step {last}")
    assert isinstance(error.value, checkpoints.DiskFull), line
    assert "Traceback" not in capsys.readouterr().err


def test_a_quota_or_size_limit_is_recognised_in_tensorstores_words():
    text = 'Failed writing: "/w/checkpoints/5/d/x": Failed to write 14124 bytes to file 14: File too large'
    assert checkpoints.is_disk_full(ValueError(f"OUT_OF_RANGE: {text} [os_error_code='27']"))
    assert checkpoints.is_disk_full(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
    assert not checkpoints.is_disk_full(OSError(errno.EACCES, os.strerror(errno.EACCES)))


def _signal_here(name):
    """A stand-in for a phase of the run that receives SIGTERM while it runs (the handler then interrupts it)."""

    def phase(*args, **kwargs):
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            pytest.fail(f"no SIGTERM handler during {name}: a preemption now kills the process")
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail(f"SIGTERM during {name} did not stop it")

    return phase


def test_after_a_failed_read_foreign_threads_print_nothing_of_it(capsys):
    """After a restore fails, tensorstore's threads go on calling orbax's closed event loop and each printed
    ``RuntimeError: Event loop is closed`` around eval.py's one line (round-8 campaign); what threads started outside
    Python print then goes to lconv's debug log. A thread's ``_thread.start_new_thread`` is such a thread to Python."""
    with pytest.raises(OSError), integrity.quiet_orbax(None):
        raise OSError("the restore failed")
    printed = threading.Event()

    def foreign_thread():
        print("RuntimeError: Event loop is closed", file=sys.stderr)
        printed.set()

    _thread.start_new_thread(foreign_thread, ())
    assert printed.wait(30)
    print("error: checkpoint ... is unreadable", file=sys.stderr)  # Python's own threads still print
    assert capsys.readouterr().err == "error: checkpoint ... is unreadable\n"


@pytest.mark.parametrize("phase", ["validation", "test"])
def test_sigterm_during_the_final_evaluation_stops_cleanly(phase, tiny_run, tmp_path, monkeypatch, lconv_log):
    workdir = helpers.copy_run(tiny_run, tmp_path / phase)
    if phase == "validation":
        monkeypatch.setattr(loss_pass, "evaluate_loss", _signal_here("the final validation"))
    else:
        monkeypatch.setattr(loop, "evaluate_test_split", _signal_here("the test decoding"))
    config = tiny_config.training_config(tiny_run.data_dir, 6, eval_after_training=True)  # trained: evaluates only
    result = loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)
    assert result["stopped_by"] == "SIGTERM" and "test" not in result
    assert ("validation" in result) == (phase == "test")
    assert any("stopping the final evaluation: SIGTERM" in m and "step 6" in m for m in lconv_log()), lconv_log()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handed back


@pytest.mark.slow  # a final evaluation stopped, then run again: CI runs it, the quick command skips it
def test_the_same_command_after_a_stopped_final_evaluation_evaluates_and_trains_no_more(tiny_run, tmp_path,
                                                                                         monkeypatch):
    """"The same command evaluates it" was false with a budget or more steps left: the rerun trained on (45 s more
    under a budget). The stop is recorded in the workdir, and the rerun evaluates that step alone."""
    workdir = helpers.copy_run(tiny_run, tmp_path / "stopped")
    with monkeypatch.context() as patched:
        patched.setattr(loss_pass, "evaluate_loss", _signal_here("the final validation"))
        config = tiny_config.training_config(tiny_run.data_dir, 6, eval_after_training=False)
        assert loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)["stopped_by"] == "SIGTERM"
    assert loop.pending_final_evaluation(str(workdir)) == 6
    config = tiny_config.training_config(tiny_run.data_dir, 9, eval_after_training=False)  # steps left to train
    result = loop.train_and_evaluate(config, str(workdir), devices=_ONE_DEVICE)
    assert result["step"] == 6 and "validation" in result and "stopped_by" not in result
    assert loop.pending_final_evaluation(str(workdir)) is None
    assert checkpoints.Checkpointer(str(workdir)).latest_step() == 6
