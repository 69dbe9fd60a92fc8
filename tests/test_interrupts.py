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
from lconv.train import loop


def test_user_errors_installs_the_handler_over_the_default_only_and_puts_it_back():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(SystemExit), runtime.user_errors():
        assert signal.getsignal(signal.SIGINT) is runtime.on_interrupt
        with loop.Preemption() as preemption:  # the training loop takes it over, then hands it back
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
        preemption = loop.Preemption()
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
