"""Helpers shared by the test modules: the one-line-error assertion, the CLIs run in this process, and the shared
artefacts of tests/conftest.py (built once per test run, copied by the tests that change them)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# "Every bad input is one line naming the field, flag or file"
# ----------------------------------------------------------------------------------------------------------------
def config_json(config) -> str:
    """``config`` (a ConfigDict a test built, or a loaded run's typed ``RunConfig``) as config.json holds it."""
    import json

    return json.dumps(config.as_config()) if hasattr(config, "as_config") else config.to_json()


def one_line_error(outcome, *named: str) -> str:
    """Asserts that ``outcome`` is a user error reported in one line naming each of ``named`` (a config field, a
    flag, a file...) and returns that line without its ``error: `` prefix. ``outcome`` is one of:

    - a ``subprocess.CompletedProcess`` or a ``(code, stdout, stderr)`` triple (a CLI run in this process): exit
      code 2 and stderr exactly one line starting ``error: ``;
    - a ``pytest.ExceptionInfo`` or an exception: a non-empty message without a newline.

    Match on what the message names, not on its wording: that is what lets a user find the input to fix."""
    if isinstance(outcome, (subprocess.CompletedProcess, tuple)):
        code, stderr = ((outcome.returncode, outcome.stderr) if isinstance(outcome, subprocess.CompletedProcess)
                        else (outcome[0], outcome[2]))
        assert code == 2, f"exit code {code}: {stderr[-2000:]}"
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
        message = lines[0].removeprefix("error: ")
    else:
        error = outcome.value if isinstance(outcome, pytest.ExceptionInfo) else outcome
        message = str(error)
        assert message and "\n" not in message, message
    for name in named:
        assert name in message, f"{name!r} not named in: {message}"
    return message


# ----------------------------------------------------------------------------------------------------------------
# The CLIs in this process (a process launch only where the process boundary is what a test checks)
# ----------------------------------------------------------------------------------------------------------------
def run_cli(capsys, program: str, *args: str) -> tuple[int, str, str]:
    """``python train.py ARGS`` / ``python eval.py ARGS`` / ``python -m lconv.data|export|import_fairseq ARGS`` in
    this process, as the entry point runs it (absl flags, ``runtime.user_errors``): (exit code, stdout, stderr). The
    absl flags the program defines are removed afterwards and the JAX compilation-cache settings it changes are put
    back, so the next call (or test) starts clean."""
    import jax
    from absl import app, flags  # absl.app defines its own flags on import: before the snapshot

    from lconv import import_fairseq
    from lconv.cli import programs
    from lconv.data import __main__ as data_main
    from lconv.export import __main__ as export_main
    from lconv.train import __main__ as train_program

    app.define_help_flags()  # absl defines --help & co. on its first run only: keep them out of the snapshot's diff
    # grain defines absl flags when first imported: imported inside a call, they would be removed after it, and the
    # next grain pipeline of this process would fail (AttributeError: grain_py_traceback_filtering)
    from lconv.data import pipeline

    pipeline.import_readers()
    saved = {name: getattr(jax.config, name) for name in ("jax_compilation_cache_dir", "jax_enable_compilation_cache")}
    before = set(flags.FLAGS)
    capsys.readouterr()
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(ROOT)  # as the launched program would (relative --config paths)
    monkeypatch.setattr(sys, "argv", [program, *args])  # ml_collections reads --config.* overrides from sys.argv
    code = 0
    try:
        if program == "lconv.data":
            data_main.main(list(args))
        else:
            {"train.py": train_program.train, "eval.py": programs.evaluate, "lconv.export": export_main.main,
             "lconv.import_fairseq": import_fairseq.main}[program]([program, *args])
    except SystemExit as exit_:
        code = 0 if exit_.code is None else exit_.code
    finally:
        for name in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, name)
        flags.FLAGS.unparse_flags()
        for name, value in saved.items():
            jax.config.update(name, value)
        monkeypatch.undo()
    out, err = capsys.readouterr()
    return code, out, err


def cpu_devices(count: int) -> list:
    """The first ``count`` CPU devices (tests/conftest.py makes 8), or a skip naming why: a user's XLA_FLAGS may set
    fewer, as on a GPU host run with ``--xla_force_host_platform_device_count=1``."""
    import jax

    devices = jax.devices("cpu")
    if len(devices) < count:
        pytest.skip(f"needs {count} CPU devices; XLA_FLAGS gives {len(devices)} ({DEVICE_COUNT_FLAG})")
    return devices[:count]


def xla_flags(devices: int | None = None) -> str:
    """This process's $XLA_FLAGS for a process a test launches, with ``devices`` virtual CPU devices instead of
    conftest's 8 (None: XLA's default, one): the rest (conftest's CPU compile flags, a user's flags) carries over."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join(kept + ([f"{DEVICE_COUNT_FLAG}={devices}"] if devices else []))


def launch(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """``python ARGS`` from the checkout's root, in a new process (for tests of the process boundary itself)."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Shared artefacts (tests/conftest.py's session fixtures)
# ----------------------------------------------------------------------------------------------------------------
def build_once(root: pathlib.Path, name: str, build) -> pathlib.Path:
    """``root/name``, made by ``build(path)`` by the first worker that asks (under a file lock) and reused by the
    others. A build that fails marks nothing done, so the next worker to ask builds it again (and fails alike)."""
    path, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                shutil.rmtree(path, ignore_errors=True)
                build(path)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def new_workdir(tiny_data, path: pathlib.Path) -> pathlib.Path:
    """An empty workdir holding the shared tokenizer (no retraining; the shared run's vocabulary)."""
    path.mkdir(parents=True)
    shutil.copy(tiny_data.spm, path / "spm.model")
    return path


def copy_run(tiny_run, path: pathlib.Path) -> pathlib.Path:
    """A private copy of the shared run at ``path``, to resume, damage or write outputs into."""
    shutil.copytree(tiny_run.workdir, path)
    return path



class ExitedAtOnce(SystemExit):
    """What the ``exits`` fixture's fake ``os._exit`` raises: the code, without ending pytest's process."""


@contextlib.contextmanager
def jax_cache_config():
    """Puts back the compilation-cache settings ``enable_compilation_cache`` changes (tests/conftest.py set them)."""
    import jax

    saved = {name: getattr(jax.config, name) for name in ("jax_compilation_cache_dir", "jax_enable_compilation_cache")}
    try:
        yield jax.config
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


def make_another_users(path, monkeypatch) -> None:
    """``path`` becomes another user's: root hands it to uid 4243; anyone else takes uid 4243 as its own, so that
    everything it made (``path`` and the folders above it) is another user's."""
    if os.getuid() == 0:
        os.chown(path, 4243, -1, follow_symlinks=False)
    else:
        monkeypatch.setattr(os, "getuid", lambda: 4243)
