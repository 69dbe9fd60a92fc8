"""The entry points' error contract: lconv's own checks (``UserError``) end in one line and exit code 2; every
other exception keeps its traceback, since it is a bug to report, not an input to fix."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import helpers
import numpy as np
import pytest

from lconv import console
from lconv.cli import runtime
from lconv.errors import NonFiniteLoss, UserError
from lconv.nn import mixers, models

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_user_error_is_one_line_and_exit_code_2(capsys):
    with pytest.raises(SystemExit) as info, runtime.user_errors():
        raise UserError("config.model.num_heads=0: must be >= 1")
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: config.model.num_heads=0: must be >= 1\n"


def test_a_user_error_shows_the_control_characters_of_a_name_as_escapes_never_raw(capsys):
    hostile_name = "x\x1b]0;PWNED-TITLE\x07\x1b[2J\x1b[31mRED\x9b"
    with pytest.raises(SystemExit), runtime.user_errors():
        raise UserError(f"checkpoint file {hostile_name} is a pipe")
    err = capsys.readouterr().err
    assert err == "error: checkpoint file x\\x1b]0;PWNED-TITLE\\x07\\x1b[2J\\x1b[31mRED\\x9b is a pipe\n"
    with pytest.raises(SystemExit):  # a flag's line (a config file's name) is printed the same way
        console.exit_with("--config=/nowhere/\x1b[2Jx.py: no such file")
    assert capsys.readouterr().err == "error: --config=/nowhere/\\x1b[2Jx.py: no such file\n"
    code, _, err = helpers.run_cli(capsys, "lconv.data", "en_\x1b[2Jde")  # python -m lconv.data's own parser
    assert code == 2 and "\x1b" not in err and "en_\\x1b[2Jde" in err and err.count("\n") == 1


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


@pytest.mark.slow  # launches a process: the slow tier
def test_eval_py_on_a_directory_without_a_run_prints_one_line(tmp_path):
    result = subprocess.run([sys.executable, "eval.py", f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    helpers.one_line_error(result, f"--workdir={tmp_path}", "config.json")  # names the path and what is missing


def test_a_mixer_field_the_model_does_not_have_is_an_error_not_a_silent_drop(monkeypatch):
    cls = mixers.mixer_class("attention")
    monkeypatch.setattr(cls, "model_fields", {**cls.model_fields, "attention_dropout": "attn_dropout"})
    cfg = models.ModelConfig(vocab_size=16, d_model=8, ffn_dim=8, num_heads=2, encoder_layers=1, decoder_layers=1,
                             encoder_mixer="attention", decoder_mixer="attention")
    with pytest.raises(UserError) as info:  # a plugin author's mistake: one line naming the mixer and the field
        models._mixer_fields(cfg, "attention", "encoder", 0, causal=False)
    assert "'attention'" in str(info.value) and "'attn_dropout'" in str(info.value) and "\n" not in str(info.value)


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
    # The manual launcher on CPUs: gloo, and one program at a time (collectives reach gloo in program order).
    settings = {}
    monkeypatch.setattr(jax.config, "update", lambda name, value: settings.update({name: value}))
    monkeypatch.setenv("LCONV_COORDINATOR", "localhost:1234")
    monkeypatch.setenv("LCONV_PROCESS_ID", "1")
    runtime.initialize()
    assert calls[-1] == {"coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1}
    assert settings == {"jax_cpu_collectives_implementation": "gloo", "jax_cpu_enable_async_dispatch": False}
    # An index past the count was a 21-line ValueError from jax; a port-less coordinator, a wait without end.
    for name, value, named in (("LCONV_PROCESS_ID", "7", "0 to 1"), ("LCONV_PROCESS_ID", "one", "0 to 1"),
                               ("LCONV_COORDINATOR", "localhost", "host:port"),
                               ("LCONV_COORDINATOR", "127.0.0.1:99999", "port 1-65535")):
        monkeypatch.setenv("LCONV_COORDINATOR", "localhost:1234")
        monkeypatch.setenv("LCONV_PROCESS_ID", "1")
        monkeypatch.setenv(name, value)
        with pytest.raises(UserError) as error:
            runtime.initialize()
        helpers.one_line_error(error, name, repr(value), named)
    assert len(calls) == 2


# ----------------------------------------------------------------------------------------------------------------
# eval.py: LM prompts, --interactive, flag combinations, process-0 writes; --config by packaged name
# ----------------------------------------------------------------------------------------------------------------
def _workdir_of(tmp_path, trained, monkeypatch):
    """A workdir holding ``trained``'s config.json, whose ``load_trained`` gives ``trained`` (an untrained
    in-memory run: eval's logic is under test, not the model)."""
    from lconv.run import restore

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(helpers.config_json(trained.config))
    monkeypatch.setattr(restore, "load_trained", lambda *args, **kwargs: trained)
    return workdir


