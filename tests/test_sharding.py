"""Sharding on pods: every parameter of every model family carries logical axis names that split it over the mesh;
a (data=2, fsdp=2, tensor=2) mesh computes the loss and gradients one device does, without XLA replicating an
activation to reshard it; per-layer rematerialisation leaves the loss and gradients unchanged.

Runs on the 8 virtual CPU devices of tests/conftest.py.
"""
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_config
from flax import linen as nn

from lconv import constants
from lconv.configs import common
from lconv.errors import UserError
from lconv.nn import knn_memory, models
from lconv.nn.common import BTC, axis_rules, constrain, under_axis_rules
from lconv.run import metrics, model_setup, schema
from lconv.train import setup, update
from scripts import param_table

MESH_SIZES = {"data": 2, "fsdp": 2, "tensor": 2}
F32_EPS = float(np.finfo(np.float32).eps)

# Tiny dims that every mesh axis of size 2 divides (d_model, heads, ffn, vocab, max_len, heads x kernel).
TINY = dict(vocab_size=64, d_model=32, ffn_dim=64, num_heads=4, encoder_layers=1, decoder_layers=1,
            encoder_kernel_sizes=(3,), decoder_kernel_sizes=(3,), max_len=16,
            mixer_kwargs={"knn_memory": {"memory_size": 8, "num_neighbors": 2},
                          "colt5": {"local_radius": 2, "num_routed": 4}})
FAMILIES = {  # name -> (ModelConfig overrides, decoder-only)
    "attention": (dict(encoder_mixer="attention", decoder_mixer="attention"), False),
    "lightconv": (dict(encoder_mixer="lightconv", decoder_mixer="lightconv"), False),
    "dynamicconv": (dict(encoder_mixer="dynamicconv", decoder_mixer="dynamicconv"), False),
    "fixed": (dict(encoder_mixer="fixed", decoder_mixer="fixed"), False),
    "fixed_factorized_mixed": (dict(encoder_mixer="fixed", decoder_mixer="fixed", mixer_kwargs={
        "fixed": {"factorized_rank": 4, "mix_dot_product": True}}), False),
    "hadamard": (dict(encoder_mixer="hadamard", decoder_mixer="hadamard"), False),
    "hadamard_projected": (dict(encoder_mixer="hadamard", decoder_mixer="hadamard",
                                mixer_kwargs={"hadamard": {"project_qk": True}}), False),
    "colt5_encoder": (dict(encoder_mixer="colt5", decoder_mixer="attention", ffn_type="colt5"), False),
    "knn_memory_decoder": (dict(encoder_mixer="attention", decoder_mixer="knn_memory"), False),
    "untied_learned_positions": (dict(encoder_mixer="dynamicconv", decoder_mixer="attention",
                                      share_embeddings=False, learned_positions=True), False),
    "decoder_only_lm": (dict(decoder_mixer="dynamicconv"), True),
    "adaptive_softmax_lm": (dict(decoder_mixer="attention", share_embeddings=False,
                                 adaptive_softmax_cutoffs=(16, 32)), True),
    "adaptive_input_tied_lm": (dict(decoder_mixer="dynamicconv", share_embeddings=False,
                                    adaptive_input_cutoffs=(16, 32), adaptive_softmax_cutoffs=(16, 32),
                                    adaptive_input_factor=2.0,
                                    adaptive_softmax_factor=2.0, tie_adaptive_weights=True), True),
    "projected_in_and_out_lm": (dict(decoder_mixer="attention", share_embeddings=False, decoder_input_dim=16,
                                     decoder_output_dim=48, decoder_final_norm=False), True),
}
# Leaves of two or more dims that are legitimately split over only one of fsdp / tensor (path suffix -> why).
# Nothing is fully replicated: even layer-norm scales, biases and per-head scalars are split along their one axis.
ONE_AXIS_OK = {
    "['learned']['embedding']": "learned positions [L, C]: positions are 'length', replicated by the config rules "
                                "(a table indexed by position); the width is on fsdp",
    "['conv']['weight']": "a lightweight conv kernel [H, K]: H * K numbers, heads on tensor, taps replicated",
    "['r1']": "Fixed attention's factor [H, L, r]: query positions are 'length' (replicated), heads on tensor; "
              "r * L per head",
}


def _cpu_mesh_2x2x2():
    """A data x fsdp x tensor mesh of the 8 virtual CPU devices (asked of the CPU: any default backend)."""
    return jax.make_mesh((2, 2, 2), constants.MESH_AXES, (jax.sharding.AxisType.Auto,) * 3,
                         devices=helpers.cpu_devices(8))


