"""Test setup: the backend the user chose (CPU by default), 8 virtual CPU devices for the sharding tests, and
float64 support for the NumPy references.

``JAX_PLATFORMS=cuda python -m pytest tests`` runs the suite on the GPU: the user's platforms come first (the
default backend), and ``cpu`` is added after them so that tests about CPU virtual devices can still ask for
``jax.devices("cpu")``. Tolerances follow the dtype and matmul precision under test (``reference.tolerance``).
"""
import os

import helpers  # imports no jax: XLA_FLAGS can still be set below
import pytest

# Must happen before jax is imported anywhere.
if helpers.DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {helpers.DEVICE_COUNT_FLAG}=8".strip()
_platforms = [p for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p]
os.environ["JAX_PLATFORMS"] = ",".join(_platforms + ["cpu"] * ("cpu" not in _platforms))
# On the CPU, compiling ~1,000 small programs is most of the suite's time, and most of that is LLVM optimising
# machine code that then runs for milliseconds. These flags change how XLA compiles and runs the same programs (HLO
# passes, precision and numerics rules are untouched). Not on an accelerator (the user's platforms); a value the
# user set wins, and a flag this jaxlib does not know is left out (XLA aborts on an unknown flag).
_CPU_FLAGS = {
    # LLVM level 0: the quick tier spent ~37% less CPU time.
    "--xla_backend_optimization_level": "0",
    # XLA's older LLVM IR emitter for fused loops, not its MLIR fusion emitters: the same fused HLO, written by the
    # other of its two CPU code generators, faster to compile here (the quick tier: 197 s -> 153 s).
    "--xla_cpu_use_fusion_emitters": "false",
    # One LLVM module per program, not split for parallel compile threads, and single-threaded Eigen inside a dot
    # or convolution: the two xdist workers already fill the two cores, and extra threads only contend with them
    # (the quick tier: 140 s -> 131 s in two runs each on the idle host).
    "--xla_cpu_parallel_codegen_split_count": "1",
    "--xla_cpu_multi_thread_eigen": "false",
}


def _known_to_jaxlib(flags) -> list[str]:
    """The ``flags`` whose names this jaxlib's library contains (one mapping of the file for all of them)."""
    import importlib.util
    import mmap
    import pathlib

    library = pathlib.Path(importlib.util.find_spec("jaxlib").origin).parent / "libjax_common.so"
    if not flags or not library.is_file():
        return []
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as image:
        return [flag for flag in flags if image.find(flag.lstrip("-").encode()) >= 0]


if _platforms in ([], ["cpu"]):
    for _flag in _known_to_jaxlib([f for f in _CPU_FLAGS if f not in os.environ["XLA_FLAGS"]]):
        os.environ["XLA_FLAGS"] += f" {_flag}={_CPU_FLAGS[_flag]}"

from lconv.run import host_memory  # noqa: E402

host_memory.reuse_freed_memory()  # as the CLIs do, before the backend is up
import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)  # tests opt in to float64 explicitly with numpy references


@pytest.fixture(autouse=True)
def _exit_in_process(monkeypatch):
    """The CLIs end the process at once (``os._exit``) when an exit would wait for a background compilation; a
    test running a CLI in this process gets a SystemExit with the code instead, as a plain exit gives. The tests
    of that path put the real one back (``.real``) with ``os._exit`` faked."""
    from lconv.cli import runtime

    real = runtime._exit_now

    def exit_in_process(code):
        raise SystemExit(code)

    exit_in_process.real = real
    monkeypatch.setattr(runtime, "_exit_now", exit_in_process)


