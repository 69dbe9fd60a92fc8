"""The fused output layer and loss (``lconv.ops.linear_cross_entropy``): its sums and gradients against float64
NumPy, bfloat16 within its tolerance, no ``[tokens, vocab]`` array in the compiled program, no gradient work in an
evaluation, and a model's train step giving what the materialised-logits loss gives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tolerance

from lconv.configs import common
from lconv.ops import linear_cross_entropy as lce
from lconv.run import metrics, model_setup, schema
from lconv.train import setup, update

B, T, C, V = 3, 13, 7, 37  # primes: a shape bug cannot hide; T=13 in chunks of 4 leaves a ragged last chunk
HIGHEST = jax.lax.Precision.HIGHEST


def _inputs(seed=0, shape=(B, T, C, V)):
    b, t, c, v = shape
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, t, c)).astype(np.float32)
    table = (rng.normal(size=(v, c)) * 0.7).astype(np.float32)
    return x, table, rng.integers(0, 31, (b, t)).astype(np.int32), (rng.random((b, t)) > 0.25).astype(np.float32)


def _reference(x, table, targets, weights, eps, valid):
    """Float64 sums and the loss's gradients from the materialised logits, written out by hand."""
    z = np.einsum("btc,vc->btv", x.astype(np.float64), table.astype(np.float64))[..., :valid]
    top = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(-1)) + top[..., 0]
    onehot = np.eye(valid)[targets]
    nll = lse - (z * onehot).sum(-1)
    loss = (1 - eps) * nll + eps * (lse - z.mean(-1))
    dz = weights[..., None] * (np.exp(z - lse[..., None]) - (1 - eps) * onehot - eps / valid)
    dtable = np.zeros(table.shape)
    dtable[:valid] = np.einsum("btv,btc->vc", dz, x)
    sums = {"loss": (loss * weights).sum(), "nll": (nll * weights).sum(),
            "correct": ((z.argmax(-1) == targets) * weights).sum()}
    return sums, np.einsum("btv,vc->btc", dz, table[:valid]), dtable


def _fused(x, table, targets, weights, eps, valid, dtype=jnp.float32, chunk=4, precision=HIGHEST,
           vocab_slice=lce.VOCAB_SLICE):
    def loss(x, table):
        sums = lce.cross_entropy_sums(x, table, targets, weights, label_smoothing=eps, valid_vocab=valid,
                                      chunk=chunk, dtype=dtype, precision=precision, vocab_slice=vocab_slice)
        return sums["loss"], sums
    (_, sums), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, table)
    return sums, *grads


@pytest.mark.parametrize("eps, valid, vocab, vocab_slice", [
    (0.1, V, V, lce.VOCAB_SLICE), (0.0, 31, V, lce.VOCAB_SLICE),
    (0.1, 31, V, 10),  # slices of 10 ids: the last one overlaps its neighbour (4 x 10 > 37)
    (0.1, 29, 40, 10),  # 4 slices that tile the vocabulary
], ids=["smoothed", "output_vocabulary", "ragged_vocabulary_slices", "even_vocabulary_slices"])
def test_sums_and_gradients_equal_float64_numpy(eps, valid, vocab, vocab_slice):
    x, table, targets, weights = _inputs(shape=(B, T, C, vocab))
    targets %= valid  # predictable targets
    targets[0, :4] = np.argmax(x[0, :4] @ table[:valid].T, -1)  # some right answers, so 'correct' is counted
    weights[0, :4] = 1.0
    targets[1, :3] = valid - 1  # the last predictable id, in the last slice
    sums, dx, dtable = _fused(x, table, targets, weights, eps, valid, vocab_slice=vocab_slice)
    ref_sums, ref_dx, ref_dtable = _reference(x, table, targets, weights, eps, valid)
    assert ref_sums["correct"] >= 4
    for key in ref_sums:
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5 * np.abs(ref_dx).max())
    np.testing.assert_allclose(dtable, ref_dtable, rtol=1e-5, atol=1e-5 * np.abs(ref_dtable).max())
    assert not np.any(dtable[valid:])  # the ids the decoder never predicts get no gradient


@pytest.mark.parametrize("shape, chunk", [((B, T, C, V), 4), ((8, 16, 16, 512), None)],
                         ids=["chunks", "one_chunk_tiny_model"])