def _abstract_params(overrides, decoder_only):
    cfg = models.ModelConfig(**{**TINY, **overrides})
    model = models.DecoderOnlyLM(cfg) if decoder_only else models.EncoderDecoder(cfg)
    args = (jnp.ones((2, 8), jnp.int32),) * (1 if decoder_only else 2)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), *args))["params"]


def _mesh_axes(spec_entry):
    return () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_parameter_is_named_and_split_over_the_mesh(family):
    """Under configs/common.py's rules (merged with lconv's defaults, lconv.nn.common.axis_rules): every leaf is
    boxed with a known logical name per dim, is split over at least one mesh axis, splits evenly on a 2x2x2 mesh,
    and a leaf of two or more dims uses both fsdp and tensor unless ONE_AXIS_OK says why not."""
    params = _abstract_params(*FAMILIES[family])
    rules = axis_rules(common.base_config().mesh.rules)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves
    for path, leaf in leaves:
        where = f"{family}: {jax.tree_util.keystr(path)}"
        assert isinstance(leaf, nn.Partitioned), f"{where} has no logical axis names"
        shape = leaf.value.shape
        assert len(leaf.names) == len(shape), f"{where}: names {leaf.names} for shape {shape}"
        assert set(leaf.names) <= set(constants.PARAM_AXES) | {None}, f"{where}: unknown names {leaf.names}"
        spec = nn.logical_to_mesh_axes(leaf.names, rules)
        used = set()
        for size, entry in zip(shape, spec):
            axes = _mesh_axes(entry)
            used.update(axes)
            assert size % int(np.prod([MESH_SIZES[a] for a in axes])) == 0, f"{where}: {shape} {spec} is uneven"
        assert used, f"{where} {shape} is replicated on every device"
        if len(shape) >= 2 and not any(jax.tree_util.keystr(path).endswith(k) for k in ONE_AXIS_OK):
            assert {"fsdp", "tensor"} <= used, f"{where} {shape} {leaf.names} is split over {used} only"


@pytest.mark.parametrize("name,variant", [("wmt_en_de", "transformer,base"), ("wmt_en_de", "dynamic,base"),
                                          ("iwslt14_de_en", "fixed"), ("lm1b", "dynamic,adaptive")])
def test_real_configs_hold_a_quarter_of_their_parameters_per_device(name, variant):
    """On a 2x2x2 mesh (fsdp x tensor = 4) each device holds ~1/4 of the parameters (param_shardings' path)."""
    config = param_table.get_config(name, variant)
    config.mesh.rules = axis_rules(config.mesh.rules)
    config = schema.validate_config(config)
    mesh = _cpu_mesh_2x2x2()
    model = model_setup.build_model(config, config.data.vocab_size)
    args, kwargs = model_setup.model_inputs(model_setup.dummy_batch(config))
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))["params"]
    shardings = jax.tree.leaves(model_setup.param_shardings(config, abstract, mesh))
    shapes = [x.shape for x in jax.tree.leaves(nn.meta.unbox(abstract))]
    total = sum(np.prod(s) for s in shapes)
    per_device = sum(np.prod(sh.shard_shape(s)) for sh, s in zip(shardings, shapes, strict=True))
    assert per_device / total <= 0.25 * 1.01, f"{name}:{variant}: {per_device / total:.4f} of the params per device"


def test_axis_rules_put_the_configs_mapping_first():
    rules = axis_rules((("embed", "fsdp"), (constants.ACT_EMBED, "tensor"), ("batchy", ["data", "fsdp"])))
    assert rules[:3] == (("embed", "fsdp"), (constants.ACT_EMBED, "tensor"), ("batchy", ("data", "fsdp")))
    names = [name for name, _ in rules]
    assert len(names) == len(set(names)) and set(dict(constants.DEFAULT_AXIS_RULES)) <= set(names)


def test_constrain_is_a_no_op_without_a_mesh_and_pins_the_batch_with_one():
    x = jnp.arange(8 * 3 * 4, dtype=jnp.float32).reshape(8, 3, 4)
    assert constrain(x, BTC) is x
    mesh = _cpu_mesh_2x2x2()
    P = jax.sharding.PartitionSpec
    with jax.set_mesh(mesh):
        y = jax.jit(lambda a: constrain(a * 2, BTC))(x)
        odd = jax.jit(lambda a: constrain(a * 2, BTC))(x[:2])  # 2 rows: only 'data' divides them
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))), 3)
    assert odd.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data")), 3)
    np.testing.assert_array_equal(y, x * 2)



def test_a_step_wrapped_in_the_configs_rules_constrains_activations_by_them():
    """A config that maps activation_batch to 'data' only (not data+fsdp) is what the traced step pins."""
    x = jnp.arange(8 * 3 * 4, dtype=jnp.float32).reshape(8, 3, 4)
    mesh = _cpu_mesh_2x2x2()
    P = jax.sharding.PartitionSpec
    step = under_axis_rules(lambda a: constrain(a * 2, BTC), ((constants.ACT_BATCH, "data"),))
    with jax.set_mesh(mesh):
        y = jax.jit(step)(x)
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data")), 3)
    np.testing.assert_array_equal(y, x * 2)

