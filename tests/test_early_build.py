"""lconv.train.early_build: the state and the train step built beside the data's preparation are what the usual
order builds (the same initial params, bit for bit the same update), the real batches run the program compiled
ahead, and anything that does not fit it takes the usual path."""
import helpers
import jax
import numpy as np
import pytest
import tiny_config

from lconv.errors import UserError
from lconv.run import model_setup
from lconv.train import early_build, setup, update


@pytest.fixture(scope="module")
def early_run(tiny_data, tmp_path_factory):
    """A run built in an empty workdir, as a new run is: the tokenizer kept under data_dir is copied in while the
    state and train step build beside it."""
    config = tiny_config.training_config(tiny_data.data_dir)
    workdir = tmp_path_factory.mktemp("early") / "run"
    return setup.build_run(config, str(workdir), jax.devices("cpu")[:1])


def _usual_order(run):
    """The state and the plain jitted step, built after the tokenizer as they were before the early build."""
    parts = setup._build_state(run.config, run.mesh, run.tokenizer.vocab_size).build()
    return parts, update.jit_train_step(run.config, parts.lr_schedule, parts.state_shardings, run.mesh)


def _batch(run, length=None):
    rows = next(run.data.train_iter)
    if length is not None:
        rows = {k: v[:, :length] for k, v in rows.items()}
    return model_setup.global_batch(rows, model_setup.batch_sharding(run.mesh))