def test_bfloat16_inputs_stay_within_bfloat16s_tolerance(shape, chunk):
    """The second case is a tiny model's head in one chunk (no loop), at the default precision a bfloat16 model
    runs with: there XLA:CPU had no dot for the table's gradient as two contracting dims (bfloat16 x bfloat16 ->
    float32, UNIMPLEMENTED)."""
    x, table, targets, weights = _inputs(1, shape)
    sums, dx, dtable = _fused(jnp.asarray(x, jnp.bfloat16), table, targets, weights, 0.1, shape[3],
                              dtype=jnp.bfloat16, chunk=chunk, precision=jax.lax.Precision.DEFAULT)
    ref_sums, ref_dx, ref_dtable = _reference(x, table, targets, weights, 0.1, shape[3])
    assert dx.dtype == jnp.bfloat16 and dtable.dtype == jnp.float32  # x's dtype; the float32 table's
    tol = tolerance(jnp.bfloat16)
    np.testing.assert_allclose(sums["loss"], ref_sums["loss"], rtol=tol["rtol"])
    for got, want in ((dx, ref_dx), (dtable, ref_dtable)):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol["rtol"],
                                   atol=tol["atol"] * np.abs(want).max())


def test_only_the_loss_carries_a_gradient_and_an_evaluation_makes_none():
    x, table, targets, weights = _inputs(2)
    nll_grad = jax.grad(lambda x: lce.cross_entropy_sums(x, table, targets, weights)["nll"])(x)
    assert not np.any(nll_grad)  # a report, stopped: it must not pass for the loss's gradient
    forward = jax.make_jaxpr(lambda x: lce.cross_entropy_sums(x, table, targets, weights, chunk=4))(x)
    with_grad = jax.make_jaxpr(jax.grad(lambda x: lce.cross_entropy_sums(x, table, targets, weights,
                                                                         chunk=4)["loss"]))(x)
    dots = [str(j).count("dot_general") for j in (forward, with_grad)]
    assert dots == [1, 3], dots  # the logits alone when evaluating; with them dx and dtable, once per chunk


def test_the_compiled_gradient_never_holds_the_whole_logits_array():
    B_, T_, C_, V_ = 4, 256, 32, 4096
    x = jnp.ones((B_, T_, C_))
    table = jnp.ones((V_, C_)) * 0.01
    targets, weights = jnp.zeros((B_, T_), jnp.int32), jnp.ones((B_, T_))
    logits_bytes = B_ * T_ * V_ * 4

    def temporaries(loss):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, table).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    fused = temporaries(lambda x, t: lce.cross_entropy_sums(x, t, targets, weights, label_smoothing=0.1,
                                                            chunk=16)["loss"])
    plain = temporaries(lambda x, t: metrics.label_smoothed_loss(
        jnp.einsum("btc,vc->btv", x, t), targets, weights, 0.1)["loss"])
    assert plain > logits_bytes > 2 * fused, (plain, fused, logits_bytes)


