"""The default: a small DynamicConv En->De model on the DDTP corpus bundled with lconv; minutes on a laptop CPU.

    python train.py --config=configs/default.py --workdir=runs/default
    python train.py --config=configs/default.py:transformer --workdir=runs/default_transformer

Variants: dynamic (default), lightconv, transformer, fixed, hadamard. Tuned for a small budget (short warmup,
a higher learning rate than the paper's, packed batches) rather than for the paper's final numbers.
"""
from configs import common


def get_config(arg=None):
    words = common.parse_args(arg, ["dynamic", "lightconv", "transformer", "fixed", "hadamard"])
    c = common.base_config()
    c.data.dataset = "ddtp/en_de"
    c.data.vocab_size = 8000
    c.data.max_input_length = c.data.max_target_length = 64
    c.data.batch_size = 48
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 256, 1024, 4
    c.model.encoder_layers = c.model.decoder_layers = 3
    c.model.encoder_kernel_sizes = (3, 7, 15)
    c.model.decoder_kernel_sizes = (3, 7, 15)
    c.model.max_len = 256
    c.model.dropout, c.model.weight_dropout = 0.1, 0.1
    c.optim.learning_rate = 2e-3
    c.optim.warmup_steps = 400
    c.train.num_steps = 6000
    c.train.max_minutes = 12.0  # the README's budget; stops early (and checkpoints) when reached
    c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 50, 500, 500
    c.decode.beam_size = 4
    return common.set_mixer(c, words)
