"""Ctrl-C outside the training loop ends a CLI with ``interrupted`` and exit code 130 even where a KeyboardInterrupt
cannot propagate (issue 56): raised inside a gc callback (JAX's ``_xla_gc_callback``), Python ignores it, and
train.py went on to train to the end. ``runtime.user_errors`` installs ``on_interrupt`` for that; the training
loop's ``Preemption`` still takes SIGINT over while it runs, and hands it back."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import helpers
import pytest

from lconv.cli import runtime
from lconv.train import hooks


def test_user_errors_installs_the_handler_over_the_default_only_and_puts_it_back():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(SystemExit), runtime.user_errors():
        assert signal.getsignal(signal.SIGINT) is runtime.on_interrupt
        with hooks.Preemption() as preemption:  # the training loop takes it over, then hands it back
            assert signal.getsignal(signal.SIGINT) == preemption._handler
        assert signal.getsignal(signal.SIGINT) is runtime.on_interrupt
        raise KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's: Ctrl-C is not for it
    try:
        with runtime.user_errors():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_first_ctrl_c_raises_and_a_second_ends_the_process_at_once(exits, capsys):
    with pytest.raises(helpers.ExitedAtOnce), runtime.user_errors():
        with pytest.raises(KeyboardInterrupt):
            runtime.on_interrupt(signal.SIGINT, None)  # propagates as usual
        # ... unless it was raised where Python ignores it (a gc callback): the next one cannot be lost
        runtime.on_interrupt(signal.SIGINT, None)
    assert exits == [130] and capsys.readouterr().err == "interrupted\n"


def test_a_ctrl_c_while_a_compile_thread_runs_ends_the_process_at_once(exits, capsys):
    compiling = threading.Event()
    thread = threading.Thread(target=compiling.wait, name=f"{runtime.EARLY_BUILD_THREAD}_0")
    thread.start()
    try:
        with pytest.raises(helpers.ExitedAtOnce), runtime.user_errors():
            runtime.on_interrupt(signal.SIGINT, None)
    finally:
        compiling.set()
        thread.join()
    assert exits == [130] and capsys.readouterr().err == "interrupted\n"


def test_the_training_loops_second_ctrl_c_goes_to_the_clis_handler():
    with pytest.raises(SystemExit), runtime.user_errors():
        preemption = hooks.Preemption()
        preemption._handler(signal.SIGINT, None)  # the first: a checkpoint and a clean stop
        assert preemption.requested and signal.getsignal(signal.SIGINT) is runtime.on_interrupt
        preemption.close()
        raise KeyboardInterrupt


_SWALLOWING = """
import gc, sys, time
from lconv.cli import runtime
def callback(phase, info):
    time.sleep(0.01)  # most of the time is spent here, where Python ignores a KeyboardInterrupt
gc.callbacks.append(callback)
with runtime.user_errors():
    print("ready", flush=True)
    while True:
        gc.collect()
"""


def test_ctrl_c_in_a_process_busy_in_gc_callbacks_ends_it_with_130():
    process = subprocess.Popen([sys.executable, "-c", _SWALLOWING], cwd=helpers.ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    for _ in range(2):
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
    try:
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130 and stderr.strip().splitlines()[-1] == "interrupted", stderr[-2000:]


# An exit handler registered before the program runs (as JAX registers its own at import) runs after lconv's, and
# takes a second Ctrl-C there: before, a KeyboardInterrupt traceback followed "interrupted".
_SECOND_CTRL_C_AT_EXIT = """
import atexit, os, signal, time
from lconv.cli import runtime
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))
with runtime.user_errors():
    raise KeyboardInterrupt
