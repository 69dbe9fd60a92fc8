"""The mixer contract (docs/models.md), checked the same way for every registered mixer: the executable
contract (``lconv.testing.check_mixer``: segments, padding, causality, decoding = the full pass, ...) and mixers
broken on purpose that it must catch, float32 softmax under bfloat16, one-line ValueErrors that name the bad field
or argument, and the plugin route (``register_mixer``, ``package.module:Class``) through configs and models.

The numerics of each mixer are tested against float64 references in its own test file.
"""
import collections
from typing import ClassVar

import flax.linen as nn
import helpers
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import toy_mixers

import lconv
import lconv.testing
from lconv.configs import common, default
from lconv.configs import study as study_config
from lconv.errors import UserError
from lconv.nn import mixers, models
from lconv.nn.colt5 import CoLT5FeedForward

B, T, C, H = 2, 13, 12, 3
X = jax.ShapeDtypeStruct((B, T, C), jnp.float32)
CAUSAL_OK = [n for n in mixers.mixer_names() if "decoder" in mixers.sides(n)]


def make(name, **kw):
    fields = dict(num_heads=H, causal=name in CAUSAL_OK) | mixers.info(name).example_fields | kw
    return mixers.make_mixer(name, **fields)


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test (a test's plugins do not leak into others)."""
    monkeypatch.setattr(mixers, "_MIXERS", dict(mixers._MIXERS))
    monkeypatch.setattr(mixers, "_FFNS", dict(mixers._FFNS))
    return mixers


# ---------------------------------------------------------------- the executable contract
CONTRACT_CASES = [(name, {}) for name in mixers.mixer_names()] + [  # and the mixers' optional forms
    ("fixed", dict(factorized_rank=2, mix_dot_product=True)), ("hadamard", dict(project_qk=True)),
    ("lightconv", dict(kernel_size=4, use_glu=False)), ("dynamicconv", dict(kernel_size=4))]


@pytest.mark.parametrize("name, fields", CONTRACT_CASES, ids=lambda v: str(v) if v else "-")
def test_every_registered_mixer_meets_the_contract(name, fields):
    if fields.get("kernel_size", 1) % 2 == 0:  # an even kernel only fits causal use: check the decoder side
        fields["causal"] = True
    lconv.testing.check_mixer(name, **fields)


def test_a_user_mixer_from_its_own_module_meets_the_contract():
    lconv.testing.check_mixer("toy_mixers:PrefixMean")


def test_a_user_mixer_with_carried_state_meets_the_contract_on_both_sides():
    lconv.testing.check_mixer("toy_mixers:CarriedMean")  # non-causal, then causal (decoding from a carried state)


@pytest.mark.parametrize("broken", list(toy_mixers.BROKEN), ids=lambda cls: cls.__name__)
def test_a_mixer_broken_on_purpose_fails_on_its_rule(broken):
    with pytest.raises(AssertionError) as info:
        lconv.testing.check_mixer(broken)
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(f"rule {toy_mixers.BROKEN[broken]!r} broken by {broken.__name__}"), first_line


def test_every_rule_has_a_mixer_that_breaks_it():
    assert set(toy_mixers.BROKEN.values()) == set(lconv.testing.RULES)


# ---------------------------------------------------------------- plugins
def test_register_mixer_adds_a_name_everywhere_a_mixer_is_chosen(registry):
    lconv.register_mixer("prefix_mean", toy_mixers.PrefixMean)
    assert "prefix_mean" in mixers.mixer_names() and mixers.info("prefix_mean").label == "Prefix mean"
    assert common.mixer_variants()["prefix_mean"] == "prefix_mean"
    config = default.get_config("prefix_mean")  # a :variant word, on both sides
    assert config.model.encoder_mixer == config.model.decoder_mixer == "prefix_mean"
    assert "prefix_mean" in study_config.get_config("quick").mixers  # the study runs it beside the others
    with pytest.raises(UserError, match="prefix_mean"):
        lconv.register_mixer("prefix_mean", toy_mixers.SegmentLeak)  # a taken name needs replace=True
    lconv.register_mixer("prefix_mean", toy_mixers.SegmentLeak, replace=True)
    assert mixers.mixer_class("prefix_mean") is toy_mixers.SegmentLeak

    @lconv.register_mixer("decorated")
    class Decorated(toy_mixers.PrefixMean):
        pass

    assert mixers.mixer_class("decorated") is Decorated and mixers.info("decorated").label == "decorated"


@pytest.mark.parametrize("bad, names", [
    (("has space", toy_mixers.PrefixMean), "has space"),
    (("ok", "no_colon_here"), "no_colon_here"),
    (("ok", int), "int"),
    (("lightconv", toy_mixers.PrefixMean), "lightconv"),
])
def test_register_mixer_refuses_bad_names_and_targets_in_one_line(registry, bad, names):
    with pytest.raises(UserError) as info:
        lconv.register_mixer(*bad)
    assert names in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("spec, names", [("no_such_module:Mixer", "no_such_module"),
                                         ("toy_mixers:NoSuchClass", "NoSuchClass"),
                                         ("toy_mixers:BROKEN", "BROKEN"), ("toy_mixers:", "toy_mixers:")])
def test_a_module_class_name_that_cannot_be_used_is_one_line_naming_it(spec, names):
    with pytest.raises(UserError) as info:
        models.ModelConfig(vocab_size=11, encoder_mixer=spec).validate()
    message = str(info.value)
    assert "encoder_mixer" in message and names in message and "\n" not in message


def test_a_module_class_mixer_builds_a_model_with_its_mixer_kwargs():
    """``package.module:Class`` in a config: the model imports it, fills its model fields and its
    ``mixer_kwargs`` (keyed by the spec or by the class name), and runs."""
    spec = "toy_mixers:PrefixMean"
    config = models.ModelConfig(vocab_size=11, d_model=12, ffn_dim=8, num_heads=3, encoder_layers=1,
                                decoder_layers=1, encoder_mixer=spec, decoder_mixer=f"{spec}",
                                mixer_kwargs={"PrefixMean": {"dropout": 0.25}})
    model = models.EncoderDecoder(config)
    tokens = jnp.array([[5, 6, 7, 1]], jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)
    assert "proj" in variables["params"]["encoder"]["layer_0"]["mixer"]
    layer = models.Layer(config, spec, layer=0, side="decoder", causal=True)
    assert models._mixer_fields(config, spec, "decoder", 0, True) == {"causal": True, "dropout": 0.25,
                                                                     "dtype": jnp.float32}
    assert layer.mixer_name == spec


def test_an_ffn_plugin_replaces_the_dense_ffn(registry):
    class DoubleFFN(nn.Module):  # the smallest feed-forward: 2x, no parameters
        @nn.compact
        def __call__(self, x, *, segment_ids=None, deterministic=True):
            return 2 * x

    lconv.register_ffn("double", DoubleFFN)
    config = models.ModelConfig(vocab_size=11, d_model=12, ffn_dim=8, num_heads=3, encoder_layers=1,
                                decoder_layers=1, ffn_type="double")
    tokens = jnp.array([[5, 6, 7, 1]], jnp.int32)
    params = jax.eval_shape(models.EncoderDecoder(config).init, jax.random.key(0), tokens, tokens)["params"]
    assert "ffn" not in params["encoder"]["layer_0"] and "ffn" not in params["decoder"]["layer_0"]
    with pytest.raises(UserError, match="ffn_type"):
        models.ModelConfig(vocab_size=11, ffn_type="nope").validate()


def trace_init(m, x=X, **call):
    return jax.eval_shape(lambda: m.init(jax.random.PRNGKey(0), jnp.zeros(x.shape, x.dtype), **call))


def _exp_input_dtypes(jaxpr):
    """The input dtype of every ``exp`` in a jaxpr, sub-jaxprs (jit, custom_jvp, loops) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "exp":
            yield eqn.invars[0].aval.dtype
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _exp_input_dtypes(sub)


@pytest.mark.parametrize("name", mixers.mixer_names() + ["colt5_ffn"])
def test_bfloat16_keeps_dtype_and_every_softmax_runs_in_float32(name):
    """Under ``dtype=bfloat16`` the output is bfloat16 of the input's shape, and every ``exp`` (softmax over
    attention logits or conv taps, soft top-k) takes float32: the logits are cast up before the softmax."""
    if name == "colt5_ffn":
        m = CoLT5FeedForward(num_routed=4, dtype=jnp.bfloat16)
    else:
        m = make(name, dtype=jnp.bfloat16)
    x16 = jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16)
    variables = trace_init(m, x16)
    out = jax.eval_shape(m.apply, variables, x16)
    assert out.shape == (B, T, C) and out.dtype == jnp.bfloat16
    dtypes = list(_exp_input_dtypes(jax.make_jaxpr(m.apply)(variables, x16).jaxpr))
    assert dtypes, "no softmax found: the check would be vacuous"
    assert all(d == jnp.float32 for d in dtypes), dtypes


@pytest.mark.parametrize("name", mixers.mixer_names())
@pytest.mark.parametrize("case, field", [
    ("x_not_3d", "x_BTC"),
    ("segment_ids_shape", "segment_ids"),
    ("positions_shape", "positions"),
    ("heads_do_not_divide", "num_heads"),
    ("decode_not_causal", "causal"),
])
def test_bad_shapes_and_fields_are_one_line_errors_naming_the_field(name, case, field):
    m, x, call = make(name), X, {}
    if case == "x_not_3d":
        x = jax.ShapeDtypeStruct((T, C), jnp.float32)
    elif case == "segment_ids_shape":
        call = dict(segment_ids=jnp.ones((B, T + 1), jnp.int32))
    elif case == "positions_shape":
        call = dict(positions=jnp.zeros((B, T - 1), jnp.int32))
    elif case == "heads_do_not_divide":
        m = make(name, num_heads=5)
    elif case == "decode_not_causal":
        m, call = make(name, causal=False), dict(decode=True)
    with pytest.raises(ValueError, match=field) as info:
        trace_init(m, x, **call)
    assert "\n" not in str(info.value)


def test_colt5_refuses_causal_use_with_one_line():
    with pytest.raises(ValueError, match="encoder mixer") as info:
        trace_init(make("colt5", causal=True))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["lightconv", "dynamicconv"])
def test_even_kernel_in_a_centred_conv_is_an_error(name):
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        trace_init(make(name, causal=False, kernel_size=4))
    trace_init(make(name, causal=True, kernel_size=4))  # fine when causal (taps K-1 .. 0 before t)


def test_unknown_mixer_and_unknown_field_are_named():
    with pytest.raises(ValueError, match="unknown mixer 'lightconvv'.*'attention'"):
        mixers.make_mixer("lightconvv", num_heads=H)
    with pytest.raises(ValueError, match=r"'fixed'.*'kernel_size'"):
        mixers.make_mixer("fixed", num_heads=H, kernel_size=3)


def _dot_precisions(jaxpr):
    """The precision of every dot and conv in a jaxpr, sub-jaxprs included (unset = the backend's default)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            precision = eqn.params.get("precision")
            yield "default" if precision is None else precision[0].name.lower()
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _dot_precisions(sub)


@pytest.mark.parametrize("name", mixers.mixer_names() + ["colt5_ffn"])
def test_matmul_precision_is_a_model_field_and_reaches_every_dot(name):
    """``matmul_precision`` comes from the model (``model_fields``) and sets every dot of the mixer, projections
    and attention alike, except those that must be exact whatever it is (the conv, top-k scores: HIGHEST)."""
    if name == "colt5_ffn":
        m = CoLT5FeedForward(num_routed=4, matmul_precision="high")
    else:
        assert mixers.model_fields(name)["matmul_precision"] == "matmul_precision"
        m = make(name, matmul_precision="high")
    variables = trace_init(m)
    precisions = collections.Counter(_dot_precisions(jax.make_jaxpr(m.apply)(variables, X).jaxpr))
    assert precisions["high"] >= 2 and set(precisions) <= {"high", "highest"}, precisions


def test_exp_finder_sees_a_bfloat16_softmax():
    """The float32 check above can fail: a softmax computed in bfloat16 is caught."""
    jaxpr = jax.make_jaxpr(lambda z: jax.nn.softmax(z))(np.zeros((2, 3), jnp.bfloat16)).jaxpr
    assert list(_exp_input_dtypes(jaxpr)) == [jnp.bfloat16]


def test_a_module_class_mixer_translates_through_the_api():
    """``package.module:Class`` on both sides of a run: ``lconv.api.Model`` builds it from the config, and beam
    search drives the plugin's own decode cache to a translation of every source."""
    import tiny_runs

    from lconv.api import Model

    config = tiny_runs.translation_config("toy_mixers:PrefixMean")
    model = Model(tiny_runs.in_memory(config))
    assert config.model.encoder_mixer == "toy_mixers:PrefixMean"
    sources = ["A small tool.", "Fast text editor for files."]
    translations = model.translate(sources, beam_size=2)
    assert len(translations) == 2 and all(isinstance(t, str) for t in translations)
    # Batched with padding = each alone: the plugin's segments and cache keep the rows apart.
    assert translations == [model.translate([s], beam_size=2)[0] for s in sources]


def test_the_docs_example_mixer_meets_the_contract(tmp_path, monkeypatch):
    """docs/models.md's "Adding a mixer" code, as a user would save it, passes the checker by its module name."""
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "models.md").read_text()
    start = text.index("# my_mixers.py")
    (tmp_path / "my_mixers.py").write_text(text[start:text.index("```", start)])
    monkeypatch.syspath_prepend(str(tmp_path))
    lconv.testing.check_mixer("my_mixers:GatedMean")


