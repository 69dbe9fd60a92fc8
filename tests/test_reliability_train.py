"""train.py's side of "every bad input a one-line error, nothing silent, nothing lost": config fields and files
checked before anything is written, one run per workdir, a config.json that matches its checkpoints, verified
checkpoints, the divergence guard and Ctrl-C. The cheap cases run train.py in a subprocess; the rest in-process
on one tiny run (tests/tiny_config.py)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import helpers
import jax
import numpy as np
import pytest
import tiny_config

from lconv.cli import runtime
from lconv.errors import Diverged, LossSpike, UserError
from lconv.infer import compiled
from lconv.run import checkpoints, integrity
from lconv.run import workdir as workdir_lib
from lconv.train import early_build, hooks, loop, update

_config = tiny_config.training_config
_ONE_DEVICE = jax.devices("cpu")[:1]  # the shared run's (tests/conftest.py:tiny_run)


def _train_py(capsys, *args):
    """``python train.py --config=tests/tiny_config.py ARGS`` in this process: (exit code, stdout, stderr)."""
    config_args = [a for a in args if a.startswith("--config=")] or ["--config=tests/tiny_config.py"]
    return helpers.run_cli(capsys, "train.py", *config_args, *[a for a in args if not a.startswith("--config=")])


# ----------------------------------------------------------------------------------------------------------------
# Config files and fields: one line, exit 2, nothing written
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, named", [
    (["--config.data.vocab_size=0"], ["config.data.vocab_size=0"]),
    (["--config.data.vocab_size=-5"], ["config.data.vocab_size=-5"]),
    (["--config.model.num_heads=0"], ["config.model.num_heads=0"]),
    (["--config.data.eval_batch_size=0"], ["config.data.eval_batch_size=0"]),
    (["--config.model.dtype=float99"], ["config.model.dtype='float99'", "float32"]),
    (["--config.model.dropout=1.5"], ["config.model.dropout=1.5"]),
    (["--config.optim.b2=nan"], ["config.optim.b2=nan"]),
    (["--config.model.conv_impl=fast"], ["config.model.conv_impl='fast'", "auto"]),
    (["--config.train.spike_factor=0.5"], ["config.train.spike_factor=0.5"]),
    # Issue 41: an OverflowError, a 373 GiB MemoryError and a hang after data preparation; ignored or KeyError later
    ([f"--config.model.d_model={10**20}"], [f"config.model.d_model={10**20}", "65,536"]),
    ([f"--config.data.max_input_length={10**11}"], [f"config.data.max_input_length={10**11}", "1,048,576"]),
    ([f"--config.model.encoder_layers={10**8}"], [f"config.model.encoder_layers={10**8}", "1,024"]),
    (["--config.data.eval_splits=('test',)"], ["config.data.eval_splits", "'validation'"]),
    (["--config.model.mixer_kwargs={'dynamicconv': 5}"], ["config.model.mixer_kwargs['dynamicconv']=5"]),
    (["--config.model.encoder_kernel_sizes=(3, 5)"], ["config.model.encoder_kernel_sizes", "ignored"]),
    (["--config.model.encoder_mixer=toy_mixers:TupleOutput"], ["toy_mixers:TupleOutput", "encoder layer 0"]),
    (["--config.model.decoder_mixer=toy_mixers:RaisesOnCall"], ["toy_mixers:RaisesOnCall", "RuntimeError"]),
])
def test_a_bad_config_field_is_one_line_before_anything_is_written(args, named, tmp_path, capsys):
    helpers.one_line_error(_train_py(capsys, *args, f"--workdir={tmp_path / 'run'}"), *named)
    assert not (tmp_path / "run").exists()


def test_a_config_whose_get_config_returns_no_config_is_one_line(tmp_path, capsys):
    (tmp_path / "returns_42.py").write_text("def get_config(arg=None):\n    return 42\n")
    outcome = _train_py(capsys, f"--config={tmp_path}/returns_42.py", f"--workdir={tmp_path / 'run'}")
    helpers.one_line_error(outcome, "returns_42.py", "get_config() returned int")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # launches a process: the slow tier
@pytest.mark.parametrize("config, named", [
    ("configs/default.py:nonsense", ["--config=configs/default.py:nonsense", "nonsense"]),
    ("configs/nope.py", ["--config=configs/nope.py", "no such file"]),
    ("configs/common.py", ["--config=configs/common.py", "get_config()"]),
])
def test_a_config_file_that_does_not_load_is_one_line_with_exit_code_2(config, named, tmp_path):
    """A process each: loading a config file is what a fresh process does (in this one, the configs are already
    imported modules), and exit code 2 with one line on stderr is the process boundary itself."""
    result = helpers.launch("train.py", f"--config={config}", f"--workdir={tmp_path / 'run'}")
    helpers.one_line_error(result, *named)
    assert not (tmp_path / "run").exists()


def test_a_workdir_that_cannot_be_created_is_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    line = helpers.one_line_error(_train_py(capsys, f"--workdir={tmp_path / 'a_file' / 'run'}"),
                                  f"--workdir={tmp_path / 'a_file' / 'run'}")
    assert "cannot create it (Not a directory)" in line


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


@pytest.mark.parametrize("busy", ["early build", "translator"])
@pytest.mark.parametrize("error, code", [(KeyboardInterrupt, 130), (UserError("bad"), 2)])
def test_an_exit_during_a_background_compilation_is_at_once_instead_of_waiting_for_it(
        busy, error, code, capsys, exits):
    """The interpreter joins running non-daemon threads at exit: sys.exit would wait for the early build's
    compilation or every decoding program queued for the translator's thread, and a second Ctrl-C in that wait
    is a threading traceback. The CLIs' exit ends the process at once instead."""
    compiling = threading.Event()
    if busy == "early build":
        thread = threading.Thread(target=compiling.wait, name=f"{early_build.THREAD_NAME}_0")
        thread.start()
    else:
        queued = compiled._background().submit(compiling.wait)
        compiled._in_flight.add(queued)
        queued.add_done_callback(compiled._in_flight.discard)
    try:
        with pytest.raises(SystemExit), runtime.user_errors():
            raise error
    finally:
        compiling.set()
        thread.join() if busy == "early build" else queued.result()
    assert exits == [code] and capsys.readouterr().err in ("interrupted\n", "error: bad\n")
    with pytest.raises(SystemExit), runtime.user_errors():  # the compilation done: the usual exit
        raise error
    assert exits == [code]