def _assert_same_update(actual, expected):
    (state, sums), (want_state, want_sums) = actual, expected
    for got, want in zip(jax.tree.leaves((state.params, state.opt_state, sums)),
                         jax.tree.leaves((want_state.params, want_state.opt_state, want_sums)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_early_state_and_step_are_the_usual_ones(early_run):
    run = early_run
    assert run.train_step is not None and run.train_step.compiled is not None
    parts, jitted = _usual_order(run)
    for got, want in zip(jax.tree.leaves(run.state.params), jax.tree.leaves(parts.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    batch = _batch(run)
    with jax.set_mesh(run.mesh):
        expected = jitted(parts.state, batch, np.float32(1.0))
        actual = run.train_step(run.state, batch, np.float32(1.0))
    assert run.train_step.compiled is not None  # the pipeline's batches fit the program compiled ahead
    _assert_same_update(actual, expected)


@pytest.mark.slow  # compiles a second train step: CI runs it, the quick command skips it
def test_a_batch_of_another_signature_takes_the_jit(early_run, lconv_log):
    run = early_run
    parts, jitted = _usual_order(run)
    prepared = early_build.PreparedStep(jitted, run.train_step.compiled, early_build.signature(parts.state),
                                        run.train_step._batch_signature)
    shorter = _batch(run, length=run.config.data.max_target_length // 2)
    parts_again, jitted_again = _usual_order(run)  # a state's model is part of its tree: each state its own jit
    with jax.set_mesh(run.mesh):
        actual = prepared(parts.state, shorter, np.float32(1.0))
        expected = jitted_again(parts_again.state, shorter, np.float32(1.0))
    assert prepared.compiled is None
    assert any("does not fit the batches: compiling it again" in line for line in lconv_log())
    _assert_same_update(actual, expected)


def test_another_vocabulary_or_a_failed_build_builds_again(lconv_log):
    calls = []
    early = early_build.EarlyBuild(None, None, 100, lambda vocab: calls.append(vocab) or 1 / 0)
    assert early.result_for(101) is None
    assert any("assumed a vocabulary of 100; the tokenizer has 101" in line for line in lconv_log())
    assert early.result_for(100) is None  # the usual order builds it (and raises there if the error is real)
    assert any("failed (ZeroDivisionError: division by zero): building it again" in line for line in lconv_log())
    assert calls == [100]


def test_a_config_error_in_the_early_build_reaches_the_caller():
    def bad_config(vocab):
        raise UserError("config.model.d_model=5 must be divisible by config.model.num_heads=4")

    with pytest.raises(UserError, match="d_model=5"):
        early_build.EarlyBuild(None, None, 100, bad_config).result_for(100)


def test_a_workdir_holding_a_tokenizer_builds_in_order(tiny_data, tmp_path):
    """A resumed run's workdir holds its tokenizer: nothing slow to overlap, so no thread (whose build a data error
    would then have to wait for before the process exits)."""
    config = tiny_config.training_config(tiny_data.data_dir)
    run = setup.build_run(config, str(helpers.new_workdir(tiny_data, tmp_path / "run")), jax.devices("cpu")[:1])
    assert run.train_step is None


def test_a_data_error_cancels_the_build_and_reaches_the_caller(tiny_data, tmp_path, monkeypatch):
    cancelled = []

    class Recording:
        def __init__(self, *args):
            pass

        def cancel(self):
            cancelled.append(True)

    def no_data(*args, **kwargs):
        raise UserError("config.data.dataset='ddtp/xx_yy' is not prepared")

    monkeypatch.setattr(early_build, "EarlyBuild", Recording)
    monkeypatch.setattr(setup.pipeline, "load_or_train_tokenizer", no_data)
    with pytest.raises(UserError, match="xx_yy"):
        setup.build_run(tiny_config.training_config(tiny_data.data_dir), str(tmp_path / "run"),
                        jax.devices("cpu")[:1])
    assert cancelled == [True]


def test_a_cancelled_build_stops_before_its_next_stage(lconv_log):
    import threading

    started, release, stages = threading.Event(), threading.Event(), []

    def slow_state(vocab):
        started.set()
        release.wait(timeout=60)
        stages.append("state")
        return object()  # the train step's stage would fail on it: it must not run

    early = early_build.EarlyBuild(None, None, 100, slow_state)
    started.wait(timeout=60)
    early.cancel()
    release.set()
    assert early.result_for(100) is None
    assert stages == ["state"]
    assert not any("failed" in line for line in lconv_log())  # it stopped; it did not try the step on object()


_COUNT_LAZY_BLOCKS = """
import sys
import etils.epy as epy
from lconv.data import pipeline
if sys.argv[2] == "settled":
    pipeline.import_readers()
blocks, lazy_imports = [], epy.lazy_imports
epy.lazy_imports = lambda *a, **k: blocks.append(1) or lazy_imports(*a, **k)
import tiny_config
config = tiny_config.training_config(sys.argv[1])
next(pipeline.tokenizer_texts(config.data))  # the train split's source opened and read, TFDS imported on the way
print(len(blocks))
"""


@pytest.mark.slow  # two process launches: a module's first import is what is checked
def test_the_readers_lazy_imports_run_before_the_early_build_thread(tiny_data):
    """etils' ``epy.lazy_imports`` swaps ``builtins.__import__`` for every thread while a TFDS or grain module's
    body runs; a run's data preparation imports them first, beside the early build's thread (its tracing then got
    stand-in modules: "'LazyModule' object is not callable"). After ``import_readers`` none runs there."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)]), "JAX_PLATFORMS": "cpu"}

    def blocks(mode):
        done = subprocess.run([sys.executable, "-c", _COUNT_LAZY_BLOCKS, str(tiny_data.data_dir), mode], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert blocks("unsettled") > 0  # what the reading would run beside the thread without it
    assert blocks("settled") == 0


@pytest.mark.slow  # a stream run's state and step, built early: CI runs it, the quick command skips it
def test_a_stream_run_with_a_stateful_mixer_builds_early_and_its_batches_fit(tiny_data, tmp_path):
    """The early build failed on every stream run with a stateful mixer (KeyError: 'document_start'), the
    project's lm1b:knn,ddtp and the docs' EMA included, and the overlap was lost."""
    import toy_mixers  # noqa: F401  (toy_mixers:CarriedMean, a mixer with carried state)

    config = tiny_config.training_config(tiny_data.data_dir)
    config.task, config.data.dataset, config.data.stream = "lm", "ddtp/lm_en", True
    config.model.encoder_layers, config.model.decoder_mixer = 0, "toy_mixers:CarriedMean"
    run = setup.build_run(config, str(tmp_path / "run"), jax.devices("cpu")[:1])
    assert run.train_step is not None and run.train_step.compiled is not None
    batch = _batch(run)
    with jax.set_mesh(run.mesh):
        run.train_step(run.state, batch, np.float32(1.0))
    assert run.train_step.compiled is not None  # the stream's batches run the program compiled ahead


def _own_files(tmp_path, sentences: int):
    """A folder of your own pair files (tests/tiny_runs.py's sentences) and the tiny config reading it."""
    import tiny_runs

    folder = tmp_path / "zed"
    folder.mkdir()
    texts = tiny_runs.sentences(sentences + 20)
    for stem, part in (("train", texts[:sentences]), ("valid", texts[sentences:sentences + 10]),
                       ("test", texts[sentences + 10:])):
        (folder / f"{stem}.src").write_text("".join(f"{text}\n" for text in part))
        (folder / f"{stem}.tgt").write_text("".join(f"{' '.join(reversed(text.split()))}\n" for text in part))
    config = tiny_config.training_config(tmp_path / "tfds")
    config.data.update(dict(dataset="files", raw_dir=str(folder), source_lang="src", target_lang="tgt"))
    return folder, config


def test_a_small_corpus_of_your_own_trains_its_tokenizer_first(tmp_path):
    """Under BYTES_PER_PIECE bytes of training text per piece asked for, the vocabulary may come out smaller: the
    tokenizer goes first. A larger corpus, a bundled dataset, or files that are not there keep the usual order."""
    from lconv.data.data_config import DataConfig

    folder, config = _own_files(tmp_path, 200)
    data = DataConfig.from_config(config.data)
    size = sum((folder / f"train.{code}").stat().st_size for code in ("src", "tgt"))
    assert size < early_build.BYTES_PER_PIECE * data.vocab_size and early_build.tokenizer_first(data)
    (folder / "train.src").write_text("x y z\n" * (early_build.BYTES_PER_PIECE * data.vocab_size // 6 + 1))
    (folder / "train.tgt").write_text("x y z\n" * (early_build.BYTES_PER_PIECE * data.vocab_size // 6 + 1))
    assert not early_build.tokenizer_first(data)
    assert not early_build.tokenizer_first(DataConfig.from_config(tiny_config.get_config().data))
    (folder / "train.src").unlink()  # the usual order reports it
    assert not early_build.tokenizer_first(data)


@pytest.mark.slow  # builds and compiles the tiny model's state and train step: ~15 s of CPU
def test_a_small_corpus_builds_early_for_the_vocabulary_its_tokenizer_gives(tmp_path, lconv_log):
    """4,000 asked, fewer given (the issue's 395 of 4,000): the early build assumed the vocabulary given, so its
    state and compiled step are used, not built again; the vocabulary used is said once."""
    _, config = _own_files(tmp_path, 200)
    config.data.vocab_size = 4000
    run = setup.build_run(config, str(tmp_path / "run"), jax.devices("cpu")[:1])
    log = lconv_log()
    assert run.tokenizer.vocab_size < 4000
    assert run.train_step is not None and run.train_step.compiled is not None  # the early build's, used
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(run.state.params)]
    assert (run.tokenizer.vocab_size, config.model.d_model) in shapes  # the embedding: one row per piece given
    assert not [line for line in log if "building it again" in line]
    (line,) = [line for line in log if line.startswith("warning: vocabulary:")]
    assert f"{run.tokenizer.vocab_size:,} pieces, not the 4,000" in line