def test_an_installed_package_adds_mixers_through_its_entry_points(registry, tmp_path, monkeypatch):
    """A distribution declaring ``[lconv.mixers]`` entry points (as ``pip install`` leaves it) adds its names."""
    dist = tmp_path / "my_mixers_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-mixers-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[lconv.mixers]\nprefix_from_ep = toy_mixers:PrefixMean\n"
                                           "lightconv = toy_mixers:SegmentLeak\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(mixers, "_entry_points_loaded", False)
    assert mixers.mixer_class("prefix_from_ep") is toy_mixers.PrefixMean
    assert mixers.mixer_class("lightconv").__name__ == "LightConvBlock"  # a built-in name is never taken over


# ---------------------------------------------------------------- plugins that fail (issue 41)
@pytest.mark.parametrize("source, named", [("raise RuntimeError('boom at import')\n", "RuntimeError: boom at import"),
                                           ("def broken(:\n", "SyntaxError"),
                                           ("import no_such_dependency_41\n", "no_such_dependency_41"),
                                           ("import sys\nsys.exit(3)\n", "SystemExit")])
def test_a_plugin_module_that_fails_to_import_is_one_line_naming_it(source, named, tmp_path, monkeypatch):
    (tmp_path / "failing_plugin.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for attempt in (lambda: lconv.testing.check_mixer("failing_plugin:Mixer"),
                    lambda: models.ModelConfig(vocab_size=11, encoder_mixer="failing_plugin:Mixer").validate()):
        with pytest.raises(UserError) as info:
            attempt()
        helpers.one_line_error(info, "failing_plugin", named)