def test_an_idle_translator_thread_leaves_the_usual_exit(exits):
    """The translator's thread stays alive between compilations: alive and idle is not compiling."""
    compiled._background().submit(lambda: None).result()
    with pytest.raises(SystemExit) as info, runtime.user_errors():
        raise UserError("bad")
    assert info.value.code == 2 and exits == []


# ----------------------------------------------------------------------------------------------------------------
# One run per workdir; config.json matches the checkpoints
# ----------------------------------------------------------------------------------------------------------------
def test_a_second_train_py_on_a_workdir_is_refused_naming_the_first(tiny_run, tmp_path, capsys):
    workdir = helpers.copy_run(tiny_run, tmp_path / "locked")
    with workdir_lib.lock(str(workdir)):  # an flock: a second open file in this process is refused as another's
        line = helpers.one_line_error(_train_py(capsys, f"--workdir={workdir}"), f"--workdir={workdir}")
    assert f"(pid {os.getpid()} on " in line


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
    first, second = workdir_lib.as_record(first), workdir_lib.as_record(second)  # as config.json holds them
    workdir_lib.write_config(first, str(tmp_path), {}, has_checkpoint=False)  # a launch killed before step 1
    changes = workdir_lib.check_config_change(second, str(tmp_path), has_checkpoint=False)
    assert changes == {"model.d_model": (16, 32)}
    workdir_lib.write_config(second, str(tmp_path), changes, has_checkpoint=False)
    assert json.loads((tmp_path / "config.json").read_text())["model"]["d_model"] == 32  # what eval.py will build
    assert json.loads((tmp_path / "config_changes.jsonl").read_text())["changes"] == {"model.d_model": [16, 32]}


