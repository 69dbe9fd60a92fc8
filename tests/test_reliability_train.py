"""train.py's side of "every bad input a one-line error, nothing silent, nothing lost": config fields and files
checked before anything is written, one run per workdir, a config.json that matches its checkpoints, verified
checkpoints, the divergence guard and Ctrl-C. The cheap cases run train.py in a subprocess; the rest in-process
on one tiny run (tests/tiny_config.py)."""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import tiny_config

from lconv.cli import runtime
from lconv.errors import Diverged, LossSpike, UserError
from lconv.train import checkpoints, integrity, loop, steps
from lconv.train import workdir as workdir_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


_config = tiny_config.training_config


def _train_py(*args, timeout=300):
    return subprocess.run([sys.executable, "train.py", "--config=tests/tiny_config.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _one_line_error(result):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]




@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 6-step run (checkpoints 2..6 with manifests) and its data dir."""
    root = tmp_path_factory.mktemp("reliability")
    workdir = root / "run"
    loop.train_and_evaluate(_config(root / "tfds"), str(workdir), devices=jax.devices()[:1])
    return root, workdir


def _copy(trained, name):
    root, workdir = trained
    shutil.copytree(workdir, root / name)
    return root / name


# ----------------------------------------------------------------------------------------------------------------
# Config files and fields: one line, exit 2, nothing written
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    (["--config=configs/default.py:nonsense"], "error: --config=configs/default.py:nonsense: unknown config "
                                               "variant(s) ['nonsense']; choose from"),
    (["--config=configs/nope.py"], "error: --config=configs/nope.py: [Errno 2] No such file or directory"),
    (["--config=configs/common.py"], "error: --config=configs/common.py: the file defines no get_config()"),
    (["--config.data.vocab_size=0"], "error: config.data.vocab_size=0: must be an integer >= "),
    (["--config.data.vocab_size=-5"], "error: config.data.vocab_size=-5: must be an integer >= "),
    (["--config.model.num_heads=0"], "error: config.model.num_heads=0: must be an integer >= 1"),
    (["--config.data.eval_batch_size=0"], "error: config.data.eval_batch_size=0: must be an integer >= 1"),
    (["--config.model.dtype=float99"], "error: config.model.dtype='float99': must be one of float32, bfloat16"),
    (["--config.model.dropout=1.5"], "error: config.model.dropout=1.5: must be a rate in [0, 1)"),
    (["--config.optim.b2=nan"], "error: config.optim.b2=nan: must be a number in [0, 1)"),
    (["--config.model.conv_impl=fast"], "error: config.model.conv_impl='fast': must be one of auto"),
    (["--config.train.spike_factor=0.5"], "error: config.train.spike_factor=0.5: must be 0 (off) or a number > 1"),
])
def test_a_bad_config_is_one_line_before_anything_is_written(args, expected, tmp_path):
    config_args = [a for a in args if a.startswith("--config=")]
    result = subprocess.run([sys.executable, "train.py", *(config_args or ["--config=tests/tiny_config.py"]),
                             *[a for a in args if not a.startswith("--config=")], f"--workdir={tmp_path / 'run'}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert _one_line_error(result).startswith(expected)
    assert not (tmp_path / "run").exists()


def test_a_workdir_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    line = _one_line_error(_train_py(f"--workdir={tmp_path / 'a_file' / 'run'}"))
    assert line == f"error: --workdir={tmp_path / 'a_file' / 'run'}: cannot create it (Not a directory)"


def test_an_unwritable_workdir_is_one_line_before_any_data_is_read(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(workdir_lib.LOCK_FILENAME):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ValueError, match=r"^--workdir=.* is not writable \(Permission denied\)$"):
        with workdir_lib.lock(str(tmp_path)):
            pass


def test_ctrl_c_outside_the_loop_is_exit_code_130_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as info, runtime.user_errors():
        raise KeyboardInterrupt
    assert info.value.code == 130 and capsys.readouterr().err == "interrupted\n"


# ----------------------------------------------------------------------------------------------------------------
# One run per workdir; config.json matches the checkpoints
# ----------------------------------------------------------------------------------------------------------------
def test_a_second_train_py_on_a_workdir_is_refused_naming_the_first(trained):
    workdir = _copy(trained, "locked")
    with workdir_lib.lock(str(workdir)):
        line = _one_line_error(_train_py(f"--workdir={workdir}"))
    assert line.startswith(f"error: --workdir={workdir} is in use by another train.py (pid {os.getpid()} on ")


def test_a_lock_left_by_a_dead_run_is_taken_over_and_reported(tmp_path, lconv_log):
    dead = {"pid": 999999, "host": "gone", "started": "2026-01-01T00:00:00"}
    (tmp_path / workdir_lib.LOCK_FILENAME).write_text(json.dumps(dead))  # a crash: the file without its flock
    with workdir_lib.lock(str(tmp_path)):
        owner = json.loads((tmp_path / workdir_lib.LOCK_FILENAME).read_text())
        assert owner["pid"] == os.getpid()
    assert lconv_log() == [f"took over {tmp_path / workdir_lib.LOCK_FILENAME} from a run that is gone (pid 999999 "
                           "on gone, started 2026-01-01T00:00:00)"]
    assert (tmp_path / workdir_lib.LOCK_FILENAME).read_text() == ""  # released cleanly


def test_before_its_first_checkpoint_a_workdir_takes_the_new_launchs_config(tmp_path):
    first, second = tiny_config.get_config(), tiny_config.get_config()
    second.model.d_model = 32
    workdir_lib.write_config(first, str(tmp_path), {}, has_checkpoint=False)  # a launch killed before step 1
    changes = workdir_lib.check_config_change(second, str(tmp_path), has_checkpoint=False)
    assert changes == {"model.d_model": (16, 32)}
    workdir_lib.write_config(second, str(tmp_path), changes, has_checkpoint=False)
    assert json.loads((tmp_path / "config.json").read_text())["model"]["d_model"] == 32  # what eval.py will build
    assert json.loads((tmp_path / "config_changes.jsonl").read_text())["changes"] == {"model.d_model": [16, 32]}


def test_resuming_a_run_made_before_a_field_existed_takes_its_default_without_asking(tmp_path):
    """A field added to lconv after the run was made is absent from its config.json: at its default (which keeps
    the old behaviour) it is recorded, not refused; at any other value it changes what the run trained with."""
    config = tiny_config.get_config()
    workdir_lib.write_config(config, str(tmp_path), {}, has_checkpoint=False)
    stored = json.loads((tmp_path / "config.json").read_text())
    del stored["optim"]["cosine_period"]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    assert workdir_lib.check_config_change(config, str(tmp_path), has_checkpoint=True) == {
        "optim.cosine_period": (None, 0)}
    config.optim.cosine_period = 500
    with pytest.raises(UserError, match=r"^this launch changes the config its checkpoints were trained with "
                                        r"\(config\.optim\.cosine_period: None -> 500\)"):
        workdir_lib.check_config_change(config, str(tmp_path), has_checkpoint=True)


def test_on_resume_run_fields_may_change_and_model_fields_only_on_purpose(trained):
    workdir = _copy(trained, "resume_config")
    line = _one_line_error(_train_py(f"--workdir={workdir}", f"--config.data.data_dir={trained[0] / 'tfds'}",
                                     "--config.model.ffn_dim=48", "--config.optim.learning_rate=0.01"))
    assert line == ("error: this launch changes the config its checkpoints were trained with (config.model.ffn_dim: "
                    "32 -> 48; config.optim.learning_rate: 0.003 -> 0.01); drop the override(s), use a new "
                    "--workdir, or pass --accept_config_changes to change it on purpose")
    more_steps = _config(trained[0] / "tfds", num_steps=9)
    more_steps.decode.beam_size = 2
    assert workdir_lib.check_config_change(more_steps, str(workdir), has_checkpoint=True) == {
        "decode.beam_size": (4, 2), "train.num_steps": (6, 9)}
    accepted = _config(trained[0] / "tfds")
    accepted.optim.learning_rate = 0.01
    assert workdir_lib.check_config_change(accepted, str(workdir), has_checkpoint=True, accept_changes=True) == {
        "optim.learning_rate": (0.003, 0.01)}


def test_an_accepted_change_that_does_not_fit_is_one_line_without_orbax_noise(trained):
    workdir = _copy(trained, "accepted_misfit")
    result = _train_py(f"--workdir={workdir}", f"--config.data.data_dir={trained[0] / 'tfds'}",
                       "--config.model.encoder_mixer=attention", "--accept_config_changes")
    assert _one_line_error(result) == (
        f"error: checkpoint {workdir}/checkpoints/6 does not fit this config's model: it has no "
        "params/encoder/layer_0/mixer/key/bias (24 of this model's arrays are not in it); use the config stored "
        "with it or a new --workdir")
    assert json.loads((workdir / "config.json").read_text())["model"]["encoder_mixer"] == "dynamicconv"


# ----------------------------------------------------------------------------------------------------------------
# Verified checkpoints
# ----------------------------------------------------------------------------------------------------------------
def _flip_bytes(step_dir, count=4096):
    """Flips ``count`` bytes in the checkpoint's largest array file, keeping its size (a bad disk block)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    for i in range(16, min(len(data), 16 + count)):
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def test_a_checkpoint_with_flipped_bytes_is_set_aside_and_the_run_resumes_from_the_one_before(trained, lconv_log):
    workdir = _copy(trained, "flipped")
    damaged = _flip_bytes(workdir / "checkpoints" / "6")
    result = loop.train_and_evaluate(_config(trained[0] / "tfds", 7), str(workdir), devices=jax.devices()[:1])
    rel = damaged.relative_to(workdir / "checkpoints" / "6")
    assert any("[6] unreadable or corrupt" in m and "resuming from step 5" in m and f"{rel} changed since it was "
               "written (SHA-256 mismatch)" in m for m in lconv_log()), lconv_log()
    assert result["step"] == 7 and len(os.listdir(workdir / "checkpoints_unreadable")) == 1
    steps_kept = checkpoints.Checkpointer(workdir).all_steps()
    assert 7 in steps_kept and integrity.verify_manifest(str(workdir / "checkpoints" / "7"), required=True)


def test_a_checkpoint_holding_nan_is_corrupt_even_with_a_valid_manifest(tmp_path, lconv_log):
    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1)
    good = {"w": np.ones((3,), np.float32), "count": np.int32(1)}
    ckpt.save(1, good, {"process_count": 1, "processes": [None]})
    ckpt.save(2, {"w": np.array([1.0, np.nan, 1.0], np.float32), "count": np.int32(2)},
              {"process_count": 1, "processes": [None]})
    assert integrity.verify_manifest(str(tmp_path / "checkpoints" / "2"), required=True)  # the bytes are intact
    state, _ = ckpt.restore_latest_readable(checkpoints.abstract_like(good))
    assert int(state["count"]) == 1
    assert "holds non-finite values (first in ['w'])" in lconv_log()[0], lconv_log()
    ckpt.close()


def test_a_file_added_to_or_missing_from_a_checkpoint_fails_verification(tmp_path):
    step_dir = tmp_path / "5"
    (step_dir / "state").mkdir(parents=True)
    (step_dir / "state" / "a").write_bytes(b"abc")
    integrity.write_manifest(str(step_dir))
    (step_dir / "state" / "b").write_bytes(b"")
    with pytest.raises(integrity.CorruptCheckpoint, match="state/b was not part of it"):
        integrity.verify_manifest(str(step_dir))
    (step_dir / "state" / "b").unlink()
    (step_dir / "state" / "a").unlink()
    with pytest.raises(integrity.CorruptCheckpoint, match="state/a is missing"):
        integrity.verify_manifest(str(step_dir))
    assert integrity.verify_manifest(str(tmp_path / "no_manifest")) is False



def test_an_async_save_keeps_the_values_it_was_given_while_their_buffers_are_donated(tmp_path):
    """train_step donates the state it is given: the async save must hold its own copy. The manifest is made
    once the files are written (the next save or close), and the restore equals the saved values."""
    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1, async_save=True)
    step_fn = jax.jit(lambda tree: jax.tree.map(lambda x: x * 0 - 7, tree), donate_argnums=0)
    state = {"w": jax.device_put(np.arange(1 << 18, dtype=np.float32)), "count": jax.device_put(np.int32(1))}
    expected = jax.tree.map(np.array, state)
    ckpt.save(1, state, {"process_count": 1, "processes": [None]})
    state = step_fn(state)  # overwrites the donated buffers while orbax may still be writing
    state = step_fn(state)
    assert ckpt.unfinished == 1
    ckpt.save(2, state, {"process_count": 1, "processes": [None]})  # finishes step 1 (its manifest) first
    assert integrity.verify_manifest(str(tmp_path / "checkpoints" / "1"), required=True)
    ckpt.close()
    assert integrity.verify_manifest(str(tmp_path / "checkpoints" / "2"), required=True)
    reader = checkpoints.Checkpointer(str(tmp_path))
    restored, _ = reader.restore(checkpoints.abstract_like(expected), 1)
    np.testing.assert_array_equal(restored["w"], expected["w"])
    restored, _ = reader.restore(checkpoints.abstract_like(expected), 2)
    np.testing.assert_array_equal(restored["w"], np.full(1 << 18, -7, np.float32))
    reader.close()

