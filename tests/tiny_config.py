"""A tiny translation config for the training tests (in-process and through ``train.py`` in a subprocess).

    python train.py --config=tests/tiny_config.py --workdir=runs/tiny --config.data.data_dir=runs/tfds
"""
from lconv.configs import common, default


def get_config(arg=None):
    del arg
    c = common.smoke_test_sizes(default.get_config())
    c.data.read_threads = 1
    c.model.dropout = 0.1  # the default has none; the tests keep dropout's paths (its rng, train vs eval) in play
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