def test_a_folder_in_config_changes_place_is_one_line_and_no_update_is_claimed(tmp_path, lconv_log):
    first, second = tiny_config.get_config(), tiny_config.get_config()
    second.train.num_steps = 3
    first, second = workdir_lib.as_record(first), workdir_lib.as_record(second)
    workdir_lib.write_config(first, str(tmp_path), {}, has_checkpoint=False)
    (tmp_path / "config_changes.jsonl").mkdir()
    changes = workdir_lib.check_config_change(second, str(tmp_path), has_checkpoint=True)
    with pytest.raises(UserError, match="config_changes.jsonl is a folder; lconv writes a regular file there"):
        workdir_lib.write_config(second, str(tmp_path), changes, has_checkpoint=True)
    assert not [m for m in lconv_log() if "updated" in m]  # config.json was not updated, and nothing says it was
    assert json.loads((tmp_path / "config.json").read_text())["train"]["num_steps"] == first["train"]["num_steps"]


def test_resuming_a_run_made_before_a_field_existed_takes_its_default_without_asking(tmp_path):
    """A field added to lconv after the run was made is absent from its config.json: at its default (which keeps
    the old behaviour) it is recorded, not refused; at any other value it changes what the run trained with."""
    config = tiny_config.get_config()
    workdir_lib.write_config(workdir_lib.as_record(config), str(tmp_path), {}, has_checkpoint=False)
    stored = json.loads((tmp_path / "config.json").read_text())
    del stored["optim"]["cosine_period"]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    assert workdir_lib.check_config_change(workdir_lib.as_record(config), str(tmp_path), has_checkpoint=True) == {
        "optim.cosine_period": (None, 0)}
    config.optim.cosine_period = 500
    with pytest.raises(UserError) as error:
        workdir_lib.check_config_change(workdir_lib.as_record(config), str(tmp_path), has_checkpoint=True)
    helpers.one_line_error(error, "config.optim.cosine_period: None -> 500")


def test_on_resume_run_fields_may_change_and_model_fields_only_on_purpose(tiny_run, tmp_path, capsys):
    workdir = helpers.copy_run(tiny_run, tmp_path / "resume_config")
    helpers.one_line_error(_train_py(capsys, f"--workdir={workdir}", f"--config.data.data_dir={tiny_run.data_dir}",
                                     "--config.model.ffn_dim=48", "--config.optim.learning_rate=0.01"),
                           "config.model.ffn_dim: 32 -> 48", "config.optim.learning_rate: 0.003 -> 0.01",
                           "--accept_config_changes")
    more_steps = _config(tiny_run.data_dir, num_steps=9)
    more_steps.decode.beam_size = 2
    assert workdir_lib.check_config_change(workdir_lib.as_record(more_steps), str(workdir), has_checkpoint=True) == {
        "decode.beam_size": (4, 2), "train.num_steps": (6, 9)}
    accepted = _config(tiny_run.data_dir)
    accepted.optim.learning_rate = 0.01
    assert workdir_lib.check_config_change(workdir_lib.as_record(accepted), str(workdir), has_checkpoint=True,
                                           accept_changes=True) == {
        "optim.learning_rate": (0.003, 0.01)}


def test_an_accepted_change_that_does_not_fit_is_one_line_without_orbax_noise(tiny_run, tmp_path, capsys):
    workdir = helpers.copy_run(tiny_run, tmp_path / "accepted_misfit")
    result = _train_py(capsys, f"--workdir={workdir}", f"--config.data.data_dir={tiny_run.data_dir}",
                       "--config.model.encoder_mixer=attention", "--accept_config_changes")
    line = helpers.one_line_error(result, f"checkpoint {workdir}/checkpoints/6",
                                  "params/encoder/layer_0/mixer/key/bias")
    assert "(24 of this model's arrays are not in it)" in line
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


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_a_checkpoint_with_flipped_bytes_is_set_aside_and_the_run_resumes_from_the_one_before(tiny_run, tmp_path,
                                                                                               lconv_log):
    workdir = helpers.copy_run(tiny_run, tmp_path / "flipped")
    damaged = _flip_bytes(workdir / "checkpoints" / "6")
    result = loop.train_and_evaluate(_config(tiny_run.data_dir, 7), str(workdir), devices=_ONE_DEVICE)
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
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        integrity.verify_manifest(str(step_dir))
    assert "state/b" in str(error.value)
    (step_dir / "state" / "b").unlink()
    (step_dir / "state" / "a").unlink()
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        integrity.verify_manifest(str(step_dir))
    assert "state/a" in str(error.value) and "state/b" not in str(error.value)
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

