"""Training recipes of the paper configs beside fairseq's and the paper's (Wu et al. 2019), as markdown tables.

    PYTHONPATH=. python scripts/recipe_table.py                          # print the tables
    PYTHONPATH=. python scripts/recipe_table.py --write docs/recipes.md  # refresh them in the docs

``--write`` replaces what stands between the ``<!-- recipe-table:begin -->`` and ``<!-- recipe-table:end -->``
lines. The lconv column is read from the configs now; the fairseq and paper columns are values recorded here by
hand from the sources each recipe names (read, not copied: fairseq is only ever cited). tests/test_recipe_table.py
checks that the docs equal this script's output and that every config equals its reference (fairseq's value, else
the paper's) except for the documented ``EXCEPTIONS``.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BEGIN, END = "<!-- recipe-table:begin -->", "<!-- recipe-table:end -->"
FAIRSEQ = "fairseq 0.12.2"
README = "examples/pay_less_attention_paper/README.md"
ARCHS = "fairseq/models/lightconv.py"
PAPER = ("Wu et al. 2019, Sec. 5 (training and hyper-parameters); ? = a value once recorded here from memory and "
         "not yet checked against the paper's text, so neither shown nor compared")


class About(str):
    """A value a source gives only roughly ("459K tokens"): shown in the table, never compared."""


class Unverified(str):
    """A paper value not checked against the paper's text: shown as "?", never compared. Replace it by the value
    only with the section and sentence it was read in (``PAPER_SOURCES``)."""


UNVERIFIED = Unverified("?")


def unverified(*fields: str) -> dict[str, Unverified]:
    return dict.fromkeys(fields, UNVERIFIED)


# Where each paper value that is recorded (not "?") was read: (recipe label, field) -> section and sentence. Empty:
# the retrieved copies of the paper (search excerpts of its stored pages) reached only its opening sections, and a
# third-party digest of it quoted from Sec. 5 only the hardware ("8 NVIDIA V100 GPUs" for the WMT models), which
# no row holds. Paper values said second-hand (fairseq issues #534, #576) are in NOTES, not in the paper column.
PAPER_SOURCES: dict[tuple[str, str], str] = {}


def _lm(c) -> bool:
    return c.task == "lm"


def _cosine(c, value):
    return value if c.optim.schedule == "cosine" else None


def _adam(c, value):
    return value if c.optim.optimizer in ("adam", "adamw") else None


def _sides(c, name):
    """A per-side setting: one value, or (encoder, decoder) where the config sets the sides apart."""
    from lconv.nn.model_config import ModelConfig

    return ModelConfig.from_config(c.model, vocab_size=c.data.vocab_size).per_side(name, decoder_only=_lm(c))


def _translation(c, value):
    return None if _lm(c) else value


# Recipe value -> how lconv's is read from a config (None = not applicable to that config).
FIELDS: dict[str, Callable[[Any], Any]] = {
    "layers (enc / dec)": lambda c: c.model.decoder_layers if _lm(c) else
    (c.model.encoder_layers, c.model.decoder_layers),
    "d / FFN / heads": lambda c: tuple(_sides(c, name) for name in ("d_model", "ffn_dim", "num_heads")),
    "kernel sizes (enc / dec)": lambda c: (tuple(c.model.decoder_kernel_sizes),) if _lm(c) else
    (tuple(c.model.encoder_kernel_sizes), tuple(c.model.decoder_kernel_sizes)),
    "GLU": lambda c: _sides(c, "use_glu"),
    "pre-norm": lambda c: _sides(c, "normalize_before"),
    "shared embeddings": lambda c: c.model.share_embeddings,
    "dropout": lambda c: c.model.dropout,
    "attention dropout": lambda c: c.model.attention_dropout,
    "weight dropout (DropConnect)": lambda c: c.model.weight_dropout,
    "input dropout": lambda c: c.model.input_dropout,
    "relu dropout": lambda c: c.model.relu_dropout,
    "optimizer": lambda c: c.optim.optimizer,
    "Adam betas": lambda c: _adam(c, (c.optim.b1, c.optim.b2)),
    "Adam eps": lambda c: _adam(c, c.optim.eps),
    "Adam eps form": lambda c: _adam(c, c.optim.adam_eps_form),
    "NAG momentum": lambda c: c.optim.momentum if c.optim.optimizer == "nag" else None,
    "peak lr": lambda c: c.optim.learning_rate,
    "lr schedule": lambda c: c.optim.schedule,
    "warmup updates": lambda c: c.optim.warmup_steps,
    "warmup init lr": lambda c: c.optim.warmup_init_lr,
    "cosine floor (min lr)": lambda c: _cosine(c, c.optim.min_lr),
    "cosine period (updates)": lambda c: _cosine(c, c.optim.cosine_period
                                                 or c.train.num_steps - c.optim.warmup_steps),
    "updates": lambda c: c.train.num_steps,
    "weight decay": lambda c: c.optim.weight_decay,
    "clip norm": lambda c: c.optim.clip_norm,
    "clip form": lambda c: c.optim.clip_form if c.optim.clip_norm else None,
    "label smoothing": lambda c: c.optim.label_smoothing,
    "label smoothing split": lambda c: c.optim.label_smoothing_split if c.optim.label_smoothing else None,
    "target tokens per update": lambda c: c.data.batch_size * c.data.max_target_length,
    "update-freq (grad_accum_steps)": lambda c: c.optim.grad_accum_steps,
    "compute dtype": lambda c: c.model.dtype,
    "beam": lambda c: _translation(c, c.decode.beam_size),
    "length penalty": lambda c: _translation(c, c.decode.lenpen),
    "compound-split BLEU": lambda c: _translation(c, c.decode.compound_split),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    config: str  # configs/<config>.py
    variant: str  # its variant words
    title: str
    sources: str  # where the fairseq values were read
    fairseq: dict[str, Any]
    paper: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.config}:{self.variant}" if self.variant else self.config


KERNELS = ((3, 7, 15, 31, 31, 31, 31), (3, 7, 15, 31, 31, 31))
# fairseq's WMT command (README, "WMT16 En-De"; En-Fr's differs in the values the recipes override).
WMT_COMMAND = {
    "shared embeddings": True, "optimizer": "adam", "Adam betas": (0.9, 0.98), "Adam eps": 1e-8,  # adam_eps default
    "Adam eps form": "before_correction", "label smoothing split": "others",  # fairseq's formulas (docs/fairseq.md)
    "peak lr": 1e-3, "lr schedule": "cosine", "warmup updates": 10_000, "warmup init lr": 1e-7,
    "cosine floor (min lr)": 1e-7, "cosine period (updates)": 20_000, "updates": 30_000, "weight decay": 0.0,
    "clip norm": 0.0, "label smoothing": 0.1, "target tokens per update": 3584 * 8 * 16,  # --max-tokens x GPUs x
    "update-freq (grad_accum_steps)": 16, "compute dtype": "float16",  # --update-freq; --fp16
    "beam": 5, "length penalty": 0.5, "compound-split BLEU": True,
}
# lightconv_wmt_en_de_big (its GLU from the command's --encoder-glu 1 --decoder-glu 1).
WMT_BIG = {
    "layers (enc / dec)": (7, 6), "d / FFN / heads": (1024, 4096, 16), "kernel sizes (enc / dec)": KERNELS,
    "GLU": True, "pre-norm": False, "dropout": 0.3, "attention dropout": 0.1, "weight dropout (DropConnect)": 0.1,
    "input dropout": 0.1, "relu dropout": 0.0,
}
# The paper's WMT setup (Sec. 5: trained on 8 V100 GPUs); every value below is still to be read in its text.
WMT_PAPER = unverified(
    "layers (enc / dec)", "d / FFN / heads", "kernel sizes (enc / dec)", "dropout", "optimizer", "Adam betas",
    "peak lr", "lr schedule", "warmup updates", "warmup init lr", "updates", "label smoothing",
    "target tokens per update", "update-freq (grad_accum_steps)", "compute dtype")

RECIPES = [
    Recipe("wmt_en_de", "dynamic,big", "WMT'14 En-De, big",
           f"`lightconv_wmt_en_de_big` ({ARCHS}) and the WMT16 En-De command of {README}",
           {**WMT_BIG, **WMT_COMMAND}, WMT_PAPER),
    Recipe("wmt_en_de", "dynamic,base", "WMT'14 En-De, base",
           f"`lightconv_wmt_en_de` ({ARCHS}); training flags of the WMT16 En-De command of {README} (written for "
           "big: its dropout flags are left to the architecture)",
           {**WMT_COMMAND, "layers (enc / dec)": (7, 6), "d / FFN / heads": (512, 2048, 8),
            "kernel sizes (enc / dec)": KERNELS, "GLU": True, "pre-norm": False, "dropout": 0.1,
            "attention dropout": 0.0, "weight dropout (DropConnect)": 0.0, "input dropout": 0.1,
            "relu dropout": 0.0},
           {}),
    Recipe("wmt_en_fr", "dynamic,big", "WMT'14 En-Fr, big",
           f"`lightconv_wmt_en_fr_big` ({ARCHS}) and the WMT14 En-Fr command of {README}",
           {**WMT_BIG, **WMT_COMMAND, "dropout": 0.1, "cosine period (updates)": 70_000, "length penalty": 0.9,
            "compound-split BLEU": False},
           WMT_PAPER),
    Recipe("wmt_zh_en", "dynamic,big", "WMT'17 Zh-En, big",
           f"`lightconv_wmt_zh_en_big` ({ARCHS}); the README has no Zh-En command",
           {**WMT_BIG, "dropout": 0.2, "attention dropout": 0.2, "weight dropout (DropConnect)": 0.2},
           WMT_PAPER),
    Recipe("iwslt14_de_en", "dynamic", "IWSLT'14 De-En",
           f"`lightconv_iwslt_de_en` ({ARCHS}) and the IWSLT14 De-En command of {README} (one GPU, no --fp16)",
           {"layers (enc / dec)": (7, 6), "d / FFN / heads": (512, 1024, 4), "kernel sizes (enc / dec)": KERNELS,
            "GLU": False, "pre-norm": False, "shared embeddings": False, "dropout": 0.3, "attention dropout": 0.1,
            "weight dropout (DropConnect)": 0.1, "input dropout": 0.0, "relu dropout": 0.0, "optimizer": "adam",
            "Adam betas": (0.9, 0.98), "Adam eps": 1e-8, "Adam eps form": "before_correction", "peak lr": 5e-4,
            "lr schedule": "inverse_sqrt",
            "warmup updates": 4000, "warmup init lr": 1e-7, "updates": 50_000, "weight decay": 1e-4,
            "clip norm": 0.0, "label smoothing": 0.1, "label smoothing split": "others",
            "target tokens per update": 4000,
            "update-freq (grad_accum_steps)": 1, "compute dtype": "float32", "beam": 4, "length penalty": 1.0,
            "compound-split BLEU": False},
           unverified("dropout", "lr schedule", "updates", "target tokens per update",
                      "update-freq (grad_accum_steps)")),
    Recipe("lm1b", "dynamic", "Billion Word LM",
           "`lightconv_lm_gbw` (fairseq/models/lightconv_lm.py); fairseq has no training command for it, so the "
           "optimisation is fairseq's LM command's (examples/language_model/README.adaptive_inputs.md, "
           "`transformer_lm_wiki103`: --optimizer nag --lr 1.0 --min-lr 0.0001 --lr-scheduler cosine "
           "--warmup-updates 16000 --warmup-init-lr 1e-07 --clip-norm 0.1; NAG's default momentum 0.99, "
           "fairseq/optim/nag.py)",
           {"layers (enc / dec)": 6, "d / FFN / heads": (512, 4096, 16), "kernel sizes (enc / dec)": KERNELS[1:],
            "GLU": True, "pre-norm": True, "shared embeddings": False, "dropout": 0.1, "attention dropout": 0.1,
            "weight dropout (DropConnect)": 0.1, "input dropout": 0.1, "relu dropout": 0.0,
            "optimizer": "nag", "NAG momentum": 0.99, "peak lr": 1.0, "lr schedule": "cosine",
            "warmup updates": 16_000, "warmup init lr": 1e-7, "clip norm": 0.1, "clip form": "norm_plus_eps"},
           unverified("optimizer", "NAG momentum", "peak lr", "lr schedule", "warmup updates", "warmup init lr",
                      "clip norm", "target tokens per update")),
    Recipe("cnn_dailymail", "dynamic", "CNN-DailyMail summarization",
           f"none (no fairseq command); input and relu dropout as every `lightconv` architecture but IWSLT's "
           f"defaults them ({ARCHS})",
           {"input dropout": 0.1, "relu dropout": 0.0},
           unverified("dropout", "optimizer", "lr schedule", "warmup updates", "cosine period (updates)",
                      "weight decay")),
]

# (recipe label, value) -> why lconv differs from the reference (fairseq's value, else the paper's).
WMT_LABELS = ("wmt_en_de:dynamic,big", "wmt_en_de:dynamic,base", "wmt_en_fr:dynamic,big")  # with an fp16 command
BFLOAT16 = ("bfloat16 trains without fp16's loss scaling (TPU's native type); params, optimizer state and the loss "
            "stay float32")
EXCEPTIONS = {
    **{(label, "compute dtype"): BFLOAT16 for label in WMT_LABELS},
    ("wmt_en_de:dynamic,base", "attention dropout"): "the recipe's --attention-dropout 0.1 for both sizes; "
    "fairseq has no base command, its base architecture defaults to 0",
    ("wmt_en_de:dynamic,base", "weight dropout (DropConnect)"): "the recipe's --weight-dropout 0.1 for both "
    "sizes (fairseq's base architecture defaults it to its attention dropout, 0)",
    ("iwslt14_de_en:dynamic", "shared embeddings"): "lconv trains one joint SentencePiece vocabulary, so one "
    "table serves both sides (fairseq's IWSLT data has two dictionaries)",
    ("iwslt14_de_en:dynamic", "target tokens per update"): "whole packed rows: 16 x 256 = 4,096 (fairseq's "
    "--max-tokens 4000 also counts padding)",
    ("lm1b:dynamic", "shared embeddings"): "32k SentencePiece pieces instead of 793k words make a tied output "
    "layer affordable; the :adaptive variant unties it for fairseq's adaptive softmax",
}
# Remarks where lconv follows one source and the other differs.
NOTES = {
    ("wmt_en_fr:dynamic,big", "target tokens per update"): "fairseq's command",
    ("wmt_zh_en:dynamic,big", "dropout"): "fairseq's architecture (a paper author's comment in fairseq issue #534 "
    "says the paper's Zh-En dropout is 0.25; not read in the paper's text)",
    ("wmt_zh_en:dynamic,big", "compute dtype"): "as the other WMT configs (no Zh-En command to say fp16; "
    "the paper's precision not verified)",
    ("wmt_zh_en:dynamic,big", "updates"): "wmt_en_de's 30k (no fairseq command; the paper's count not verified)",
    ("lm1b:dynamic", "peak lr"): "fairseq's LM command --lr 1.0 (before 2020 written --max-lr 1.0 --lr 0.0001: "
    "that cosine scheduler warmed up to --max-lr, --lr was its floor)",
    ("lm1b:dynamic", "updates"): "neither source is recorded here for it",
    ("cnn_dailymail:dynamic", "warmup updates"): "a paper author's comment in fairseq issue #576 gives 4,000 warmup "
    "updates (1e-7 to 1e-3) for the summarization model; not read in the paper's text",
}


def get_config(name: str, variant: str):
    return importlib.import_module(f"lconv.configs.{name}").get_config(variant or None)


def lconv_values(recipe: Recipe) -> dict[str, Any]:
    config = get_config(recipe.config, recipe.variant)
    return {field: _plain(read(config)) for field, read in FIELDS.items()}


def _plain(value):
    """Lists (as ml_collections may hold them) as tuples, so values compare with the recorded ones."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def reference(recipe: Recipe, field: str) -> Any:
    """The value lconv must equal: fairseq's, else the paper's; None where neither is recorded or exact."""
    value = recipe.fairseq.get(field, recipe.paper.get(field))
    return None if isinstance(value, (About, Unverified)) else value


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return not isinstance(a, (bool, str)) and not isinstance(b, (bool, str)) and math.isclose(a, b, rel_tol=1e-9)
    return type(a) is type(b) and a == b


