"""Fields shared by every config family; each family file overrides what its task needs.

Every field is commented here; family files only change values. Override any field from the command line:
``python train.py --config=configs/wmt_en_de.py:dynamic,big --config.model.dropout=0.1``.
"""
import ml_collections

from lconv.errors import UserError
from lconv.nn import mixers

# The paper's per-layer kernel sizes (Wu et al. 2019, Sec. 6.1).
PAPER_ENCODER_KERNELS = (3, 7, 15, 31, 31, 31, 31)
PAPER_DECODER_KERNELS = (3, 7, 15, 31, 31, 31)



def mixer_variants(both_sides: bool = False) -> dict[str, str]:
    """``{word: mixer}`` a config's ``:variant`` argument may name to set the mixer of every layer: each registered
    mixer's name and its class's ``variant`` word (lconv.nn.mixers), plugins included; a ``package.module:Class``
    word names a mixer too. A mixer that fits only one side gets a Transformer's attention on the other;
    ``both_sides`` keeps only the mixers that fit both."""
    words = mixers.variants()
    return {w: m for w, m in words.items() if not both_sides or mixers.info(m).both_sides}


def base_config():
    c = ml_collections.ConfigDict()
    c.task = "translation"  # translation | summarization | lm
    c.seed = 0  # params init, dropout (folded with the step) and data shuffling

    # --- data -------------------------------------------------------------------------------------------------
    c.data = ml_collections.ConfigDict()
    c.data.dataset = "ddtp/en_de"  # tfds name[/config]; ddtp/* is built from the corpus bundled with lconv
    c.data.data_dir = "~/tensorflow_datasets"  # where tfds datasets are (or, for ddtp, get) prepared
    # ddtp: a directory of raw apt Translation-* files (None = the bundled snapshot)
    c.data.raw_dir = ml_collections.config_dict.placeholder(str)
    c.data.vocab_size = 8000  # joint SentencePiece vocabulary, trained from the training split
    c.data.max_input_length = 128  # longer training examples are truncated (and counted)
    c.data.max_target_length = 128
    c.data.eval_max_input_length = 256  # evaluation examples are truncated only past these (counted)
    c.data.eval_max_target_length = 256
    c.data.pack = True  # pack several examples per row (segment ids keep them apart)
    c.data.batch_size = 32  # rows per global batch (all hosts); tokens per batch ~ batch_size * max_len
    c.data.eval_batch_size = 64
    c.data.seed = 0  # shuffling
    c.data.train_long = "truncate"  # truncate | drop over-long training examples (both counted)
    c.data.stream = False  # lm only: every row reads whole documents, max_target_length tokens per step
    # (lconv.data.stream), and the kNN memory is carried from window to window (reset at each new document)

    # --- model (lconv.nn.models.ModelConfig) ---------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.d_model = 512  # model width (fairseq encoder_embed_dim)
    c.model.ffn_dim = 2048  # FFN hidden size
    c.model.num_heads = 8  # conv heads / attention heads
    c.model.encoder_layers = 7
    c.model.decoder_layers = 6
    c.model.encoder_mixer = "dynamicconv"  # a registry name, or a comma list, one per layer
    c.model.decoder_mixer = "dynamicconv"
    c.model.encoder_kernel_sizes = PAPER_ENCODER_KERNELS  # one per layer, or one for all
    c.model.decoder_kernel_sizes = PAPER_DECODER_KERNELS
    c.model.mixer_kwargs = {}  # per-mixer extra fields, e.g. {"fixed": {"factorized_rank": 8}}
    c.model.ffn_type = "dense"  # dense | colt5 (routed light/heavy FFN)
    c.model.ffn_kwargs = {}  # fields of CoLT5FeedForward when ffn_type = colt5
    c.model.use_glu = True  # GLU after the block's input projection
    c.model.conv_features = 0  # fairseq conv_dim; 0 = d_model
    c.model.dropout = 0.1  # residual and embedding dropout
    c.model.attention_dropout = 0.0
    c.model.relu_dropout = 0.0
    c.model.input_dropout = 0.0  # dropout on the conv block's input
    c.model.weight_dropout = 0.1  # DropConnect on the normalised conv kernels
    c.model.normalize_before = False  # pre-norm; the paper's translation models are post-norm
    c.model.share_embeddings = True  # one table for source, target and output (joint vocabulary)
    c.model.adaptive_softmax_cutoffs = ()  # e.g. (8000, 20000): fairseq's adaptive softmax output; needs
    c.model.adaptive_softmax_factor = 4.0  # share_embeddings=False; tail i is d / factor**(i+1) wide
    c.model.adaptive_softmax_dropout = 0.0  # dropout inside the tails
    c.model.learned_positions = False  # sinusoidal positions otherwise
    c.model.max_len = 1024  # longest sequence for learned positions / Fixed / Hadamard attention
    c.model.conv_impl = "auto"  # auto | band | shift | conv | unfold (see lconv.ops.conv)
    c.model.dtype = "float32"  # compute dtype (bfloat16 on TPU); params and loss stay float32
    c.model.matmul_precision = "default"  # dots outside the conv ops: default (TF32 on GPU) | high | highest
    c.model.attention_impl = "auto"  # auto (cuDNN flash on GPU; blockwise when long) | xla | chunked | cudnn
    c.model.remat = "none"  # recompute in the backward pass: none | full (keep layer inputs) | dots (keep matmuls)

    # --- optimisation ----------------------------------------------------------------------------------------
    c.optim = ml_collections.ConfigDict()
    c.optim.optimizer = "adam"  # adam | adamw | nag
    c.optim.learning_rate = 5e-4  # peak learning rate
    c.optim.schedule = "inverse_sqrt"  # inverse_sqrt | cosine | constant (all with linear warmup)
    c.optim.warmup_steps = 4000
    c.optim.warmup_init_lr = 1e-7  # fairseq's warmup-init-lr
    c.optim.min_lr = 1e-9  # cosine floor
    c.optim.cosine_period = 0  # cosine updates after warmup (fairseq's --lr-period-updates); 0 = the rest of the run
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.eps = 1e-8
    c.optim.momentum = 0.99  # nag
    c.optim.weight_decay = 0.0
    c.optim.clip_norm = 0.0  # global gradient-norm clipping; 0 = off
    c.optim.label_smoothing = 0.1
    c.optim.grad_accum_steps = 1  # fairseq's update-freq

    # --- training loop ---------------------------------------------------------------------------------------
    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 50_000  # optimizer updates
    c.train.max_minutes = 0.0  # stop (and checkpoint) after this wall time; 0 = no limit
    c.train.stop_check_every = 10  # several processes agree on a stop (signal, max_minutes) every N steps
    c.train.log_every = 100
    c.train.eval_every = 2000  # validation loss / ppl
    c.train.checkpoint_every = 2000
    c.train.keep_checkpoints = 5
    c.train.eval_after_training = True  # decode the test split and report BLEU/ROUGE at the end
    # Divergence guard: a log window whose mean loss is above spike_factor x the median of the windows before it
    # is a spike; no checkpoint is written during one, and spike_windows in a row stop the run (0 = off).
    c.train.spike_factor = 3.0
    c.train.spike_windows = 3
    c.train.checkpoint_checksums = True  # a SHA-256 manifest per checkpoint, verified on restore
    c.train.async_checkpoints = True  # checkpoint files are written while training goes on (orbax async)

    # --- decoding / evaluation -------------------------------------------------------------------------------
    c.decode = ml_collections.ConfigDict()
    c.decode.beam_size = 5
    c.decode.batch_size = 0  # sources per decoding batch; 0 = auto: data.eval_batch_size on CPU, wider on a GPU/TPU
    c.decode.lenpen = 1.0  # fairseq length penalty: score / length**lenpen
    c.decode.max_len_a = 1.2  # max output length = a * source length + b
    c.decode.max_len_b = 10
    c.decode.split = "test"
    c.decode.num_print = 5  # sample translations printed at the end
    c.decode.stop = "optimal"  # beam search ends when no alive hypothesis can win | "fairseq" (its generator's rule)
    c.decode.compound_split = False  # tokenized BLEU splits hyphenated compounds (the paper's WMT En-De BLEU)

    # --- sharding --------------------------------------------------------------------------------------------
    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor); -1 = all remaining devices
    c.mesh.axis_names = ("data", "fsdp", "tensor")
    # logical axis -> mesh axis (None = replicated)
    c.mesh.rules = (
        ("embed", "fsdp"),
        ("vocab", "tensor"),
        ("mlp", "tensor"),
        ("conv", "tensor"),
        ("heads", "tensor"),
        ("kernel", None),
        ("length", None),
        ("key_length", "fsdp"),  # Fixed / Hadamard attention's [T, T] tables
    )
    # Activations (activation_batch, _heads, _mlp, ...) follow lconv.constants.DEFAULT_AXIS_RULES unless named here.
    return c