def test_the_latest_and_the_best_checkpoint_of_one_step_wait_at_different_cross_process_barriers(tmp_path,
                                                                                                     monkeypatch):
    """At a validation step a run saves the latest and the best checkpoint of the same step, both async. Their
    background threads wait at cross-process barriers, and the coordination service pairs the arrivals at one name
    in order: with a name shared by both directories, process 0's "latest" could pass with process 1's "best" and
    commit a step still being written (a two-process CI run hung there). Recorded in one process by making orbax's
    save threads believe they have a peer: no barrier name is waited at by both directories."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer
    from orbax.checkpoint._src.multihost import multihost as orbax_multihost

    class TwoProcessJax:  # jax as orbax's save thread sees it: one of two processes
        def __getattr__(self, name):
            return getattr(jax, name)

        @staticmethod
        def process_count():
            return 2

    waited = []
    monkeypatch.setattr(async_checkpointer, "jax", TwoProcessJax())
    monkeypatch.setattr(orbax_multihost, "should_skip_process_sync", lambda processes=None: False)
    monkeypatch.setattr(orbax_multihost, "get_barrier_sync_fn",
                        lambda processes=None: lambda key, timeout_ms: waited.append(key))
    state = {"w": jax.device_put(np.arange(8, dtype=np.float32))}
    latest = checkpoints.Checkpointer(str(tmp_path), save_every=1, async_save=True)
    best = checkpoints.BestCheckpointer(str(tmp_path), async_save=True)
    best.offer(10, state, validation_loss=1.0)
    latest.save(10, state, {"process_count": 1, "processes": [None]})
    best.close()
    latest.close()
    writes = [key for key in waited if "async_write_complete" in key]
    assert len(writes) == 2, f"orbax's save threads no longer wait as they did; look again: {waited}"
    by_directory = [{key for key in waited if f"lconv_{name}_" in key} for name in ("checkpoints", "best")]
    assert by_directory[0] | by_directory[1] == set(waited), waited  # every name belongs to a directory
    assert not by_directory[0] & by_directory[1]


# ----------------------------------------------------------------------------------------------------------------
# Divergence guard and Ctrl-C
# ----------------------------------------------------------------------------------------------------------------
def test_the_spike_guard_against_a_brute_force_reading_of_its_rule():
    losses = [9.0, 8.0, 7.0, 6.5, 30.0, 6.0, 25.0, 26.0, 27.0]
    guard, seen = hooks.SpikeGuard(factor=3.0, windows=3, history=20, min_history=3), []
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


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_a_finite_divergence_stops_and_keeps_the_checkpoint_before_it(tiny_data, tmp_path):
    diverging = helpers.new_workdir(tiny_data, tmp_path / "lr_1e4")
    config = _config(tiny_data.data_dir, 30, spike_windows=2)
    config.optim.learning_rate = 1e4  # the case: loss 6.9 -> 5.8e9, and it used to run to the end
    with pytest.raises(Diverged, match=r"by step \d+.*the last (good )?checkpoint.* is kept \(step (\d+)\)") as info:
        loop.train_and_evaluate(config, str(diverging), devices=_ONE_DEVICE)
    stopped_at = int(str(info.value).split("by step ")[1].split()[0].rstrip(";"))
    rows = [json.loads(r) for r in (diverging / "metrics.jsonl").read_text().splitlines()]
    train_losses = {r["step"]: r["loss"] for r in rows if r["split"] == "train"}
    kept = checkpoints.Checkpointer(diverging).all_steps()
    assert stopped_at < 30 and kept and max(kept) < stopped_at
    assert all(train_losses[s] < 3 * min(train_losses.values()) for s in kept)  # no diverged state was saved


@pytest.mark.slow  # in-process training: CI runs it, the quick command skips it
def test_a_loss_spike_is_never_checkpointed(tiny_data, tmp_path, monkeypatch):
    spiking = helpers.new_workdir(tiny_data, tmp_path / "spiking")
    make_step = update.make_train_step

    def spiked(config, lr_schedule):  # from the 5th update on, the loss reads 1000x (finite)
        step_fn = make_step(config, lr_schedule)

        def train_step(state, batch, lr_factor):
            new_state, sums = step_fn(state, batch, lr_factor)
            sums["loss"] = jax.numpy.where(state.step >= 4, sums["loss"] * 1000, sums["loss"])
            return new_state, sums

        return train_step

    monkeypatch.setattr(update, "make_train_step", spiked)
    with pytest.raises(LossSpike, match=r"by step 6 .* for 2 log windows in a row.*kept \(step 4\)"):
        loop.train_and_evaluate(_config(tiny_data.data_dir, 8, spike_windows=2), str(spiking), devices=_ONE_DEVICE)
    assert checkpoints.Checkpointer(spiking).all_steps() == [1, 2, 3, 4]


@pytest.mark.slow  # launches a process: the slow tier
def test_ctrl_c_checkpoints_and_exits_130_like_a_preemption(tiny_run, tmp_path):
    workdir = helpers.copy_run(tiny_run, tmp_path / "ctrl_c")
    process = subprocess.Popen([sys.executable, "train.py", "--config=tests/tiny_config.py", f"--workdir={workdir}",
                                f"--config.data.data_dir={tiny_run.data_dir}", "--config.train.num_steps=100000",
                                "--config.train.checkpoint_every=1000"], cwd=helpers.ROOT, stdout=subprocess.PIPE,
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


def test_the_run_writes_what_its_data_was_built_from_and_what_was_skipped(tiny_run):
    from lconv.data import sources

    report = json.loads((tiny_run.workdir / "data_report.json").read_text())
    assert report == sources.source_report("ddtp/en_de", str(tiny_run.data_dir), None)
    assert report["source"] == "the bundled snapshot" and report["examples"]["train"] > 1000
    assert "skipped" in report and "parse" in report["skipped"]  # the parser's counts, kept


def _two_checkpoints(directory):
    ckpt = checkpoints.Checkpointer(str(directory), save_every=1)
    ckpt.retry_seconds = 0.0
    for step in (1, 2):
        ckpt.save(step, {"w": np.full((3,), step, np.float32)}, {"process_count": 1, "processes": [None]})
    return ckpt, checkpoints.abstract_like({"w": np.ones((3,), np.float32)})


def test_a_checkpoint_folder_of_very_many_steps_says_so_before_orbax_reads_them(tmp_path, monkeypatch, lconv_log):
    """20,000 empty step folders: eval.py was silent for 95 s while orbax read each one's metadata, then gave its
    one line (round-11 campaign e24). Past ``MANY_STEPS`` folders, a warning says why it takes a while."""
    ckpt, abstract = _two_checkpoints(tmp_path)
    ckpt.close()
    for step in range(100, 104):
        (tmp_path / "checkpoints" / str(step)).mkdir()
    monkeypatch.setattr(checkpoints.Checkpointer, "MANY_STEPS", 5)
    checkpoints.Checkpointer(str(tmp_path), read_only=True).close()
    (line,) = [m for m in lconv_log() if "step folders" in m]
    assert f"{tmp_path / 'checkpoints'} holds 6 step folders" in line
    monkeypatch.setattr(checkpoints.Checkpointer, "MANY_STEPS", 6)
    checkpoints.Checkpointer(str(tmp_path), read_only=True).close()
    assert len([m for m in lconv_log() if "step folders" in m]) == 1  # at the bound: nothing said


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


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Rows a run logged after the checkpoint it resumes from are dropped: the resumed run logs those steps
    again (issue 41: after kill -9 and resume metrics.jsonl held them twice); a row the kill cut goes too."""
    import json

    from lconv.train import logs

    rows = [json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n" for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(rows) + '{"step": 7, "spl')
    writer = logs.MetricWriter(str(tmp_path), resumed_step=4)
    writer.write(5, "train", {"loss": 0.5})
    writer.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_a_rerun_of_a_final_evaluation_replaces_its_row(tmp_path):
    """kill -9 in the final evaluation after its validation row was written: the rerun resumes from that step's
    checkpoint and evaluates again; that step's validation row was in metrics.jsonl twice."""
    import json

    from lconv.train import logs

    rows = [{"step": s, "split": "train", "loss": 1.0} for s in range(1, 7)] + [
        {"step": 3, "split": "validation", "loss": 2.0}, {"step": 6, "split": "validation", "loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    writer = logs.MetricWriter(str(tmp_path), resumed_step=6)
    writer.write(6, "validation", {"loss": 1.5})
    writer.write(6, "test", {"bleu": 3.0})
    writer.close()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["split"]) for r in logged]
    assert len(keys) == len(set(keys)) == 9
    assert [r["loss"] for r in logged if (r["step"], r["split"]) == (6, "validation")] == [1.5]  # the rerun's


def test_a_tensorboard_write_that_fails_in_its_thread_is_one_warning(tmp_path, monkeypatch, capsys, lconv_log):
    """A full disk: the run's one line was followed by a tensorboardX thread traceback (issue 41)."""
    import errno

    from tensorboardX import event_file_writer

    from lconv.train import logs

    writer = logs.MetricWriter(str(tmp_path))

    def full(self, event_str):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(event_file_writer.EventsWriter, "_write_serialized_event", full)
    writer.write(1, "train", {"loss": 1.0})
    writer.close()
    assert "Traceback" not in capsys.readouterr().err
    assert [m for m in lconv_log() if "TensorBoard" in m] == [
        "warning: TensorBoard events are no longer written (OSError: [Errno 28] No space left on device); "
        "metrics.jsonl has every value"]


def test_a_file_in_tensorboards_place_is_one_line(tmp_path):
    from lconv.train import logs

    (tmp_path / "tensorboard").write_text("x")
    with pytest.raises(UserError, match="cannot write TensorBoard's events in .*tensorboard: .*must be a folder"):
        logs.MetricWriter(str(tmp_path), resumed_step=2)


def test_tensorboards_file_is_no_name_a_link_or_a_pipe_could_be_planted_at(tmp_path):
    """TensorBoard named its file ``events.out.tfevents.<second>.<host>``: links planted at the next minutes' names
    in a resumed workdir's ``tensorboard/`` had a user's file outside replaced by events, and pipes hung train.py
    (round-11 campaign S1). The name now ends in a random part."""
    import socket
    import time

    from lconv.train import logs

    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file")
    workdir = tmp_path / "run"
    (workdir / "tensorboard").mkdir(parents=True)
    now = int(time.time())
    for second in range(now - 5, now + 120):
        name = f"events.out.tfevents.{second}.{socket.gethostname()}"
        (workdir / "tensorboard" / name).symlink_to(victim)
        (workdir / "tensorboard" / (name + ".fifo")).symlink_to(victim)  # a prefix of the new names
    writer = logs.MetricWriter(str(workdir))
    writer.write(1, "train", {"loss": 1.0})
    writer.close()
    assert victim.read_text() == "the user's own file"
    written = [p for p in (workdir / "tensorboard").iterdir() if not p.is_symlink()]
    assert len(written) == 1 and written[0].is_file() and written[0].stat().st_size > 0


def test_a_tensorboard_folder_swapped_for_a_link_after_its_checks_is_not_written_through(tmp_path, monkeypatch):
    """``tensorboard/`` swapped for a link between the workdir's checks and the event file's creation had the file
    made where the link led (round-12 campaign N3, a race). The folder is opened once, and written through that."""
    import tensorboardX

    from lconv.train import logs

    workdir, victim = tmp_path / "run", tmp_path / "victim"
    (workdir / "tensorboard").mkdir(parents=True)
    victim.mkdir()
    opened = tensorboardX.SummaryWriter.__init__

    def swap_then_open(self, *args, **kwargs):
        (workdir / "tensorboard").rename(workdir / "moved")
        (workdir / "tensorboard").symlink_to(victim)
        opened(self, *args, **kwargs)

    monkeypatch.setattr(tensorboardX.SummaryWriter, "__init__", swap_then_open)
    writer = logs.MetricWriter(str(workdir))
    writer.write(1, "train", {"loss": 1.0})
    writer.close()
    assert not os.listdir(victim) and len(os.listdir(workdir / "moved")) == 1


def test_a_step_whose_orbax_metadata_is_nested_too_deep_is_set_aside_for_the_step_before(tmp_path, lconv_log):
    """A ``_CHECKPOINT_METADATA`` nested 100,000 deep: orbax's reader, run on every step when the folder is opened,
    died of a RecursionError (an 80-line traceback, round-9 campaign). Now it is a corrupt step like any other: a
    resume falls back to the step before and moves it aside."""
    ckpt, abstract = _two_checkpoints(tmp_path)
    ckpt.close()
    (tmp_path / "checkpoints" / "2" / integrity.STEP_METADATA_FILENAME).write_text("[" * 100_000 + "]" * 100_000)
    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1)
    assert ckpt.all_steps() == [1, 2] and ckpt.latest_step() == 2  # listed, never opened by orbax
    state, _ = ckpt.restore_latest_readable(abstract)
    assert float(state["w"][0]) == 1 and ckpt.all_steps() == [1]
    assert "[2] unreadable or corrupt" in lconv_log()[0] and "nested deeper" in lconv_log()[0], lconv_log()
    assert len(os.listdir(tmp_path / "checkpoints_unreadable")) == 1
    ckpt.close()


