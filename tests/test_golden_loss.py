"""One-step golden-loss regression: a tiny model on a fixed batch has exactly the recorded loss before and after
one optimizer step of the real training step (train_lib's init, loss, dropout rng, optimizer).

Any change to initialisation, the model's math, the loss or the optimizer moves these numbers. If a change is
MEANT to move them (a deliberate fix or a new default), regenerate them and say why in the commit:

    PYTHONPATH=. python tests/test_golden_loss.py

prints the two values to paste into GOLDEN below. If they move and nothing was meant to change, that is the bug.
The golden values are not checked against themselves only: the initial loss must also sit where an untrained
model's must (near log(vocab)), and one step on the batch must lower it.
"""
import math

import jax
import numpy as np
import pytest
from reference import tolerance

from lconv.configs import common
from lconv.run import loss_pass, model_setup, schema
from lconv.train import setup, update

VOCAB = 64
# (loss at init, loss after one step), label-smoothed cross-entropy per target token, deterministic forward.
GOLDEN = (4.932626247406006, 3.9947896003723145)  # dropout masks from 16 random bits an element (issue 36)


def _tiny_config(conv_impl="auto"):
    """Every field that matters set here, on the shared base config (not configs/default.py, which is tuned)."""
    c = common.base_config()
    c.model.conv_impl = conv_impl
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 16, 32, 2
    c.model.encoder_layers, c.model.decoder_layers = 1, 2
    c.model.encoder_mixer, c.model.decoder_mixer = "dynamicconv", "lightconv,attention"
    c.model.encoder_kernel_sizes, c.model.decoder_kernel_sizes = (3,), (4,)
    c.data.max_input_length, c.data.max_target_length = 12, 10
    c.model.normalize_before, c.model.share_embeddings = False, True  # post-norm, one shared table
    c.model.dropout, c.model.weight_dropout, c.model.attention_dropout = 0.1, 0.1, 0.0  # the step's randomness
    c.model.matmul_precision = "highest"  # exact float32 on every backend: the golden values hold on GPU and TPU too
    c.optim.optimizer, c.optim.label_smoothing, c.optim.clip_norm = "adam", 0.1, 0.0
    c.optim.schedule, c.optim.warmup_steps, c.optim.learning_rate = "constant", 0, 1e-2
    c.seed = 0
    return c


def _batch():
    """Two rows: row 0 packs two examples, row 1 holds one and padding (fixed by the seed)."""
    rng = np.random.default_rng(1234)
    inputs_seg = np.array([[1] * 5 + [2] * 6 + [0], [1] * 9 + [0] * 3], np.int32)
    targets_seg = np.array([[1] * 4 + [2] * 5 + [0], [1] * 7 + [0] * 3], np.int32)
    batch = {}
    for key, seg in (("inputs", inputs_seg), ("targets", targets_seg)):
        tokens = rng.integers(4, VOCAB, size=seg.shape).astype(np.int32)
        batch[key] = np.where(seg > 0, tokens, 0)
        batch[f"{key}_segmentation"] = seg
        starts = np.concatenate([np.ones((2, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        idx = np.arange(seg.shape[1])
        batch[f"{key}_position"] = np.where(seg > 0, idx - np.maximum.accumulate(np.where(starts, idx, 0), 1), 0)
    batch["example_weight"] = np.ones((2,), np.int32)
    return batch


def losses(conv_impl="auto"):
    """(loss before, loss after one train step), both from the deterministic evaluation forward pass."""
    config = schema.validate_config(_tiny_config(conv_impl))
    model = model_setup.build_model(config, vocab_size=VOCAB)
    tx, lr = update.build_optimizer(config.optim, config.train.num_steps)
    mesh = model_setup.make_mesh(config.mesh, devices=jax.devices()[:1])
    state, _ = setup.create_state(config, model, mesh, tx)
    train_step = jax.jit(update.make_train_step(config, lr))
    eval_step = jax.jit(loss_pass.make_eval_step(config), static_argnums=1)
    batch = _batch()

    def loss(params):
        sums, _ = eval_step(params, state.apply_fn, batch, {})
        return float(sums["loss"]) / float(sums["tokens"])

    before = loss(state.params)
    state, _ = train_step(state, batch)
    return before, loss(state.params)


@pytest.mark.slow  # compiles for many seconds: CI runs it, the quick command skips it
@pytest.mark.parametrize("conv_impl", ["auto", "pallas"])  # pallas: its kernels (interpret mode on CPU) in a model
def test_initial_loss_and_one_step_match_the_recorded_values(conv_impl):
    before, after = losses(conv_impl)
    # Independent of the golden values: an untrained model with ~unit-variance logits scores about
    # E[logsumexp(z) - z_y] = log V + Var(z)/2 (label smoothing's uniform term is near the same value), and
    # one Adam step at lr 1e-2 on the very batch it is scored on must lower the loss.
    assert math.log(VOCAB) - 0.5 < before < math.log(VOCAB) + 1.5, before
    assert after < before - 0.05, (before, after)
    rel = tolerance(np.float32, _tiny_config().model.matmul_precision, rtol=1e-5)["rtol"]
    assert (before, after) == pytest.approx(GOLDEN, rel=rel), (
        f"golden loss moved: got {(before, after)}, recorded {GOLDEN}. If the change was intended, regenerate "
        "with `PYTHONPATH=. python tests/test_golden_loss.py` and say why in the commit.")


if __name__ == "__main__":
    import os

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # as tests/conftest.py
    print(f"GOLDEN = {losses()!r}")