def test_eval_continues_an_lm_runs_prompts_as_the_api_does(tmp_path, monkeypatch):
    import tiny_runs

    from lconv.api import Model
    from lconv.cli import eval_program

    trained = tiny_runs.in_memory(tiny_runs.lm_config())
    workdir = _workdir_of(tmp_path, trained, monkeypatch)
    prompts = ["The small package", "", "Fonts and images for the server"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    report = eval_program.run(str(workdir), source_file=str(tmp_path / "prompts.txt"),
                          output_file=str(tmp_path / "out.txt"), max_len=5, temperature=1.0, top_p=0.9, seed=3)
    expected = Model(trained).generate(prompts, max_len=5, temperature=1.0, top_p=0.9, seed=3)
    assert (tmp_path / "out.txt").read_text().split("\n")[:-1] == [e.replace("\n", " ") for e in expected]
    assert report["examples"] == 3 and report["truncated_prompts"] == 0 and report["top_p"] == 0.9


def test_interactive_decodes_each_line_with_one_program_per_bucket(tmp_path, monkeypatch):
    import io

    import tiny_runs

    from lconv.api import Model
    from lconv.cli import eval_program
    from lconv.infer import compiled

    trained = tiny_runs.in_memory(tiny_runs.translation_config())
    workdir = _workdir_of(tmp_path, trained, monkeypatch)
    built, original = [], compiled.Translator

    def recording(*args):
        built.append(original(*args))
        return built[-1]

    monkeypatch.setattr(compiled, "Translator", recording)
    lines = ["Fast tool.", "A library for the window system and fonts.", "Data"]
    stdout = io.StringIO()
    report = eval_program.run(str(workdir), interactive=True, stdin=io.StringIO("\n".join(lines) + "\n"),
                          stdout=stdout)
    assert report == {"examples": 3, "not_utf8_lines": 0} and len(built) == 1
    assert built[0].jitted._cache_size() == 1  # three lengths, one (1 row, 32 wide) bucket: compiled once
    model = Model(trained)
    assert stdout.getvalue().splitlines() == [model.translate([line])[0] for line in lines]

    # A run's pieces can hold escape sequences (a handed-over spm.model): a terminal is shown them escaped, a pipe
    # gets the text as it is.
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    from lconv.infer import per_line

    found = per_line.translate_lines
    monkeypatch.setattr(per_line, "translate_lines", lambda *a, **k: dataclasses.replace(
        found(*a, **k), hypotheses=["\x1b]0;PWNED\x07\x1b[2J"]))
    for stdout, shown in ((Terminal(), "\\x1b]0;PWNED\\x07\\x1b[2J"), (io.StringIO(), "\x1b]0;PWNED\x07\x1b[2J")):
        eval_program.run(str(workdir), interactive=True, stdin=io.StringIO("Data\n"), stdout=stdout)
        assert stdout.getvalue() == shown + "\n"


def _nbest_blocks(text):
    """fairseq-generate's H/P lines -> {source index: [(score, text, token scores), ...]} in file order."""
    blocks, lines = {}, text.split("\n")[:-1]
    assert len(lines) % 2 == 0
    for h, p in zip(lines[::2], lines[1::2]):
        tag, score, hypothesis = h.split("\t")
        p_tag, token_scores = p.split("\t")
        assert tag.startswith("H-") and p_tag == "P-" + tag[2:]
        blocks.setdefault(int(tag[2:]), []).append((float(score), hypothesis, [float(x) for x in token_scores.split()]))
    return blocks


def test_eval_py_writes_nbest_lists_with_the_apis_scores(tmp_path, monkeypatch, capsys):
    import helpers
    import tiny_runs

    from lconv.api import Model

    trained = tiny_runs.in_memory(tiny_runs.translation_config())
    workdir = _workdir_of(tmp_path, trained, monkeypatch)
    sources = ["Fast tool.", "", "A library for the window system and fonts."]
    (tmp_path / "in.txt").write_text("\n".join(sources) + "\n")
    code, _, err = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", f"--source_file={tmp_path / 'in.txt'}",
                                   f"--output_file={tmp_path / 'out.txt'}", "--beam_size=3", "--nbest=2",
                                   "--compilation_cache=none")
    assert code == 0, err
    blocks = _nbest_blocks((tmp_path / "out.txt").read_text())
    expected = Model(trained).translate(sources, beam_size=3, nbest=2)
    assert sorted(blocks) == [0, 2]  # 0-based as fairseq numbers sources; a blank source has no hypothesis
    for index, entries in blocks.items():
        written = [(e["text"].replace("\n", " ").replace("\t", " "), e["score"]) for e in expected[index]]
        assert [(text, score) for score, text, _ in entries] == written
        for (_, _, token_scores), entry in zip(entries, expected[index], strict=True):
            np.testing.assert_allclose(token_scores, entry["token_scores"], atol=5e-5)  # printed to 4 decimals
    code, out, err = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", f"--source_file={tmp_path / 'in.txt'}",
                                     "--output_file=-", "--beam_size=3", "--nbest=2", "--compilation_cache=none")
    assert code == 0, err
    assert out == (tmp_path / "out.txt").read_text() and "outputs written" not in out  # the log goes to stderr


