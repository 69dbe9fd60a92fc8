"""IWSLT'14 De->En, fairseq's ``lightconv_iwslt_de_en`` (Wu et al. 2019, Sec. 5.2).

    python train.py --config=configs/iwslt14_de_en.py:dynamic --workdir=gs://BUCKET/iwslt_dynamic
    python train.py --config=configs/iwslt14_de_en.py:lightconv --workdir=...
    python train.py --config=configs/iwslt14_de_en.py:transformer --workdir=...

d 512, FFN 1024, 4 heads, 7 encoder / 6 decoder layers (transformer: 6 / 6, fairseq's transformer_iwslt_de_en),
no GLU, dropout 0.3, weight dropout 0.1, Adam (0.9, 0.98), lr 5e-4 inverse-sqrt with 4k warmup, label smoothing
0.1, 50k updates: fairseq's training command (examples/pay_less_attention_paper/README.md), compared value by value
in docs/recipes.md. A batch is 16 packed rows of 256 tokens = 4,096 target tokens per update, fairseq's
``--max-tokens 4000`` on one GPU with no update-freq; tokens per update = batch_size x max_target_length whatever
``optim.grad_accum_steps`` (it only splits the rows into micro-batches). fairseq evaluates the average of the last
10 epoch checkpoints (about the last 10k updates): ``python eval.py --workdir=... --average_last=5`` averages the 5
kept checkpoints, 2k updates apart. The data is the local-files builder ``iwslt14`` (see README, Datasets):
fairseq's ``prepare-iwslt14.sh`` output, prepared with lconv.
"""
from lconv.configs import common


def get_config(arg=None):
    words = common.parse_args(arg, common.mixer_variants())
    c = common.follow_fairseq(common.base_config())  # fairseq's Adam eps, clip and label smoothing split
    c.data.dataset = "iwslt14/de_en"
    c.data.vocab_size = 10000
    c.data.max_input_length = c.data.max_target_length = 256
    c.data.batch_size = 16  # x 256 tokens packed = 4,096 ~ fairseq's --max-tokens 4000 per update
    c.model.d_model, c.model.ffn_dim, c.model.num_heads = 512, 1024, 4
    c.model.encoder_layers, c.model.decoder_layers = 7, 6
    c.model.use_glu = False
    c.model.dropout, c.model.weight_dropout, c.model.attention_dropout = 0.3, 0.1, 0.1
    c.model.share_embeddings = True
    c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = 5e-4, "inverse_sqrt", 4000
    c.optim.weight_decay = 1e-4
    c.train.num_steps = 50_000
    c.decode.beam_size, c.decode.lenpen = 4, 1.0
    if "transformer" in words:  # fairseq's transformer_iwslt_de_en: 6 + 6 layers (the conv models take 7 + 6)
        c.model.encoder_layers = 6
    return common.set_mixer(c, words or {"dynamic"})
