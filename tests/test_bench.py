"""The benchmark helpers' pure logic (the suites themselves are not tests: ``python -m lconv.bench``)."""
import argparse
import pathlib
import subprocess
import sys

import jax
import pytest

from lconv.bench import __main__ as bench_main
from lconv.bench import report, timing
from lconv.bench.__main__ import parse_T_list


def test_timing_arithmetic():
    assert timing.summarize([0.3, 0.1, 0.2, 5.0]) == {"median_s": 0.25, "min_s": 0.1, "max_s": 5.0}
    assert timing.repeats_for(0.01, 1.0) == 10  # fast: capped at hi
    assert timing.repeats_for(0.3, 1.0) == 3
    assert timing.repeats_for(4.0, 1.0) == 3  # slow: never fewer than lo
    assert timing.predict_seconds(None, 512, 1.0) is None
    assert timing.predict_seconds((1024, 2.0), 4096, 1.0) == 8.0  # quadratic mixer at fixed tokens: x T
    assert timing.predict_seconds((1024, 2.0), 4096, 0.0) == 2.0  # linear mixer: the same per call
    # fwd+bwd floats per token: 5C for a light conv; 5C + 3HK for a dynamic one (read w twice, write dw).
    assert timing.conv_bytes_per_token(512, 8, 31, dynamic=False, backward=True) == 5 * 512 * 4
    assert timing.conv_bytes_per_token(512, 8, 31, dynamic=True, backward=True) == (5 * 512 + 3 * 8 * 31) * 4
    assert timing.conv_bytes_per_token(512, 8, 31, dynamic=True, backward=False) == (2 * 512 + 8 * 31) * 4
    # fwd+bwd as one program reads x and the kernel once: 4C (+ 2HK), here in bfloat16's 2 bytes a number
    assert timing.conv_bytes_per_token(512, 8, 31, dynamic=True, backward=True, one_program=True,
                                       itemsize=2) == (4 * 512 + 2 * 8 * 31) * 2
    with pytest.raises(ValueError):
        timing.summarize([])


def test_report_writers():
    table = report.markdown_table(["name", "x"], [["a", 1234.5678], ["b", None], ["c", "skipped: too slow"]])
    assert table.splitlines() == ["| name | x |", "|---|---|", "| a | 1,235 |", "| b | - |",
                                  "| c | skipped: too slow |"]
    assert report.fmt(0.012345) == "0.0123" and report.fmt(12345.6) == "12,346"
    assert report.csv_text([{"a": 1, "b": 2}, {"a": 3, "c": 4}]) == "a,b,c\n1,2,\n3,,4\n"
    doc = "# Benchmarks\n\nintro\n"
    once = report.replace_section(doc, "mixers", "table 1")
    assert once == "# Benchmarks\n\nintro\n\n<!-- bench:mixers -->\ntable 1\n<!-- /bench:mixers -->\n"
    twice = report.replace_section(once + "\noutro\n", "mixers", "table 2")
    assert "table 1" not in twice and "table 2" in twice and twice.endswith("outro\n") and "intro" in twice
    with pytest.raises(ValueError, match="cells"):
        report.markdown_table(["a", "b"], [[1]])


@pytest.mark.parametrize("planted", ["limits.csv", "benchmarks.md", "limits.png"])
def test_the_reports_files_are_never_written_through_a_link_planted_in_the_out_folder(tmp_path, capsys, planted):
    """The CSV, the markdown and the plots were written with a plain ``open``: links planted in ``--out`` had two
    files outside overwritten (round-11 campaign S4). The command refuses them before any suite runs, and each
    writer at its write."""
    from lconv import console
    from lconv.errors import UserError

    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("the user's own file")
    (out / planted).symlink_to(victim)
    with pytest.raises(UserError, match="symbolic link") as error:
        if planted.endswith(".png"):
            report.plot_bars(str(out / planted), ["a"], {"x": [1.0]}, title="t", ylabel="y")
        else:
            report.write_results(str(out), "limits", [{"a": 1}], "table", str(out / "benchmarks.md"))
    assert "\n" not in str(error.value) and victim.read_text() == "the user's own file"
    opts = argparse.Namespace(quick=True, out=str(out), doc=None)
    with pytest.raises(SystemExit) as exit_:
        bench_main.resolve_outputs(opts, console.OneLineParser(prog="python -m lconv.bench"))
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and str(out / planted) in line and "symbolic link" in line


