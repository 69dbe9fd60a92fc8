"""fairseq's recipes in lconv: the optimisers' update rules against NumPy loops of fairseq's own (fairseq/optim/
adam.py and nag.py, read for their semantics), including the decoupled weight decay."""
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lconv.configs import common
from lconv.train import update


def _optim(**overrides):
    optim = ml_collections.ConfigDict(common.base_config().optim.to_dict())
    optim.update(dict(schedule="inverse_sqrt", warmup_steps=3, warmup_init_lr=1e-3, learning_rate=0.1,
                      weight_decay=0.05, clip_norm=0.0))
    optim.update(overrides)
    return optim


def _run(optim, params, grads_per_step):
    tx, lr = update.build_optimizer(optim, num_steps=100)
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


@pytest.mark.parametrize("period", [0, 70])
def test_the_cosine_runs_over_fairseqs_period_and_stays_at_its_floor(period):
    """fairseq's cosine with --t-mult 1 --lr-shrink 1: warmup from warmup_init_lr, then lr = min + (max - min) *
    (1 + cos(pi * (t - warmup) / period)) / 2 over ``--lr-period-updates`` (lconv: the rest of the run when 0);
    a run shorter than the period (wmt_en_fr: 30k updates of a 70k period) is cut before the floor."""
    optim = _optim(schedule="cosine", warmup_steps=10, warmup_init_lr=1e-7, learning_rate=1e-3, min_lr=1e-7,
                   cosine_period=period)
    num_steps = 40
    rate = update.step_rate(optim, num_steps)
    span = period or num_steps - 10
    for t in (0, 5, 10, 20, 25, 39, 40, 85, 200):
        if t < 10:
            expected = 1e-7 + (1e-3 - 1e-7) * t / 10
        else:
            progress = min((t - 10) / span, 1.0)
            expected = 1e-7 + 0.5 * (1e-3 - 1e-7) * (1 + np.cos(np.pi * progress))
        assert float(rate(t)) == pytest.approx(expected, rel=1e-5), t


def test_wmt_en_fr_is_fairseqs_command_30k_updates_of_a_70k_cosine():
    from lconv.configs import wmt_en_fr

    c = wmt_en_fr.get_config("dynamic,big")
    assert (c.train.num_steps, c.optim.warmup_steps, c.optim.cosine_period, c.decode.lenpen) == (30_000, 10_000,
                                                                                                 70_000, 0.9)
    lr = update.step_rate(c.optim, c.train.num_steps)
    assert float(lr(c.train.num_steps)) > 0.5 * c.optim.learning_rate  # 20k of 70k: still above half the peak


def test_fairseqs_adam_epsilon_is_added_before_the_bias_correction():
    """``adam_eps_form="before_correction"``: fairseq's Adam with its eps (1e-8, where the two forms differ most: a
    gradient near eps in size), to float32 rounding; optax's form (the default) is measurably another rule."""
    rng = np.random.default_rng(2)
    p0 = rng.normal(size=(6,)).astype(np.float32)
    grads = [(rng.normal(size=(6,)) * 1e-8).astype(np.float32) for _ in range(8)]  # |g| ~ eps
    optim = _optim(optimizer="adam", eps=1e-8, adam_eps_form="before_correction")
    got, lr = _run(optim, jnp.asarray(p0), [jnp.asarray(g) for g in grads])
    lr_at = lambda t: float(lr(t))
    want = _fairseq_adam(p0.astype(np.float64), grads, lr_at, optim.b1, optim.b2, 1e-8, optim.weight_decay)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    optax_form, _ = _run(_optim(optimizer="adam", eps=1e-8), jnp.asarray(p0), [jnp.asarray(g) for g in grads])
    assert np.abs(optax_form - want).max() > 1e-3


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_fairseqs_clip_multiplies_by_clip_over_norm_plus_1e_6_capped_at_1(scale):
    """``clip_form="norm_plus_eps"``: g * min(1, clip / (|g| + 1e-6)), as fairseq's clip_grad_norm_; optax's
    ``max_norm`` form scales by clip / max(|g|, clip). Checked on a plain SGD step (lr 1, no decay)."""
    g = np.array([3.0, -4.0], np.float32) * scale  # |g| = 5 * scale
    clip = 0.5
    for form, coefficient in (("norm_plus_eps", min(1.0, clip / (5 * scale + 1e-6))),
                              ("max_norm", clip / max(5 * scale, clip))):
        optim = _optim(optimizer="nag", momentum=0.0, weight_decay=0.0, clip_norm=clip, clip_form=form,
                       schedule="constant", warmup_steps=0, learning_rate=1.0)
        got, _ = _run(optim, jnp.zeros(2), [jnp.asarray(g)])
        np.testing.assert_allclose(-got, g * coefficient, rtol=1e-6)
        assert float(update.clip_coefficient(jnp.float32(5 * scale), clip, form)) == pytest.approx(coefficient,
                                                                                                   rel=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_fairseqs_label_smoothing_split_gives_its_loss_with_the_logits_and_the_fused_loss(fused):
    """``label_smoothing_split="others"``: fairseq's label_smoothed_nll_loss, (1 - eps - eps/(V-1)) * nll +
    eps/(V-1) * sum_v(-log p_v), in float64 NumPy; the default ``all`` is (1 - eps) * nll + eps * mean_v."""
    from lconv.nn.decoder_ends import OutputLayer
    from lconv.run import metrics

    rng = np.random.default_rng(3)
    B, T, C, V, eps = 2, 5, 7, 11, 0.1
    x, table = rng.normal(size=(B, T, C)).astype(np.float32), rng.normal(size=(V, C)).astype(np.float32)
    targets, weights = rng.integers(0, V, (B, T)), rng.random((B, T)) > 0.3
    z = x.astype(np.float64) @ table.T.astype(np.float64)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    fairseq = ((1 - eps - eps / (V - 1)) * nll - eps / (V - 1) * logp.sum(-1))[weights].sum()
    lconv_all = ((1 - eps) * nll - eps * logp.mean(-1))[weights].sum()
    outputs = (OutputLayer(jnp.asarray(x), jnp.asarray(table), V, jnp.float32, "highest") if fused
               else jnp.einsum("btc,vc->btv", x, table, precision="highest"))
    for split, want in (("others", fairseq), ("all", lconv_all)):
        got = metrics.label_smoothed_loss(outputs, jnp.asarray(targets), jnp.asarray(weights), eps, split)
        assert float(got["loss"]) == pytest.approx(want, rel=2e-6), split
    assert abs(fairseq - lconv_all) > 1e-3 * abs(fairseq)


@pytest.mark.parametrize("name,arg", [("iwslt14_de_en", "dynamic"), ("wmt_en_de", "dynamic,big"),
                                      ("wmt_en_fr", "lightconv,big"), ("wmt_zh_en", "dynamic,big"),
                                      ("lm1b", "dynamic")])
def test_the_papers_configs_train_with_fairseqs_semantics_and_the_default_with_lconvs(name, arg):
    import importlib

    from lconv.configs import default

    semantics = ("adam_eps_form", "clip_form", "label_smoothing_split")
    config = importlib.import_module(f"lconv.configs.{name}").get_config(arg)
    assert {k: config.optim[k] for k in semantics} == common.FAIRSEQ_SEMANTICS
    base = common.base_config().optim
    assert {k: default.get_config().optim[k] for k in semantics} == {k: base[k] for k in semantics} == {
        "adam_eps_form": "after_correction", "clip_form": "max_norm", "label_smoothing_split": "all"}
