"""The config parsed once: each decoding setting has one default (``lconv.decode_settings``), written in no signature
below the surfaces; one frozen ``DecodeSettings`` carries a search; a ``ModelConfig`` is validated once, not at every
trace of the model that holds it."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest

from lconv.configs import schema
from lconv.decode_settings import SAMPLING_DEFAULTS, DecodeSettings
from lconv.errors import UserError
from lconv.nn import models
from lconv.nn.model_config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = {f.name for f in dataclasses.fields(DecodeSettings)}
# The surfaces build a DecodeSettings from the user's choices: their arguments may default to None ("not chosen":
# the contract's default, which DecodeSettings.build reads), never to a value of their own.
SURFACES = ("lconv/api.py", "lconv/export", "lconv/cli")
# Below them, the search takes the settings it is handed: a default there would be a second one.
BELOW = ("lconv/infer",)


def _defaults(path: pathlib.Path) -> list[tuple[str, int, str, str]]:
    """``(function, line, parameter, default)`` for each parameter of ``path``'s functions (lambdas too) that is
    named as a decoding setting and has a default."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        found += [(getattr(node, "name", "<lambda>"), node.lineno, a.arg, ast.unparse(d)) for a, d in pairs
                  if a.arg in SETTINGS]
    return found


def _files(places: tuple[str, ...]) -> list[pathlib.Path]:
    return sorted(p for place in places for p in ((ROOT / place).rglob("*.py") if (ROOT / place).is_dir()
                                                   else [ROOT / place]))


def test_no_decoding_setting_is_defaulted_twice():
    """A decoding setting's default is written once (``SamplingSettings``, or the config's ``decode`` section):
    ``lconv.infer`` writes none (it takes a ``DecodeSettings`` or required arguments) and the surfaces default
    only to None. A second default can drift from the first (``search.sample`` once defaulted the temperature to
    1.0 while the schema's contract, which eval.py, the API and export follow, was 0)."""
    wrong = [f"{p.relative_to(ROOT)}:{line} {fn}({name}={default})" for p in _files(BELOW)
             for fn, line, name, default in _defaults(p)]
    wrong += [f"{p.relative_to(ROOT)}:{line} {fn}({name}={default}): a surface defaults to None (= the schema's)"
              for p in _files(SURFACES) for fn, line, name, default in _defaults(p) if default != "None"]
    assert not wrong, "decoding settings defaulted outside lconv.decode_settings / the config:\n" + "\n".join(wrong)


def test_the_scan_sees_a_second_default(tmp_path):
    """The check is not vacuous: a signature like the old ``sample(..., temperature=1.0)`` is caught."""
    source = tmp_path / "old.py"
    source.write_text("def sample(fn, *, temperature: float = 1.0, top_k=None, rng=None):\n    pass\n")
    assert _defaults(source) == [("sample", 1, "temperature", "1.0"), ("sample", 1, "top_k", "None")]
    assert SETTINGS >= {"beam_size", "lenpen", "max_len", "temperature", "top_k", "top_p", "seed"}