@pytest.mark.parametrize("planted", ["link", "pipe", "another_users"])
def test_the_doc_is_read_through_one_descriptor_never_through_a_link_put_there_after_the_checks(tmp_path, planted,
                                                                                                monkeypatch):
    """The doc was checked (no link, no pipe), then opened by name: a link put there in between had a file only root
    could read written out, world-readable, as the doc (round 23, r23-1). Read once, without following a link: a
    link, a pipe or another user's file there is one line (and no wait on the pipe)."""
    import os

    import helpers

    from lconv import shared_folders
    from lconv.errors import UserError

    monkeypatch.delenv(shared_folders.OPT_IN, raising=False)
    doc, secret = tmp_path / "benchmarks.md", tmp_path / "secret.txt"
    secret.write_text("root only")
    if planted == "link":
        doc.symlink_to(secret)
    elif planted == "pipe":
        os.mkfifo(doc)
    else:
        doc.write_text("# theirs\n")
        helpers.make_another_users(doc, monkeypatch)
    with pytest.raises(UserError) as error:
        report.write_results(str(tmp_path / "out"), "limits", [{"a": 1}], "table", str(doc))
    helpers.one_line_error(error, f"--doc={doc}", "plain file of their own")
    assert secret.read_text() == "root only"


def test_an_output_refused_at_its_write_after_a_suite_ran_is_one_line(tmp_path, capsys, monkeypatch):
    """A link put at the doc's name while the suite ran is refused by the writer: that refusal was a 29-line
    traceback after the whole suite (r23-17)."""
    from lconv.bench import limits
    from lconv.errors import UserError

    def refused(opts, info):
        raise UserError(f"--doc={opts.doc}: a link was put there")

    monkeypatch.setattr(limits, "run_suite", refused)
    with pytest.raises(SystemExit) as exit_:
        bench_main.main(["limits", "--quick", f"--out={tmp_path / 'out'}", f"--doc={tmp_path / 'doc.md'}"])
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and "a link was put there" in line


@pytest.mark.parametrize("text,want", [("256", (256,)), ("128,256,8192", (128, 256, 8192))])
def test_T_list(text, want):
    assert parse_T_list(text) == want


@pytest.mark.parametrize("text", ["", "a", "256,128", "0,1", "1,1", "1.5"])
def test_bad_T_list(text):
    with pytest.raises(ValueError, match="--T"):
        parse_T_list(text)


# ----------------------------------------------------------------------------------------------------------------
# The committed results are never overwritten by a smoke test or an empty list
# ----------------------------------------------------------------------------------------------------------------
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "lconv.bench", *args], cwd=_ROOT, capture_output=True, text=True,
                          timeout=120)


def _committed_results():
    files = [p for p in (_ROOT / "docs" / "bench").rglob("*") if p.is_file()]  # the GPU's subfolder too
    return {p: p.read_bytes() for p in [*files, *(_ROOT / "docs").glob("benchmarks*.md")]}


@pytest.mark.slow  # launches python -m lconv.bench three times: the slow tier
def test_an_empty_T_list_and_a_quick_run_over_the_committed_results_are_refused():
    before = _committed_results()
    for args, message in [(["mixers", "--quick", "--T="], "error: --T must be comma-separated integers, e.g. "
                                                          "256,1024; got ''"),
                          (["mixers", "--quick", "--out=docs/bench"], "error: --out=docs/bench holds the committed "
                                                                      "results; a --quick run is a smoke test"),
                          (["train", "--quick", "--doc=docs/benchmarks.md"], "error: --doc=docs/benchmarks.md holds")]:
        result = _bench(*args)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith(message), result.stderr
    assert _committed_results() == before


