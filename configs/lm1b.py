"""Billion Word language modelling, fairseq's ``lightconv_lm_gbw`` (decoder-only, pre-norm).

    python train.py --config=configs/lm1b.py:dynamic --workdir=gs://BUCKET/lm1b_dynamic
    python train.py --config=configs/lm1b.py:transformer --workdir=...
    python train.py --config=configs/lm1b.py:knn,ddtp --workdir=runs/lm_knn     # bundled corpus, on a CPU

fairseq's architecture; fairseq has no training command for it, so the optimisation is its LM command's
(examples/language_model/README.adaptive_inputs.md; docs/recipes.md compares every value). The output layer is
the shared embedding over a 32k SentencePiece vocabulary; the ``adaptive`` variant word swaps in fairseq's
adaptive softmax (``lconv.nn.adaptive_softmax``; 32k pieces cut at 8k/20k, factor 4, untied embeddings):

    python train.py --config=configs/lm1b.py:dynamic,adaptive --workdir=...

More variant words:
- ``knn``: the Memorizing Transformer (Wu et al. 2022): one kNN-memory layer (the second to last, as the paper
  puts it near the top of the stack), local causal attention in the others, trained on document streams
  (``data.stream``: each row reads whole documents 64 tokens per step; the memory, 1024 entries per row with
  top-32 retrieval, holds the current document's past windows and is cleared at each new one). Billion Word
  is shuffled single sentences, so there a "document" is a sentence; ``ddtp`` has real multi-window documents.
- ``stream``: the same document streams for any mixer (``transformer,stream`` is the no-memory baseline of
  ``knn``: the same windows, no memory). A mixer that carries state (its class's ``state``, a plugin's too)
  gets them without the word.
- ``ddtp``: the bundled English DDTP descriptions (``ddtp/lm_en``) with a small model for a 10-minute local run
  (with ``knn`` the memory holds 512 entries).

Needs tfds ``lm1b`` prepared (see README), except with ``ddtp``.
"""
from lconv.configs import common


def get_config(arg=None):
    words = common.parse_args(arg, [*common.mixer_variants(), "adaptive", "ddtp", "stream"])
    c = common.base_config()
    c.task = "lm"
    c.data.dataset = "lm1b"
    c.data.vocab_size = 32000
    c.data.max_target_length = 256
    c.data.batch_size = 256
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 512, 4096, 16
    c.model.encoder_layers, c.model.decoder_layers = 0, 6
    c.model.normalize_before = True
    c.model.dropout, c.model.attention_dropout, c.model.weight_dropout = 0.1, 0.1, 0.1
    c.model.input_dropout = 0.1  # lightconv_lm's default
    c.optim.optimizer, c.optim.momentum = "nag", 0.99
    # Peak lr 1: fairseq's LM command (0.12.2: --optimizer nag --lr 1.0 --min-lr 0.0001; docs/recipes.md).
    c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = 1.0, "cosine", 16_000
    c.optim.clip_norm = 0.1
    c.optim.label_smoothing = 0.0
    c.train.num_steps = 984_000  # fairseq's gbw recipe: max_update 984k with the cosine period
    memory_size = 1024
    if "adaptive" in words:
        c.model.share_embeddings = False
        c.model.adaptive_softmax_cutoffs = (8000, 20000)
        c.model.adaptive_softmax_dropout = 0.1
    if "ddtp" in words:
        c.data.dataset, c.data.vocab_size, c.data.batch_size = "ddtp/lm_en", 8000, 32
        c.model.d_model, c.model.ffn_dim, c.model.num_heads = 256, 1024, 4
        c.model.decoder_layers, c.model.decoder_kernel_sizes = 3, (3, 7, 15)
        c.model.max_len = 256
        c.model.weight_dropout = c.model.input_dropout = 0.0
        c.optim.optimizer, c.optim.learning_rate, c.optim.schedule = "adam", 3e-3, "inverse_sqrt"
        c.optim.warmup_steps, c.optim.clip_norm = 100, 0.0
        c.train.num_steps, c.train.max_minutes = 1500, 10.0
        c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 50, 1000, 200
        memory_size = 512
    else:  # fairseq's recipe: its clip (and Adam eps, label smoothing, should they be set); ddtp keeps lconv's
        common.follow_fairseq(c)
    # A mixer's layout rule places it (the kNN memory: second to last, attention elsewhere; lconv.nn.mixers)
    c = common.set_mixer(c, (words - {"adaptive", "ddtp", "stream"}) or {"dynamic"}, layout=True)
    if "knn" in words:
        c.model.mixer_kwargs = {"knn_memory": {"memory_size": memory_size, "num_neighbors": 32}}
    if "stream" in words or common.carries_state(c):  # a mixer with state reads documents window by window
        c.data.stream = True
        c.data.max_target_length = 64
    return c
