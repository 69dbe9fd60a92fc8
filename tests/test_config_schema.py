"""The config schema (lconv.run.schema): each field defined once, and everything else derived from it.

Fast: no model is traced and no data is read.
"""
from __future__ import annotations

import ast
import json
import pathlib

import ml_collections
import pytest

from lconv.configs import common, schema
from lconv.configs import default as default_config
from lconv.data.data_config import DataConfig
from lconv.errors import UserError
from lconv.fields import schema_fields
from lconv.nn.model_config import ModelConfig, SideConfig
from lconv.run import restore

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "config.md"


def test_docs_field_tables_are_the_schemas():
    assert DOCS.read_text(encoding="utf-8") == schema.markdown(), (
        "docs/config.md differs from the schema; refresh it: python -m lconv.run.schema > docs/config.md")


def test_every_field_has_a_doc_and_a_default_its_own_rule_allows():
    config = common.base_config()
    for name, section in [(None, schema.TopConfig), *schema.SECTIONS.items()]:
        values = config if name is None else config[name]
        for f in schema_fields(section):
            assert f.metadata["doc"].strip(), f"{section.__name__}.{f.name} has no doc"
            assert f.metadata["rule"].test(values[f.name]), f"{section.__name__}.{f.name}={values[f.name]!r}"


def test_base_config_holds_every_field_at_its_default_and_validates():
    config = common.base_config()
    schema.validate_config(config)
    assert set(config) == {f.name for f in schema_fields(schema.TopConfig)} | set(schema.SECTIONS)
    for name, section in schema.SECTIONS.items():
        assert set(config[name]) == {f.name for f in schema_fields(section)}, name


def test_a_model_built_without_a_config_file_gets_the_configs_defaults():
    assert ModelConfig.from_config(common.base_config().model, vocab_size=400) == ModelConfig(vocab_size=400)
    assert DataConfig.from_config({}) == DataConfig.from_config(common.base_config().data)


def test_a_config_lacking_fields_gets_their_defaults_not_a_readers_fallback():
    """The divergence guard used to be off (spike_factor 0.0) for a config without train.spike_factor."""
    config = common.base_config()
    del config.train["spike_factor"], config.train["stop_check_every"], config.data["stream"]
    schema.validate_config(config)
    assert config.train.spike_factor == 3.0 and config.train.stop_check_every == 10 and config.data.stream is False


def test_an_older_runs_config_json_loads_with_the_fields_added_since(tmp_path):
    stored = common.base_config().to_dict()
    del stored["decode"]["compound_split"], stored["data"]["eval_splits"], stored["model"]["decoder_start"]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    config = restore.read_config(str(tmp_path))
    assert config.decode.compound_split is False and tuple(config.data.eval_splits) == ("validation", "test")
    assert config.model.decoder_start == "bos"


