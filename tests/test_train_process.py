"""train.py as a user runs it, in subprocesses: SIGTERM saves and exits cleanly, a ``kill -9`` loses nothing (the
resumed run logs exactly the losses of an uninterrupted one), two processes on localhost train together over
gloo, score the whole test split exactly as one process does and stop together when one of them is preempted,
and a bad flag is one line on stderr."""
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import helpers
import pytest
import tiny_config

from lconv.cli import eval_program
from lconv.data import sources, tokenizer_files
from lconv.data import tokenizer as tokenizer_lib
from lconv.run import checkpoints
from lconv.train import loop

# slow: each case launches train.py processes (run by CI, skipped by the quick command).
# One xdist worker runs them all (pyproject:
# --dist loadgroup), so their shared fixture is built once, not once per worker. It is session-scoped: the
# worker may run other modules' tests between these, and a module fixture would then be torn down and built again.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_process")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def prepared(tiny_data, tmp_path):
    """The shared prepared data and tokenizer (tests/conftest.py), so the subprocesses only train: (folder for
    this test's workdirs, tiny_data)."""
    return tmp_path, tiny_data


def _workdir(prepared, name):
    root, tiny_data = prepared
    return helpers.new_workdir(tiny_data, root / name)


def _launch(prepared, workdir, *overrides, devices=8, env=None, data_dir=None):
    _, tiny_data = prepared
    command = [sys.executable, "train.py", "--config=tests/tiny_config.py", f"--workdir={workdir}",
               f"--config.data.data_dir={data_dir or tiny_data.data_dir}", *overrides]
    # A single process inherits $JAX_COMPILATION_CACHE_DIR (tests/conftest.py): the launches share compiled
    # programs. Processes of a multi-process run keep train.py's default cache, as a user's run does: the user's
    # folder, here one beside the workdir for each run ($XDG_CACHE_HOME) rather than the real ~/.cache.
    full_env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "PYTHONFAULTHANDLER": "1",
                "XLA_FLAGS": helpers.xla_flags(devices), **(env or {})}
    if "LCONV_NUM_PROCESSES" in full_env:
        full_env.pop("JAX_COMPILATION_CACHE_DIR", None)
        full_env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
        full_env["XDG_CACHE_HOME"] = f"{workdir}.user_cache"
    return subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _logged(workdir):
    """Every train row written so far, in order: [(step, loss)] (a resumed run writes some steps again)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]


def _wait_for_step(process, workdir, step, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(s >= step for s, _ in _logged(workdir)):
            return
        if process.poll() is not None:
            raise AssertionError(f"train.py ended (rc {process.returncode}) before step {step}: "
                                 f"{process.stderr.read()[-2000:]}")
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"no step {step} within {timeout}s")


def _finish(process, timeout=240):
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # e.g. processes waiting on each other's collectives: never leave them
        process.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's Python stack goes to stderr
        out, err = process.communicate()
        raise AssertionError(f"train.py did not end within {timeout}s; its threads' stacks: {err[-6000:]}") from None
    assert process.returncode == 0, err[-3000:]
    return out


STEPS = ("--config.train.num_steps=40", "--config.train.checkpoint_every=5", "--config.train.eval_every=1000")


def test_sigterm_then_kill_9_then_resume_logs_the_uninterrupted_losses(prepared):
    workdir = _workdir(prepared, "interrupted")
    run = _launch(prepared, workdir, *STEPS)
    _wait_for_step(run, workdir, 8)
    run.send_signal(signal.SIGTERM)
    out = _finish(run)
    stopped = int(out.split("stopping at step ")[1].split(":")[0])
    assert "SIGTERM" in out and stopped >= 8
    assert str(stopped) in os.listdir(workdir / "checkpoints")  # saved on the way out, off the 5-step grid

    run = _launch(prepared, workdir, *STEPS)
    _wait_for_step(run, workdir, stopped + 10)
    assert run.poll() is None, "the run ended before it could be killed"
    run.kill()  # SIGKILL: no handler runs, a checkpoint may be half written
    run.wait()
    _finish(_launch(prepared, workdir, *STEPS))

    _, tiny_data = prepared
    reference = _workdir(prepared, "reference")
    config = tiny_config.training_config(tiny_data.data_dir, num_steps=40, checkpoint_every=5, eval_every=1000)
    loop.train_and_evaluate(config, str(reference))
    expected = dict(_logged(reference))
    logged = _logged(workdir)
    assert sorted(expected) == list(range(1, 41)) and {s for s, _ in logged} == set(expected)
    assert len(logged) == 40  # each step once: a resumed run drops the rows of the steps it trains again
    for step, loss in logged:
        assert loss == pytest.approx(expected[step], rel=1e-6), step


def _launch_two(prepared, workdir, *overrides, data_dir=None):
    """train.py as two processes of 4 CPU devices each over gloo (not yet finished)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    return [_launch(prepared, workdir, *overrides, devices=4, data_dir=data_dir,
                    env={"LCONV_NUM_PROCESSES": "2", "LCONV_PROCESS_ID": str(i),
                         "LCONV_COORDINATOR": f"localhost:{port}"}) for i in range(2)]