# ----------------------------------------------------------------------------------------------------------------
# Divergence guard and Ctrl-C
# ----------------------------------------------------------------------------------------------------------------
def test_the_spike_guard_against_a_brute_force_reading_of_its_rule():
    losses = [9.0, 8.0, 7.0, 6.5, 30.0, 6.0, 25.0, 26.0, 27.0]
    guard, seen = loop.SpikeGuard(factor=3.0, windows=3, history=20, min_history=3), []
    with pytest.raises(LossSpike, match=r"loss 27 by step 9 is above 3 x its running median 7.*3 log windows.*"
                                        r"\(step 4\)"):
        for step, loss in enumerate(losses, 1):
            seen.append(guard.observe(loss, step, last_checkpoint=4))
    kept = []  # brute force: a spike is > 3 x the median of the non-spike losses before it (once 3 are known)
    expected = []
    for loss in losses[:-1]:
        spike = len(kept) >= 3 and loss > 3 * float(np.median(kept[-20:]))
        expected.append(spike)
        if not spike:
            kept.append(loss)
    assert seen == expected == [False, False, False, False, True, False, True, True]


def test_a_finite_divergence_stops_and_keeps_the_checkpoint_before_it(trained):
    root, workdir = trained
    diverging = root / "lr_1e4"
    diverging.mkdir()
    shutil.copy(workdir / "spm.model", diverging / "spm.model")
    config = _config(root / "tfds", 30, spike_windows=2)
    config.optim.learning_rate = 1e4  # the case: loss 6.9 -> 5.8e9, and it used to run to the end
    with pytest.raises(Diverged, match=r"by step \d+.*the last (good )?checkpoint.* is kept \(step (\d+)\)") as info:
        loop.train_and_evaluate(config, str(diverging), devices=jax.devices()[:1])
    stopped_at = int(str(info.value).split("by step ")[1].split()[0].rstrip(";"))
    rows = [json.loads(r) for r in (diverging / "metrics.jsonl").read_text().splitlines()]
    train_losses = {r["step"]: r["loss"] for r in rows if r["split"] == "train"}
    kept = checkpoints.Checkpointer(diverging).all_steps()
    assert stopped_at < 30 and kept and max(kept) < stopped_at
    assert all(train_losses[s] < 3 * min(train_losses.values()) for s in kept)  # no diverged state was saved