def test_the_table_gradient_is_added_one_vocabulary_slice_at_a_time():
    """With slices, the program holds no second ``[V, C]`` array (the whole product before its add): its
    temporaries are at least that much smaller than with one slice."""
    B_, T_, C_, V_ = 2, 64, 64, 8192
    x, table = jnp.ones((B_, T_, C_)), jnp.ones((V_, C_)) * 0.01
    targets, weights = jnp.zeros((B_, T_), jnp.int32), jnp.ones((B_, T_))

    def temporaries(vocab_slice):
        loss = lambda x, t: lce.cross_entropy_sums(x, t, targets, weights, label_smoothing=0.1, chunk=8,
                                                   vocab_slice=vocab_slice)["loss"]
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, table).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    table_bytes = V_ * C_ * 4
    whole, sliced = temporaries(V_), temporaries(V_ // 8)
    assert whole - sliced >= 0.75 * table_bytes, (whole, sliced, table_bytes)


def test_vocabulary_slices_are_even_and_as_few_as_the_width_allows():
    assert lce._vocab_slicing(32000, 4096) == (8, 4000)
    assert lce._vocab_slicing(8000, 4096) == (2, 4000)
    assert lce._vocab_slicing(37, 10) == (4, 10)  # 40 > 37: the last slice overlaps
    assert lce._vocab_slicing(5, 4096) == (1, 5)


def test_the_chunk_length_fits_the_budget_and_divides_the_length_when_it_can():
    assert lce.chunk_length(8, 512, 8000, budget=2**23) == 128  # 8 x 128 x 8000 <= 2^23
    assert lce.chunk_length(8, 500, 8000, budget=2**23) == 125  # a divisor of 500 close below 131
    assert lce.chunk_length(1, 97, 10, budget=500) == 50  # 97 is prime: no divisor near 50, so padded
    assert lce.chunk_length(512, 64, 256_000, budget=2**23) == 1  # never below one position
    assert lce.chunk_length(2, 16, 8, budget=2**23) == 16  # all of it when it fits


def _tiny_train_config(lm):
    c = common.base_config()
    c.task = "lm" if lm else "translation"
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 16, 32, 2
    c.model.encoder_layers, c.model.decoder_layers = 1, 1
    c.model.encoder_mixer, c.model.decoder_mixer = "lightconv", "dynamicconv"
    c.model.encoder_kernel_sizes, c.model.decoder_kernel_sizes = (3,), (4,)
    c.data.max_input_length, c.data.max_target_length, c.data.batch_size, c.data.vocab_size = 12, 10, 3, 61
    c.model.matmul_precision = "highest"
    c.optim.schedule, c.optim.warmup_steps, c.optim.learning_rate = "constant", 0, 1e-2
    c.optim.optimizer = "nag"  # an update linear in the gradients (Adam's first step is their sign: ill-conditioned)
    c.mesh.shape = (1, 1, 1)
    if lm:  # untied, and an output vocabulary smaller than the embedding's
        c.model.share_embeddings, c.model.output_vocab_size, c.optim.label_smoothing = False, 53, 0.0
    return c


@pytest.mark.parametrize("lm", [pytest.param(False, id="translation_tied", marks=pytest.mark.slow),  # 10 s to compile
                                pytest.param(True, id="lm_untied_output_vocabulary")])
def test_a_train_step_with_the_fused_loss_equals_one_with_materialised_logits(lm):
    """The same update, dropout included, whichever loss the step uses: sums, gradient norm and each parameter's
    update."""
    rng = np.random.default_rng(5)
    results = []
    for fused in (True, False):
        c = _tiny_train_config(lm)
        c.optim.fused_loss = fused
        c = schema.validate_config(c)
        model = model_setup.build_model(c, c.data.vocab_size)
        tx, lr = update.build_optimizer(c.optim, 10)
        state, _ = setup.create_state(c, model, model_setup.make_mesh(c.mesh, jax.devices("cpu")[:1]), tx)
        if not results:
            seg = np.ones((3, 10), np.int32)
            seg[1, 7:] = 0
            batch = {"targets": np.where(seg > 0, rng.integers(4, 53, (3, 10)), 0).astype(np.int32),
                     "targets_segmentation": seg, "targets_position": np.tile(np.arange(10, dtype=np.int32), (3, 1))}
            if not lm:
                batch.update(inputs=rng.integers(4, 61, (3, 12)).astype(np.int32),
                             inputs_segmentation=np.ones((3, 12), np.int32),
                             inputs_position=np.tile(np.arange(12, dtype=np.int32), (3, 1)))
        before = jax.device_get(state.params)
        new_state, sums = jax.jit(update.make_train_step(c, lr))(state, batch)
        results.append((jax.device_get(sums), jax.tree.map(np.subtract, jax.device_get(new_state.params), before)))
    (fused_sums, fused_updates), (plain_sums, plain_updates) = results
    for key in ("loss", "nll", "correct", "tokens", "grad_norm"):
        np.testing.assert_allclose(fused_sums[key], plain_sums[key], rtol=1e-5, err_msg=key)
    scale = max(float(np.abs(u).max()) for u in jax.tree.leaves(plain_updates))
    for (path, a), b, param in zip(jax.tree_util.tree_leaves_with_path(fused_updates), jax.tree.leaves(plain_updates),
                                   jax.tree.leaves(before), strict=True):
        ulp = np.finfo(np.float32).eps * float(np.abs(param).max())  # an update read back from float32 params
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale + ulp, err_msg=jax.tree_util.keystr(path))