def test_printed_outputs_are_escaped_on_a_terminal_only():
    """``--output_file=-`` prints a run's text: on a terminal its control characters (which set the title or clear
    the screen) are shown as escapes; through a pipe the bytes are the program's data, as written to a file."""
    import io

    from lconv.cli import eval_program

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with pytest.MonkeyPatch.context() as patch:  # started with stdout closed: Python's sys.stdout is None (r28-37)
        patch.setattr(sys, "stdout", None)
        with pytest.raises(UserError, match="^--output_file=-: stdout is closed"):
            eval_program.run("no_run", source_file="in.txt", output_file="-")
    for closed in ("stdin", "stdout"):  # --interactive with either closed: a traceback after loading (r29-27)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, closed, None)
            with pytest.raises(UserError, match="^--interactive .* one of them closed"):
                eval_program.run("no_run", interactive=True)
    text = "a \x1b]0;title\x07b\n"
    for stream, expected in ((io.StringIO(), text), (Terminal(), "a \\x1b]0;title\\x07b\n")):
        eval_program._write_text(stream, text)
        assert stream.getvalue() == expected


def test_eval_py_samples_translations_as_the_api_does(tmp_path, monkeypatch):
    import io

    import tiny_runs

    from lconv.api import Model
    from lconv.cli import eval_program

    trained = tiny_runs.in_memory(tiny_runs.translation_config())
    workdir = _workdir_of(tmp_path, trained, monkeypatch)
    (workdir / "spm.model").write_bytes(trained.tokenizer.model_proto)  # --top_k is checked against its vocabulary
    sources = ["Fast tool.", "Data files for the small editor."]
    (tmp_path / "in.txt").write_text("\n".join(sources) + "\n")
    sampling = dict(temperature=1.0, top_k=20, top_p=0.9, seed=5)
    eval_program.run(str(workdir), source_file=str(tmp_path / "in.txt"), output_file=str(tmp_path / "out.txt"),
                     **sampling)
    model = Model(trained)
    expected = [text.replace("\n", " ") for text in model.translate(sources, **sampling)]
    assert (tmp_path / "out.txt").read_text().split("\n")[:-1] == expected
    stdout = io.StringIO()
    eval_program.run(str(workdir), interactive=True, nbest=2, stdin=io.StringIO(sources[1] + "\n"), stdout=stdout,
                     **sampling)
    (entries,) = _nbest_blocks(stdout.getvalue()).values()
    samples = model.translate(sources[1], nbest=2, **sampling)
    assert [text for _, text, _ in entries] == [e["text"].replace("\n", " ").replace("\t", " ") for e in samples]


