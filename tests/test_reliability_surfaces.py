"""Issue 27's surfaces as a user meets them: every CLI (train.py, eval.py, ``python -m lconv.export``,
``python -m lconv.import_fairseq``) and the Python API (``lconv.load``, ``Model``, ``lconv.export.load``).

- One set of decode and sampling rules (``lconv.run.schema``) wherever the settings are given;
- token ids out of the vocabulary refused by an exported model;
- a damaged workdir or export is one line naming the file and what is wrong with it;
- ``eval.py --interactive`` survives a line that is not UTF-8;
- a backend named in ``JAX_PLATFORMS`` that is not there is one line (a process of its own: the backend is
  chosen once per process).
Each ends in one ``error: ...`` line and exit code 2 on the command line, a one-line ``UserError`` in Python.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import math
import os
import random
import shutil
import sys

import helpers
import jax
import numpy as np
import pytest
import tiny_config
import tiny_runs

import lconv
from lconv import export
from lconv.api import Model
from lconv.errors import UserError
from lconv.run import restore, schema


def _workdir(tmp_path, config, name="run"):
    """A workdir holding ``config``'s config.json and the in-memory runs' tokenizer: what eval.py and
    ``lconv.load`` read before any checkpoint."""
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / "config.json").write_text(helpers.config_json(config))
    (workdir / "spm.model").write_bytes(tiny_runs.tokenizer().to_bytes())
    return workdir


@pytest.fixture
def not_loaded(monkeypatch):
    """``load_trained`` fails the test: an error raised with it in place was raised before anything was loaded."""
    monkeypatch.setattr(restore, "load_trained", lambda *a, **k: pytest.fail("loaded before the input was checked"))


@pytest.fixture(scope="module")
def lm():
    return Model(tiny_runs.in_memory(tiny_runs.lm_config()))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One small translation export (one bucket); tests that damage it work on a copy."""
    out = tmp_path_factory.mktemp("export") / "out"
    export.export(tiny_runs.in_memory(tiny_runs.translation_config()), str(out), rows=(1,), widths=(32,),
                  beam_size=2)
    return out


# ----------------------------------------------------------------------------------------------------------------
# One validation of decode and sampling settings
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, shown", [
    ({"seed": -1}, "seed=-1"), ({"seed": 2**32}, f"seed={2**32}"), ({"seed": 1.5}, "seed=1.5"),
    ({"top_k": -1}, "top_k=-1"), ({"top_k": 2.0}, "top_k=2.0"), ({"top_p": math.nan}, "top_p=nan"),
    ({"top_p": 0.0}, "top_p=0.0"), ({"temperature": math.inf}, "temperature=inf"), ({"max_len": 0}, "max_len=0"),
    ({"top_k": 401}, "top_k=401"),
    # beyond float32's range on the device: every output came back empty, without a word
    ({"temperature": 1e39}, "temperature=1e+39"), ({"top_p": 1e-40}, "top_p=1e-40"),
])
@pytest.mark.parametrize("spell", [str, lambda name: f"--{name}"])
def test_sampling_settings_have_one_rule_wherever_they_are_given(settings, shown, spell):
    with pytest.raises(UserError) as error:
        schema.check_sampling(settings, spell, vocab_size=400)
    assert helpers.one_line_error(error, spell(shown.split("=")[0])).startswith(spell(shown))
    schema.check_sampling({**schema.SAMPLING_DEFAULTS, "temperature": 1.0, "top_k": 400, "seed": 2**32 - 1}, spell,
                          vocab_size=400)


@pytest.mark.parametrize("flag", ["--seed=-1", "--seed=4294967296", "--top_k=100000", "--max_len=100000"])
def test_eval_py_refuses_sampling_out_of_range_before_loading(flag, tmp_path, capsys, not_loaded):
    workdir = _workdir(tmp_path, tiny_runs.lm_config())
    (tmp_path / "prompts.txt").write_text("The small package\n")
    outcome = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", f"--source_file={tmp_path}/prompts.txt",
                              f"--output_file={tmp_path}/out.txt", "--temperature=1", flag)
    vocab = [str(tiny_runs.tokenizer().vocab_size)] if "top_k" in flag else []  # the bound, from the tokenizer
    helpers.one_line_error(outcome, flag, *vocab)


