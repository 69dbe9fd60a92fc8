"""The base every config family starts from; each family file overrides what its task needs.

Every field is defined once, with its default, what it allows and a one-line doc, in the schema
(``lconv.run.schema``; the table is docs/config.md); family files only change values. Override any field from
the command line: ``python train.py --config=configs/wmt_en_de.py:dynamic,big --config.model.dropout=0.1``.
"""
from lconv.errors import UserError
from lconv.nn import mixers
from lconv.run import schema


def mixer_variants(both_sides: bool = False) -> dict[str, str]:
    """``{word: mixer}`` a config's ``:variant`` argument may name to set the mixer of every layer: each registered
    mixer's name and its class's ``variant`` word (lconv.nn.mixers), plugins included; a ``package.module:Class``
    word names a mixer too. A mixer that fits only one side gets a Transformer's attention on the other;
    ``both_sides`` keeps only the mixers that fit both."""
    words = mixers.variants()
    if not both_sides:
        return words
    fit_both = {i.name for i in mixers.importable_infos() if i.both_sides}  # one that cannot be imported: neither
    return {w: m for w, m in words.items() if m in fit_both}


def base_config():
    """Every field at its default (``lconv.run.schema``)."""
    return schema.base_config()


# fairseq's optimisation formulas where lconv's own differ (docs/fairseq.md, "Training parity"): the configs of the
# paper's recipes train as fairseq trains; the README's default keeps lconv's (its measured recipe).
FAIRSEQ_SEMANTICS = {"adam_eps_form": "before_correction", "clip_form": "norm_plus_eps",
                     "label_smoothing_split": "others"}


def follow_fairseq(config):
    """``config.optim`` set to fairseq's Adam epsilon, clip and label smoothing (``FAIRSEQ_SEMANTICS``)."""
    config.optim.update(FAIRSEQ_SEMANTICS)
    return config


def parse_args(arg, allowed):
    """``"dynamic,big"`` -> ``{"dynamic", "big"}``; unknown words are a one-line error naming the choices. A
    ``package.module:Class`` word (a mixer plugin) is always allowed; ``set_mixer`` imports it."""
    words = {w.strip() for w in (arg or "").split(",") if w.strip()}
    unknown = sorted(w for w in words - set(allowed) if not mixers.is_spec(w))
    for word in unknown:
        if word in mixers.mixer_names():  # registered, but its module cannot be imported: say why
            mixers.mixer_class(word)
    if unknown:
        raise UserError(f"unknown config variant(s) {unknown}; choose from {sorted(allowed)}")
    return words


def set_mixer(config, words, layout=False):
    """Applies a mixer variant word (transformer/lightconv/dynamic/..., a plugin's, or ``package.module:Class``) to
    both sides of the model: to every layer, or with ``layout`` to the layers its class's layout rule names
    (``lconv.nn.mixers.layer_layout``; the kNN memory's is second to last) for the layer counts set by then."""
    variants = mixer_variants()
    picked = sorted(w for w in words if w in variants or mixers.is_spec(w))
    if len(picked) > 1:
        raise UserError(f"choose one mixer variant; got {picked}")
    if picked:
        mixer = variants.get(picked[0], picked[0])
        sides = mixers.sides(mixer)
        if "decoder" not in sides and config.task == "lm":
            raise UserError(f"mixer variant {mixer!r} is encoder-only; a decoder-only LM cannot use it")
        for side in mixers.BOTH_SIDES:
            layers = config.model[f"{side}_layers"]
            value = mixers.layer_layout(mixer, layers) if layout else mixer
            config.model[f"{side}_mixer"] = value if side in sides else "attention"
        if mixer == "attention":  # the Transformer baseline has no conv kernels to drop
            config.model.weight_dropout = 0.0
    return config


def carries_state(config):
    """Whether a layer's mixer carries state from window to window (its class's ``state``): such a model reads
    document streams (``data.stream``)."""
    names = []
    for side in mixers.BOTH_SIDES:
        value = config.model[f"{side}_mixer"]
        if config.model[f"{side}_layers"]:
            names += value.split(",") if isinstance(value, str) else list(value)
    return any(mixers.info(name.strip()).state for name in names)


def smoke_test_sizes(config):
    """``config`` (a translation config) shrunk to a model, tokenizer and batches that compile and run in seconds
    on a CPU: tests/tiny_config.py's sizes, and the gpu benchmark's smoke test (``python -m lconv.bench gpu
    --quick``)."""
    config.data.vocab_size = 512
    config.data.tokenizer_max_sentences = 2_000  # a tokenizer trained in about a second
    config.data.batch_size, config.data.eval_batch_size = 8, 64  # divisible by the 8 test devices
    config.data.max_input_length = config.data.max_target_length = 16
    config.data.eval_max_input_length = config.data.eval_max_target_length = 32
    config.model.d_model, config.model.ffn_dim, config.model.num_heads = 16, 32, 2
    config.model.encoder_layers = config.model.decoder_layers = 1
    config.model.encoder_kernel_sizes = config.model.decoder_kernel_sizes = (3,)
    return config