def _config_only(tmp_path, config):
    workdir = tmp_path / "run"
    workdir.mkdir(exist_ok=True)
    (workdir / "config.json").write_text(helpers.config_json(config))
    return str(workdir)


@pytest.mark.parametrize("task, flags, message", [
    ("lm", dict(beam_size=4), "--beam_size: an lm run samples rather than beam-searches"),
    ("lm", dict(source_file="p.txt", reference_file="r.txt"), "--reference_file: an lm run continues the prompts"),
    ("lm", dict(temperature=0.7), "--temperature go with prompts: --source_file (one per line) or --interactive"),
    ("translation", dict(top_k=5, seed=1), "--top_k, --seed go with sources: --source_file (one per line) or "
                                           "--interactive"),
    ("translation", dict(nbest=2), "--nbest go with sources: --source_file (one per line) or --interactive"),
    ("translation", dict(max_len=5, source_file="s.txt"), "--max_len: for lm runs"),
    ("translation", dict(nbest=5, beam_size=4, source_file="s.txt"), "--nbest=5: must be at most the beam size (4)"),
    ("translation", dict(nbest=10**6, beam_size=4, source_file="s.txt"), "--nbest=1000000: at most "),  # r29-32
    ("translation", dict(nbest=0, source_file="s.txt"), "--nbest=0: must be an integer >= 1"),
    ("translation", dict(temperature=0.5, beam_size=3, interactive=True), "--beam_size=3: not used when sampling"),
    ("lm", dict(nbest=2, source_file="p.txt"), "--nbest=2: for translation and summarization runs"),
    ("translation", dict(interactive=True, source_file="s.txt"), "--source_file does not go with --interactive"),
    ("translation", dict(interactive=True, output_file="o.txt"), "--output_file does not go with --interactive"),
    ("lm", dict(top_p=0.0, source_file="p.txt"), "--top_p=0.0: must be in [1e-06, 1]"),
    ("lm", dict(max_len=0, source_file="p.txt"), "--max_len=0: must be an integer >= 1"),
    ("lm", dict(temperature=float("nan"), interactive=True), "--temperature=nan: must be 0 (greedy) or a number in "),
    ("lm", dict(temperature=1e-38, interactive=True), "--temperature=1e-38: must be 0 (greedy) or a number in "
                                                      "[1e-06, 1e+06]"),
    ("translation", dict(no_repeat_ngram_size=-1), "--no_repeat_ngram_size=-1: must be an integer in [0, 64]"),
    ("translation", dict(min_len=2.5, source_file="s.txt"), "--min_len=2.5: must be an integer in [0, "),
    ("lm", dict(min_len=3), "--min_len go with prompts: --source_file (one per line) or --interactive"),
    ("lm", dict(temperature=0.7, no_repeat_ngram_size=3), "--temperature, --no_repeat_ngram_size go with prompts"),
])
def test_eval_flag_combinations_that_do_not_fit_are_one_line_errors(task, flags, message, tmp_path, monkeypatch):
    import tiny_config
    import tiny_runs

    from lconv.cli import eval_program
    from lconv.run import restore

    monkeypatch.setattr(restore, "load_trained", lambda *a, **k: pytest.fail("loaded before the flags were checked"))
    config = tiny_runs.lm_config() if task == "lm" else tiny_config.get_config()
    with pytest.raises(UserError, match=f"^{re.escape(message)}[^\n]*$"):  # one line
        eval_program.run(_config_only(tmp_path, config), **flags)