def test_a_quick_run_writes_to_a_scratch_folder_by_default():
    quick = argparse.Namespace(quick=True, out=None, doc=None)
    bench_main.resolve_outputs(quick, None)
    assert (quick.out, quick.doc) == (bench_main.QUICK_DIR, f"{bench_main.QUICK_DIR}/benchmarks.md")
    full = argparse.Namespace(quick=False, out=None, doc=None)
    bench_main.resolve_outputs(full, None)
    assert (full.out, full.doc) == ("docs/bench", "docs/benchmarks.md")


def test_out_takes_the_report_along_and_mixers_replaces_the_mixer_rows(tmp_path):
    """``--out=DIR`` alone puts the report beside its figures in DIR (not the scratch folder); ``--mixers=`` names
    the mixer rows (the op rows stay), and a plugin that fails at a small shape is one line before any row runs."""
    import helpers

    from lconv.bench import mixers as bench_mixers
    from lconv.errors import UserError

    for quick in (True, False):
        opts = argparse.Namespace(quick=quick, out=str(tmp_path / f"out{quick}"), doc=None)
        bench_main.resolve_outputs(opts, None)
        assert opts.doc == str(tmp_path / f"out{quick}" / "benchmarks.md")
    configs = bench_mixers.op_configs(["attention", "toy_mixers:PrefixMean"])
    assert [c.mixer for c in configs if c.kind == "mixer"] == ["attention", "toy_mixers:PrefixMean"]
    assert any(c.kind == "op" for c in configs)
    for broken, named in (("toy_mixers:TupleOutput", "tuple"), ("toy_mixers:RaisesOnCall", "RuntimeError")):
        with pytest.raises(UserError) as error:
            bench_mixers.op_configs([broken])
        helpers.one_line_error(error, broken, named)