def fmt(value: Any, group: bool = True) -> str:
    """A table cell: ``None`` as —, booleans as yes/no, tuples as ``a / b`` (kernel lists as ``3,7,15``), counts
    with thousands separators (``group``, not inside tuples)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        inner = [",".join(fmt(x, False) for x in v) if isinstance(v, tuple) else fmt(v, False) for v in value]
        return " / ".join(inner)
    if isinstance(value, int):
        return f"{value:,}" if group else str(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def recipe_markdown(recipe: Recipe) -> str:
    ours = lconv_values(recipe)
    lines = [f"### `{recipe.label}`: {recipe.title}", "", f"fairseq recipe: {recipe.sources}.", "",
             "| value | lconv | fairseq recipe | paper | note |", "|---|---|---|---|---|"]
    for field in FIELDS:
        note = EXCEPTIONS.get((recipe.label, field), NOTES.get((recipe.label, field), ""))
        flag = " **≠**" if (recipe.label, field) in EXCEPTIONS else ""
        lines.append(f"| {field} | {fmt(ours[field])}{flag} | {fmt(recipe.fairseq.get(field))} | "
                     f"{fmt(recipe.paper.get(field))} | {note} |")
    return "\n".join(lines)


def unsourced_paper_values() -> list[tuple[str, str]]:
    """Paper values recorded without the section and sentence they were read in (must be none)."""
    return [(r.label, field) for r in RECIPES for field, value in r.paper.items()
            if not isinstance(value, Unverified) and (r.label, field) not in PAPER_SOURCES]


def markdown() -> str:
    if unsourced_paper_values():
        raise ValueError(f"paper values with no PAPER_SOURCES entry: {unsourced_paper_values()}")
    head = (f"fairseq recipe: {FAIRSEQ}, the files each table names. paper: {PAPER}. lconv: the config now. "
            "**≠** marks a documented difference from the reference (fairseq's value, else the paper's); "
            "— means no value.")
    return "\n\n".join([head, *(recipe_markdown(r) for r in RECIPES)])


if __name__ == "__main__":
    from scripts import markdown_block

    markdown_block.main(__doc__.splitlines()[0], markdown, BEGIN, END)