def _finish_all(runs, timeout=240):
    """Every run's stdout. When one fails or hangs, the others are stopped too (left alone they would wait on it for
    ever), and their stacks are part of the failure: a hang is one process waiting on another."""
    try:
        return [_finish(run, timeout) for run in runs]
    except AssertionError as failure:
        others = []
        for index, run in enumerate(runs):
            if run.stderr.closed:  # the failed one, already read
                continue
            if run.poll() is None:
                run.send_signal(signal.SIGABRT)
            err = run.communicate()[1]
            others.append(f"process {index} (rc {run.returncode}), the end of its stderr: {err[-6000:]}")
        raise AssertionError("\n".join([str(failure), *others])) from None
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()


def _two_processes(prepared, workdir, *overrides, timeout=240, data_dir=None):
    """train.py as two processes to the end; returns both processes' stdout."""
    return _finish_all(_launch_two(prepared, workdir, *overrides, data_dir=data_dir), timeout)


TWO_STEPS = ("--config.train.num_steps=20", "--config.train.checkpoint_every=5", "--config.train.eval_every=10")


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory):
    """One uninterrupted two-process run from an empty data dir and workdir (a first launch on a pod), scoring the
    test split after training: ``(workdir, data_dir, both stdouts)``. Shared by the tests below (each launch of two
    processes costs about a minute on 2 cores)."""
    root = tmp_path_factory.mktemp("two_processes")
    workdir, data_dir = root / "run", root / "fresh_tfds"
    outs = _two_processes((root, None), workdir, *TWO_STEPS, "--config.train.eval_after_training=True",
                          data_dir=data_dir, timeout=600)  # preparing the data and the tokenizer comes first
    return workdir, data_dir, outs


def test_two_processes_start_from_an_empty_data_dir_and_workdir(two_process_run):
    """Process 0 prepares the data and trains the tokenizer while the other waits; both train on the same
    vocabulary and end together."""
    workdir, data_dir, outs = two_process_run
    assert (workdir / "spm.model").exists() and sorted(s for s, _ in _logged(workdir)) == list(range(1, 21))
    prepared = [p for p in (data_dir / "lconv_prepared").iterdir() if p.name != tokenizer_files.KEPT_TOKENIZERS]
    assert len(prepared) == 1  # one prepared copy, not one per process
    (kept,) = (data_dir / "lconv_prepared" / tokenizer_files.KEPT_TOKENIZERS).iterdir()  # process 0's, kept once
    assert (kept / "spm.model").read_bytes() == (workdir / "spm.model").read_bytes()
    root = workdir.parent
    assert not list(root.rglob("*.tmp*")) and not list(root.rglob("incomplete.*"))
    sizes = [[line for line in out.splitlines() if line.startswith("model: ")] for out in outs]
    assert sizes[0] and sizes[0] == sizes[1], sizes  # the same vocabulary, so the same parameter count


