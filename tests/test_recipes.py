"""fairseq's recipes in lconv: the optimisers' update rules against NumPy loops of fairseq's own (fairseq/optim/
adam.py and nag.py, read for their semantics), including the decoupled weight decay."""
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import common
from lconv.train import setup


def _optim(**overrides):
    optim = ml_collections.ConfigDict(common.base_config().optim.to_dict())
    optim.update(dict(schedule="inverse_sqrt", warmup_steps=3, warmup_init_lr=1e-3, learning_rate=0.1,
                      weight_decay=0.05, clip_norm=0.0))
    optim.update(overrides)
    return optim


def _run(optim, params, grads_per_step):
    tx, lr = setup.build_optimizer(optim, num_steps=100)
    state, p = tx.init(params), params
    for g in grads_per_step:
        updates, state = tx.update(g, state, p)
        p = p + updates
    return np.asarray(p, np.float64), lr


def _fairseq_adam(p, grads, lr_at, b1, b2, eps, wd):
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        step_size = lr_at(t - 1) * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        p = p - wd * lr_at(t - 1) * p  # decoupled: applied to the weights, not the gradient
        p = p - step_size * m / (np.sqrt(v) + eps)
    return p


def _fairseq_nag(p, grads, lr_at, momentum, wd):
    buf, lr_old = np.zeros_like(p), None
    for t, g in enumerate(grads):
        lr = lr_at(t)
        correct = 1.0 if lr_old is None else lr / lr_old  # the buffer holds lr-scaled steps: rescale it
        p = p * (1 - lr * wd)
        p = p + momentum * momentum * correct * buf - (1 + momentum) * lr * g
        buf = momentum * correct * buf - lr * g
        lr_old = lr
    return p


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_is_fairseqs_adam_with_decoupled_weight_decay(name):
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(6,)).astype(np.float32)
    grads = [rng.normal(size=(6,)).astype(np.float32) for _ in range(8)]
    optim = _optim(optimizer=name, eps=0.0)  # fairseq adds eps before bias correction, optax after: eps=0 is exact
    got, lr = _run(optim, jnp.asarray(p0), [jnp.asarray(g) for g in grads])
    lr_at = lambda t: float(lr(t))
    want = _fairseq_adam(p0.astype(np.float64), grads, lr_at, optim.b1, optim.b2, 0.0, optim.weight_decay)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    coupled = _fairseq_adam(p0.astype(np.float64), [g + optim.weight_decay * p0 for g in grads], lr_at, optim.b1,
                            optim.b2, 0.0, 0.0)
    assert np.abs(got - coupled).max() > 1e-3  # the rule lconv had before (L2 in the gradient) differs


def test_nag_is_fairseqs_nag_with_decoupled_weight_decay_through_a_changing_learning_rate():
    rng = np.random.default_rng(1)
    p0 = rng.normal(size=(5,)).astype(np.float32)
    grads = [rng.normal(size=(5,)).astype(np.float32) for _ in range(8)]  # warmup then decay: lr changes each step
    optim = _optim(optimizer="nag", momentum=0.9)
    got, lr = _run(optim, jnp.asarray(p0), [jnp.asarray(g) for g in grads])
    want = _fairseq_nag(p0.astype(np.float64), grads, lambda t: float(lr(t)), optim.momentum, optim.weight_decay)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
