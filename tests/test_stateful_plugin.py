"""docs/models.md's stateful plugin ("A mixer with state": an EMA recurrence carried from window to window), saved
as a user would save it, outside lconv: it meets the mixer contract, trains on document streams named as
``ema_mixer:EMAMixer``, resumes exactly after a ``kill -9`` (its carried state is in the checkpoints), is
evaluated window by window, and loads with ``lconv.load``."""
import json
import os
import pathlib
import subprocess
import sys
import time

import helpers
import pytest
import tiny_config

import lconv
import lconv.testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
# tests/tiny_config.py made a decoder-only LM over the bundled documents, read as streams of windows.
FIELDS = {"task": "lm", "data.dataset": "ddtp/lm_en", "data.stream": True, "model.encoder_layers": 0,
          "model.decoder_mixer": "ema_mixer:EMAMixer", "train.num_steps": 12, "train.checkpoint_every": 2,
          # one validation pass, at the end: 256 rows of windows cover the split's documents in few batches
          "train.eval_every": 12, "data.eval_batch_size": 256}


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """A folder holding docs/models.md's ``ema_mixer.py``, as a user would save it."""
    text = (ROOT / "docs" / "models.md").read_text()
    start = text.index("# ema_mixer.py")
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "ema_mixer.py").write_text(text[start:text.index("```", start)])
    return folder


@pytest.fixture
def on_path(plugin_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir))
    return plugin_dir


def test_the_docs_stateful_mixer_meets_the_contract(on_path):
    lconv.testing.check_mixer("ema_mixer:EMAMixer")


def _config(data_dir):
    config = tiny_config.training_config(data_dir)
    for path, value in FIELDS.items():
        section, _, field = path.rpartition(".")
        (config[section] if section else config)[field] = value
    return config


def _logged(workdir, split="train"):
    """``[(step, loss)]`` of ``split`` in the order written (a resumed run writes some steps again)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == split]


@pytest.mark.slow  # a train.py process, killed, and two runs in this one: CI runs it, the quick command skips it
@pytest.mark.xdist_group("train_process")
def test_the_docs_stateful_mixer_trains_resumes_after_kill_9_evaluates_and_loads(on_path, tiny_data, tmp_path):
    from lconv.train import loop

    workdir = helpers.new_workdir(tiny_data, tmp_path / "killed")
    flags = [f"--config.{path}={value}" for path, value in FIELDS.items()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(on_path)]), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": helpers.xla_flags(8)}  # the 8 devices of this process: the same sums, so the same losses
    run = subprocess.Popen([sys.executable, "train.py", "--config=tests/tiny_config.py", f"--workdir={workdir}",
                            f"--config.data.data_dir={tiny_data.data_dir}", *flags], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not any(step >= 7 for step, _ in _logged(workdir)):
        assert run.poll() is None, f"train.py ended (rc {run.returncode}): {run.stderr.read()[-3000:]}"
        assert time.time() < deadline, "no step 7 within 300 s"
        time.sleep(0.02)
    run.kill()  # SIGKILL mid-document: no handler runs, the last checkpoint holds the state rows at its step
    run.communicate()
    assert len(_logged(workdir)) < 12

    loop.train_and_evaluate(_config(tiny_data.data_dir), str(workdir))  # the resume, as train.py runs it
    reference = helpers.new_workdir(tiny_data, tmp_path / "reference")
    loop.train_and_evaluate(_config(tiny_data.data_dir), str(reference))
    expected, logged = dict(_logged(reference)), _logged(workdir)
    assert sorted(expected) == list(range(1, 13)) and sorted(step for step, _ in logged) == sorted(expected)
    for step, loss in logged:
        assert loss == pytest.approx(expected[step], rel=1e-6), step
    # The validation windows at the end, their state carried from window to window, score alike.
    assert dict(_logged(workdir, "validation"))[12] == pytest.approx(dict(_logged(reference, "validation"))[12],
                                                                     rel=1e-6)

    model = lconv.load(str(workdir))
    assert model.config.model.decoder_mixer == "ema_mixer:EMAMixer"
    (continuation,) = model.generate(["the"], max_len=4)
    assert isinstance(continuation, str)
