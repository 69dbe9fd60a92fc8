"""Adaptive input (fairseq's ``AdaptiveInput``) against a per-token NumPy loop, fairseq's init and widths, and the
config rules of the decoder's ends (``lconv.nn.decoder_ends``): projections, the final norm, tying."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tolerance

from lconv.errors import UserError
from lconv.nn.adaptive_input import AdaptiveInput
from lconv.nn.models import ModelConfig


def test_each_token_reads_its_bands_table_and_projection():
    V, cutoffs, d_in, d = 37, (5, 17), 12, 10
    layer = AdaptiveInput(V, cutoffs, d_in, d, factor=2.0, matmul_precision="highest")
    tokens = np.array([[0, 4, 5, 16, 17, 36], [3, 3, 20, 9, 1, 0]])  # every band edge, both sides
    params = nn.meta.unbox(layer.init(jax.random.key(0), jnp.asarray(tokens))["params"])
    got = np.asarray(layer.apply({"params": params}, jnp.asarray(tokens)))
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    # fairseq's widths int(d_in // factor**band): 12, 6, 3; tables [ids in band, width]; projections [width, d]
    assert [p[f"band_{b}"].shape for b in range(3)] == [(5, 12), (12, 6), (20, 3)]
    assert [p[f"band_{b}_projection"].shape for b in range(3)] == [(12, 10), (6, 10), (3, 10)]
    assert not p["band_0"][0].any() and p["band_1"][0].any()  # the PAD row (0) starts at zero, in band 0 only
    expected = np.zeros(tokens.shape + (d,))
    for index in np.ndindex(tokens.shape):
        token = tokens[index]
        band, first = (0, 0) if token < 5 else (1, 5) if token < 17 else (2, 17)
        expected[index] = p[f"band_{band}"][token - first] @ p[f"band_{band}_projection"]
    np.testing.assert_allclose(got, expected, **tolerance(np.float32, "highest", atol=1e-6))


def _config(**fields):
    base = dict(vocab_size=300, d_model=16, ffn_dim=24, num_heads=4, encoder_layers=0, decoder_layers=1,
                share_embeddings=False)
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize("fields, message", [
    (dict(adaptive_input_cutoffs=(50,), share_embeddings=True),
     "adaptive_input_cutoffs needs share_embeddings=False and share_decoder_input_output=False"),
    (dict(adaptive_input_cutoffs=(50, 40)), r"adaptive_input_cutoffs=\(50, 40\) must increase strictly"),
    (dict(decoder_input_dim=8, share_embeddings=True), "decoder_input_dim=8 needs share_embeddings=False"),
    (dict(decoder_output_dim=12, share_decoder_input_output=True),
     "decoder_output_dim=12 differs from the embedding width 16, which the tied output layer reads"),
    (dict(adaptive_input_cutoffs=(50,), adaptive_softmax_cutoffs=(60,), tie_adaptive_weights=True),
     "tie_adaptive_weights needs adaptive_input_cutoffs = adaptive_softmax_cutoffs"),
    (dict(adaptive_input_cutoffs=(50,), adaptive_softmax_cutoffs=(50,), tie_adaptive_weights=True,
          decoder_output_dim=8), "decoder_input_dim = decoder_output_dim = d_model"),
    (dict(tie_adaptive_proj=True), "tie_adaptive_proj .* needs tie_adaptive_weights=True"),
])
def test_decoder_ends_that_do_not_fit_are_one_line_errors(fields, message):
    with pytest.raises(UserError, match=message) as err:
        _config(**fields).validate(decoder_only=True)
    assert "\n" not in str(err.value)


def test_decoder_ends_that_fit_validate():
    _config(decoder_input_dim=8, decoder_output_dim=12).validate(decoder_only=True)
    _config(decoder_input_dim=8, decoder_output_dim=8, share_decoder_input_output=True).validate(decoder_only=True)
    _config(adaptive_input_cutoffs=(50, 100), adaptive_softmax_cutoffs=(50, 100), tie_adaptive_weights=True,
            tie_adaptive_proj=True, decoder_final_norm=False).validate(decoder_only=True)
