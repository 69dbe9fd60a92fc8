"""lconv trains as fairseq trains: two recorded 40-update ``fairseq-train`` runs (tests/fixtures/
fairseq_train_parity/, made by fairseq alone) replayed through lconv's own train step by
``lconv.interop.fairseq_replay``, the code of ``python -m lconv.interop.fairseq_replay``: fairseq's update-0
weights imported, its batches fed in order, and every update's loss sum, gradient norm, clip decision and
learning rate, and the weights after updates 1 and 40, compared with fairseq's.

The tolerance, and why the factor is 8 (``fairseq_replay.DEFAULT_FACTOR``). The recording's float-noise floor is
how far fairseq moves from itself when some gradient entries move by one rounding step (x / n against
x * (1 / n)). lconv is a different program: every operation rounds in its own order, so at update 1, before any
difference can grow, its loss sum and gradient norm are already a few float32 roundings from fairseq's (checked
below: the loss within 2 eps, the norm, a float32 sum of 220k squares in both programs, within 8 eps), against
the floor's one. Training amplifies a difference in proportion to its seed, so a port seeded a few roundings
away must be allowed a few times the floor: 8, the power of two above the seed ratio measured at update 1. The
floor itself is taken as the larger of the recording's and lconv's own, which the slow replay measures by running
lconv again with every weight moved by one float32 spacing before each update: the recording's perturbation
reaches only the entries where the two divisions round apart; on run a the two floors agree, on run b the
recording's is far below what one rounding step everywhere gives (docs/fairseq.md, "Training parity", has the
figures).
"""
import dataclasses
import functools
import io
import json
import pathlib
import zipfile

import numpy as np
import pytest

from lconv.interop import fairseq_recording, fairseq_replay

RECORDING = pathlib.Path(__file__).parent / "fixtures" / "fairseq_train_parity"
RUN_A, RUN_B = "a_dynamic_postnorm_clip", "b_prenorm_lightdec_uf2"
EPS32 = float(np.finfo(np.float32).eps)


def _run(name: str) -> fairseq_recording.RecordedRun:
    (run,) = fairseq_recording.find_runs(str(RECORDING / name))
    return run


@functools.cache
def _replayed(name: str) -> fairseq_replay.Replay:
    """A run's 40 updates replayed once per process (with lconv's own noise floor, from a second pass) for every
    slow test here; its cost is the train step's compilation, so the quick tier has none (tests/test_recipes.py
    checks the three fairseq formulas against NumPy there)."""
    return fairseq_replay.replay(_run(name))