def test_a_loss_spike_is_never_checkpointed(trained, monkeypatch):
    root, workdir = trained
    spiking = root / "spiking"
    spiking.mkdir()
    shutil.copy(workdir / "spm.model", spiking / "spm.model")
    make_step = steps.make_train_step

    def spiked(config, lr_schedule):  # from the 5th update on, the loss reads 1000x (finite)
        step_fn = make_step(config, lr_schedule)

        def train_step(state, batch):
            new_state, sums = step_fn(state, batch)
            sums["loss"] = jax.numpy.where(state.step >= 4, sums["loss"] * 1000, sums["loss"])
            return new_state, sums

        return train_step

    monkeypatch.setattr(steps, "make_train_step", spiked)
    with pytest.raises(LossSpike, match=r"by step 6 .* for 2 log windows in a row.*kept \(step 4\)"):
        loop.train_and_evaluate(_config(root / "tfds", 8, spike_windows=2), str(spiking), devices=jax.devices()[:1])
    assert checkpoints.Checkpointer(spiking).all_steps() == [1, 2, 3, 4]


def test_ctrl_c_checkpoints_and_exits_130_like_a_preemption(trained):
    workdir = _copy(trained, "ctrl_c")
    process = subprocess.Popen([sys.executable, "train.py", "--config=tests/tiny_config.py", f"--workdir={workdir}",
                                f"--config.data.data_dir={trained[0] / 'tfds'}", "--config.train.num_steps=100000",
                                "--config.train.checkpoint_every=1000"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    metrics = workdir / "metrics.jsonl"
    start, rows_before = time.time(), len(metrics.read_text().splitlines())
    while len(metrics.read_text().splitlines()) <= rows_before + 1 and time.time() - start < 240:
        time.sleep(0.5)  # wait until it is training (it writes a train row every step)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stopped_by"] == "SIGINT" and summary["step"] > 6
    assert checkpoints.Checkpointer(workdir).latest_step() == summary["step"]  # saved, though not a multiple of 1000


def test_the_run_writes_what_its_data_was_built_from_and_what_was_skipped(trained):
    from lconv.data import sources

    root, workdir = trained
    report = json.loads((workdir / "data_report.json").read_text())
    assert report == sources.source_report("ddtp/en_de", str(root / "tfds"), None)
    assert report["source"] == "the bundled snapshot" and report["examples"]["train"] > 1000
    assert "skipped" in report and "parse" in report["skipped"]  # the parser's counts, kept


def _two_checkpoints(directory):
    ckpt = checkpoints.Checkpointer(str(directory), save_every=1)
    ckpt.retry_seconds = 0.0
    for step in (1, 2):
        ckpt.save(step, {"w": np.full((3,), step, np.float32)}, {"process_count": 1, "processes": [None]})
    return ckpt, checkpoints.abstract_like({"w": np.ones((3,), np.float32)})


def _failing(manager, failures):
    """``manager.restore`` raising an OSError for its first ``failures`` calls (a flaky filesystem)."""
    real, calls = manager.restore, []

    def restore(*args, **kwargs):
        calls.append(args[0])
        if len(calls) <= failures:
            raise OSError(5, "Input/output error")
        return real(*args, **kwargs)

    return restore, calls


def test_a_transient_read_error_is_retried_and_never_falls_back_past_a_good_checkpoint(tmp_path, monkeypatch):
    ckpt, abstract = _two_checkpoints(tmp_path)
    restore, calls = _failing(ckpt.manager, failures=2)
    monkeypatch.setattr(ckpt.manager, "restore", restore)
    state, _ = ckpt.restore_latest_readable(abstract)
    assert float(state["w"][0]) == 2 and calls == [2, 2, 2]  # the third attempt read the newest

    restore, calls = _failing(ckpt.manager, failures=100)
    monkeypatch.setattr(ckpt.manager, "restore", restore)
    with pytest.raises(integrity.CheckpointReadError, match=r"checkpoint .*/2 verified but could not be read in 3 "
                                                            r"attempts \(OSError: .*nothing was moved"):
        ckpt.restore_latest_readable(abstract)
    assert calls == [2, 2, 2] and ckpt.all_steps() == [1, 2]  # no older fallback, nothing set aside
    ckpt.close()


def test_an_unverified_checkpoint_that_does_not_read_is_set_aside(tmp_path, monkeypatch, lconv_log):
    ckpt, abstract = _two_checkpoints(tmp_path)
    (tmp_path / "checkpoints" / "2" / integrity.MANIFEST_FILENAME).unlink()  # e.g. written by an older lconv
    real = ckpt.manager.restore
    monkeypatch.setattr(ckpt.manager, "restore", lambda step, **kw: real(step, **kw) if step == 1 else 1 / 0)
    state, _ = ckpt.restore_latest_readable(abstract)
    assert float(state["w"][0]) == 1 and ckpt.all_steps() == [1]
    assert "[2] unreadable or corrupt" in lconv_log()[0] and "ZeroDivisionError" in lconv_log()[0]
    ckpt.close()