@pytest.mark.parametrize("kwargs, named", [(dict(seed=-1), "seed=-1"), (dict(seed=2**32), "seed="),
                                           (dict(top_k=10**6), "top_k=1000000")])
def test_the_api_refuses_sampling_out_of_range(lm, kwargs, named):
    with pytest.raises(UserError) as error:
        lm.generate(["The small package"], temperature=1.0, **kwargs)
    helpers.one_line_error(error, named)


def test_export_refuses_sampling_and_search_settings_by_the_same_rules(lm, tmp_path, capsys):
    with pytest.raises(UserError) as error:  # the vocabulary's bound, once the run is known; nothing written
        export.export(tiny_runs.in_memory(tiny_runs.lm_config()), str(tmp_path / "out"), top_k=10**6,
                      temperature=1.0)
    assert helpers.one_line_error(error, str(lm.tokenizer.vocab_size)).startswith("top_k=1000000: ")  # its argument
    assert not (tmp_path / "out").exists()
    for flag in ("--beam_size=0", "--top_p=nan", "--temperature=-1", "--max_len=0", "--top_k=-3"):
        outcome = helpers.run_cli(capsys, "lconv.export", f"--workdir={tmp_path}/none", f"--out={tmp_path}/x", flag)
        helpers.one_line_error(outcome, flag)


def test_an_exported_lm_refuses_a_seed_out_of_range(tmp_path):
    export.export(tiny_runs.in_memory(tiny_runs.lm_config()), str(tmp_path), rows=(1,), widths=(32,), max_len=3)
    served = export.load(str(tmp_path))
    for seed in (-1, 2**32):
        with pytest.raises(UserError) as error:
            served(["The small package"], seed=seed)
        helpers.one_line_error(error, f"seed={seed}")


@pytest.mark.parametrize("flag", ["--lenpen=nan", "--beam_size=0", "--max_len_a=-1"])
def test_the_importer_refuses_decode_settings_on_the_command_line(flag, tmp_path, capsys):
    outcome = helpers.run_cli(capsys, "lconv.import_fairseq", f"--checkpoint={tmp_path}/none.pt",
                              f"--dict={tmp_path}/dict.txt", f"--workdir={tmp_path}/run", flag)
    helpers.one_line_error(outcome, flag.split("=")[0])
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------------
# An exported model: token ids in range
# ----------------------------------------------------------------------------------------------------------------
def test_an_export_refuses_token_ids_outside_its_vocabulary(exported):
    served = export.load(str(exported))
    vocab = served.tokenizer.vocab_size
    for call, shown in [(lambda: served.run_ids([np.array([5, vocab, 1])]), f"token id {vocab}"),
                        (lambda: served(np.array([[5, 7, 1, 0], [4, -2, 1, 0]])), "token id -2"),
                        (lambda: served.run_ids([np.array([5.0, 1.0])]), "float64")]:
        with pytest.raises(UserError) as error:  # not an all-padding output
            call()
        helpers.one_line_error(error, shown, *([str(vocab)] if "id" in shown else []))


# ----------------------------------------------------------------------------------------------------------------
# A damaged workdir or export: one line naming the file
# ----------------------------------------------------------------------------------------------------------------
_WORKDIR_DAMAGE = {
    "config.json not JSON": ("config.json", b'{"task": "translation",'),
    "config.json not an object": ("config.json", b"[1, 2]"),
    "config.json not UTF-8": ("config.json", b"\xff\xfe{}"),
    "config.json nested too deep": ("config.json", b"[" * 100_000 + b"]" * 100_000),  # a RecursionError traceback
    "config.json with a bad field": ("config.json", None),
    "spm.model truncated": ("spm.model", slice(0, 100)),
    "spm.model empty": ("spm.model", b""),
    "spm.model garbage": ("spm.model", b"\x00\x01garbage" * 20),
}


def _damage(folder, name, how):
    path = folder / name
    if how is None:  # a field whose value breaks its rule, as a hand edit might leave it
        config = json.loads(path.read_text())
        config["model"]["d_model"] = "big"
        path.write_text(json.dumps(config))
    elif isinstance(how, slice):
        path.write_bytes(path.read_bytes()[how])
    else:
        path.write_bytes(how)
    return path