def _grouped(*names: str) -> list:
    """One xdist group per run, so a run is replayed by one worker only."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(f"train_parity_{name}")) for name in names]


@pytest.mark.slow  # the replay compiles lconv's train step
@pytest.mark.parametrize("name", _grouped(RUN_B))
def test_the_first_update_differs_by_float32_rounding_alone(name):
    """The factor's premise: before any difference can grow, lconv's loss sum and gradient norm are a few float32
    roundings from fairseq's (its norm too is a float32 sum), and the weights after update 1 are fairseq's to one
    spacing plus 5% of its own step (``weights after update 1`` <= 1 in the verdict)."""
    result = _replayed(name)
    first = result.rows[0]  # sums over update 1's two micro-batches, natural log
    assert abs(first.loss[0] - first.loss[1]) / first.loss[1] <= 2 * EPS32
    assert abs(first.grad_norm[0] - first.grad_norm[1]) / first.grad_norm[1] <= fairseq_replay.DEFAULT_FACTOR * EPS32
    assert first.lr == pytest.approx((1e-7, 1e-7), rel=1e-6)  # the inverse-sqrt warmup's first rate
    ratio, _, _ = fairseq_replay.judge(result, _run(name).noise_floor).ratios["weights after update 1"]
    assert ratio <= 1.0


def test_recorded_batches_convert_to_lconvs_collation_and_back_losslessly():
    """Every recorded micro-batch survives the round trip through lconv's collation (right-padded sources, lconv's
    ids, micro-batches interleaved by row) token for token. Run b's 80
    micro-batches hold run a's 40 (the README: b's update u is a's batches 2u - 1 and 2u), checked here too."""
    run_a, run_b = _run(RUN_A), _run(RUN_B)
    a_batches, b_batches = run_a.batches(), run_b.batches()
    for u in range(1, 21):
        for m in range(2):
            a_micro, b_micro = run_a.micro_batches(a_batches, 2 * u - 1 + m)[0], run_b.micro_batches(b_batches, u)[m]
            assert all(np.array_equal(a_micro[k], b_micro[k]) for k in a_micro)
    updates = [run_b.micro_batches(b_batches, u) for u in range(1, len(run_b.updates) + 1)]
    shape = fairseq_recording.batch_shape(updates)
    for micros in updates:
        batch = fairseq_recording.collate(micros, shape)
        back = fairseq_recording.to_fairseq(batch, len(micros), [m["target"].shape[0] for m in micros],
                                            [m["src_tokens"].shape[1] for m in micros],
                                            [m["target"].shape[1] for m in micros])
        for original, again in zip(micros, back):
            for key in ("src_tokens", "src_lengths", "prev_output_tokens", "target"):
                np.testing.assert_array_equal(again[key], original[key], err_msg=key)
        assert batch["targets_segmentation"].sum() == sum((m["target"] != 1).sum() for m in micros)


