"""Parameter counts of every config and variant, from ``jax.eval_shape`` (nothing is allocated).

    PYTHONPATH=. python scripts/param_table.py                        # print the markdown table
    PYTHONPATH=. python scripts/param_table.py --write docs/models.md  # refresh the table in the docs

``--write`` replaces what stands between the ``<!-- param-table:begin -->`` and ``<!-- param-table:end -->``
lines, so the table in docs/models.md is generated, never hand-edited; tests/test_models.py checks rows of it
against fresh counts (tracing only, nothing allocated).
"""
from __future__ import annotations

import importlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402

from lconv.nn import mixers  # noqa: E402
from lconv.nn.model_config import ModelConfig  # noqa: E402
from lconv.run import model_setup, schema

BEGIN, END = "<!-- param-table:begin -->", "<!-- param-table:end -->"
FAIRSEQ_WMT_VOCAB = 32_768  # the joined 32K-BPE dictionary fairseq's WMT En-De models were counted with

PAPER_MIXERS = ("lightconv", "dynamic", "transformer")  # the models of the paper's tables
# Every registered mixer's variant word, in registry order; the LM and the default config take those that fit.
MIXER_WORDS, DECODER_WORDS = mixers.variant_words(), mixers.variant_words("decoder")
BOTH_SIDES_WORDS = mixers.variant_words(both_sides=True)

# (config, variant, vocabulary override) in table order; None = the config's own data.vocab_size.
ROWS = [
    ("wmt_en_de", "lightconv,big", FAIRSEQ_WMT_VOCAB),
    ("wmt_en_de", "dynamic,big", FAIRSEQ_WMT_VOCAB),
    ("wmt_en_de", "transformer,big", FAIRSEQ_WMT_VOCAB),
    *[("wmt_en_de", f"{m},{size}", None) for size in ("big", "base") for m in PAPER_MIXERS],
    *[("wmt_en_de", f"{m},big", None) for m in MIXER_WORDS if m not in PAPER_MIXERS],
    *[(name, f"{m},big", None) for name in ("wmt_en_fr", "wmt_zh_en") for m in PAPER_MIXERS],
    *[("iwslt14_de_en", m, None) for m in MIXER_WORDS],
    *[("lm1b", m, None) for m in DECODER_WORDS],
    ("lm1b", "dynamic,adaptive", None),
    *[("lm1b", f"{m},ddtp", None) for m in ("dynamic", "transformer", "knn")],
    *[("cnn_dailymail", m, None) for m in ("lightconv", "dynamic", "transformer", "dynamic,ddtp")],
    *[("default", m, None) for m in ["", *(w for w in BOTH_SIDES_WORDS if w != "dynamic")]],
]
# Wu et al. (2019), Table 1 (WMT En-De big, shared 32K BPE vocabulary).
PAPER = {("wmt_en_de", "lightconv,big", FAIRSEQ_WMT_VOCAB): "202M",
         ("wmt_en_de", "dynamic,big", FAIRSEQ_WMT_VOCAB): "213M"}


def get_config(name: str, variant: str):
    return importlib.import_module(f"lconv.configs.{name}").get_config(variant or None)


def count_parameters(config, vocab_size: int | None = None) -> int:
    """Parameters of the model ``config`` builds (the training init's inputs), counted abstractly."""
    config = schema.validate_config(config)
    model = model_setup.build_model(config, vocab_size=vocab_size or config.data.vocab_size)
    args, kwargs = model_setup.model_inputs(model_setup.dummy_batch(config))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    return model_setup.count_params(shapes["params"])


def label(name: str, variant: str) -> str:
    return f"{name}:{variant}" if variant else name


def table_rows():
    """Markdown rows, one per ROWS entry."""
    for name, variant, vocab in ROWS:
        c = get_config(name, variant)
        m, n = c.model, count_parameters(c, vocab)
        mixers = m.decoder_mixer if c.task == "lm" else f"{m.encoder_mixer} / {m.decoder_mixer}"
        layers = f"{m.decoder_layers}" if c.task == "lm" else f"{m.encoder_layers} / {m.decoder_layers}"
        vocab_note = f"{vocab or c.data.vocab_size:,}" + (" (fairseq's)" if vocab else "")
        sides = ModelConfig.from_config(m, vocab_size=vocab or c.data.vocab_size)
        widths = " / ".join(_per_side(sides.per_side(f, c.task == "lm")) for f in ("d_model", "ffn_dim", "num_heads"))
        yield (f"| `{label(name, variant)}` | {vocab_note} | {layers} | {mixers} | "
               f"{widths} | {n:,} ({n / 1e6:.1f}M) | "
               f"{PAPER.get((name, variant, vocab), '')} |")


def _per_side(value) -> str:
    """One value, or ``encoder+decoder`` where the config sets the sides apart."""
    return "+".join(map(str, value)) if isinstance(value, tuple) else str(value)


def markdown_table() -> str:
    head = ("| config:variant | vocabulary | layers (enc / dec) | mixers (enc / dec) | d / FFN / heads | parameters "
            "| paper |\n|---|---|---|---|---|---|---|")
    return "\n".join([head, *table_rows()])


def parse_table(text: str) -> dict[tuple[str, int, bool], int]:
    """``{(label, vocabulary, fairseq_vocab): parameters}`` from a table written by ``markdown_table``."""
    out = {}
    for row in re.finditer(r"^\| `([^`]+)` \| ([\d,]+)( \(fairseq's\))? \|.*\| ([\d,]+) \(", text, re.M):
        out[row[1], int(row[2].replace(",", "")), bool(row[3])] = int(row[4].replace(",", ""))
    return out


if __name__ == "__main__":
    from scripts import markdown_block

    markdown_block.main(__doc__.splitlines()[0], markdown_table, BEGIN, END)