@pytest.fixture
def exits(monkeypatch):
    """The codes the CLIs' at-once exit (``runtime._exit_now``, its ``os._exit`` faked) was called with."""
    from lconv.cli import runtime

    codes: list[int] = []

    def fake_exit(code):
        codes.append(code)
        raise helpers.ExitedAtOnce(code)

    monkeypatch.setattr(runtime.os, "_exit", fake_exit)
    monkeypatch.setattr(runtime.logging, "shutdown", lambda: None)  # it would close pytest's capture too
    monkeypatch.setattr(runtime, "_exit_now", runtime._exit_now.real)
    return codes


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """One persistent compilation cache per test run, shared by the xdist workers and every process the tests
    launch (they inherit $JAX_COMPILATION_CACHE_DIR): a program that many tests compile alike (the tiny run's
    train, eval and beam-search steps) is compiled once and read back after. It lives in the run's base temp
    folder, so every run starts cold, and pytest removes it with the folder. A cache the user set is kept."""
    _check_xdist_can_group(config)
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # the user's cache, or (in an xdist worker) the controller's, which jax read from the environment
    cache = factory.getbasetemp() / "jax_compilation_cache"
    cache.mkdir(exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    # 0.1 s: with LLVM level 0 and the older fused-loop emitter most programs compile in under half a second
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_collection_modifyitems(config, items):
    """The tiers (README): a test that reads the shared tiny data or run is ``integration``; one that launches
    processes is marked ``slow`` where it is defined; the rest are unit tests."""
    for item in items:
        if {"tiny_data", "tiny_run"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def _check_xdist_can_group(config):
    """Under ``-n`` (pyproject: ``--dist loadgroup``) the tests of one ``xdist_group`` share a costly session
    fixture on one worker. pytest-xdist up to 3.8.0 cannot group under pytest 9.2 (pytest-xdist#1386): it spreads
    the tests silently, each worker builds the study's and the two-process run's fixtures again, and two
    two-process runs can overlap on the same cores."""
    if getattr(config.option, "dist", "no") != "loadgroup" or not getattr(config.option, "numprocesses", None):
        return
    from importlib.metadata import version

    xdist = tuple(int(part) for part in version("pytest-xdist").split(".")[:3] if part.isdigit())
    if pytest.version_tuple[:2] >= (9, 2) and xdist <= (3, 8, 0):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {version('pytest-xdist')} runs "
                                "the xdist_group tests on every worker (pytest-xdist#1386): pip install "
                                "'pytest<9.2' (requirements.txt)")


def pytest_report_header(config):
    return f"jax {jax.__version__}, default backend {jax.default_backend()}: {jax.devices()}"


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """A local folder behind gs:// and s3:// (tests/buckets.py), with ``bucket.os_calls``: the os-level calls made
    on a gs:// path, which should be none."""
    import buckets

    yield from buckets.store(tmp_path, monkeypatch)


@pytest.fixture
def lconv_log(caplog):
    """``lconv_log()``: the messages lconv logged so far in the test, in order, as its programs print them."""
    import log_capture

    from lconv import console

    with log_capture.attached(caplog.handler):
        yield lambda: [console.line(r) for r in caplog.records if r.name.split(".")[0] == "lconv"]

# ----------------------------------------------------------------------------------------------------------------
# Shared artefacts: one prepared tiny dataset, one tokenizer and one tiny trained run per test run
# ----------------------------------------------------------------------------------------------------------------
# Preparing data, training a tokenizer and training a run cost seconds to tens of seconds each on 2 cores; every
# module that needs them asks for these session fixtures instead of making its own. Under pytest-xdist each worker
# is a process with its own session, so each artefact is built once per test run under a file lock in a folder
# every worker sees, and the other workers read it (tests/helpers.py:build_once). Tests treat them as read-only: a
# test that changes a run works on a copy (helpers.copy_run). lconv's imports are inside the fixtures: CI runs the
# notebook test from an installed package with only this file, helpers.py and tiny_config.py beside it.
import json  # noqa: E402
import types  # noqa: E402


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory):
    """A folder of this test run that every xdist worker sees (each worker's base temp is a subfolder of it)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_data(shared_root):
    """The bundled DDTP corpus prepared once in ``data_dir`` (ddtp/en_de for translation, ddtp/lm_en for the LM),
    and tests/tiny_config.py's SentencePiece model trained once on it (``spm``: copy it into a workdir with
    ``helpers.new_workdir``)."""
    import tiny_config

    def build(path):
        import tensorflow_datasets as tfds

        from lconv.data import pipeline, sources

        tfds.disable_progress_bar()
        config = tiny_config.training_config(path / "tfds")
        tokenizer = pipeline.load_or_train_tokenizer(config.data, str(path / "tokenizer"), process_index=0,
                                                     process_count=1)
        pipeline.make_datasets(config.data, tokenizer, process_index=0, process_count=1)
        for split in ("train", "validation", "test"):
            sources.get_source("ddtp/lm_en", split, str(path / "tfds"))

    path = helpers.build_once(shared_root, "tiny_data", build)
    return types.SimpleNamespace(data_dir=path / "tfds", spm=path / "tokenizer" / "spm.model")


@pytest.fixture(scope="session")
def tiny_run(shared_root, tiny_data):
    """tests/tiny_config.py trained for its 6 steps on one CPU device: checkpoints 2..6 (keep 5), validation at
    steps 3 and 6, the best checkpoint, metrics.jsonl, data_report.json. ``workdir`` is shared: read it, or
    ``helpers.copy_run`` it to change it. ``result`` is what ``train_and_evaluate`` returned (through JSON)."""
    import jax
    import tiny_config

    from lconv.train import loop

    def build(path):
        path.mkdir()
        workdir = helpers.new_workdir(tiny_data, path / "run")
        result = loop.train_and_evaluate(tiny_config.training_config(tiny_data.data_dir), str(workdir),
                                         devices=jax.devices("cpu")[:1])
        (path / "result.json").write_text(json.dumps(result, default=float))

    path = helpers.build_once(shared_root, "tiny_run", build)
    return types.SimpleNamespace(workdir=path / "run", data_dir=tiny_data.data_dir,
                                 result=json.loads((path / "result.json").read_text()))