def test_settings_take_the_config_and_the_contract_and_the_choices():
    config = schema.base_config()
    settings = DecodeSettings.build(config.decode)
    assert settings == DecodeSettings(beam_size=config.decode.beam_size, lenpen=config.decode.lenpen,
                                      max_len_a=config.decode.max_len_a, max_len_b=config.decode.max_len_b,
                                      stop=config.decode.stop, no_repeat_ngram_size=config.decode.no_repeat_ngram_size,
                                      min_len=config.decode.min_len, **SAMPLING_DEFAULTS)
    assert SAMPLING_DEFAULTS["temperature"] == 0.0 and not settings.sampling  # the one default: greedy / beam
    chosen = DecodeSettings.build(config.decode, temperature=0.7, top_k=None, seed=3, lenpen=0.5)
    assert (chosen.temperature, chosen.top_k, chosen.seed, chosen.lenpen) == (0.7, SAMPLING_DEFAULTS["top_k"], 3, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.temperature = 1.0
    with pytest.raises(UserError, match=r"unknown decoding setting\(s\) \['temprature'\]"):
        DecodeSettings.build(config.decode, temprature=1.0)
    assert schema.validate_config(config).search == settings  # the typed config gives the same search


def test_a_program_key_ignores_what_is_an_argument_or_unread():
    """``lenpen`` and the seed are a program's arguments, and a beam search reads no filter: one program each."""
    decode = schema.base_config().decode
    beams = DecodeSettings.build(decode)
    assert DecodeSettings.build(decode, lenpen=0.3, seed=9).program_key() == beams.program_key()
    hash(beams.program_key())  # a static argument of jax.jit
    sampled = DecodeSettings.build(decode, temperature=1.0, top_k=5)
    assert sampled.program_key() != DecodeSettings.build(decode, temperature=1.0, top_k=6).program_key()


def test_one_prompt_rule():
    """BOS + prompt + ``max_len`` new tokens fit the model's positions; a prompt of 0 tokens (BOS alone) fits,
    so eval.py, the API and export all allow ``max_len = positions - 1`` and refuse one more. The refusal advertises
    ``positions - 2``, the most that leaves room for a prompt of one token, and the blank prompts' one more."""
    decode = schema.base_config().decode
    assert DecodeSettings.build(decode, max_len=15).prompt_limit(16) == 0
    assert DecodeSettings.build(decode, max_len=10).prompt_limit(16) == 5
    assert DecodeSettings.build(decode, max_len=14).prompt_limit(16) == 1
    with pytest.raises(UserError, match=r"^--max_len=16 new tokens do not fit .*max_len=16 .*at most 14 \(15 from "
                                        r"blank prompts\)$"):
        DecodeSettings.build(decode, max_len=16).prompt_limit(16, "--max_len")


@pytest.mark.parametrize("decoder_only", [False, True])
def test_a_model_config_is_validated_once_not_at_every_trace(monkeypatch, decoder_only):
    calls = []
    original = ModelConfig.validate
    monkeypatch.setattr(ModelConfig, "validate", lambda self, decoder_only=False: (
        calls.append(decoder_only), original(self, decoder_only))[1])
    cfg = ModelConfig.from_config(dict(d_model=16, ffn_dim=16, num_heads=2, encoder_layers=1, decoder_layers=1,
                                       encoder_kernel_sizes=(3,), decoder_kernel_sizes=(3,)), vocab_size=11,
                                  decoder_only=decoder_only)
    assert calls == ([False, True] if decoder_only else [False])  # both sides' fields, then the LM's own rules
    model = models.DecoderOnlyLM(cfg) if decoder_only else models.EncoderDecoder(cfg)
    for length in (4, 5):  # traces of init and apply, then of both again at another shape: no check again
        tokens = jnp.ones((1, length), jnp.int32)
        args = (tokens,) if decoder_only else (tokens, tokens)
        variables = jax.jit(model.init)(jax.random.key(0), *args)
        jax.jit(model.apply)(variables, *args)
    assert len(calls) == (2 if decoder_only else 1)
    assert ModelConfig.from_config(cfg, decoder_only=decoder_only) is cfg  # validated: handed on as it is


def test_a_config_built_in_code_is_still_validated_by_its_model():
    """A ``ModelConfig`` made without ``from_config`` is checked by the model that holds it, at its first trace."""
    cfg = ModelConfig(vocab_size=11, d_model=15, num_heads=2, encoder_layers=1, decoder_layers=1)
    with pytest.raises(UserError, match="d_model=15 must be divisible by config.model.num_heads=2"):
        models.EncoderDecoder(cfg).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))


@pytest.fixture
def parses(monkeypatch):
    """Counts each parse of a config's ``model`` section (``ModelConfig.validate``) and ``data`` section
    (``DataConfig.from_config`` given a section, not an already parsed ``DataConfig``)."""
    from lconv.data.data_config import DataConfig

    counts = {"model": 0, "data": 0}
    validate, parse_data = ModelConfig.validate, DataConfig.from_config.__func__

    def counting_validate(self, decoder_only=False):
        counts["model"] += 1
        return validate(self, decoder_only)

    def counting_parse(cls, section):
        counts["data"] += not isinstance(section, cls)
        return parse_data(cls, section)

    monkeypatch.setattr(ModelConfig, "validate", counting_validate)
    monkeypatch.setattr(DataConfig, "from_config", classmethod(counting_parse))
    return counts