def test_a_folder_that_is_not_a_recording_is_one_line(tmp_path, capsys):
    assert fairseq_replay.main([str(tmp_path / "missing")]) == 2
    assert fairseq_replay.main([str(tmp_path)]) == 2
    (tmp_path / "meta.json").write_text('{"runs": {"r": {"model_args": {}, "cfg": {}}}}')
    (tmp_path / "r").mkdir()
    assert fairseq_replay.main([str(tmp_path / "r")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)
    assert "no meta.json" in lines[1] and "lacks state_update000.npz" in lines[2]


def test_a_recordings_arrays_are_read_bounded_and_bad_ones_are_one_line(tmp_path, monkeypatch, capsys):
    """A small .npz that inflates to gigabytes was read until memory ran out, and a damaged one was a traceback
    (round 27, r27-36/22); a negative or NaN --factor was taken, turning a FAIL into a PASS (r27-23)."""
    import shutil

    from lconv.data import paths
    from lconv.errors import UserError

    shutil.copytree(RECORDING, tmp_path / "rec")
    run = fairseq_recording.find_runs(str(tmp_path / "rec" / RUN_B))[0]
    assert set(run.batches()) == set(_run(RUN_B).batches())
    np.savez_compressed(tmp_path / "rec" / RUN_B / "batches.npz", n_micro=np.zeros(1 << 22, np.int64))  # 32 MiB
    with monkeypatch.context() as patch:
        patch.setattr(paths, "memory_read_limit", lambda copies: 1 << 20)  # a host with little memory to spare
        with pytest.raises(UserError, match=r"batches.npz: its arrays decompress to 33,554,\d+ bytes .*1,048,576"):
            run.batches()
    header = io.BytesIO()  # a 200-byte member whose header claims 8 TB: np.load allocated it (r28-31)
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10 ** 12,)})
    with zipfile.ZipFile(tmp_path / "rec" / RUN_B / "batches.npz", "w") as archive:
        archive.writestr("n_micro.npy", header.getvalue() + b"\0" * 64)
    with pytest.raises(UserError, match=r"n_micro.npy: its header claims \(1000000000000,\) float64"):
        run.batches()
    encrypted, unknown_method = (8, 1, "n_micro.npy: encrypted"), (10, 97, "n_micro.npy: .*compression method")
    for offset, value, named in (encrypted, unknown_method):  # tracebacks (r29-24)
        np.savez(tmp_path / "rec" / RUN_B / "batches.npz", n_micro=np.zeros(3))
        data = bytearray((tmp_path / "rec" / RUN_B / "batches.npz").read_bytes())
        central = data.index(b"PK\x01\x02")  # the central directory's entry: its flag bits, its method
        data[central + offset:central + offset + 2] = value.to_bytes(2, "little")
        (tmp_path / "rec" / RUN_B / "batches.npz").write_bytes(bytes(data))
        with pytest.raises(UserError, match=f"batches.npz: .*{named}"):
            run.batches()
    np.savez(tmp_path / "rec" / RUN_B / "batches.npz", other=np.zeros(3))  # no n_micro: a KeyError (r28-32)
    with pytest.raises(UserError, match="lacks update 1's batch .*'n_micro'"):
        run.micro_batches(run.batches(), 1)
    (tmp_path / "rec" / RUN_B / "batches.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(UserError, match="batches.npz: not a readable .npz of arrays"):
        run.batches()
    for factor in ("-1e-9", "nan", "0"):
        assert fairseq_replay.main([str(tmp_path / "rec"), f"--factor={factor}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all("must be a number above 0" in line for line in lines)
    escape = "r\x1b]0;title\x07\x1b[2J"  # a recording's run name, printed: it set the terminal's title and cleared it
    (tmp_path / "esc").mkdir()
    (tmp_path / "esc" / "meta.json").write_text(json.dumps({"runs": {escape: {"model_args": {}, "cfg": {}}}}))
    (tmp_path / "esc" / escape).mkdir()
    assert fairseq_replay.main([str(tmp_path / "esc")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "\x1b" not in line and "r\\x1b]0;title\\x07" in line


def test_settings_the_replay_cannot_reproduce_are_refused_in_one_line():
    from lconv.errors import UserError

    run = _run(RUN_B)
    cfg = {**run.cfg, "optimizer": {**run.cfg["optimizer"], "_name": "nag"}}
    with pytest.raises(UserError, match=r"not optimizer='nag' \(replayed: 'adam'\)"):
        fairseq_replay.replay_config(dataclasses.replace(run, cfg=cfg), 1008)
    config = fairseq_replay.replay_config(run, 1008)
    assert (config.optim.grad_accum_steps, config.optim.clip_norm, config.optim.warmup_steps) == (2, 0.0, 10)
    assert {k: config.optim[k] for k in ("adam_eps_form", "clip_form", "label_smoothing_split")} == {
        "adam_eps_form": "before_correction", "clip_form": "norm_plus_eps", "label_smoothing_split": "others"}


@pytest.mark.slow  # 2 x 40 updates, each twice (lconv's own floor): a few minutes on 2 cores
@pytest.mark.parametrize("name", _grouped(RUN_A, RUN_B))
def test_both_runs_replay_within_the_noise_floor_through_all_40_updates(name):
    run = _run(name)
    result = _replayed(name)
    assert len(result.rows) == 40 and set(result.weights) == {1, 40}
    assert min(dataclasses.astuple(result.own_noise_floor)) > 0  # the second pass did start one rounding apart
    verdict = fairseq_replay.judge(result, run.noise_floor)
    assert verdict.passed, "\n".join(fairseq_replay.format_verdict(name, verdict, fairseq_replay.DEFAULT_FACTOR,
                                                                   result, run.noise_floor))
    clipped = [row.clip_coef[0] < 1 for row in result.rows]
    assert clipped == [row["clipped"] for row in run.updates]  # run a: every update clipped; b: none


@pytest.mark.slow  # compiles the train step again
def test_the_command_prints_each_update_and_exits_zero_within_tolerance(capsys):
    assert fairseq_replay.main([str(RECORDING / RUN_B), "--updates", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{RUN_B}: replaying 2 of 40 updates" and out[1] == fairseq_replay.HEADER
    assert [line.split("|")[0].strip() for line in out[2:4]] == ["1", "2"]
    assert out[-1].strip() == "PASS"
