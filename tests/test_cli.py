"""The entry points' error contract: lconv's own checks (``UserError``) end in one line and exit code 2; every
other exception keeps its traceback, since it is a bug to report, not an input to fix."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from lconv.cli import runtime
from lconv.errors import NonFiniteLoss, UserError
from lconv.nn import mixers, models

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_user_error_is_one_line_and_exit_code_2(capsys):
    with pytest.raises(SystemExit) as info, runtime.user_errors():
        raise UserError("config.model.num_heads=0: must be >= 1")
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: config.model.num_heads=0: must be >= 1\n"


def test_a_diverged_run_is_a_user_error_and_still_a_floating_point_error(capsys):
    with pytest.raises(SystemExit), runtime.user_errors():
        raise NonFiniteLoss("non-finite loss (nan) by step 4")
    assert capsys.readouterr().err.count("\n") == 1
    assert issubclass(NonFiniteLoss, FloatingPointError) and issubclass(UserError, ValueError)


@pytest.mark.parametrize("error", [ValueError("Incompatible shapes for broadcasting"), FileNotFoundError("x"),
                                   TypeError("bug")])
def test_any_other_exception_keeps_its_traceback(error):
    with pytest.raises(type(error)), runtime.user_errors():
        raise error


def test_eval_py_on_a_directory_without_a_run_prints_one_line(tmp_path):
    result = subprocess.run([sys.executable, "eval.py", f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path}/config.json not found: --workdir must be a directory written by train.py"]


def test_a_mixer_field_the_model_does_not_have_is_an_error_not_a_silent_drop(monkeypatch):
    cls = mixers.mixer_class("attention")
    monkeypatch.setattr(cls, "model_fields", {**cls.model_fields, "attention_dropout": "attn_dropout"})
    cfg = models.ModelConfig(vocab_size=16, d_model=8, ffn_dim=8, num_heads=2, encoder_layers=1, decoder_layers=1,
                             encoder_mixer="attention", decoder_mixer="attention")
    with pytest.raises(TypeError, match="'attention' declares model field 'attn_dropout'"):
        models._mixer_fields(cfg, "attention", "encoder", 0, causal=False)


def test_mixers_declare_where_they_fit_and_the_models_enforce_it():
    assert mixers.sides("colt5") == ("encoder",) and mixers.sides("knn_memory") == ("decoder",)
    assert mixers.sides("lightconv") == ("encoder", "decoder")
    base = dict(vocab_size=16, d_model=8, ffn_dim=8, num_heads=2, encoder_layers=1, decoder_layers=1)
    with pytest.raises(UserError, match="encoder_mixer: 'knn_memory' is a decoder-only mixer"):
        models.ModelConfig(**base, encoder_mixer="knn_memory", decoder_mixer="attention").validate()
    with pytest.raises(UserError, match="decoder_mixer: 'colt5' is an encoder-only mixer"):
        models.ModelConfig(**base, encoder_mixer="attention", decoder_mixer="colt5").validate()


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"LCONV_NUM_PROCESSES": "2", "LCONV_COORDINATOR": "h:1", "LCONV_PROCESS_ID": "0"}, "lconv"),
    ({"LCONV_NUM_PROCESSES": "1"}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "8"}, "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1"}, None),  # one task: one process
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}, None),  # sbatch's shell, not an srun step
    ({"OMPI_MCA_orte_hnp_uri": "1;tcp://h:1", "OMPI_COMM_WORLD_SIZE": "4"}, "openmpi"),
    ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),  # a single-host TPU VM
    ({"MEGASCALE_COORDINATOR_ADDRESS": "c:8080"}, "tpu"),
])
def test_the_launcher_is_detected_from_its_environment(environ, expected):
    assert runtime.cluster_environment(environ) == expected


def test_a_cluster_launch_initializes_jax_distributed_from_the_environment(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    for name in [n for n in __import__("os").environ if n.startswith(("LCONV_", "SLURM_", "OMPI_", "TPU_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    runtime.initialize()
    assert calls == [{}]  # no arguments: JAX's own SLURM detection fills them
    monkeypatch.setenv("LCONV_NUM_PROCESSES", "2")
    with pytest.raises(UserError, match="LCONV_NUM_PROCESSES=2 needs LCONV_COORDINATOR and LCONV_PROCESS_ID too"):
        runtime.initialize()