def test_a_training_start_parses_the_config_once(parses, tiny_data, tmp_path):
    """``check_config`` parses the model and data sections; ``build_run`` (tokenizer, datasets, model, state)
    takes what it parsed instead of parsing them again."""
    import helpers
    import tiny_config

    from lconv.train import setup

    config = tiny_config.training_config(tiny_data.data_dir)
    devices = jax.devices("cpu")[:1]
    checked = setup.check_config(config, devices)
    assert parses == {"model": 1, "data": 1}
    run = setup.build_run(config, str(helpers.new_workdir(tiny_data, tmp_path / "run")), devices, checked=checked)
    assert parses == {"model": 1, "data": 1}
    assert run.model.config is checked.config.model


def test_loading_a_run_parses_its_config_once(parses, tiny_run):
    """``load_trained`` parses the stored config once, reusing what ``read_stored`` parsed (eval.py and export read
    it first to check their flags); an override that changes the config is checked again."""
    from lconv.run import restore

    stored = restore.read_stored(str(tiny_run.workdir))
    trained = restore.load_trained(str(tiny_run.workdir), stored=stored)
    assert parses == {"model": 1, "data": 1}
    assert trained.model.config is stored.config.model

    with pytest.raises(UserError, match="beam_size"):
        restore.load_trained(str(tiny_run.workdir), stored=stored, overrides={"decode": {"beam_size": 0}})


# ----------------------------------------------------------------------------------------------------------------
# The config typed below the edges
# ----------------------------------------------------------------------------------------------------------------
# Where a config as its file spells it (a ConfigDict or a plain dict) comes in and is typed once: the programs and
# surfaces that write configs or take them from a user, and the parsers themselves. Everything else takes the
# typed ``RunConfig`` (lconv.run.schema) or the section it needs.
EDGE_FOLDERS = ("lconv/cli/", "lconv/configs/", "lconv/study/", "lconv/bench/", "lconv/interop/")
EDGE_FILES = {"lconv/api.py", "lconv/run/schema.py", "lconv/run/workdir.py", "lconv/fields.py",
              "lconv/nn/model_config.py", "lconv/data/data_config.py", "lconv/train/__main__.py",
              "lconv/data/__main__.py"}
EDGE_FUNCTIONS = {("lconv/train/loop.py", "train_and_evaluate"), ("lconv/train/setup.py", "check_config"),
                  ("lconv/train/setup.py", "build_run")}  # training from Python: a config as its file writes it
CONFIG_NAMES = {"config", "cfg", "model_config", "data_config", "mesh_config", "run_config"}
UNTYPED = {"Any", "Config", "ConfigDict", "ml_collections.ConfigDict", "dict", "Mapping"}


def untyped_configs(source: str, path: str) -> list[str]:
    """Each parameter named as a config with no annotation or an untyped one, and each ml_collections import,
    in ``source`` (the file ``path``) outside ``EDGE_FUNCTIONS``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(name.split(".")[0] == "ml_collections" for name in names):
                found.append(f"{path}:{node.lineno} imports ml_collections")
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (path, node.name) in EDGE_FUNCTIONS:
            continue
        for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else None
            if arg.arg in CONFIG_NAMES and (annotation is None or annotation in UNTYPED):
                found.append(f"{path}:{node.lineno} {node.name}({arg.arg}: {annotation})")
    return found


def test_below_the_edges_every_config_parameter_is_typed():
    """No ``config: Any`` (or ConfigDict) below the edges: each ``config.<section>.<field>`` read there reads a
    typed, frozen field, checked once by ``validate_config``."""
    found = []
    for path in sorted((ROOT / "lconv").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(EDGE_FOLDERS) or rel in EDGE_FILES:
            continue
        found += untyped_configs(path.read_text(encoding="utf-8"), rel)
    assert not found, found


def test_the_typed_config_check_sees_a_planted_config_dict():
    planted = ("import ml_collections\n"
               "def decode(config: Any, width: int): ...\n"
               "def train_and_evaluate(config, workdir): ...\n"
               "def build(cfg): ...\n"
               "def fine(config: RunConfig, data: DataConfig): ...\n")
    assert untyped_configs(planted, "lconv/infer/x.py") == [
        "lconv/infer/x.py:1 imports ml_collections", "lconv/infer/x.py:2 decode(config: Any)",
        "lconv/infer/x.py:3 train_and_evaluate(config: None)", "lconv/infer/x.py:4 build(cfg: None)"]
    assert untyped_configs(planted, "lconv/train/loop.py")[2:] == ["lconv/train/loop.py:4 build(cfg: None)"]