def test_two_processes_on_localhost_train_and_checkpoint_together(two_process_run):
    workdir, _, outs = two_process_run
    assert "devices 8 x cpu" in outs[0]  # one mesh over both processes' 4 devices
    losses = dict(_logged(workdir))
    assert sorted(losses) == list(range(1, 21)) and losses[20] < losses[1]
    assert {"15", "20"} <= set(os.listdir(workdir / "checkpoints"))
    with open(workdir / "metrics.jsonl") as f:
        validation = [json.loads(line) for line in f if '"validation"' in line]
    assert validation[-1]["tokens"] > 1000  # both processes' halves of the validation split were scored


def _score_line(out):
    """The ``test: sacreBLEU ...`` line a process printed, without its speed."""
    return next(line for line in out.splitlines() if line.startswith("test: sacreBLEU")).split(", ")[0]


def test_two_processes_score_the_whole_test_split_as_one_process_does(two_process_run, tmp_path):
    """Each process holds half of the test split; together they decode all of it once, in the same batches and
    widths on both, so the BLEU and the hypotheses are one process's, not those of process 0's half."""
    workdir, data_dir, outs = two_process_run
    test_split, _, _ = sources.get_source("ddtp/en_de", "test", str(data_dir))
    scores = json.loads((workdir / "test.scores.json").read_text())
    hypotheses = (workdir / "test.hyp.txt").read_bytes()
    assert scores["examples"] == len(test_split) == hypotheses.count(b"\n")
    assert _score_line(outs[0]) == _score_line(outs[1])  # the same score on both processes
    assert f"on {len(test_split)} examples" in _score_line(outs[0])
    # eval.py's code in this one process (8 devices) on the same checkpoint: the same file and the same score.
    single = tmp_path / "one_process"
    shutil.copytree(workdir, single)
    one = eval_program.run(str(single))
    assert (single / "test.hyp.txt").read_bytes() == hypotheses
    for key in ("bleu", "bleu_text", "examples", "truncated_sources", "longest_source_tokens"):
        assert one[key] == scores[key], key


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_resumes_exactly(prepared, two_process_run):
    """A scheduler preempting one host: both processes agree to stop after the same step, checkpoint it together
    and exit 0; the relaunched pair logs exactly the uninterrupted run's losses."""
    reference, data_dir, _ = two_process_run
    workdir = prepared[0] / "two_processes_sigterm"
    workdir.mkdir()
    shutil.copy(reference / "spm.model", workdir / "spm.model")  # the reference's data and vocabulary
    runs = _launch_two(prepared, workdir, *TWO_STEPS, "--config.train.stop_check_every=5", data_dir=data_dir)
    try:
        _wait_for_step(runs[0], workdir, 5)
    except AssertionError:
        for run in runs:
            run.kill()
        raise
    runs[1].send_signal(signal.SIGTERM)  # process 1 alone
    outs = _finish_all(runs)
    stopped = [int(out.split("stopping at step ")[1].split(":")[0]) for out in outs]
    assert stopped[0] == stopped[1] and 5 <= stopped[0] < 20, stopped
    assert stopped[0] % 5 == 0  # processes agree at every stop_check_every-th step only (no host sync between)
    assert all(f"stopping at step {stopped[0]}: SIGTERM" in out for out in outs)
    assert str(stopped[0]) in os.listdir(workdir / "checkpoints")
    assert checkpoints.Checkpointer(workdir).read_data(stopped[0])["process_count"] == 2

    _two_processes(prepared, workdir, *TWO_STEPS, data_dir=data_dir)
    expected = dict(_logged(reference))
    logged = _logged(workdir)
    assert {s for s, _ in logged} == set(expected) == set(range(1, 21))
    for step, loss in logged:
        assert loss == pytest.approx(expected[step], rel=1e-6), step


