"""``lconv.export``: programs lowered for CPU (and for CPU + CUDA from this CPU host), serialised, read back and
run give the live model's tokens on the same inputs; bad flags are one-line errors."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import helpers
import numpy as np
import pytest
import tiny_runs

from lconv import export
from lconv.api import Model
from lconv.constants import EOS_ID
from lconv.decode_settings import DecodeSettings
from lconv.errors import UserError
from lconv.infer import compiled

SOURCES = ["The small package for images.", "Fast text editor with python support and fonts.", "Data."]


@pytest.fixture(scope="module")
def translation_in_memory():
    """The in-memory translation model, built once: export reads it and never changes it."""
    return tiny_runs.in_memory(tiny_runs.translation_config())


def test_translation_round_trip_for_cpu_and_cuda_gives_the_live_tokens(tmp_path, translation_in_memory):
    trained = translation_in_memory
    sidecar = export.export(trained, str(tmp_path), platforms=("cpu", "cuda"), rows=(1, 4), widths=(32,),
                            beam_size=2)
    assert sidecar["platforms"] == ["cpu", "cuda"] and sidecar["conv_impl"] == {"cpu": "shift", "cuda": "band"}
    assert [p["file"] for p in sidecar["programs"]] == ["translate_r1_w32.jax", "translate_r4_w32.jax"]
    assert json.loads((tmp_path / export.SIDECAR).read_text())["config"]["model"]["d_model"] == 16
    served = export.load(str(tmp_path))  # deserialised: no model code runs from here on
    live = Model(trained).translate(SOURCES, beam_size=2)
    assert served(SOURCES) == live
    assert served(SOURCES[1]) == live[1]  # one string: one string, as translate gives
    blank = ["", SOURCES[0], "  "]  # not decoded, as translate leaves them (served from EOS alone a model's babble)
    assert served(blank) == Model(trained).translate(blank, beam_size=2) == ["", live[0], ""]
    ids = [np.append(trained.tokenizer.encode(s), EOS_ID) for s in SOURCES]
    live_BL = compiled.Translator(trained.config.infer, trained.model, trained.params)(
        _padded(ids, 4, 32), DecodeSettings.build(trained.config.decode, beam_size=2))[:3]
    np.testing.assert_array_equal(served.run_ids(ids), live_BL)
    wide = np.append(np.arange(4, 43, dtype=np.int32), EOS_ID)  # 40 tokens: wider than every bucket, cut to 32
    np.testing.assert_array_equal(served.run_ids([wide]), served.run_ids([np.append(wide[:31], EOS_ID)]))


@pytest.mark.parametrize("planted", ["params.npz", "translate_r1_w32.jax", export.SIDECAR, "spm.model"])
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_an_export_refuses_a_planted_link_or_pipe_before_writing_anything(tmp_path, planted, kind,
                                                                           translation_in_memory):
    """A params.npz linked out of --out was refused at its write, after the marker and the programs were
    written: every file the export writes is checked first."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.write_text("victim")
    if kind == "link":
        (out / planted).symlink_to(victim)
    else:
        os.mkfifo(out / planted)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UserError) as error:
        export.export(translation_in_memory, str(out), rows=(1,), widths=(32,), beam_size=2)
    helpers.one_line_error(error, str(out / planted))
    assert sorted(p.name for p in out.iterdir()) == before and victim.read_text() == "victim"


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_lm_round_trip_gives_the_live_continuations(tmp_path, monkeypatch):
    trained = tiny_runs.in_memory(tiny_runs.lm_config())
    settings = dict(rows=(2,), widths=(32,), max_len=5, temperature=1.0, top_k=3)
    export.export(trained, str(tmp_path), **settings)
    prompts = ["The small package", "Fonts and images for the server", ""]
    served = export.load(str(tmp_path))
    # Two prompts fill the exported 2-row bucket, as they do the live model's: the same draws from the same seed.
    live = Model(trained).generate(prompts[:2], max_len=5, temperature=1.0, top_k=3, seed=4)
    assert served(prompts[:2], seed=4) == live
    assert served(prompts[0], seed=4) == Model(trained).generate(prompts[0], max_len=5, temperature=1.0, top_k=3,
                                                                 seed=4)
    assert len(served(prompts, seed=4)) == 3  # three prompts: two batches of the 2-row program

    # Exported again over it, stopped half-way (the disk fills up at the params): not taken for an export.
    real_open = os.open

    def full_disk_at_the_params(path, flags, mode=0o777, **kwargs):
        if os.path.basename(path).startswith(".params.npz."):  # the atomic writer's temporary file beside it
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", full_disk_at_the_params)
    with pytest.raises(UserError) as error:  # one line naming the file (it was an OSError traceback)
        export.export(trained, str(tmp_path), **settings)
    helpers.one_line_error(error, str(tmp_path / "params.npz"), "No space left on device")
    with pytest.raises(UserError, match=export.SIDECAR):
        export.load(str(tmp_path))


def _padded(ids, rows, width):
    out = np.zeros((rows, width), np.int32)
    for row, x in enumerate(ids):
        out[row, :len(x)] = x
    return out


@pytest.mark.slow  # launches python -m lconv.export: the slow tier
@pytest.mark.parametrize("flags, message", [
    (["--platforms=cpu,gpu"], "--platforms=cpu,gpu: choose from cpu, cuda, rocm, tpu"),
    (["--rows=8,1"], "--rows=8,1: positive integers, ascending, no repeats"),
    (["--widths=a"], "--widths=a: comma-separated integers"),
])
def test_bad_export_flags_are_one_line(flags, message, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(tiny_runs.translation_config().to_json())
    result = subprocess.run([sys.executable, "-m", "lconv.export", f"--workdir={workdir}", f"--out={tmp_path}/x",
                             *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr == f"error: {message}\n", result.stderr
