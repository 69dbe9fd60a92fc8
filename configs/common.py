"""The base every config family starts from; each family file overrides what its task needs.

Every field is defined once, with its default, what it allows and a one-line doc, in the schema
(``lconv.configs.schema``; the table is docs/config.md); family files only change values. Override any field from
the command line: ``python train.py --config=configs/wmt_en_de.py:dynamic,big --config.model.dropout=0.1``.
"""
from lconv.configs import schema
from lconv.errors import UserError
from lconv.nn import mixers

# Mixer variants a config's ``:variant`` argument may name -> the mixer of every layer; a mixer that fits only
# one side (its class's ``sides``, lconv.nn.mixers) gets a Transformer's attention on the other.
MIXER_VARIANTS = {
    "transformer": "attention",
    "lightconv": "lightconv",
    "dynamic": "dynamicconv",
    "dynamicconv": "dynamicconv",
    "fixed": "fixed",
    "hadamard": "hadamard",
    "colt5": "colt5",
    "knn": "knn_memory",
}


def base_config():
    """Every field at its default (``lconv.configs.schema``)."""
    return schema.base_config()


def parse_args(arg, allowed):
    """``"dynamic,big"`` -> ``{"dynamic", "big"}``; unknown words are a one-line error naming the choices."""
    words = {w.strip() for w in (arg or "").split(",") if w.strip()}
    unknown = sorted(words - set(allowed))
    if unknown:
        raise UserError(f"unknown config variant(s) {unknown}; choose from {sorted(allowed)}")
    return words


def set_mixer(config, words):
    """Applies a mixer variant word (transformer/lightconv/dynamic/...) to both sides of the model."""
    chosen = [MIXER_VARIANTS[w] for w in words if w in MIXER_VARIANTS]
    if len(chosen) > 1:
        raise UserError(f"choose one mixer variant; got {sorted(words & set(MIXER_VARIANTS))}")
    if chosen:
        mixer = chosen[0]
        sides = mixers.sides(mixer)
        if "decoder" not in sides and config.task == "lm":
            raise UserError(f"mixer variant {mixer!r} is encoder-only; a decoder-only LM cannot use it")
        config.model.encoder_mixer = mixer if "encoder" in sides else "attention"
        config.model.decoder_mixer = mixer if "decoder" in sides else "attention"
        if mixer == "attention":  # the Transformer baseline has no conv kernels to drop
            config.model.weight_dropout = 0.0
    return config