def test_class_attributes_are_not_constructor_fields():
    assert mixers.constructor_fields(toy_mixers.PrefixMean) == {"num_heads", "causal", "dropout", "dtype"}
    with pytest.raises(UserError) as info:  # a ClassVar is no field: refused in one line, not a TypeError
        mixers.make_mixer(toy_mixers.PrefixMean, label="x")
    helpers.one_line_error(info, "label")


def test_a_variant_word_that_cannot_pick_the_mixer_is_refused_or_left_out(registry, tmp_path, monkeypatch):
    class Lightish(toy_mixers.PrefixMean):
        variant: ClassVar[str] = "lightconv"

    with pytest.raises(UserError) as info:
        lconv.register_mixer("lightish", Lightish)
    helpers.one_line_error(info, "lightish", "'lightconv'")
    with pytest.raises(UserError) as info:  # a name that is another mixer's variant word
        lconv.register_mixer("dynamic", toy_mixers.PrefixMean)
    helpers.one_line_error(info, "'dynamic'", "dynamicconv")
    # Registered by a string (or an entry point), the class is only seen later: its word is left out, once.
    (tmp_path / "lightish_plugin.py").write_text("import toy_mixers\n\nclass Lightish(toy_mixers.PrefixMean):\n"
                                                 "    variant = 'lightconv'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    lconv.register_mixer("lightish_lazy", "lightish_plugin:Lightish")
    words = mixers.variant_words()
    assert len(words) == len(set(words)) and "lightish_lazy" in words, words
    assert mixers.variants()["lightconv"] == "lightconv"


def test_a_registered_plugin_that_cannot_be_imported_breaks_no_other_config(registry):
    registry._MIXERS["gone"] = "no_such_module_41:Mixer"  # a lazily registered or entry-point mixer
    config = default.get_config("transformer")
    assert config.model.encoder_mixer == "attention"
    assert "gone" not in mixers.variant_words() and "prefix_mean" not in mixers.variant_words()
    with pytest.raises(UserError) as info:  # naming it is the one line
        default.get_config("gone")
    helpers.one_line_error(info, "no_such_module_41")


def test_a_plugin_with_the_wrong_output_fails_the_model_build_naming_it():
    config = models.ModelConfig(vocab_size=11, d_model=12, ffn_dim=8, num_heads=3, encoder_layers=1,
                                decoder_layers=1, encoder_mixer="toy_mixers:TupleOutput")
    tokens = jnp.array([[5, 6, 7, 1]], jnp.int32)
    with pytest.raises(UserError) as info:
        jax.eval_shape(models.EncoderDecoder(config).init, jax.random.key(0), tokens, tokens)
    helpers.one_line_error(info, "toy_mixers:TupleOutput", "encoder layer 0", "tuple")


def test_a_mixer_is_shown_by_one_name_everywhere():
    """Its class's ``label``: the bench's mixer rows (and the committed CSV's), the study's tables, the mixer list
    of docs/models.md; no surface writes a name of its own."""
    import csv
    import pathlib

    from lconv.bench import mixers as bench_mixers
    from lconv.study import plan

    labels = {i.name: i.label for i in mixers.importable_infos()}
    assert len(set(labels.values())) == len(labels)  # two mixers never share a name
    assert {c.name for c in bench_mixers.CONFIGS if c.kind == "mixer"} == set(labels.values())
    assert all(c.name == labels[c.mixer] for c in bench_mixers.CONFIGS if c.kind == "mixer")
    assert all(plan.label(word) == labels[plan.mixer_name(word)] for word in mixers.variant_words())
    root = pathlib.Path(__file__).parents[1]
    with open(root / "docs" / "bench" / "mixers.csv") as f:
        assert {r["name"] for r in csv.DictReader(f) if r["kind"] == "mixer"} <= set(labels.values())
    text = (root / "docs" / "models.md").read_text()
    section = text[text.index("## Mixers: what each one projects"):text.index("## Adding a mixer")]
    bold = {name.strip() for line in section.splitlines() if line.startswith("- **")
            for name in line[4:line.index("**", 4)].split(" / ")}
    assert bold == set(labels.values())


def test_a_layout_rule_places_its_mixer_in_the_configs_and_the_study_alike(registry):
    """One rule on the class (``layout``, ``layout_others``), read by configs/lm1b.py and the study's configs after
    their layer counts are set: the kNN memory's second-to-last layer, and a plugin's own rule."""
    from lconv.configs import lm1b
    from lconv.study import plan

    assert mixers.layer_layout("knn_memory", 6) == "attention,attention,attention,attention,knn_memory,attention"
    assert mixers.layer_layout("knn_memory", 1) == "knn_memory"  # -2 of one layer is that layer
    assert lm1b.get_config("knn").model.decoder_mixer == mixers.layer_layout("knn_memory", 6)
    assert lm1b.get_config("knn,ddtp").model.decoder_mixer == "attention,knn_memory,attention"

    class Edges(toy_mixers.PrefixMean):
        layout: ClassVar[tuple[int, ...]] = (0, -1)
        layout_others: ClassVar[str] = "lightconv"

    lconv.register_mixer("edges", Edges)
    assert lm1b.get_config("edges,ddtp").model.decoder_mixer == "edges,lightconv,edges"
    study = plan.normalize(study_config.get_config("quick"))
    for task in ("translation", "lm"):
        config = plan.training_config(study, plan.RunKey(task, "edges", 0))
        for side in ("encoder", "decoder") if task != "lm" else ("decoder",):
            assert config.model[f"{side}_mixer"] == mixers.layer_layout("edges", config.model[f"{side}_layers"])
    with pytest.raises(UserError, match="layout"):
        mixers.info(type("BadLayout", (toy_mixers.PrefixMean,), {"layout": "second to last"}))


@pytest.mark.parametrize("state, named", [("ema", "tuple of collection names"), (("intermediates",), "intermediates"),
                                          (("cache",), "cache"), ((3,), "tuple of collection names")])
def test_a_state_that_would_not_be_carried_is_one_line_naming_the_mixer(state, named):
    """``state = "ema"`` (a string: its letters) or ``'intermediates'`` (a collection lconv fills itself) trained
    with no state carried, rc 0."""
    import flax.linen as nn

    class Stateful(nn.Module):
        num_heads: int = 1

        @nn.compact
        def __call__(self, x, **kwargs):
            return x

    Stateful.state = state
    with pytest.raises(UserError) as error:
        mixers.info(Stateful)
    helpers.one_line_error(error, "Stateful", named)
    Stateful.state, Stateful.reset_state = ("ema",), "zero"
    with pytest.raises(UserError) as error:
        mixers.info(Stateful)
    helpers.one_line_error(error, "reset_state", "not callable")