@pytest.mark.parametrize("damage", list(_WORKDIR_DAMAGE))
def test_a_damaged_workdir_is_one_line_naming_the_file(damage, tmp_path, capsys):
    workdir = _workdir(tmp_path, tiny_config.get_config())
    path = _damage(workdir, *_WORKDIR_DAMAGE[damage])
    for args in ([], [f"--source_file={tmp_path}/none.txt"]):  # a split, and a file to translate
        (tmp_path / "none.txt").write_text("A tool.\n")
        helpers.one_line_error(helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", *args), str(path))
    with pytest.raises(UserError) as error:
        lconv.load(str(workdir))
    helpers.one_line_error(error, str(path))


_EXPORT_DAMAGE = {
    "sidecar not JSON": (export.SIDECAR, b"{"),
    "sidecar without programs": (export.SIDECAR, "programs"),
    "sidecar of another format": (export.SIDECAR, "format"),
    "params.npz truncated": ("params.npz", slice(0, 300)),
    "params.npz of another model": ("params.npz", "shape"),
    "program missing": ("translate_r1_w32.jax", "delete"),
    "program truncated": ("translate_r1_w32.jax", slice(0, 200)),
    "spm.model garbage": ("spm.model", b"\x00garbage"),
    "sidecar width edited": (export.SIDECAR, "width"),  # fails at call time with XLA's "Shape mismatch" otherwise
    "sidecar rows edited": (export.SIDECAR, "rows"),
    "sidecar beam size not a number": (export.SIDECAR, "beam"),
    "sidecar digest of a file it does not name": (export.SIDECAR, "sha256"),
}


def _damage_export(folder, name, how):
    path = folder / name
    if how == "delete":
        path.unlink()
    elif how in ("programs", "format", "width", "rows", "beam", "sha256"):
        sidecar = json.loads(path.read_text())
        if how == "programs":
            sidecar.pop("programs")
        elif how == "format":
            sidecar.update(format=99)
        elif how == "beam":
            sidecar["search"]["beam_size"] = "four"
        elif how == "sha256":
            sidecar["sha256"]["../outside.npz"] = "0" * 64
        else:
            sidecar["programs"][0][how] *= 2
        path.write_text(json.dumps(sidecar))
    elif how == "shape":
        with np.load(path) as flat:
            params = {k: flat[k] for k in flat.files}
        first = sorted(params)[0]
        params[first] = np.zeros(params[first].shape[0] + 1, params[first].dtype)
        np.savez(path, **params)
    else:
        _damage(folder, name, how)
    return path


@pytest.mark.parametrize("damage", list(_EXPORT_DAMAGE))
def test_a_damaged_export_is_one_line_naming_the_file(damage, exported, tmp_path):
    copy = shutil.copytree(exported, tmp_path / "export")
    path = _damage_export(copy, *_EXPORT_DAMAGE[damage])
    with pytest.raises(UserError) as error:
        export.load(str(copy))
    helpers.one_line_error(error, str(path))


@pytest.mark.parametrize("part", ["translate_r1_w32.jax", "params.npz", "tokenizer"])
def test_an_export_file_altered_inside_is_one_line_at_load(exported, tmp_path, part):
    """Three bytes flipped in a file's body: a program deserialised and then either ran or was a 34-line
    JaxRuntimeError at its first call, depending on where the bytes fell. The sidecar's digests catch any change."""
    copy = shutil.copytree(exported, tmp_path / "export")
    name = json.loads((copy / export.SIDECAR).read_text())["tokenizer"] if part == "tokenizer" else part
    path = copy / name
    data = bytearray(path.read_bytes())
    for position in random.Random(3).sample(range(len(data) // 3, len(data) * 9 // 10), 3):
        data[position] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(UserError) as error:
        export.load(str(copy))
    helpers.one_line_error(error, str(path), "altered")


def test_an_exported_program_that_fails_to_run_is_one_line(exported, monkeypatch):
    """A program that deserialises can still fail in XLA (a platform's compiler, an altered file whose sidecar
    was rewritten to match): one line naming its file, not the runtime's traceback."""
    served = export.load(str(exported))

    def fails(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: a deliberately failing program")

    monkeypatch.setattr(jax.export.Exported, "call", fails)
    with pytest.raises(UserError) as error:
        served(["Fast tool."])
    helpers.one_line_error(error, str(exported / "translate_r1_w32.jax"), "cannot run")



def test_an_exported_program_calling_a_host_callback_is_refused_at_load(exported, tmp_path, monkeypatch):
    """A program of the export's signature holding a Python callback's native call (exported with jax's check
    switched off, its digest rewritten as a forger would): it loaded, then its first call killed the process with
    SIGSEGV, the handler indexing a table by a number from the file (round 16, r16-7)."""
    import hashlib

    import jax.numpy as jnp
    from jax._src.export import _export as jax_export_internals

    monkeypatch.setattr(jax_export_internals, "_check_lowering", lambda lowering: None)  # the forger's export
    copy = shutil.copytree(exported, tmp_path / "export")
    sidecar = json.loads((copy / export.SIDECAR).read_text())
    name = sidecar["programs"][0]["file"]
    original = jax.export.deserialize(bytearray((copy / name).read_bytes()))
    args = jax.tree.unflatten(original.in_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in original.in_avals])

    def calls_back(*positional, **named):
        last = jax.tree.leaves((positional, named))[-1]
        echoed = jax.pure_callback(lambda x: x, jax.ShapeDtypeStruct(last.shape, last.dtype), last)
        zero = jnp.sum(echoed) * 0
        return jax.tree.unflatten(original.out_tree, [jnp.zeros(a.shape, a.dtype) + zero.astype(a.dtype)
                                                      for a in original.out_avals])

    checks = [jax.export.DisabledSafetyCheck.custom_call(target)
              for target in ("xla_python_cpu_callback", "xla_ffi_python_cpu_callback")]
    data = jax.export.export(jax.jit(calls_back), platforms=original.platforms,
                             disabled_checks=checks)(*args[0], **args[1]).serialize()
    (copy / name).write_bytes(data)
    sidecar["sha256"][name] = hashlib.sha256(data).hexdigest()
    (copy / export.SIDECAR).write_text(json.dumps(sidecar))
    with pytest.raises(UserError) as error:
        export.load(str(copy))
    helpers.one_line_error(error, str(copy / name), "native target", "callback")

# ----------------------------------------------------------------------------------------------------------------
# eval.py --interactive: a line that is not UTF-8 is reported and skipped; the session goes on
# ----------------------------------------------------------------------------------------------------------------
def test_interactive_skips_a_line_that_is_not_utf8_and_goes_on(tmp_path, capsys, monkeypatch):
    trained = tiny_runs.in_memory(tiny_runs.translation_config())
    workdir = _workdir(tmp_path, trained.config)
    monkeypatch.setattr(restore, "load_trained", lambda *a, **k: trained)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Fast tool.\nBad \xff\xfe line\nData\n")))
    code, out, err = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", "--interactive")
    assert code == 0, err
    model = Model(trained)
    assert out.split("\n") == [model.translate("Fast tool."), "", model.translate("Data"), ""]  # paired by line
    assert "line 2" in err and "0xff" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------------------------
# Where a folder goes: a file, or nothing at all
# ----------------------------------------------------------------------------------------------------------------
def test_export_out_on_a_file_and_an_empty_train_workdir_are_one_line(tmp_path, capsys):
    workdir = _workdir(tmp_path, tiny_config.get_config())
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    outcome = helpers.run_cli(capsys, "lconv.export", f"--workdir={workdir}", f"--out={target}", "--widths=32")
    helpers.one_line_error(outcome, f"--out={target}")
    assert target.read_text() == "mine\n"
    before = sorted(os.listdir(helpers.ROOT))  # run_cli runs from the checkout's root: nothing is made there
    outcome = helpers.run_cli(capsys, "train.py", "--config=tests/tiny_config.py", "--workdir=",
                              f"--config.data.data_dir={tmp_path}/tfds")
    helpers.one_line_error(outcome, "--workdir")
    assert sorted(os.listdir(helpers.ROOT)) == before and not (tmp_path / "tfds").exists()


# ----------------------------------------------------------------------------------------------------------------
# A backend that is not there
# ----------------------------------------------------------------------------------------------------------------
def _missing_platform() -> str:
    """A backend this host certainly lacks, so the tests below run everywhere instead of being skipped: tpu unless
    libtpu is installed (a TPU host), then cuda unless JAX's CUDA plugin is, then rocm."""
    for platform, providers in (("tpu", ("libtpu",)), ("cuda", ("jax_cuda12_plugin", "jax_cuda13_plugin")),
                                ("rocm", ("jax_rocm60_plugin", "jax_rocm7_plugin"))):
        if not any(importlib.util.find_spec(name) for name in providers):
            return platform
    raise AssertionError("every accelerator plugin is installed here; name a platform this host lacks")


MISSING = _missing_platform()


@pytest.mark.slow  # launches processes: the backend is chosen once per process
@pytest.mark.parametrize("program", [
    ["train.py", "--config=tests/tiny_config.py", "--workdir={tmp}/run"],
    ["eval.py", "--workdir={tmp}/run"],
    ["-m", "lconv.export", "--workdir={tmp}/run", "--out={tmp}/out"],
    ["-m", "lconv.import_fairseq", "--checkpoint={tmp}/m.pt", "--dict={tmp}/d.txt", "--workdir={tmp}/run"],
], ids=["train", "eval", "export", "import_fairseq"])
def test_a_backend_that_is_not_there_is_one_line_naming_it(program, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": MISSING}
    result = helpers.launch(*[arg.format(tmp=tmp_path) for arg in program], env=env, timeout=120)
    line = helpers.one_line_error(result, f"JAX_PLATFORMS={MISSING}", "cpu")
    assert f"{MISSING} backend" in line and not (tmp_path / "run").exists()


@pytest.mark.slow  # launches a process: the backend is chosen once per process
@pytest.mark.parametrize("call", ["lconv.load", "lconv.export.load"])
def test_a_backend_that_is_not_there_is_one_user_error_in_python(call, tmp_path):
    script = (f"import lconv, lconv.export\nfrom lconv.errors import UserError\ntry:\n    {call}({str(tmp_path)!r})\n"
              "except UserError as err:\n    print('UserError:', err)")
    result = helpers.launch("-c", script, env={**os.environ, "JAX_PLATFORMS": MISSING}, timeout=120)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"UserError: JAX_PLATFORMS={MISSING}") and "cpu" in lines[0]


# ----------------------------------------------------------------------------------------------------------------
# Issue 41: bounded sizes, nothing ignored, and text that is not text refused at the API boundary
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def translator():
    return Model(tiny_runs.in_memory(tiny_runs.translation_config()))


def test_the_api_refuses_what_it_would_ignore_or_could_not_hold(translator, lm):
    vocab = translator.tokenizer.vocab_size
    for call, named in [
        (lambda: translator.translate(["A tool."], beam_size=10**9), ("beam_size=1000000000", str(vocab - 1))),
        (lambda: translator.translate(["A tool."], top_p=0.9), ("top_p=0.9", "temperature")),
        (lambda: translator.translate(["A tool."], temperature=1.0, nbest=10**6), ("nbest=1000000", str(vocab - 1))),
        (lambda: lm.generate(["The small"], top_k=5), ("top_k=5", "temperature")),
        (lambda: lm.generate(["The small"], seed=3), ("seed=3", "temperature")),
    ]:
        with pytest.raises(UserError) as error:
            call()
        helpers.one_line_error(error, *named)


@pytest.mark.parametrize("call, named", [
    (lambda m, lm: m.translate(["A tool.", "Bad \udcff byte"]), "sources[1]"),
    (lambda m, lm: m.score("A tool.", "Werkzeug \ud800"), "targets"),
    (lambda m, lm: m.kernels("Bad \udcff"), "sentence"),
    (lambda m, lm: m.kernels(None), "sentence"),
    (lambda m, lm: lm.generate(["\ud800"]), "prompts[0]"),
    (lambda m, lm: lm.perplexity(["ok", "\udcff"]), "texts[1]"),
    (lambda m, lm: lconv.load(None), "workdir"),
    (lambda m, lm: lconv.load("runs/x", average_last=2.5), "average_last=2.5"),
    (lambda m, lm: export.load(None), "path"),
], ids=["translate", "score", "kernels", "kernels-None", "generate", "perplexity", "load-None", "load-2.5",
        "export-None"])
def test_text_that_is_not_text_is_one_line_naming_the_argument(translator, lm, call, named):
    """A lone surrogate (what ``surrogateescape`` makes of a byte that is not UTF-8) was SentencePiece's
    TypeError in every text entry point; None and a fractional count were tracebacks too."""
    with pytest.raises(UserError) as error:
        call(translator, lm)
    helpers.one_line_error(error, named)


def test_an_exported_model_refuses_what_is_not_text(exported):
    served = export.load(str(exported))
    for inputs, named in ((None, "inputs"), (["A tool.", None], "inputs[1]"), (["\udcff"], "inputs[0]")):
        with pytest.raises(UserError) as error:
            served(inputs)
        helpers.one_line_error(error, named)
    with pytest.raises(UserError) as error:  # a translation export beam-searches: a seed would be ignored
        served(["A tool."], seed=3)
    helpers.one_line_error(error, "seed=3")


def test_perplexity_takes_one_string_and_warns_of_a_text_it_cuts(lm, lconv_log):
    long_text = " ".join(["The small package for the window system."] * 6)  # > the LM's 32-token limit
    one = lm.perplexity("The small package.")
    assert one == lm.perplexity(["The small package."]) and one["tokens"] > 0
    lm.perplexity(["The small package.", long_text])
    (warning,) = [m for m in lconv_log() if "cut to" in m]
    assert warning.startswith("warning: 1 input cut to 32 tokens") and "texts[1] had" in warning


def test_export_refuses_the_other_tasks_settings_and_reaches_the_loaded_models_widths(tmp_path, capsys):
    """A translation export beam-searches (``--temperature`` was ignored), an LM export samples (``--beam_size``
    was), and by default the widths reach the longest source ``lconv.load`` takes (they stopped at 64 tokens).
    The Python function's errors name its arguments; ``python -m lconv.export``'s name its flags."""
    with pytest.raises(UserError) as error:
        export.export(tiny_runs.in_memory(tiny_runs.translation_config()), str(tmp_path / "a"), temperature=0.8)
    assert "--" not in helpers.one_line_error(error, "temperature", "beam_size")
    with pytest.raises(UserError) as error:  # a million rows of beam search in one program
        export.export(tiny_runs.in_memory(tiny_runs.translation_config()), str(tmp_path / "a"), rows=(10**6,))
    assert helpers.one_line_error(error, str(export.MAX_EXPORT_ROWS)).startswith("rows=1000000: ")
    workdir = _workdir(tmp_path, tiny_runs.lm_config(), "lm")
    outcome = helpers.run_cli(capsys, "lconv.export", f"--workdir={workdir}", f"--out={tmp_path}/b",
                              "--beam_size=4")
    helpers.one_line_error(outcome, "--beam_size=4")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    from lconv.configs import default

    assert export.default_widths(default.get_config()) == [32, 64, 128, 256]  # eval_max_input_length 256
    assert export.default_widths(tiny_runs.translation_config()) == [32]


@pytest.mark.parametrize("flags, named", [
    (["--beam_size=1000000"], ["--beam_size=1000000", "vocabulary"]),  # std::bad_alloc before
    (["--top_p=0.9"], ["--top_p=0.9", "--temperature"]),  # greedy beam search would ignore it
    (["extra"], ["unexpected argument extra"]),  # a positional argument: 62 lines of usage, exit 1, before
])
def test_eval_py_refuses_what_it_would_ignore_before_loading(flags, named, tmp_path, capsys, not_loaded):
    workdir = _workdir(tmp_path, tiny_runs.translation_config())
    (tmp_path / "sources.txt").write_text("A small tool.\n")
    outcome = helpers.run_cli(capsys, "eval.py", f"--workdir={workdir}", f"--source_file={tmp_path}/sources.txt",
                              f"--output_file={tmp_path}/out.txt", *flags)
    helpers.one_line_error(outcome, *named)


@pytest.mark.parametrize("change, named", [
    (lambda s: s["programs"][0].update(rows=True), ("programs[0].rows", "a boolean", "integer")),
    (lambda s: s["programs"][0].update(width=32.0), ("programs[0].width", "a number", "integer")),
    (lambda s: s["programs"].__setitem__(0, 3), ("programs[0]", "an integer", "object")),
    (lambda s: s.update(format="1"), ("format", "a string", "integer")),
    (lambda s: s.update(tokenizer=5), ("tokenizer", "an integer", "string")),
    (lambda s: s.update(programs={}), ("programs", "an object", "array")),
    (lambda s: s.update(search=None), ("search", "null", "object")),
    (lambda s: s.update(guards="x"), ("guards", "a string", "object")),
    (lambda s: s.pop("params"), ("no params", "string")),
], ids=["rows_true", "width_float", "program_int", "format_str", "tokenizer_int", "programs_obj", "search_null",
        "guards_str", "params_missing"])
def test_a_sidecar_field_of_the_wrong_type_is_one_line_naming_it_and_its_type(change, named, exported, tmp_path):
    """``"rows": true`` was a TypeError traceback: every field's type is checked in one place, before use."""
    folder = tmp_path / "export"
    folder.mkdir()
    sidecar = json.loads((exported / export.SIDECAR).read_text())
    change(sidecar)
    (folder / export.SIDECAR).write_text(json.dumps(sidecar))
    with pytest.raises(UserError) as error:
        export.load(str(folder))
    helpers.one_line_error(error, str(folder / export.SIDECAR), *named)


def _zip_member(archive, name, header_shape, zeros):
    """A .npy member of ``archive``: a header claiming ``header_shape`` float32, then ``zeros`` zero bytes."""
    with archive.open(name, "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": header_shape})
        for _ in range(zeros >> 20):
            f.write(bytes(1 << 20))


def _reseal(folder, name):
    """The sidecar's digest rewritten to match an edited file, as a hostile export would: the checks behind the
    digest must still hold."""
    sidecar = json.loads((folder / export.SIDECAR).read_text())
    sidecar["sha256"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / export.SIDECAR).write_text(json.dumps(sidecar))


@pytest.mark.parametrize("bomb", ["declared_size", "header_shape"])
def test_a_params_zip_bomb_is_refused_before_it_decompresses(bomb, exported, tmp_path, monkeypatch):
    """A params.npz of a few kB that decompresses to far more than the programs' params take (here 16 MB of
    zeros), or whose member's header claims 10**10 values: one line, and nothing decompressed or allocated."""
    import zipfile

    copy = shutil.copytree(exported, tmp_path / "export")
    with zipfile.ZipFile(copy / "params.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        if bomb == "declared_size":
            _zip_member(archive, "a.npy", (16 << 18,), 16 << 20)
        else:
            _zip_member(archive, "a.npy", (10**10,), 0)
    assert (copy / "params.npz").stat().st_size < 64 << 10
    _reseal(copy, "params.npz")
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("np.load reached"))
    with pytest.raises(UserError) as error:
        export.load(str(copy))
    helpers.one_line_error(error, str(copy / "params.npz"),
                           "decompress to 16,777,344 bytes" if bomb == "declared_size" else "header claims")


def test_params_with_nan_are_one_line_naming_the_array_not_an_empty_output(exported, tmp_path):
    """A params.npz whose arrays hold NaN (a diverged run's, or damaged) translated every input to '' silently."""
    copy = shutil.copytree(exported, tmp_path / "export")
    with np.load(copy / "params.npz") as flat:
        arrays = {name: flat[name] for name in flat.files}
    name = next(k for k in sorted(arrays) if arrays[k].dtype.kind == "f")
    arrays[name] = np.full_like(arrays[name], np.nan)
    np.savez(copy / "params.npz", **arrays)
    _reseal(copy, "params.npz")
    with pytest.raises(UserError) as error:
        export.load(str(copy))
    helpers.one_line_error(error, str(copy / "params.npz"), "NaN")


@pytest.mark.parametrize("repeat", ["same_entry", "same_file"])
def test_a_sidecar_repeating_a_program_is_one_line_before_any_program_is_read(repeat, exported, tmp_path,
                                                                            monkeypatch):
    """A sidecar listing its one program 100,000 times deserialised it 100,000 times: minutes of load."""
    from lconv.export import files

    copy = shutil.copytree(exported, tmp_path / "export")
    sidecar = json.loads((copy / export.SIDECAR).read_text())
    program = sidecar["programs"][0]
    again = dict(program) if repeat == "same_entry" else dict(program, rows=program["rows"] + 1)
    sidecar["programs"] = [program] + [again] * 100_000
    (copy / export.SIDECAR).write_text(json.dumps(sidecar))
    monkeypatch.setattr(files, "parse_program", lambda data: pytest.fail("a program was read"))
    with pytest.raises(UserError) as error:
        export.load(str(copy))
    helpers.one_line_error(error, str(copy / export.SIDECAR), "programs[1]", "repeats programs[0]")
