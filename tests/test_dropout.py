"""lconv's dropout (``lconv.ops.dropout``, ``nn.common.Dropout``): the drop rate, its independence between the two
elements one random word gives, the 1 / (1 - rate) scaling, the gradient, and the module's rng use."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lconv.nn.common import Dropout
from lconv.ops import dropout as dropout_ops

SHAPE = (4, 256, 257)  # an odd last axis: its last word gives one element, the other half unused


def _sigmas(count, n, p):
    """How many binomial standard deviations ``count`` of ``n`` draws is from ``n * p``."""
    return abs(count - n * p) / np.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_drops_at_the_rate_and_the_two_halves_of_a_word_independently(rate):
    keep = np.asarray(dropout_ops.keep_mask(jax.random.key(0), rate, SHAPE))
    assert keep.shape == SHAPE and keep.dtype == bool
    p = round(rate * 2**16) / 2**16  # the rate at 16 bits
    assert abs(p - rate) <= 2**-17
    assert _sigmas((~keep).sum(), keep.size, p) < 5
    # elements 2i and 2i+1 of the last axis come from one 32-bit word: both dropped at p^2, as independent draws
    pairs = ~keep[..., :256].reshape(*SHAPE[:-1], 128, 2)
    assert _sigmas((pairs[..., 0] & pairs[..., 1]).sum(), pairs[..., 0].size, p * p) < 5
    # and neighbouring rows and positions are not copies of each other
    assert (keep[0] != keep[1]).any() and (keep[:, 0] != keep[:, 1]).any()


def test_kept_values_are_divided_by_the_keep_rate_dropped_are_zero_and_so_is_their_gradient():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=SHAPE), jnp.float32)
    w = jnp.asarray(rng.normal(size=SHAPE), jnp.float32)
    key, rate = jax.random.key(3), 0.25
    keep = np.asarray(dropout_ops.keep_mask(key, rate, SHAPE))
    y = dropout_ops.dropout(key, rate, x)
    eps = np.finfo(np.float32).eps  # XLA may divide or multiply by the reciprocal: one rounding apart
    np.testing.assert_allclose(y, np.where(keep, np.asarray(x) / np.float32(1 - rate), 0), rtol=eps, atol=0)
    assert (np.asarray(y)[~keep] == 0).all()
    grad = jax.grad(lambda x: jnp.sum(w * dropout_ops.dropout(key, rate, x)))(x)
    np.testing.assert_allclose(grad, np.where(keep, np.asarray(w) / np.float32(1 - rate), 0), rtol=eps, atol=0)
    np.testing.assert_array_equal(dropout_ops.dropout(key, 0.0, x), x)
    np.testing.assert_array_equal(dropout_ops.dropout(key, 1.0, x), np.zeros(SHAPE))


def test_bfloat16_keeps_its_dtype():
    x = jnp.ones((8, 16), jnp.bfloat16)
    y = dropout_ops.dropout(jax.random.key(0), 0.5, x)
    assert y.dtype == jnp.bfloat16
    assert set(np.unique(np.asarray(y, np.float32))) <= {0.0, 2.0}


def test_module_draws_from_the_dropout_rng_and_passes_through_when_deterministic():
    x = jnp.ones(SHAPE)

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic):
            return Dropout(0.5)(x, deterministic), Dropout(0.5)(x, deterministic)

    first, second = Two().apply({}, x, False, rngs={"dropout": jax.random.key(1)})
    again, _ = Two().apply({}, x, False, rngs={"dropout": jax.random.key(1)})
    other, _ = Two().apply({}, x, False, rngs={"dropout": jax.random.key(2)})
    np.testing.assert_array_equal(first, again)  # the same rng, the same mask
    assert (np.asarray(first) != np.asarray(second)).any()  # two modules, two masks
    assert (np.asarray(first) != np.asarray(other)).any()
    np.testing.assert_array_equal(Two().apply({}, x, True)[0], x)  # no rng needed