# ----------------------------------------------------------------------------------------------------------------
# A 2x2x2 mesh computes what one device does
# ----------------------------------------------------------------------------------------------------------------
def _packed_batch(config, seed=0):
    """Rows of two packed examples and padding: segment and position ids as the pipeline makes them."""
    rng, batch = np.random.default_rng(seed), {}
    B = config.data.batch_size
    for key, T in (("inputs", config.data.max_input_length), ("targets", config.data.max_target_length)):
        seg = np.zeros((B, T), np.int32)
        pos = np.zeros((B, T), np.int32)
        for row in range(B):
            first, second = 3 + row % 5, 2 + row % 4
            seg[row, :first], seg[row, first:first + second] = 1, 2
            pos[row, :first], pos[row, first:first + second] = np.arange(first), np.arange(second)
        batch[key] = np.where(seg > 0, rng.integers(4, config.data.vocab_size, (B, T)), 0).astype(np.int32)
        batch[f"{key}_segmentation"], batch[f"{key}_position"] = seg, pos
    return batch


def _loss_and_grads(config, shape, batch):
    """``(loss sum, gradients)`` of ``batch`` with dropout on, on a mesh of ``shape`` built as train.py builds it."""
    config.mesh.shape = shape
    config = schema.validate_config(config)
    mesh = model_setup.make_mesh(config.mesh, helpers.cpu_devices(int(np.prod(shape))))
    model = model_setup.build_model(config, config.data.vocab_size)
    state, shardings = setup.create_state(config, model, mesh, update.build_optimizer(config.optim, 10)[0])
    sharding = model_setup.batch_sharding(mesh)

    def loss(params, batch):  # the train step's loss: the fused output layer unless the config turns it off
        outputs, _ = model_setup.apply_model(state.apply_fn, params, {}, batch, deterministic=False,
                                             rngs={"dropout": jax.random.key(7)}, logits=not config.optim.fused_loss)
        return metrics.label_smoothed_loss(outputs, batch["targets"], batch["targets_segmentation"] > 0,
                                           config.optim.label_smoothing)["loss"]

    # Gradients leave in the parameters' layout, as the train step's optimizer update needs them.
    loss_and_grads = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings.params, sharding),
                             out_shardings=(None, shardings.params))
    with jax.set_mesh(mesh):
        value, grads = loss_and_grads(state.params, model_setup.global_batch(batch, sharding))
    return jax.device_get(state.params), float(value), jax.device_get(grads)


def assert_trees_close(actual, expected, tol, what):
    """Leaf by leaf, relative to the largest entry of the whole expected tree (gradients of tiny parameters are
    sums of the same few terms; a relative-only check would ask more of them than float32 gives)."""
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(expected))
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol * scale, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


# A float32 sum reordered (split over devices, then all-reduced) moves by ~eps x sqrt(terms) relative to the sum of
# magnitudes; the largest sums here run over a batch of 8 x 16 tokens (~11 eps). Measured: <= 3 eps.
SHARDED_TOL = 64 * F32_EPS


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
@pytest.mark.parametrize("variant", ["dynamic", "transformer", "fixed"])
def test_a_2x2x2_mesh_gives_one_devices_loss_and_gradients(variant, capfd):
    """Fixed attention's [H, L, L] table is split over fsdp by its key positions ('key_length', a rule lconv adds
    when the config's rules lack it), so its lookup needs the table gathered first."""
    config = tiny_config.get_config()
    common.set_mixer(config, {variant})
    config.mesh.rules = axis_rules(config.mesh.rules)
    config.model.max_len = config.data.max_target_length
    config.data.eval_max_input_length = config.data.eval_max_target_length = config.model.max_len  # within them
    config.model.dropout = config.model.attention_dropout = config.model.weight_dropout = 0.1
    batch = _packed_batch(config)
    params_1, loss_1, grads_1 = _loss_and_grads(config, (1, 1, 1), batch)
    params_8, loss_8, grads_8 = _loss_and_grads(config, (2, 2, 2), batch)
    compile_log = capfd.readouterr().err
    assert_trees_close(params_8, params_1, 0.0, "init")  # the same parameters whatever the layout
    assert loss_8 == pytest.approx(loss_1, rel=SHARDED_TOL)
    assert_trees_close(grads_8, grads_1, SHARDED_TOL, f"{variant} gradients")
    # XLA logs this when it can only reshard an activation by replicating it (a C++ warning on stderr).
    assert "Involuntary full rematerialization" not in compile_log