"""


def test_a_second_ctrl_c_while_the_exit_handlers_run_is_ignored():
    process = subprocess.run([sys.executable, "-c", _SECOND_CTRL_C_AT_EXIT], cwd=helpers.ROOT, capture_output=True,
                             text=True, timeout=60)
    assert process.returncode == 130 and process.stderr == "interrupted\n", process.stderr[-2000:]


def test_a_ctrl_c_while_a_checkpoint_is_written_ends_at_once_and_the_next_start_clears_what_it_left(
        exits, capsys, tmp_path, lconv_log):
    """The loop's save after a first Ctrl-C, then a second Ctrl-C in orbax's wait: a traceback from its threads and
    a temporary folder left forever. Now one line, exit 130, and the next Checkpointer removes the folder, saying
    so once."""
    import jax.numpy as jnp

    from lconv.run import checkpoints

    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1, async_save=True)
    ckpt.save(1, {"w": jnp.ones(3)}, {"a": 1})
    assert checkpoints.writing() == [str(tmp_path / "checkpoints" / "1")]
    try:
        with pytest.raises(helpers.ExitedAtOnce), runtime.user_errors():
            runtime.on_interrupt(signal.SIGINT, None)
    finally:
        ckpt.close()
    assert exits == [130] and checkpoints.writing() == []
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("interrupted") and str(tmp_path / "checkpoints" / "1") in line
    left = tmp_path / "checkpoints" / f"2{checkpoints.TMP_SUFFIX}-1764410000"  # as an interrupted save leaves it
    (left / "state").mkdir(parents=True)
    (left / "state" / "_METADATA").write_text("{")
    assert checkpoints.Checkpointer(str(tmp_path)).all_steps() == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
    checkpoints.Checkpointer(str(tmp_path))
    (said,) = [m for m in lconv_log() if "unfinished checkpoint" in m]
    assert left.name in said and "complete checkpoints are kept" in said


_TWO_CTRL_CS_IN_A_SAVE = """
import os, signal, sys
import jax.numpy as jnp
from lconv.cli import runtime
from lconv.run import checkpoints
from lconv.train import hooks
with runtime.user_errors():
    ckpt = checkpoints.Checkpointer(sys.argv[1], save_every=1, async_save=True)
    with hooks.Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: the loop saves and stops
        ckpt.save(1, {"w": jnp.zeros(1 << 24)}, {"a": 1}, force=preemption.requested)
        os.kill(os.getpid(), signal.SIGINT)  # the second, while the save is written
        ckpt.finish()
    print("not reached", flush=True)
"""


@pytest.mark.slow
def test_two_ctrl_cs_during_an_async_save_end_the_process_in_one_line_and_leave_nothing_after_the_next_start(
        tmp_path):
    """The process boundary is the point: orbax's threads are writing when the second Ctrl-C comes (it was a
    traceback from them at interpreter shutdown, and ``1.orbax-checkpoint-tmp`` was left forever)."""
    from lconv.run import checkpoints

    run = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
           " sys.argv = sys.argv[1:]; exec(sys.argv[0])", _TWO_CTRL_CS_IN_A_SAVE, str(tmp_path)]
    done = subprocess.run(run, cwd=helpers.ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if "WARNING" not in line and line.strip()]
    assert done.returncode == 130 and len(lines) == 1 and lines[0].startswith("interrupted while checkpoint"), \
        done.stderr[-3000:]
    assert "not reached" not in done.stdout
    clear = "from lconv.run import checkpoints; import sys; checkpoints.Checkpointer(sys.argv[1])"
    subprocess.run([sys.executable, "-c", clear, str(tmp_path)], cwd=helpers.ROOT, check=True, timeout=300)
    assert not [p.name for p in (tmp_path / "checkpoints").iterdir() if checkpoints.TMP_SUFFIX in p.name]


def test_a_file_where_unreadable_checkpoints_go_is_one_line(tmp_path):
    """A workdir whose ``checkpoints_unreadable`` is a file: the damaged step cannot be moved aside, said in one line
    naming it (it was a FileExistsError traceback), and nothing is moved or lost."""
    import jax.numpy as jnp

    from lconv.errors import UserError
    from lconv.run import checkpoints

    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1, async_save=False)
    for step in (1, 2):
        ckpt.save(step, {"w": jnp.full(4, float(step))}, {"a": step})
    ckpt.close()
    for path in (tmp_path / "checkpoints" / "2").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    (tmp_path / "checkpoints_unreadable").write_text("planted")
    ckpt = checkpoints.Checkpointer(str(tmp_path))
    with pytest.raises(UserError, match=r"_unreadable is not a folder: the unreadable checkpoint\(s\) \[2\]"):
        ckpt.restore_latest_readable(checkpoints.abstract_like({"w": jnp.zeros(4)}))
    assert (tmp_path / "checkpoints" / "2").is_dir()