def parse_args(arg, allowed):
    """``"dynamic,big"`` -> ``{"dynamic", "big"}``; unknown words are a one-line error naming the choices. A
    ``package.module:Class`` word (a mixer plugin) is always allowed; ``set_mixer`` imports it."""
    words = {w.strip() for w in (arg or "").split(",") if w.strip()}
    unknown = sorted(w for w in words - set(allowed) if not mixers.is_spec(w))
    if unknown:
        raise UserError(f"unknown config variant(s) {unknown}; choose from {sorted(allowed)}")
    return words


def set_mixer(config, words):
    """Applies a mixer variant word (transformer/lightconv/dynamic/..., a plugin's, or ``package.module:Class``) to
    both sides of the model."""
    variants = mixer_variants()
    picked = sorted(w for w in words if w in variants or mixers.is_spec(w))
    if len(picked) > 1:
        raise UserError(f"choose one mixer variant; got {picked}")
    if picked:
        mixer = variants.get(picked[0], picked[0])
        sides = mixers.sides(mixer)
        if "decoder" not in sides and config.task == "lm":
            raise UserError(f"mixer variant {mixer!r} is encoder-only; a decoder-only LM cannot use it")
        config.model.encoder_mixer = mixer if "encoder" in sides else "attention"
        config.model.decoder_mixer = mixer if "decoder" in sides else "attention"
        if mixer == "attention":  # the Transformer baseline has no conv kernels to drop
            config.model.weight_dropout = 0.0
    return config