def test_eval_py_prints_a_flag_combination_error_in_one_line(tmp_path, capsys):
    import helpers
    import tiny_config

    workdir = _config_only(tmp_path, tiny_config.get_config())
    code, _, err = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", "--temperature=0.5")  # main, in-process
    assert helpers.one_line_error((code, "", err), "--temperature", "--source_file", "--interactive")
    assert err == ("error: --temperature go with sources: --source_file (one per line) or --interactive; a split is "
                   "scored on its beam search's best hypotheses\n")


def test_outputs_are_written_by_process_0_only(tmp_path, monkeypatch):
    import jax

    from lconv.cli import eval_program
    from lconv.infer import reports

    reports.write_outputs(str(tmp_path), "test", ["a\nb", "c"], {"bleu": 1.0})
    eval_program._write_lines(str(tmp_path / "out.txt"), ["x"])
    assert (tmp_path / "test.hyp.txt").read_text() == "a b\nc\n" and (tmp_path / "out.txt").read_text() == "x\n"
    assert json.loads((tmp_path / "test.scores.json").read_text()) == {"bleu": 1.0}
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    reports.write_outputs(str(tmp_path / "p1"), "test", ["a"], {"bleu": 1.0})  # the folder does not even exist
    eval_program._write_lines(str(tmp_path / "p1.txt"), ["x"])
    assert not (tmp_path / "p1").exists() and not (tmp_path / "p1.txt").exists()


def test_a_packaged_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    packaged = str(ROOT / "lconv" / "configs" / "default.py")
    assert runtime.resolve_config_argument(["p", "--config=default:transformer", "--workdir=w"]) == [
        "p", f"--config={packaged}:transformer", "--workdir=w"]
    assert runtime.resolve_config_argument(["p", "--config", "wmt_en_de.py"])[2] == packaged.replace(
        "default.py", "wmt_en_de.py")
    (tmp_path / "default").mkdir()  # `--config=default --workdir=default`, run again to resume: found by name again
    assert runtime.resolve_config_argument(["p", "--config=default"]) == ["p", f"--config={packaged}"]
    (tmp_path / "mine.py").write_text("")
    mine = os.path.realpath(tmp_path / "mine.py")  # the file checked is the file loaded: by its resolved path
    assert runtime.resolve_config_argument(["p", "--config=mine.py:x"]) == ["p", f"--config={mine}:x"]
    (tmp_path / "default.py").write_text("raise SystemExit('planted')")  # a bare packaged name is never this file
    assert runtime.resolve_config_argument(["p", "--config=default.py"]) == ["p", f"--config={packaged}"]
    assert runtime.resolve_config_argument(["p", "--config=./default.py"]) == [
        "p", f"--config={os.path.realpath(tmp_path / 'default.py')}"]
    for argv in (["p", "-config=default.py"], ["p", "-config", "default"], ["p", "--config", "default"]):
        assert runtime.resolve_config_argument(argv)[-1].endswith(f"={packaged}") or \
            runtime.resolve_config_argument(argv)[-1] == packaged  # absl's one-dash spellings too (r28-5)
    with pytest.raises(UserError, match="^--config=configs/default.py: no such file"):  # a path, not a name
        runtime.resolve_config_argument(["p", "--config=configs/default.py"])
    with pytest.raises(UserError, match="^--config=nope: no such file, nor a config packaged with lconv; "
                                        "packaged: .*default.*wmt_en_de"):
        runtime.resolve_config_argument(["p", "--config=nope"])
    assert "common" not in runtime.packaged_configs() and "lm1b" in runtime.packaged_configs()


