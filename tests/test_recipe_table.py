"""The paper configs' recipes against fairseq's and the paper's (scripts/recipe_table.py, docs/recipes.md), and
fairseq's attention initialisation (xavier gain 1/sqrt(2) on Q/K/V, 1 on the output projection)."""
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lconv.nn import mixers
from lconv.nn.attention import CrossAttention, SelfAttention
from scripts import recipe_table

DOCS = pathlib.Path(__file__).parents[1] / "docs" / "recipes.md"
REGENERATE = "if the change is intended, run: PYTHONPATH=. python scripts/recipe_table.py --write docs/recipes.md"


def test_docs_tables_are_what_the_script_writes_from_the_configs_now():
    text = DOCS.read_text()
    committed = text.split(recipe_table.BEGIN, 1)[1].split(recipe_table.END, 1)[0].strip()
    assert committed == recipe_table.markdown(), f"docs/recipes.md differs from the configs: {REGENERATE}"


@pytest.mark.parametrize("recipe", recipe_table.RECIPES, ids=lambda r: r.label)
def test_config_equals_fairseqs_recipe_except_the_documented_differences(recipe):
    """Every recorded value (fairseq's, else the paper's) holds in the config, or is a listed exception; an
    exception whose config now agrees is stale and fails too."""
    ours = recipe_table.lconv_values(recipe)
    wrong, stale = [], []
    for field in recipe_table.FIELDS:
        want = recipe_table.reference(recipe, field)
        excepted = (recipe.label, field) in recipe_table.EXCEPTIONS
        if want is None:
            assert not excepted, f"{recipe.label} {field}: an exception with no recorded value to differ from"
        elif recipe_table.same(ours[field], want) == excepted:
            (stale if excepted else wrong).append(f"{field}: lconv {ours[field]!r}, reference {want!r}")
    assert not wrong, f"{recipe.label} differs from fairseq/the paper without a documented reason: {wrong}"
    assert not stale, f"{recipe.label}: documented exceptions that no longer differ (remove them): {stale}"


def test_exceptions_and_notes_name_real_rows():
    labels = {r.label for r in recipe_table.RECIPES}
    for label, field in [*recipe_table.EXCEPTIONS, *recipe_table.NOTES]:
        assert label in labels and field in recipe_table.FIELDS, (label, field)
    for r in recipe_table.RECIPES:
        assert set(r.fairseq) | set(r.paper) <= set(recipe_table.FIELDS), r.label


@pytest.mark.parametrize("devices,accum", [(8, 16), (16, 4), (16, 16), (32, 2)])
def test_wmt_batch_splits_as_the_docstring_says_per_hardware(devices, accum):
    """8 GPUs with fairseq's update-freq 16 hold its 3,584 tokens each; TPU slices divide the same update."""
    c = recipe_table.get_config("wmt_en_de", "dynamic,big")
    assert c.data.batch_size * c.data.max_target_length == 3584 * 8 * 16
    assert c.data.batch_size % (devices * accum) == 0
    if (devices, accum) == (8, c.optim.grad_accum_steps):
        assert c.data.batch_size // (devices * accum) * c.data.max_target_length == 3584


# ------------------------------------------------------------------------------------------------------------
# Initialisation: fairseq's MultiheadAttention.reset_parameters (q/k/v gain 1/sqrt(2) with equal dims; out 1)
# ------------------------------------------------------------------------------------------------------------
C, H = 64, 4  # 64 x 64 kernels: 4,096 samples pin the std to ~1% and the max to within 0.1% of the bound
QKV, OUT = 1 / math.sqrt(2), 1.0


def _check_xavier(kernel, gain, where):
    """Uniform(-b, b) with b = gain * sqrt(6 / (fan_in + fan_out)): max |w| at b, std at b / sqrt(3)."""
    w = np.asarray(kernel, np.float64)
    bound = gain * math.sqrt(6.0 / sum(w.shape))
    assert np.abs(w).max() <= bound * (1 + 1e-6), where
    assert np.abs(w).max() >= 0.98 * bound, f"{where}: max |w| {np.abs(w).max():.4f}, bound {bound:.4f}"
    assert w.std() == pytest.approx(bound / math.sqrt(3), rel=0.05), where


def _params(module, *args):
    return nn.meta.unbox(module.init(jax.random.key(0), *args)["params"])


def _check_projections(params, qkv_names, where):
    for name in qkv_names:
        _check_xavier(params[name]["kernel"], QKV, f"{where}.{name}")
        assert not np.any(params[name]["bias"]), f"{where}.{name} bias"
    _check_xavier(params["out"]["kernel"], OUT, f"{where}.out")
    assert not np.any(params["out"]["bias"]), f"{where}.out bias"


def test_self_and_cross_attention_init_as_fairseq():
    x = jnp.zeros((1, 3, C))
    _check_projections(_params(SelfAttention(num_heads=H), x), ("query", "key", "value"), "SelfAttention")
    _check_projections(_params(CrossAttention(num_heads=H), x, jnp.zeros((1, 5, C))), ("query", "key", "value"),
                       "CrossAttention")


def test_cross_attention_to_an_encoder_of_another_width_inits_qkv_at_gain_one_as_fairseq():
    """fairseq's qkv_same_dim is False when kdim = vdim = the encoder's width differs: plain xavier-uniform."""
    params = _params(CrossAttention(num_heads=H), jnp.zeros((1, 3, C)), jnp.zeros((1, 5, 3 * C // 2)))
    assert params["key"]["kernel"].shape == (3 * C // 2, C)
    for name in ("query", "key", "value", "out"):
        _check_xavier(params[name]["kernel"], 1.0, f"CrossAttention.{name}")


@pytest.mark.parametrize("name,fields,qkv", [
    ("fixed", dict(max_len=8, mix_dot_product=True), ("query", "key", "value")),
    ("hadamard", dict(max_len=8, project_qk=True), ("query", "key", "value")),
    ("knn_memory", dict(memory_size=8, num_neighbors=2), ("query", "key", "value")),
])
def test_other_attention_mixers_project_qkv_with_the_same_gain(name, fields, qkv):
    mixer = mixers.make_mixer(name, num_heads=H, causal=True, **fields)
    _check_projections(_params(mixer, jnp.zeros((1, 3, C))), qkv, name)
