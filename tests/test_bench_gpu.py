"""``python -m lconv.bench gpu``'s plans: stage caps, each stage's rows fitted to its cap (a fake clock), the FLOP
model's ideal speed-up, the trace reducer and the trained beam's order. No real timing here."""
import gzip
import json

import pytest

from lconv.bench import gpu_ops, gpu_plan, profile, report, timing
from lconv.bench import train as train_suite

INFO = dict(date="today", cpu="a CPU", device="cpu / cpu x1", jax="jax", load="0.0")  # timing.machine_info()'s keys


class FakeClock:
    """Seconds that pass only when the code under test says work was done."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_default_command_fits_its_minutes_and_the_run_stage_gets_three_minutes():
    for profile_on in (False, True):
        caps = gpu_plan.stage_caps(gpu_plan.DEFAULT_MINUTES, profile_on)
        assert sum(cap for _, cap in caps) == pytest.approx(gpu_plan.DEFAULT_MINUTES * 60)
        assert [s for s, _ in caps] == ["ops", "train"] + ["profile"] * profile_on + ["run", "beam"]
        assert gpu_plan.run_budget(dict(caps)["run"]) >= gpu_plan.RUN_MIN_BUDGET_S
    caps = dict(gpu_plan.stage_caps(gpu_plan.DEFAULT_MINUTES))  # without --profile every train T and beam size fits
    assert gpu_plan.train_fit(train_suite.T_FULL, caps["train"] - gpu_plan.STAGE_START_S).cut == []
    from lconv.bench import beam

    assert gpu_plan.beam_fit(beam.TRAINED_ROWS, caps["beam"] - gpu_plan.STAGE_START_S).cut == []
    from lconv.bench import gpu

    # the command, each stage's kill grace once (the next stage's cap absorbs an overrun), under 9 minutes
    assert gpu_plan.DEFAULT_MINUTES * 60 + gpu.KILL_GRACE_S <= 9 * 60
    # an earlier stage that overran is paid for by the next: the command still ends on time
    assert gpu_plan.stage_cap(100, later_s=200, left_s=280) == 80
    assert gpu_plan.stage_cap(100, later_s=200, left_s=400) == 100
    assert gpu_plan.stage_cap(100, later_s=200, left_s=150) == 10  # never below a tenth: the stage still starts


def test_fit_keeps_rows_in_order_of_value_while_their_estimates_fit_the_cap():
    fitted = gpu_plan.fit(["a", "b", "c", "d"], {"a": 3, "b": 5, "c": 4, "d": 1}.get, 9.0)
    assert fitted.kept == ["a", "b", "d"] and fitted.cut == ["c"] and fitted.seconds == 9  # d still fits after c
    assert gpu_plan.cut_reason(fitted.seconds, 9.0) == (
        "cut: not in the plan (the kept rows take an estimated 9 s of the 9 s cap)")
    assert "earlier stages overran" in gpu_plan.cut_reason(0.0, -1.0)  # nothing left of the cap


def test_the_op_plan_measures_bfloat16_first_pallas_beside_band_and_the_baselines_last_at_one_T():
    plan = gpu_ops.op_plan(quick=False)
    assert len(plan) == len(set(plan))
    main = [p for p in plan if p[4] == "fwd+bwd" and p[1] in gpu_ops.MAIN_IMPLS]
    assert plan[:len(main)] == main and len(main) == 2 * 3 * 2 * 3  # dtypes x T x ops x (band, split, fused)
    assert [p[2] for p in main] == ["bfloat16"] * 18 + ["float32"] * 18
    assert {p[3] for p in main} == {512, 4096, 16384}
    assert main[:3] == [("light", "band", "bfloat16", 512, "fwd+bwd"), ("light", "pallas", "bfloat16", 512, "fwd+bwd"),
                        ("light", "pallas-fused", "bfloat16", 512, "fwd+bwd")]
    baselines = [p for p in plan if p[1] not in gpu_ops.MAIN_IMPLS]
    assert plan[-len(baselines):] == baselines and {p[3] for p in baselines} == {gpu_ops.BASELINE_T}
    assert {(op, impl) for op, impl, *_ in baselines} == {(op, i) for op, impls in gpu_ops.BASELINES.items()
                                                           for i in impls}
    quick = gpu_ops.op_plan(quick=True)
    assert quick[0][2] == "bfloat16" and quick[-1][1] == "shift"  # the same order at tiny sizes


def _fake_ops(monkeypatch, clock, slowdown):
    """The op stage's GPU work replaced by a fake clock that advances ``slowdown`` x each row's estimate."""
    measured = []
    monkeypatch.setattr(timing, "copy_bytes_per_s", lambda *a, **k: {"copy_bytes_per_s": 2e12})
    monkeypatch.setattr(gpu_ops.mixers, "pallas_backend", lambda: True)
    monkeypatch.setattr(gpu_ops, "lower_group", lambda group: list(group))
    monkeypatch.setattr(gpu_ops, "compile_group", lambda lowered: lowered)

    def measure(group, ready):
        results = []
        for row in group:
            clock.now += slowdown * gpu_plan.op_row_seconds(row["impl"], gpu_ops.COMPILE_THREADS)
            measured.append(row)
            results.append(dict(status="ok", us_per_token=0.01, compile_s=1.0, runs=3))
        return results

    monkeypatch.setattr(gpu_ops, "measure_group", measure)
    monkeypatch.setattr(report, "write_results", lambda *a, **k: "")
    return measured


@pytest.mark.parametrize("cap_s", [30.0, 80.0, 400.0])
def test_the_op_stage_plan_fits_its_cap_on_a_fake_clock_and_says_what_it_cut(monkeypatch, cap_s):
    clock = FakeClock()
    measured = _fake_ops(monkeypatch, clock, slowdown=1.0)
    start = clock.now
    rows = gpu_ops.ops_stage(False, "out", "doc", INFO, start + cap_s, clock=clock, overlap=False)
    assert clock.now - start <= cap_s  # the estimates held, so the plan ended inside its cap
    plan = gpu_ops.op_plan(quick=False)
    assert [(r["op"], r["impl"], r["dtype"], r["T"], r["passes"]) for r in rows] == plan
    cut = [r for r in rows if r["status"].startswith("cut: not in the plan")]
    assert len(measured) + len(cut) == len(plan)
    if cut:  # the most valuable rows ran: a dtype's main rows are never cut for a baseline's
        first_cut = rows.index(cut[0])
        assert all(r["status"] == "ok" for r in rows[:first_cut])
        assert gpu_ops.cut_summary(rows)[0].startswith(f"{len(cut)} rows cut: not in the plan")
    else:
        assert gpu_ops.cut_summary(rows) == []
    assert rows[0]["status"] == "ok" and rows[0]["dtype"] == "bfloat16"


def test_an_op_stage_slower_than_its_estimates_stops_at_its_deadline(monkeypatch):
    clock = FakeClock()
    _fake_ops(monkeypatch, clock, slowdown=3.0)
    start, cap = clock.now, 60.0
    rows = gpu_ops.ops_stage(False, "out", "doc", INFO, start + cap, clock=clock, overlap=True)
    group = 3.0 * gpu_ops.COMPILE_THREADS * max(gpu_plan.op_row_seconds(i, gpu_ops.COMPILE_THREADS)
                                                 for i in gpu_plan.OP_COMPILE_S)
    assert clock.now - start <= cap + group  # no group starts past the deadline
    assert any(r["status"] == gpu_plan.TIME_RAN_OUT for r in rows)
    assert "cut: the stage's time ran out" in gpu_ops.section(rows, INFO)


def test_the_train_table_puts_the_flop_models_ideal_beside_the_measured_speed_up():
    rows = [dict(model=label, T=T, dtype="bfloat16", attention=None, B=1, params=1, step_s=1.0,
                 tokens_per_s=speed, model_flops_per_token=train_suite.model_flops_per_token(mixer, T),
                 xla_flops_per_token=1e9, compile_s=1.0, runs=3, matmul_flops_per_s=1e12, mfu=0.5)
            for T in (512, 4096) for (label, mixer), speed in zip(train_suite.MODELS.items(), (1.0, 1.1, 1.2))]
    assert train_suite.ideal_speed_up(rows, "DynamicConv", 512, "bfloat16") == pytest.approx(1.15, abs=0.005)
    assert train_suite.ideal_speed_up(rows, "DynamicConv", 4096, "bfloat16") == pytest.approx(1.98, abs=0.005)
    text = train_suite.section(rows, [512, 4096], INFO, "cmd")
    assert "| model | T=512 bfloat16 | T=4096 bfloat16 | FLOP model T=512 | FLOP model T=4096 |" in text
    assert "| DynamicConv | 1.2 | 1.2 | 1.15 | 1.98 |" in text
    assert "| Transformer | 1 | 1 | 1 | 1 |" in text


def _trace_file(tmp_path, device: bool) -> str:
    """A small trace in the Chrome JSON format jax.profiler writes: a host process, and a GPU's when ``device``."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "python"}},
              {"ph": "M", "pid": 1, "tid": 11, "name": "thread_name", "args": {"name": "tf_XLAEigen/1"}},
              {"ph": "X", "pid": 1, "tid": 10, "name": "PjitFunction(step)", "ts": 0, "dur": 900.0},
              {"ph": "X", "pid": 1, "tid": 11, "name": "fusion.1", "ts": 0, "dur": 300.0},
              {"ph": "X", "pid": 1, "tid": 11, "name": "fusion.1", "ts": 400, "dur": 100.0},
              {"ph": "X", "pid": 1, "tid": 11, "name": "ThreadpoolListener::Record", "ts": 0, "dur": 5.0},
              {"ph": "X", "pid": 1, "tid": 11, "name": "ThunkExecutor::Execute", "ts": 0, "dur": 800.0},
              {"ph": "X", "pid": 1, "tid": 11, "name": "dot.2", "ts": 600, "dur": 200.0}]
    if device:
        events += [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
                   {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
                   {"ph": "M", "pid": 2, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
                   {"ph": "X", "pid": 2, "tid": 1, "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 600.0},
                   {"ph": "X", "pid": 2, "tid": 1, "name": "loop_reduce_fusion", "ts": 700, "dur": 150.0},
                   {"ph": "X", "pid": 2, "tid": 1, "name": "sm90_xmma_gemm_bf16", "ts": 900, "dur": 600.0},
                   {"ph": "X", "pid": 2, "tid": 1, "name": "loop_reduce_fusion", "ts": 1600, "dur": 50.0},
                   {"ph": "X", "pid": 2, "tid": 2, "name": "dot.2", "ts": 0, "dur": 1200.0}]
    path = tmp_path / f"trace_{device}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)
    return str(path)


def test_the_trace_reducer_sums_a_gpus_kernels_by_name_per_step(tmp_path):
    rows = profile.kernel_times(profile.read_events(_trace_file(tmp_path, device=True)), steps=2)
    assert [r["kernel"] for r in rows] == ["sm90_xmma_gemm_bf16", "loop_reduce_fusion"]  # streams only, no host
    assert rows[0]["ms_per_step"] == pytest.approx(0.6) and rows[0]["calls_per_step"] == 1
    assert rows[1]["ms_per_step"] == pytest.approx(0.1)
    assert sum(r["share"] for r in rows) == pytest.approx(1) and rows[0]["share"] == pytest.approx(1200 / 1400)
    text = profile.section(rows, "a test", top=1)
    assert "| sm90_xmma_gemm_bf16 | 0.6 | 1 | 0.857 |" in text and "| 1 other kernels | 0.1 | 1 | 0.143 |" in text


def test_the_trace_reducer_takes_the_xla_threads_of_a_cpu_trace(tmp_path):
    rows = profile.kernel_times(profile.read_events(_trace_file(tmp_path, device=False)))
    times = {r["kernel"]: r["ms_per_step"] for r in rows}  # not the python thread's, not the bookkeeping
    assert times == {"fusion.1": pytest.approx(0.4), "dot.2": pytest.approx(0.2)}
    with pytest.raises(ValueError, match="steps must be at least 1"):
        profile.kernel_times([], steps=0)


def test_the_trained_beam_decodes_autos_size_first_then_the_widest():
    from lconv.bench import beam

    assert beam.rows_order(64, beam.TRAINED_ROWS, 1216) == [64, 256, 16]
    assert beam.rows_order(512, beam.TRAINED_ROWS, 1216) == [512, 256, 64, 16]
    assert beam.rows_order(24, (16,), 24) == [24, 16]
    assert beam.rows_order(8, (256, 16), 12) == [8]  # no size past the split's


def test_a_real_trace_of_a_jitted_step_reduces_to_named_work(tmp_path):
    import jax
    import jax.numpy as jnp

    x = jnp.ones((128, 128))
    step = jax.jit(lambda: jnp.tanh(x @ x).sum())
    path = profile.trace(step, 2, str(tmp_path))
    rows = profile.kernel_times(profile.read_events(path), steps=2)
    assert rows and all(r["ms_per_step"] >= 0 and r["calls_per_step"] > 0 for r in rows)
    assert sum(r["share"] for r in rows) == pytest.approx(1)
    assert not any(r["kernel"].startswith(profile.BOOKKEEPING) for r in rows)


def test_the_gpu_flags_on_another_suite_are_a_one_line_error(capsys):
    from lconv.bench import __main__ as bench_main

    for flags in (["--profile"], ["--compilation_cache=/tmp/x"]):
        with pytest.raises(SystemExit) as exit_info:
            bench_main.main(["mixers", *flags])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err == "error: --profile and --compilation_cache are the gpu suite's; the mixers suite has neither\n"


def test_a_full_runs_compilation_cache_is_this_users_own_folder_not_the_shared_tmp(tmp_path, monkeypatch):
    """An entry is native code that JAX runs: a cache in the world-shared temporary folder could be planted by any
    user. A full run's default is this user's folder, as train.py's, made for its owner alone."""
    import argparse

    from lconv.bench import gpu
    from lconv.cli import runtime

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    seen = {}
    monkeypatch.setattr(gpu, "_run_stages", lambda opts, info, planned, scratch, cache: seen.setdefault("cache", cache))
    opts = argparse.Namespace(stage=None, compilation_cache=None, quick=False, minutes=8, profile=False)
    gpu.run_suite(opts, INFO)
    assert seen["cache"] == runtime.user_compilation_cache() == str(tmp_path / "xdg" / "lconv" / "compilation_cache")
    assert (tmp_path / "xdg" / "lconv" / "compilation_cache").stat().st_mode & 0o777 == 0o700