@pytest.mark.slow  # launches a process: the slow tier
def test_python_m_lconv_train_loads_a_packaged_config_outside_the_checkout(tmp_path):
    """From another directory, with lconv importable as an install makes it: the config is found by name and
    loaded (its variant check runs), and a bad variant is one line naming what the user typed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "lconv.train", "--config=default:nope", f"--workdir={tmp_path}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith(
        "error: --config=default:nope: unknown config variant(s) ['nope']"), result.stderr


@pytest.mark.parametrize("entry", [["train.py"], ["eval.py"], *[pytest.param(e, marks=pytest.mark.slow) for e in (
    ["-m", "lconv.export"], ["-m", "lconv.import_fairseq"], ["-m", "lconv.study"])]])  # launched: the slow tier
def test_asking_an_absl_entry_point_for_help_prints_its_flags_and_succeeds(entry, capsys):
    """absl exits 1 after printing --help; a user (and CI's install check) asking for help gets exit code 0.
    train.py and eval.py run in this process (their mains are lconv.train.__main__'s and lconv.cli.programs'); the
    others are launched."""
    import helpers

    if entry[0].endswith(".py"):
        code, stdout, stderr = helpers.run_cli(capsys, entry[0], "--help")
    else:
        result = helpers.launch(*entry, "--help", timeout=120)
        code, stdout, stderr = result.returncode, result.stdout, result.stderr
    assert code == 0 and "--" in stdout and "flags:" in stdout, stderr[-500:]


@pytest.mark.slow  # launches a process: the slow tier
def test_a_second_eval_reads_every_program_back_from_the_users_compilation_cache(tmp_path):
    """eval.py keeps what it compiles in this user's cache folder, not the workdir (an entry is code): the same
    command again compiles nothing (every program a persistent-cache hit, none a miss), adds no entry and writes the
    same outputs."""
    from lconv.interop import fairseq_workdir

    fixtures = ROOT / "tests" / "fixtures" / "fairseq"
    workdir = tmp_path / "run"
    fairseq_workdir.import_checkpoint(str(fixtures / "dynamic" / "checkpoint_last.pt"), str(fixtures / "dict.txt"),
                                      str(fixtures / "spm.model"), str(workdir), decode={"beam_size": 2})
    sources = (fixtures / "test.src").read_text(encoding="utf-8").splitlines()[:4]
    (tmp_path / "sources.txt").write_text("\n".join(sources) + "\n", encoding="utf-8")
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_LOG_COMPILES": "1",
           "JAX_EXPLAIN_CACHE_MISSES": "1",  # cache every program; log each hit and miss
           "XDG_CACHE_HOME": str(tmp_path / "xdg")}  # the user's cache, here rather than the real ~/.cache
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cache = tmp_path / "xdg" / "lconv" / runtime.COMPILATION_CACHE

    def evaluate(output):
        done = subprocess.run([sys.executable, "eval.py", f"--workdir={workdir}",
                               f"--source_file={tmp_path / 'sources.txt'}", f"--output_file={tmp_path / output}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr

    first = evaluate("first.txt")
    entries = sorted(os.listdir(cache))
    assert "PERSISTENT COMPILATION CACHE MISS" in first and entries
    assert not (workdir / runtime.COMPILATION_CACHE).exists()
    second = evaluate("second.txt")
    assert "Persistent compilation cache hit" in second and "PERSISTENT COMPILATION CACHE MISS" not in second
    assert sorted(os.listdir(cache)) == entries
    assert (tmp_path / "second.txt").read_text() == (tmp_path / "first.txt").read_text()


def test_eval_py_scores_the_test_split_by_default(monkeypatch, tmp_path):
    """The split eval.py scores is a view of the run's data for that pass: training's rule that eval_splits hold
    validation does not refuse ``--split=test`` (it did, for every run, once the config was typed)."""
    import tiny_runs

    from lconv.cli import eval_program
    from lconv.data import pipeline
    from lconv.infer import split_scoring

    trained, seen = tiny_runs.in_memory(tiny_runs.translation_config()), {}

    def make_datasets(data, tokenizer):
        seen["data"] = data
        return types.SimpleNamespace(eval_sets={"test": []})

    monkeypatch.setattr(pipeline, "make_datasets", make_datasets)
    monkeypatch.setattr(split_scoring, "score_split", lambda config, *args, **kwargs: {"split": kwargs["split"]})
    assert eval_program._score_split(trained, None, str(tmp_path), "test", "test", None) == {"split": "test"}
    assert seen["data"].eval_splits == ("test",) and trained.config.data.eval_splits == ("validation", "test")


def test_an_interactive_line_without_end_is_one_error_not_all_memory():
    """``--interactive < /dev/zero``: a line past the limit is one line naming it; the lines before it are decoded."""
    import io

    from lconv.cli import eval_program

    limit = eval_program.STDIN_LINE_LIMIT
    lines = eval_program._stdin_lines(io.BytesIO(b"ka lo\n" + b"\0" * (limit + 1)))
    assert next(lines) == (1, "ka lo")
    with pytest.raises(UserError, match=f"stdin line 2: more than {limit:,} bytes without a newline"):
        next(lines)
    assert list(eval_program._stdin_lines(io.StringIO("a\n\nb"))) == [(1, "a"), (2, ""), (3, "b")]


def test_a_flagfiles_config_name_is_the_packaged_config_too(tmp_path, monkeypatch, capsys):
    """``--flagfile`` holding ``--config=default``, run in a folder holding another ``default``: absl read the
    flagfile after lconv had resolved the command line's config names, so the folder's file ran (round 28,
    r28-6)."""
    import helpers

    from lconv.cli import flag_files

    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_text("import pathlib\\npathlib.Path('ran').write_text('planted')\\n")
    (tmp_path / "flags.txt").write_text("--config=default\\n--config.train.num_steps=-1\\n")
    code, _, err = helpers.run_cli(capsys, "train.py", f"--flagfile={tmp_path / 'flags.txt'}",
                                   f"--workdir={tmp_path / 'run'}")
    assert code == 2 and "num_steps=-1" in err and not (tmp_path / "ran").exists()
    # absl and ml_collections read any flag file whole, before lconv's errors could name it: a missing one was a
    # traceback from train.py, /dev/zero took the host's memory (r29-15), bytes not UTF-8 a traceback (r29-25)
    (tmp_path / "binary.txt").write_bytes(b"--workdir=w\n\xff\n")
    (tmp_path / "big.txt").write_text("# " + "x" * flag_files.LIMIT_BYTES + "\n")
    (tmp_path / "nested.txt").write_text(f"--flagfile={tmp_path / 'binary.txt'}\n")
    os.mkfifo(tmp_path / "pipe.txt")
    for name, named in (("missing.txt", "no such file"), ("binary.txt", "byte offset 12 is not UTF-8"),
                        ("big.txt", "more than the 1,048,576"), ("nested.txt", "binary.txt: byte offset 12"),
                        ("pipe.txt", "not a regular file")):
        for program in ("train.py", "eval.py"):
            outcome = helpers.run_cli(capsys, program, "--flagfile", str(tmp_path / name), "--workdir=w")
            helpers.one_line_error(outcome, "--flagfile=", named)
    if os.getuid() == 0:  # another user's flag file: its flags would be the command line's (--trust_plugins)
        (tmp_path / "theirs.txt").write_text("--trust_plugins\n")
        os.chown(tmp_path / "theirs.txt", 4243, -1)
        with pytest.raises(UserError, match="theirs.txt belongs to another user"):
            flag_files.expand(["p", f"--flagfile={tmp_path / 'theirs.txt'}"])
        (tmp_path / "their_link.txt").symlink_to(tmp_path / "cycle.txt")  # they could point it elsewhere (r30-1)
        os.chown(tmp_path / "their_link.txt", 4243, -1, follow_symlinks=False)
        with pytest.raises(UserError, match="their_link.txt is a link another user owns"):
            flag_files.expand(["p", f"--flagfile={tmp_path / 'their_link.txt'}"])
    (tmp_path / "cycle.txt").write_text(f"# a comment\n\n  --flagfile={tmp_path / 'cycle.txt'}  \n"
                                        "--config.train.num_steps=-1\n// another\n")
    (tmp_path / "two_lines.txt").write_text(f"--flagfile\n{tmp_path / 'cycle.txt'}\n--beam_size=2\n")
    assert flag_files.expand(["p", "-a", f"-flagfile={tmp_path / 'cycle.txt'}", "--flagfile",
                              str(tmp_path / "two_lines.txt"), "--", "--flagfile=x"]) == [
        "p", "-a", "--config.train.num_steps=-1", "--config.train.num_steps=-1", "--beam_size=2", "--",
        "--flagfile=x"]  # each file read once per nesting, as absl does; a file's two-line form too (r30-3)
    # A file named 3,000 times in a file named 3,000 times: absl expanded 450 million flags (r30-11)
    (tmp_path / "c.txt").write_text("--beam_size=2\n" * 50)
    (tmp_path / "b.txt").write_text(f"--flagfile={tmp_path / 'c.txt'}\n" * 3000)
    (tmp_path / "a.txt").write_text(f"--flagfile={tmp_path / 'b.txt'}\n" * 3000)
    with pytest.raises(UserError, match=f"more than {flag_files.LIMIT_FLAGS:,} flags and flag files in all"):
        flag_files.expand(["p", f"--flagfile={tmp_path / 'a.txt'}"])
    # ... or files that expand to nothing, named often enough to keep a core busy (r31-5); a chain deeper than
    # Python's recursion (r31-6)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "many.txt").write_text(f"--flagfile={tmp_path / 'empty.txt'}\n" * 1500)
    for number in range(5):
        (tmp_path / f"chain{number}.txt").write_text(f"--flagfile={tmp_path / f'chain{number + 1}.txt'}\n")
    (tmp_path / "chain5.txt").write_text("--beam_size=2\n")
    (tmp_path / "wide.txt").write_text("--beam_size=2 " + "#" * 1000 + "\n")  # one long flag, named often (r32-12)
    (tmp_path / "often.txt").write_text(f"--flagfile={tmp_path / 'wide.txt'}\n" * 20)
    sticky = tmp_path / "sticky"  # a name another user put in a sticky folder would be taken as yours (r32-11)
    sticky.mkdir()
    (sticky / "flags.txt").write_text("--beam_size=2\n")
    sticky.chmod(0o1777)
    with pytest.raises(UserError, match="lets other users add files"):
        flag_files.expand(["p", f"--flagfile={sticky / 'flags.txt'}"])
    with monkeypatch.context() as patch:
        patch.setattr(flag_files, "LIMIT_EXPANDED_BYTES", 10_000)
        with pytest.raises(UserError, match="wide.txt: the flag files named take more than 10,000 bytes"):
            flag_files.expand(["p", f"--flagfile={tmp_path / 'often.txt'}"])
    with monkeypatch.context() as patch:
        patch.setattr(flag_files, "LIMIT_FLAGS", 1000)
        patch.setattr(flag_files, "LIMIT_DEPTH", 3)
        with pytest.raises(UserError, match="many.txt: more than 1,000 flags and flag files"):
            flag_files.expand(["p", f"--flagfile={tmp_path / 'many.txt'}"])
        with pytest.raises(UserError, match="chain3.txt: flag files nested more than 3 deep"):
            flag_files.expand(["p", f"--flagfile={tmp_path / 'chain0.txt'}"])
    assert flag_files.expand(["p", f"--flagfile={tmp_path / 'chain0.txt'}"]) == ["p", "--beam_size=2"]
