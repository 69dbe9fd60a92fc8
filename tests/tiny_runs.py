"""Untrained tiny runs held in memory (``restore.Trained``) for the API and export tests: no training, no dataset
preparation, a SentencePiece model trained in a second on synthetic sentences. What these tests check (the same
tokens through different programs) does not need a trained model."""
from __future__ import annotations

import functools

import jax
import numpy as np
import tiny_config

from lconv.configs import lm1b
from lconv.data import tokenizer as tokenizer_lib
from lconv.run import model_setup, restore, schema

WORDS = ("the a package tool library for and of to with files images convert data system window small fast "
         "server client network text editor font support python module documentation").split()


def sentences(count: int = 600, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 12))).capitalize() + "." for _ in range(count)]


@functools.cache
def tokenizer() -> tokenizer_lib.Tokenizer:
    """One per test process (the same sentences give the same model; nothing changes a Tokenizer)."""
    return tokenizer_lib.train_tokenizer(sentences(), 400, num_threads=1)


def lm_config():
    c = lm1b.get_config("ddtp")
    c.data.eval_batch_size, c.data.eval_max_target_length = 8, 32
    c.data.max_target_length = 32
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 16, 32, 2
    c.model.decoder_layers, c.model.decoder_kernel_sizes = 2, (3, 5)
    c.model.max_len = 96
    return c


def in_memory(config, tok: tokenizer_lib.Tokenizer | None = None, seed: int = 0) -> restore.Trained:
    """``config``'s model with freshly initialised params (single device) and a tokenizer."""
    tok = tok or tokenizer()
    config = schema.validate_config(config)
    model = model_setup.build_model(config, tok.vocab_size)
    args, kwargs = model_setup.model_inputs(model_setup.dummy_batch(config))
    params = jax.jit(model.init)(jax.random.key(seed), *args, **kwargs)["params"]
    return restore.Trained(config, "in-memory", tok, model, params, [0])


def translation_config(mixer: str | None = None):
    c = tiny_config.get_config()
    c.data.eval_batch_size = 8
    if mixer is not None:
        c.model.encoder_mixer = c.model.decoder_mixer = mixer
    return c