def test_two_processes_score_a_language_models_perplexity_on_the_whole_split(prepared, tmp_path):
    """The end-of-training perplexity of two processes covers every token of the test split once, as one
    process's does."""
    _, tiny_data = prepared
    test_split, _, key = sources.get_source("ddtp/lm_en", "test", str(tiny_data.data_dir))  # prepared already
    tokenizer = tokenizer_lib.load_tokenizer(str(tiny_data.spm.parent))
    limit = tiny_config.get_config().data.eval_max_target_length  # each example cut to it, EOS kept
    expected_tokens = sum(min(len(tokenizer.encode(test_split[i][key].decode())) + 1, limit)
                          for i in range(len(test_split)))
    workdir = _workdir(prepared, "two_processes_lm")
    _two_processes(prepared, workdir, "--config.task=lm", "--config.data.dataset=ddtp/lm_en",
                   "--config.model.encoder_layers=0", "--config.train.num_steps=2",
                   "--config.train.eval_every=1000", "--config.train.eval_after_training=True")
    scores = json.loads((workdir / "test.scores.json").read_text())
    assert scores["tokens"] == expected_tokens
    single = tmp_path / "one_process"
    shutil.copytree(workdir, single)
    one = eval_program.run(str(single))  # eval.py's code, in this one process
    assert one["tokens"] == expected_tokens and one["ppl"] == pytest.approx(scores["ppl"], rel=1e-5)


def test_two_processes_stream_documents_and_carry_the_knn_memory(prepared):
    """Each process streams its shard of the documents into its rows of the global batch and of the memory; the
    validation pass scores every token of the split exactly once, the processes padding to stay in lockstep."""
    _, tiny_data = prepared
    config = tiny_config.get_config()
    source, _, key = sources.get_source("ddtp/lm_en", "validation", str(tiny_data.data_dir))  # prepared already
    tokenizer = tokenizer_lib.load_tokenizer(str(tiny_data.spm.parent))
    expected_tokens = sum(len(tokenizer.encode(source[i][key].decode())) + 1 for i in range(len(source)))
    workdir = _workdir(prepared, "two_processes_stream")
    _two_processes(prepared, workdir, "--config.task=lm", "--config.data.dataset=ddtp/lm_en",
                   "--config.data.stream=True", "--config.model.encoder_layers=0",
                   "--config.model.decoder_mixer=knn_memory", "--config.data.max_target_length=64",
                   # 16 slots, not 1024: the memory's FIFO evicts within a document, and the validation's 256 rows
                   # do not search 1024 slots each for 610k tokens
                   '--config.model.mixer_kwargs={"knn_memory": {"memory_size": 16, "num_neighbors": 4}}',
                   "--config.data.eval_max_target_length=64",  # config_rules: >= max_target_length
                   "--config.data.eval_batch_size=256", "--config.train.num_steps=4",
                   "--config.train.checkpoint_every=2",
                   "--config.train.eval_every=1000")
    losses = dict(_logged(workdir))
    assert sorted(losses) == [1, 2, 3, 4] and all(map(math.isfinite, losses.values()))
    # Both processes' stream positions are in the checkpoint, each in its own shard (documents p::2).
    data_item = checkpoints.Checkpointer(workdir).read_data(4)
    assert data_item["process_count"] == 2
    for p, position in enumerate(data_item["processes"]):
        documents = [doc for doc, _ in position["rows"]]
        assert len(documents) == config.data.batch_size // 2 and all(d % 2 == p for d in documents if d >= 0)
    with open(workdir / "metrics.jsonl") as f:
        validation = [json.loads(line) for line in f if '"validation"' in line]
    assert validation[-1]["tokens"] == expected_tokens


def test_a_bad_flag_is_one_line_on_stderr(prepared):
    workdir = prepared[0] / "bad_flag"
    run = _launch(prepared, workdir, "--config.model.dropoutt=0.2")  # with the env of the launches above
    out, err = run.communicate(timeout=120)
    assert run.returncode == 2
    assert err.strip() == ('error: --config.model.dropoutt is not a field of the config; '
                           'Did you mean "dropout" instead of "dropoutt"?')
    assert not workdir.exists()