@pytest.mark.parametrize("field, value, message", [
    ("train.spike_factor", 0.5, "config.train.spike_factor=0.5: must be 0 (off) or a number > 1"),
    ("data.read_threads", 0, "config.data.read_threads=0: must be an integer in [1, 1,024]"),
    # Sizes have upper bounds (issue 41: an overflow, a 373 GiB MemoryError and a hang, each after data preparation)
    ("model.d_model", 10**20, f"config.model.d_model={10**20}: must be an integer in [1, 65,536] (the upper bound"),
    ("data.max_input_length", 10**11, f"config.data.max_input_length={10**11}: must be an integer in [2, 1,048,576]"),
    ("model.encoder_layers", 10**8, f"config.model.encoder_layers={10**8}: must be an integer in [0, 1,024]"),
    ("train.max_minutes", 1e308, "config.train.max_minutes=1e+308: must be a number in [0, 525,600] (0 = no limit;"),
    ("decode.beam_size", 8000, "config.decode.beam_size=8000: must be at most the vocabulary's size - 1 (7999;"),
    ("data.eval_splits", ("test",), "config.data.eval_splits=('test',): must include 'validation'"),
    ("decode.split", "train", "config.decode.split='train': must be one of config.data.eval_splits="),
    # A split names its output files (<split>.hyp.txt): a stored '../..' would write outside the workdir
    ("decode.split", "../../x", "config.decode.split='../../x': must be a split name (no folder in it)"),
    ("data.eval_splits", ("validation", "../x"), "config.data.eval_splits=('validation', '../x'): must be a non-empty"),
    ("mesh.shape", (2, 2), "config.mesh.shape=(2, 2): must be three sizes"),
    # A rule sharding onto an axis the mesh lacks was a jax traceback at the first compile
    ("mesh.rules", [["embed", "nope"]], "config.mesh.rules has ('embed', 'nope'): its mesh axis must be one of "
                                        "config.mesh.axis_names ('data', 'fsdp', 'tensor')"),
    ("mesh.rules", [["batch", ["data", "nope"]]], "config.mesh.rules has ('batch', ['data', 'nope']): its mesh"),
    ("mesh.rules", [5], "config.mesh.rules=(5,): must be (logical axis, mesh axis or None) pairs"),
    ("decode.beam_size", 0, "config.decode.beam_size=0: must be >= 1 (1 = greedy)"),
    ("model.weight_dropout", 1.0, "config.model.weight_dropout=1.0: must be a rate in [0, 1)"),
    ("train.spike_windows_typo", 1, "config.train has unknown field(s) ['spike_windows_typo']"),
    # A seq2seq run decodes within its positions (one 1,441-token line had decoded silently for minutes)
    ("data.eval_max_input_length", 1025, "config.data.eval_max_input_length=1025: at most config.model.max_len=1024"),
    ("data.eval_max_target_length", 10**6, "config.data.eval_max_target_length=1000000: at most config.model.max_len"),
])
def test_a_bad_field_is_one_line_naming_it(field, value, message):
    config = common.base_config()
    section, name = field.split(".")
    config[section][name] = value
    with pytest.raises(UserError) as error:
        schema.validate_config(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("spell, shown", [(lambda n: f"config.decode.{n}", "config.decode."),
                                          (lambda n: f"--{n}", "--"), (str, "")])
def test_beam_settings_have_one_rule_wherever_they_are_given(spell, shown):
    for kwargs, message in [(dict(beam_size=0), "beam_size=0: must be >= 1"),
                            (dict(beam_size=2.5), "beam_size=2.5: must be >= 1"),
                            (dict(lenpen=float("nan")), "lenpen=nan: must be a number in [0, 10]"),
                            # a float32 length**lenpen overflowed: every hypothesis scored alike, without a word
                            (dict(lenpen=1e308), "lenpen=1e+308: must be a number in [0, 10]"),
                            (dict(beam_size=10**9, vocab_size=400), f"beam_size={10**9}: must be at most the "
                                                                    "vocabulary's size - 1 (399")]:
        with pytest.raises(UserError) as error:
            schema.check_search(spell=spell, **kwargs)
        assert str(error.value).startswith(shown + message)
    schema.check_search(beam_size=1, lenpen=0.0, spell=spell)
    schema.check_search(beam_size=399, spell=spell, vocab_size=400)


# ----------------------------------------------------------------------------------------------------------------
# Every config field the sources read is in the schema, and none is read with a fallback of its own
# ----------------------------------------------------------------------------------------------------------------
_CONFIG_NAMES = {"config", "cfg", "c"}
_CONFIG_DICT_METHODS = set(dir(ml_collections.ConfigDict))


def _sources() -> list[pathlib.Path]:
    package = [p for p in sorted((ROOT / "lconv").rglob("*.py")) if "configs" not in p.relative_to(ROOT).parts]
    return package + sorted((ROOT / "configs").glob("*.py"))  # lconv/configs is a link to configs/


def _is_config(node: ast.expr) -> bool:
    """``config``, ``cfg``, ``c`` or ``<anything>.config`` (``self.config``, ``run.config``)."""
    return (isinstance(node, ast.Name) and node.id in _CONFIG_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "config")


def _section_reads() -> list[tuple[str, str, str]]:
    """(section, field, where) of every ``<config>.<section>.<field>`` in the sources."""
    reads = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr in schema.SECTIONS and _is_config(node.value.value)):
                reads.append((node.value.attr, node.attr, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return reads


def test_the_scan_finds_the_reads_it_looks_for():
    fields = {(section, name) for section, name, _ in _section_reads()}
    assert {("train", "spike_factor"), ("data", "stream"), ("decode", "beam_size"), ("model", "d_model")} <= fields


def test_every_config_field_read_in_lconv_and_configs_is_in_the_schema():
    known = {name: {f.name for f in schema_fields(section)} for name, section in schema.SECTIONS.items()}
    unknown = [f"{where}: config.{section}.{name}" for section, name, where in _section_reads()
               if name not in known[section] and name not in _CONFIG_DICT_METHODS]
    assert not unknown, "fields read but not in the schema (add them to it):\n" + "\n".join(unknown)


def test_no_config_field_is_read_with_a_fallback_of_its_own():
    """``config.train.get("spike_factor", 0.0)`` would shadow the schema's default; the schema fills it."""
    fallbacks = [where for section, name, where in _section_reads() if name == "get"]
    assert not fallbacks, "read the field: the schema fills what a config lacks:\n" + "\n".join(fallbacks)


# ----------------------------------------------------------------------------------------------------------------
# Per-side model settings: encoder_<field> / decoder_<field> override the shared field (ModelConfig.side)
# ----------------------------------------------------------------------------------------------------------------
# config.model as lconv wrote it before the per-side fields (and activation, layernorm_embedding, token_positions)
# existed: a workdir's config.json from then must load to the same model.
_OLD_MODEL_SECTION = {
    "d_model": 48, "ffn_dim": 96, "num_heads": 4, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_mixer": "lightconv", "decoder_mixer": "dynamicconv", "encoder_kernel_sizes": [3, 5],
    "decoder_kernel_sizes": [3], "mixer_kwargs": {}, "ffn_type": "dense", "ffn_kwargs": {}, "use_glu": False,
    "conv_features": 24, "dropout": 0.1, "attention_dropout": 0.0, "relu_dropout": 0.0, "input_dropout": 0.0,
    "weight_dropout": 0.1, "normalize_before": True, "share_embeddings": True, "adaptive_softmax_cutoffs": [],
    "adaptive_softmax_factor": 4.0, "adaptive_softmax_dropout": 0.0, "learned_positions": True, "max_len": 64,
    "conv_impl": "auto", "dtype": "float32", "remat": "none", "matmul_precision": "default",
    "attention_impl": "auto", "weight_softmax": True, "decoder_start": "bos", "position_offset": 0,
    "scale_embeddings": True, "share_decoder_input_output": False}


def test_an_old_model_section_loads_with_each_side_taking_the_shared_values(tmp_path, lconv_log):
    stored = common.base_config().to_dict()
    stored["model"] = dict(_OLD_MODEL_SECTION)
    (tmp_path / "config.json").write_text(json.dumps(stored))
    config = restore.read_config(str(tmp_path))  # checked by the schema as it is read
    # Its evaluation limits (256) predate the rule that they fit its 64 learned positions: lowered, said once each
    assert (config.data.eval_max_input_length, config.data.eval_max_target_length) == (64, 64)
    assert [m.split("config.json: ", 1)[1] for m in lconv_log()] == [
        f"config.data.{name} 256 -> 64 (config.model.max_len, the model's positions)"
        for name in ("eval_max_input_length", "eval_max_target_length")]
    model = ModelConfig.from_config(config.model, vocab_size=400)
    assert (model.activation, model.layernorm_embedding, model.token_positions) == ("relu", False, True)
    for side in ("encoder", "decoder"):
        assert model.side(side) == SideConfig(name=side, d_model=48, ffn_dim=96, num_heads=4, use_glu=False,
                                              conv_features=24, normalize_before=True, learned_positions=True)
    assert ModelConfig.from_config(_OLD_MODEL_SECTION, vocab_size=400) == model


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # ml_collections loading the file
def test_a_side_value_overrides_the_shared_one_and_the_command_line_sets_it():
    from absl import flags
    from ml_collections import config_flags

    argv = ["train.py", "--config=configs/default.py", "--config.model.decoder_ffn_dim=256",
            "--config.model.encoder_use_glu=False", "--config.model.decoder_d_model=128",
            "--config.model.decoder_conv_features=64", "--config.model.encoder_normalize_before=False",
            "--config.model.share_embeddings=False"]  # one table needs one width
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True, sys_argv=argv)
    flag_values(argv)
    config = flag_values.config
    schema.validate_config(config)
    model = ModelConfig.from_config(config.model, vocab_size=400)
    assert model.side("encoder") == SideConfig(name="encoder", d_model=256, ffn_dim=512, num_heads=4,
                                               use_glu=False, conv_features=256, normalize_before=False,
                                               learned_positions=False)
    assert model.side("decoder") == SideConfig(name="decoder", d_model=128, ffn_dim=256, num_heads=4, use_glu=True,
                                               conv_features=64, normalize_before=True, learned_positions=False)
    assert config.model.encoder_ffn_dim is None  # unset: the shared ffn_dim (default.py's 512)


def test_the_default_validates_only_at_its_end_and_its_fields_stay_apart():
    from absl import flags
    from ml_collections import config_flags

    # A plain value, not a reference to num_steps: setting a field that holds an ml_collections reference sets what
    # it refers to, so --config.train.eval_every would have moved num_steps too.
    argv = ["train.py", "--config=configs/default.py", "--config.train.eval_every=300"]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True, sys_argv=argv)
    flag_values(argv)
    config = flag_values.config
    schema.validate_config(config)
    assert (config.train.eval_every, config.train.num_steps) == (300, 1500)
    default = default_config.get_config().train
    assert default.eval_every == default.num_steps  # no pass before the final one (the loop's: step < num_steps)


