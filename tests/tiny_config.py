"""A tiny translation config for the training tests (in-process and through ``train.py`` in a subprocess).

    python train.py --config=tests/tiny_config.py --workdir=/tmp/tiny --config.data.data_dir=/tmp/tfds
"""
from lconv.configs import default


def get_config(arg=None):
    del arg
    c = default.get_config()
    c.data.vocab_size = 512
    c.data.tokenizer_max_sentences = 2_000  # a tokenizer trained in about a second; the tests need no better one
    c.data.batch_size, c.data.eval_batch_size = 8, 64  # divisible by the 8 test devices
    c.data.max_input_length = c.data.max_target_length = 16
    c.data.eval_max_input_length = c.data.eval_max_target_length = 32
    c.data.read_threads = 1
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 16, 32, 2
    c.model.encoder_layers = c.model.decoder_layers = 1
    c.model.encoder_kernel_sizes = c.model.decoder_kernel_sizes = (3,)
    c.optim.warmup_steps = 2
    c.train.num_steps, c.train.max_minutes = 6, 0.0
    c.train.log_every = c.train.checkpoint_every = 1
    c.train.eval_every = 3
    c.train.eval_after_training = False
    return c


def training_config(data_dir, num_steps=6, **train):
    """The tiny config reading ``data_dir``, trained for ``num_steps`` with ``train`` fields overridden."""
    c = get_config()
    c.data.data_dir = str(data_dir)
    c.train.num_steps = num_steps
    c.train.update(train)
    return c