def test_the_pytorch_baseline_is_lconvs_light_conv_with_its_gradients():
    """The PyTorch row times the same op as lconv's rows: values and both gradients equal ``ops.light_conv``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lconv import ops
    from lconv.bench import external
    from tests.reference import tolerance

    torch, missing = external.torch_or_reason()
    assert missing is None, missing  # torch is a test dependency (requirements.txt)
    B, T, C, H, K = 2, 9, 8, 2, 5
    fn, (x_BCT, w_HK) = external.build(torch, "depthwise", False, B, T, C, H, K, "float64")
    x_BCT, w_HK = x_BCT.cpu().requires_grad_(True), w_HK.cpu().requires_grad_(True)
    g_BCT = torch.randn_like(x_BCT)
    y_BCT = fn(x_BCT, w_HK)
    y_BCT.backward(g_BCT)

    def lconv_op(x_BTC, w_HK):
        return ops.light_conv(x_BTC, w_HK, K // 2, impl="band")

    x_BTC, w = jnp.asarray(x_BCT.detach().numpy().transpose(0, 2, 1), jnp.float32), jnp.asarray(w_HK.detach().numpy())
    y_BTC, vjp = jax.vjp(lconv_op, x_BTC, w.astype(jnp.float32))
    dx_BTC, dw_HK = vjp(jnp.asarray(g_BCT.numpy().transpose(0, 2, 1), jnp.float32))
    close = tolerance(np.float32, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_BTC), y_BCT.detach().numpy().transpose(0, 2, 1), **close)
    np.testing.assert_allclose(np.asarray(dx_BTC), x_BCT.grad.numpy().transpose(0, 2, 1), **close)
    np.testing.assert_allclose(np.asarray(dw_HK), w_HK.grad.numpy(), **close)


def test_baselines_that_cannot_run_here_are_rows_that_say_why():
    from lconv.bench import external, mixers

    rows = mixers.external_rows(256, 4, {}, budget_s=0.05)
    by_name = {(r["name"], r["pass"]): r for r in rows}
    assert {name for name, _ in by_name} == {label for label, _, _ in external.BASELINES}
    torch, _ = external.torch_or_reason()
    for (name, _), row in by_name.items():
        if "PyTorch" in name:
            assert row["status"] == "ok" and row["us_per_token"] > 0 and row["device"] == external.device_name(torch)
        elif not torch.cuda.is_available():  # fairseq's kernels are CUDA-only
            assert row["status"] == "skipped: fairseq's CUDA kernels need a CUDA device", row


def test_the_train_suite_names_the_attention_kernel_and_tables_each_dtype():
    import jax

    from lconv.bench import timing
    from lconv.bench import train as train_suite

    on_cpu = jax.default_backend() == "cpu"
    assert train_suite.dtypes() == (("float32",) if on_cpu else ("float32", "bfloat16"))  # CPU emulates bfloat16
    assert train_suite.tokens_per_batch() == (4096 if on_cpu else 65_536)
    # float32 never takes cuDNN; 512² pairs are past CPU's chunked threshold (128²), below the others' (1024²)
    assert train_suite.attention_kernel(train_suite.lm_config("attention", 512)) == ("chunked" if on_cpu else "xla")
    assert train_suite.attention_kernel(train_suite.lm_config("lightconv", 512)) is None
    rows = [dict(model=label, T=512, dtype=dtype, attention="cudnn" if label == "Transformer" else None, B=128,
                 params=1, step_s=1.0, tokens_per_s=speed, model_flops_per_token=1e9, xla_flops_per_token=1e9,
                 compile_s=1.0, runs=3, matmul_flops_per_s=1e12, mfu=0.5)
            for dtype, speeds in (("float32", (1.0, 2.0, 3.0)), ("bfloat16", (4.0, 2.0, 1.0)))
            for label, speed in zip(train_suite.MODELS, speeds)]
    text = train_suite.section(rows, [512], timing.machine_info(), "cmd")
    assert "| model | T=512 float32 | T=512 bfloat16 |" in text
    assert "| DynamicConv | 3 | 0.25 |" in text  # each model's speed over the Transformer's of the same dtype


def test_another_backends_results_go_beside_the_cpu_ones_never_over_them():
    assert bench_main.committed_paths("cpu") == ("docs/bench", "docs/benchmarks.md")
    assert bench_main.committed_paths("gpu") == ("docs/bench/gpu", "docs/benchmarks-gpu.md")
    full = argparse.Namespace(quick=False, out=None, doc=None)
    bench_main.resolve_outputs(full, None, "gpu")
    assert (full.out, full.doc) == ("docs/bench/gpu", "docs/benchmarks-gpu.md")
    import jax

    backend = jax.default_backend()  # this run's figures, linked from its backend's doc
    assert report.figure("train.png") == ("bench/train.png" if backend == "cpu" else f"bench/{backend}/train.png")


def test_the_beam_suite_decodes_a_split_of_short_sources_and_tables_the_speed_up_over_64_rows():
    from lconv.bench import beam

    split = beam.synthetic_split(100, 4000, 64)
    lengths = [len(t["inputs"]) for t in split.tokens]
    assert (split.batch_size, split.num_batches, len(lengths)) == (64, 2, 100)
    assert min(lengths) >= beam.SOURCE_TOKENS[0] and max(lengths) <= beam.SOURCE_TOKENS[1]
    assert all(t["inputs"][-1] == 1 and 1 not in t["inputs"][:-1] for t in split.tokens)  # EOS once, at the end
    rows = [dict(model=label, rows=n, auto=n == 512, sentences=1216, batches=-(-1216 // n), beam=4, seconds=1216 / rate,
                 sentences_per_s=rate, first_pass_s=9.0)
            for label in beam.MODELS for n, rate in ((64, 50.0), (512, 400.0))]
    text = beam.section(rows, timing.machine_info(), "cmd")
    assert "| model | 64 rows | 512 rows |" in text and "| DynamicConv | 1 | 8 |" in text
    assert "picks DynamicConv: 512, Transformer: 512 rows here" in text


# ----------------------------------------------------------------------------------------------------------------
# python -m lconv.bench gpu: one command, its stages under caps
# ----------------------------------------------------------------------------------------------------------------
def test_the_gpu_floor_moves_each_array_once_in_its_dtype_and_the_plan_measures_every_impl():
    from lconv.bench import gpu_ops

    C, HK = gpu_ops.C, gpu_ops.H * gpu_ops.K  # read x, dy, w and write y, dx, dw once; fwd: read x (w), write y
    assert gpu_ops.floor_bytes_per_token("light", "float32", "fwd+bwd") == 16 * C
    assert gpu_ops.floor_bytes_per_token("dynamic", "float32", "fwd+bwd") == 16 * C + 8 * HK
    assert gpu_ops.floor_bytes_per_token("dynamic", "bfloat16", "fwd") == 2 * (2 * C + HK)
    plan = gpu_ops.op_plan(quick=False)
    assert len(plan) == len(set(plan))
    every = {("light", i) for i in ("band", "pallas", "pallas-fused", "conv", "shift", "unfold")}
    every |= {("dynamic", i) for i in ("band", "pallas", "pallas-fused", "shift", "unfold")}
    assert {(op, impl) for op, impl, *_ in plan} == every
    fused = [p for p in plan if p[1] == "pallas-fused"]  # beside band and the split backward, at every T and dtype
    assert {(p[2], p[3]) for p in fused} == {(d, T) for d in ("bfloat16", "float32") for T in gpu_ops.T_FULL}
    assert len(fused) == 2 * 3 * 2 and {p[4] for p in fused} == {"fwd+bwd"}


def test_the_gpu_op_stage_gives_the_pallas_bytes_model_and_times_both_backwards():
    """The Pallas rows' bytes model over the floor: split reads dy twice and x twice (1.5x), fused x twice
    (1.25x light, 1.3x dynamic); "pallas-fused" lowers to one backward kernel where "pallas" has two."""
    from jax import export

    from lconv.bench import gpu_ops as gpu

    def ratio(op, impl, dtype="float32"):
        return gpu.model_bytes_per_token(op, impl, dtype, "fwd+bwd") / gpu.floor_bytes_per_token(op, dtype, "fwd+bwd")

    C, HK = gpu.C, gpu.H * gpu.K
    assert ratio("light", "pallas") == pytest.approx(1.5, abs=0.01)
    assert ratio("dynamic", "pallas") == pytest.approx(1.5) == ratio("dynamic", "pallas", "bfloat16")
    assert ratio("light", "pallas-fused") == pytest.approx(1.25, abs=0.01)
    assert ratio("dynamic", "pallas-fused") == pytest.approx((5 * C + 3 * HK) / (4 * C + 2 * HK))
    assert gpu.model_bytes_per_token("light", "pallas", "float32", "fwd") == 8 * C
    assert gpu.model_bytes_per_token("light", "band", "float32", "fwd+bwd") is None
    triton = "__gpu$xla.gpu.triton"
    for impl, kernels in (("pallas", 3), ("pallas-fused", 2)):
        fn, args = gpu.op_program(dict(op="light", impl=impl, dtype="float32", T=64, B=1, passes="fwd+bwd"))
        exported = export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(*args)
        assert exported.mlir_module().count(f"@{triton}(") == kernels, impl


def test_a_gpu_stage_past_its_cap_is_killed_reported_and_the_next_stage_runs(tmp_path, monkeypatch):
    from lconv.bench import gpu, gpu_plan

    launched, clock = [], {"now": 0.0}

    def fake_launch(command, timeout):
        stage = next(a.split("=", 1)[1] for a in command if a.startswith("--stage="))
        launched.append((stage, timeout))
        if stage == "train":  # it ran to its kill: the stages after it share what is left of the command's time
            clock["now"] += timeout
            raise subprocess.TimeoutExpired(command, timeout)
        clock["now"] += timeout - gpu.KILL_GRACE_S  # the others take their whole cap
        return 3 if stage == "beam" else 0

    monkeypatch.setattr(gpu, "launch_stage", fake_launch)
    monkeypatch.setattr(gpu.time, "monotonic", lambda: clock["now"])
    opts = argparse.Namespace(stage=None, minutes=8.0, quick=True, data_dir=None, out=str(tmp_path),
                              doc=str(tmp_path / "b.md"), command="cmd", profile=False, compilation_cache=None)
    rows = gpu.run_suite(opts, timing.machine_info())
    caps = [cap for _, cap in gpu_plan.stage_caps(8.0)]
    assert sum(caps) == pytest.approx(480)
    assert [stage for stage, _ in launched] == ["ops", "train", "run", "beam"]
    assert [t for _, t in launched[:2]] == pytest.approx([cap + gpu.KILL_GRACE_S for cap in caps[:2]])
    assert launched[2][1] == pytest.approx(caps[2])  # the run's cap pays the train's overrun (its grace)
    assert launched[3][1] == pytest.approx(caps[3] + gpu.KILL_GRACE_S)
    assert sum(r["cap_s"] for r in rows) + gpu.KILL_GRACE_S == pytest.approx(480)  # the command ends on time
    status = {r["stage"]: r["status"] for r in rows}
    assert status["ops"] == status["run"] == "done" and status["train"].startswith("killed at its cap")
    assert status["beam"].startswith("failed (exit 3")
    assert "| train | killed at its cap" in (tmp_path / "b.md").read_text()


@pytest.mark.slow  # five processes that compile tiny models for several minutes on a shared CPU: the slow tier
def test_the_gpu_command_runs_every_stage_at_tiny_sizes_on_cpu(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lconv.bench", "gpu", "--quick", "--profile", "--minutes=12",
                             f"--out={tmp_path}", f"--doc={tmp_path}/b.md"], cwd=_ROOT, capture_output=True,
                            text=True, timeout=1000)
    assert result.returncode == 0, result.stderr[-2000:]
    from lconv.bench import gpu_plan

    stages = [line.split(":")[0].removeprefix("stage ") for line in result.stdout.splitlines()
              if line.startswith("stage ")]
    assert stages == [stage for stage, _ in gpu_plan.stage_caps(12, profile=True)], result.stdout[-3000:]
    for stage in stages:
        assert f"stage {stage}: done" in result.stdout, result.stdout[-3000:]
    doc = (tmp_path / "b.md").read_text()
    for section in ("gpu", "gpu_ops", "gpu_train", "gpu_profile", "gpu_run", "gpu_beam"):
        assert f"<!-- bench:{section} -->" in doc and (tmp_path / f"{section}.csv").is_file()
    assert "FLOP model T=64" in doc and "| ops | done |" in doc
    import csv

    ops_rows = list(csv.DictReader(open(tmp_path / "gpu_ops.csv")))
    measured = [r for r in ops_rows if r["status"] == "ok"]
    assert len(measured) == 4 and all(  # the ratio to the floor is the time over the floor, both per token
        float(r["x_floor"]) == pytest.approx(float(r["us_per_token"]) / float(r["floor_us_per_token"]))
        for r in measured)
    assert [r["status"] for r in ops_rows if r["impl"] == "pallas"] == [
        "skipped: the Pallas kernel compiles on a GPU only (interpret mode here)"]
    run = next(csv.DictReader(open(tmp_path / "gpu_run.csv")))
    assert int(run["updates"]) == 4 and int(run["test_sentences"]) > 1000 and float(run["first_update_s"]) > 0
    assert run["setup_parts"].startswith("data and tokenizer ") and "model and optimizer state" in run["setup_parts"]
    beam_rows = list(csv.DictReader(open(tmp_path / "gpu_beam.csv")))  # the run's checkpoint, auto's size first
    assert [int(r["step"]) for r in beam_rows] == [4, 4] and beam_rows[0]["auto"] == "True"
    assert float(beam_rows[0]["sentences_per_s"]) > 0 and "The run's final evaluation decoded its 1216" in doc
    kernels = list(csv.DictReader(open(tmp_path / "gpu_profile.csv")))
    assert {r["model"] for r in kernels} == {"DynamicConv", "Transformer"} and all(
        float(r["ms_per_step"]) >= 0 for r in kernels)