@pytest.mark.parametrize("overrides, message", [
    (dict(decoder_num_heads=5), "config.model.d_model=256 must be divisible by config.model.decoder_num_heads=5"),
    (dict(encoder_d_model=250), "config.model.encoder_d_model=250 must be divisible by config.model.num_heads=4"),
    (dict(decoder_conv_features=30), "config.model.decoder_conv_features=30 (the decoder's conv width) must be "
                                     "divisible by config.model.num_heads=4"),
    (dict(decoder_d_model=128, share_embeddings=True), "config.model.share_embeddings needs one width: encoder "
                                                       "256, decoder 128"),
    (dict(decoder_ffn_dim=0), "config.model.decoder_ffn_dim=0: must be None (= the shared field) or an integer"),
    (dict(encoder_conv_features=-1), "config.model.encoder_conv_features=-1: must be None (= the shared field), 0 "
                                     "(= the side's width) or an integer in [1, 65,536]"),
    (dict(activation="swish"), "config.model.activation='swish': must be one of relu, gelu, gelu_accurate"),
    # Settings that would be ignored are refused (issue 41)
    (dict(encoder_layers=2, encoder_kernel_sizes=(3, 5, 7)), "config.model.encoder_kernel_sizes has 3 entries for 2 "
                                                            "encoder layers; the last 1 would be ignored"),
    (dict(mixer_kwargs={"dynamic_conv": {"kernel_size": 3}}), "config.model.mixer_kwargs['dynamic_conv']: "
                                                              "'dynamic_conv' is no registered mixer"),
    (dict(mixer_kwargs={"dynamicconv": 5}), "config.model.mixer_kwargs['dynamicconv']=5: must be a dict"),
    (dict(mixer_kwargs={"dynamicconv": {"kernel": 3}}), "config.model.mixer_kwargs['dynamicconv']: mixer "
                                                        "'dynamicconv' has no field(s) ['kernel']"),
    (dict(ffn_kwargs={"hidden": 3}), "config.model.ffn_kwargs: ffn_type 'dense' has no field(s) ['hidden']"),
    (dict(mixer_kwargs={"dynamicconv": {"param_dtype": "float64x"}}),  # a stored config's: a 71-line TypeError
     "config.model.mixer_kwargs['dynamicconv']['param_dtype']='float64x': not a floating-point dtype"),
    (dict(mixer_kwargs={"dynamicconv": {"param_dtype": "int8"}}),  # a dtype, but no parameter's: a traceback
     "config.model.mixer_kwargs['dynamicconv']['param_dtype']='int8': not a floating-point dtype"),
    (dict(mixer_kwargs={"dynamicconv": {"conv_features": -1}}),  # a traceback from inside JAX at the first trace
     "config.model.mixer_kwargs['dynamicconv']['conv_features']=-1: must be >= 1"),
    (dict(ffn_kwargs={"hidden_dim": 0}), "config.model.ffn_kwargs['hidden_dim']=0: must be >= 1"),
    (dict(mixer_kwargs={"knn_memory": {"memory_size": 10 ** 8}}),  # 400 GB asked at load (r27-35, r27-17)
     "config.model.mixer_kwargs['knn_memory']['memory_size']=100000000: must be at most 1,048,576"),
    (dict(mixer_kwargs={"dynamicconv": {"weight_dropout": 2.0}}),
     "config.model.mixer_kwargs['dynamicconv']['weight_dropout']=2.0: a dropout rate must be in [0, 1)"),
    (dict(mixer_kwargs={"dynamicconv": {"input_dropout": float("nan")}}),
     "config.model.mixer_kwargs['dynamicconv']['input_dropout']=nan: a dropout rate must be in [0, 1)"),
    (dict(ffn_kwargs={"activation": "bogus"}),  # a KeyError traceback at the first trace
     "config.model.ffn_kwargs['activation']='bogus': must be one of relu, gelu, gelu_accurate"),
    (dict(mixer_kwargs={"dynamicconv": {"causal": "false"}}),  # was read as true without a word (r24-28)
     "config.model.mixer_kwargs['dynamicconv']['causal']='false': must be a bool"),
    (dict(mixer_kwargs={"dynamicconv": {"kernel_size": 3.5}}),  # a traceback at the first trace (r24-27)
     "config.model.mixer_kwargs['dynamicconv']['kernel_size']=3.5: must be an int"),
    (dict(mixer_kwargs={"lightconv": {"conv_features": "16"}}),
     "config.model.mixer_kwargs['lightconv']['conv_features']='16': must be an int | None"),
    # A module (already imported, so no plugin) that is no mixer was a flax traceback at the first trace
    (dict(encoder_mixer="flax.linen:Dense"), "config.model.encoder_mixer='flax.linen:Dense' cannot be a mixer: "
                                             "flax.linen.linear:Dense needs field(s) ['features']"),
    (dict(decoder_mixer="flax.linen:Dense", mixer_kwargs={"Dense": {"features": 256}}),
     "config.model.decoder_mixer='flax.linen:Dense' cannot be a mixer: flax.linen.linear:Dense cannot take a layer's "
     "call mixer(x, segment_ids=..., positions=..., deterministic=..., decode=...): got an unexpected keyword"),
    (dict(ffn_type="flax.linen:Dense"), "config.model.ffn_type='flax.linen:Dense' cannot be an FFN: "
                                        "flax.linen.linear:Dense needs field(s) ['features']"),
    (dict(activation="gelu", ffn_type="colt5"), "config.model.activation='gelu' needs an FFN with an activation "
                                                "field; ffn_type='colt5' has none"),
])
def test_a_bad_side_setting_is_one_line_naming_its_field(overrides, message):
    config = common.base_config()
    config.model.d_model, config.model.num_heads = 256, 4
    config.model.update(overrides)
    with pytest.raises(UserError) as error:
        schema.validate_config(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