# ----------------------------------------------------------------------------------------------------------------
# model.remat
# ----------------------------------------------------------------------------------------------------------------
REMAT_BASE = dict(TINY, d_model=16, num_heads=2, ffn_dim=32, encoder_mixer="dynamicconv", decoder_mixer="attention",
                  dropout=0.1, weight_dropout=0.1)
# Recomputation replays the same float32 ops; only XLA's fusion of them may differ (a few eps on the largest).
REMAT_TOL = 16 * F32_EPS


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_remat_leaves_loss_and_gradients_unchanged():
    """A conv encoder and an attention decoder under each policy, from the same parameters (the tree is the same
    under every policy, so checkpoints restore across them). Dropout is on: the recomputed forward pass must draw
    the masks the first one drew."""
    rng = np.random.default_rng(0)
    tokens = tuple(jnp.asarray(rng.integers(4, 64, (4, n)), jnp.int32) for n in (11, 9))
    model_of = {remat: models.EncoderDecoder(models.ModelConfig(**REMAT_BASE, remat=remat))
                for remat in constants.REMAT_POLICIES}
    params = jax.jit(model_of["none"].init)(jax.random.key(0), *tokens)["params"]
    results = {}
    for remat, model in model_of.items():
        shapes = jax.eval_shape(lambda m=model: m.init(jax.random.key(0), *tokens))["params"]
        assert jax.tree.structure(shapes) == jax.tree.structure(params), remat

        def loss(params, model=model):
            logits = model.apply({"params": params}, *tokens, deterministic=False, rngs={"dropout": jax.random.key(1)})
            return jax.nn.log_softmax(logits).sum()

        results[remat] = jax.jit(jax.value_and_grad(loss))(params)
    loss, grads = results["none"]
    for remat in ("full", "dots"):
        assert float(results[remat][0]) == pytest.approx(float(loss), rel=REMAT_TOL), remat
        assert_trees_close(results[remat][1], grads, REMAT_TOL, f"remat={remat}")


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
def test_remat_keeps_the_knn_memory_a_window_writes():
    """The 'memory' collection is mutable inside the rematerialised layer: the written memory and the gradients
    match the plain layer's."""
    cfg = dict(TINY, d_model=16, num_heads=2, ffn_dim=32, decoder_mixer="knn_memory", dropout=0.0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(4, 64, (2, 8)), jnp.int32)
    results = {}
    for remat in ("none", "full"):
        model = models.DecoderOnlyLM(models.ModelConfig(**cfg, remat=remat))
        variables = model.init(jax.random.key(0), tokens)
        memory = knn_memory.reset_memory(variables["memory"], jnp.ones((2,), bool))

        def loss(params, memory):
            logits, updated = model.apply({"params": params, "memory": memory}, tokens, mutable=["memory"])
            return jax.nn.log_softmax(logits).sum(), updated["memory"]

        results[remat] = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"], memory)
    (loss, memory), grads = results["none"]
    (remat_loss, remat_memory), remat_grads = results["full"]
    assert float(remat_loss) == pytest.approx(float(loss), rel=REMAT_TOL)
    assert int(jnp.sum(memory["decoder"]["layer_0"]["mixer"]["valid"])) == 2 * 8  # the window was written
    assert_trees_close(jax.tree.map(np.float32, remat_memory), jax.tree.map(np.float32, memory), REMAT_TOL, "memory")
    assert_trees_close(remat_grads, grads, REMAT_TOL, "gradients")


@pytest.mark.parametrize("remat,policy", [("none", None), ("full", None),
                                          ("dots", jax.checkpoint_policies.dots_with_no_batch_dims_saveable)])
def test_remat_wraps_each_layer_with_its_policy(remat, policy):
    """The traced forward pass holds one checkpoint per layer (none without remat), with the policy named."""
    model = models.EncoderDecoder(models.ModelConfig(**REMAT_BASE, remat=remat))
    tokens = (jnp.ones((2, 5), jnp.int32), jnp.ones((2, 4), jnp.int32))
    variables = jax.eval_shape(model.init, jax.random.key(0), *tokens)
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, *tokens))(variables).jaxpr
    checkpoints = [e for e in jaxpr.eqns if e.primitive.name in ("checkpoint", "remat", "remat2")]
    layers = REMAT_BASE["encoder_layers"] + REMAT_BASE["decoder_layers"]
    assert len(checkpoints) == (0 if remat == "none" else layers)
    assert all(e.params["policy"] == policy for e in checkpoints)


def test_remat_is_checked_by_the_model_config():
    with pytest.raises(UserError, match=r"config\.model\.remat='some'.*none, full, dots"):
        models.ModelConfig.from_config({**TINY, "remat": "some"})
    assert models.ModelConfig.from_config({**TINY, "remat": "dots"}).remat == "dots"