@pytest.mark.parametrize("record", ['{"step": 2, "validation_loss": [1]}', '{"step": 2, "validation_loss": "x"}',
                                    "[1]", '{"step": 2, "validation_loss": ' + "[" * 100_000 + "]" * 100_000 + "}"],
                         ids=["a_list", "a_string", "not_a_dict", "nested_too_deep"])
def test_a_best_checkpoint_whose_record_is_not_lconvs_is_one_line_naming_it(tmp_path, record):
    """A hand-written ``best/<step>/data/metadata``: a list where the loss goes was a TypeError traceback at the
    resume, one nested 100,000 deep a RecursionError from orbax's JSON reader."""
    best = checkpoints.BestCheckpointer(str(tmp_path))
    assert best.offer(2, {"w": np.ones((3,), np.float32)}, 1.5)
    best.close()
    (tmp_path / "best" / "2" / integrity.MANIFEST_FILENAME).unlink()
    (tmp_path / "best" / "2" / "data" / "metadata").write_text(record)
    with pytest.raises(integrity.CorruptCheckpoint) as error:
        checkpoints.BestCheckpointer(str(tmp_path))
    helpers.one_line_error(error, str(tmp_path / "best" / "2"))


def test_a_step_folder_holding_another_steps_state_is_set_aside_and_saving_goes_on(tmp_path, lconv_log):
    """``cp -a checkpoints/6 checkpoints/1000``: the copy read, the run went on from its state, and orbax refused
    every later save as older than step 1000 (step 7 lost, a 52-line traceback; round 13)."""
    from flax.training import train_state

    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1)
    state = train_state.TrainState(step=np.int32(2), apply_fn=None, params={"w": np.full((3,), 2.0, np.float32)},
                                   tx=None, opt_state=())
    data = {"process_count": 1, "processes": [None]}
    ckpt.save(2, state, data)
    ckpt.close()
    shutil.copytree(tmp_path / "checkpoints" / "2", tmp_path / "checkpoints" / "1000")
    ckpt = checkpoints.Checkpointer(str(tmp_path), save_every=1)
    restored, _ = ckpt.restore_latest_readable(checkpoints.abstract_like(state))
    assert int(restored.step) == 2 and ckpt.all_steps() == [2]
    assert "[1000] unreadable or corrupt" in lconv_log()[0] and "holds step 2's state" in lconv_log()[0]
    assert ckpt.save(3, restored.replace(step=np.int32(3)), data, force=True)
    ckpt.finish()
    assert ckpt.all_steps() == [2, 3] and len(os.listdir(tmp_path / "checkpoints_unreadable")) == 1
    ckpt.close()


def test_a_verified_checkpoint_whose_json_orbax_cannot_parse_is_not_blamed_on_the_storage(tmp_path, monkeypatch):
    """A step's orbax JSON nested 100,000 deep with its manifest rewritten to match: retried three times, then
    "verified but could not be read ... check the storage" (round 16, r16-8). A parse failure is the checkpoint's,
    the same at every try: read once, and the older good step is the one restored."""
    ckpt, abstract = _two_checkpoints(tmp_path)
    real, calls = ckpt.manager.restore, []

    def restore(step, **kwargs):
        calls.append(step)
        if step == 2:
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
        return real(step, **kwargs)

    monkeypatch.setattr(ckpt.manager, "restore", restore)
    state, _ = ckpt.restore_latest_readable(abstract)
    assert float(state["w"][0]) == 1 and calls == [2, 1]
    ckpt.close()
