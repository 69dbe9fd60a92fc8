"""The fairseq parity matrix: each case is a tiny fairseq 0.12.2 model given by fairseq's own command-line flags
(``scripts/make_fairseq_parity.py`` builds, saves and runs them; docs/fairseq.md shows the results).

A case is ``name -> Case``: the task (``translation`` or ``language_modeling``), the flags over its family's base
flags, whether the translation dictionaries are joined (one ``dict.txt``) or separate (``dict.src.txt`` /
``dict.tgt.txt``), and which embeddings are shared. ``covers`` says which flag (or pair of flags) the case is
there for. Names: ``lc_`` lightconv, ``tf_`` transformer, ``lclm_`` lightconv_lm, ``tflm_`` transformer_lm;
``side_``: one per-side setting differs between encoder and decoder, everything else is the family's baseline.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Case:
    task: str  # "translation" or "language_modeling"
    flags: tuple[str, ...]  # over the family's base flags (a later flag overrides an earlier one in argparse)
    covers: str  # the flag, or pair of flags, this case is there for
    joined: bool = True  # translation: one dictionary for both sides
    share: str = "all"  # embeddings shared: "all" (translation only), "decoder" (input/output), "none"


def _f(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Every translation model: 2+2 layers, d=12, FFN 20 (unlike sizes make layout bugs visible), small position limits.
_TRANSLATION = _f("--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 12 --decoder-embed-dim 12 "
                  "--encoder-ffn-embed-dim 20 --decoder-ffn-embed-dim 20 --encoder-attention-heads 4 "
                  "--decoder-attention-heads 4 --max-source-positions 64 --max-target-positions 64 --dropout 0.1")
LIGHTCONV = ("--arch", "lightconv") + _TRANSLATION + _f(
    "--encoder-kernel-size-list [3,5] --decoder-kernel-size-list [3,5] --encoder-conv-type dynamic "
    "--decoder-conv-type dynamic --encoder-glu True --decoder-glu True "
    "--weight-softmax True --weight-dropout 0.1")
TRANSFORMER = ("--arch", "transformer") + _TRANSLATION
_LM = _f("--decoder-layers 2 --decoder-embed-dim 24 --decoder-ffn-embed-dim 36 --decoder-attention-heads 4 "
         "--tokens-per-sample 64 --sample-break-mode eos --dropout 0.1")
LIGHTCONV_LM = ("--arch", "lightconv_lm") + _LM + _f(
    "--decoder-kernel-size-list [3,5] --decoder-conv-type dynamic --decoder-glu True --weight-softmax True")
# transformer_lm's dataclass defaults decoder_input_dim and decoder_output_dim to 512 whatever the embed dim (its
# arch function only fills them when absent): without these two flags a d=24 model embeds at 512 and projects.
TRANSFORMER_LM = ("--arch", "transformer_lm") + _LM + _f("--decoder-input-dim 24 --decoder-output-dim 24")
BASES = {"lc": LIGHTCONV, "tf": TRANSFORMER, "lclm": LIGHTCONV_LM, "tflm": TRANSFORMER_LM}

_T, _L = "translation", "language_modeling"
# adaptive softmax / input over the 56-entry LM dictionary: cutoffs below the vocabulary size
_ADAPTIVE_SOFTMAX = "--adaptive-softmax-cutoff 20,36 --adaptive-softmax-factor 3"
_ADAPTIVE_INPUT = "--adaptive-input --adaptive-input-cutoff 20,36 " \
                  "--adaptive-input-factor 2"
_ADAPTIVE_TIED = ("--adaptive-input --adaptive-input-cutoff 20,36 "
                  "--adaptive-softmax-cutoff 20,36 --adaptive-input-factor 2 --adaptive-softmax-factor 2 "
                  "--tie-adaptive-weights")
_IO_DIMS = "--decoder-input-dim 16 --decoder-output-dim 20"

CASES: dict[str, Case] = {
    # --- lightconv translation ---------------------------------------------------------------------------
    "lc_base": Case(_T, (), "baseline: dynamic conv, GLU, post-norm, sinusoidal positions, shared embeddings"),
    "lc_lightweight": Case(_T, _f("--encoder-conv-type lightweight --decoder-conv-type lightweight"),
                           "conv type lightweight (× GLU on)"),
    "lc_dynamic_noglu": Case(_T, _f("--encoder-glu False --decoder-glu False"), "GLU off × dynamic"),
    "lc_lightweight_noglu": Case(_T, _f("--encoder-conv-type lightweight --decoder-conv-type lightweight "
                                        "--encoder-glu False --decoder-glu False"), "GLU off × lightweight"),
    "lc_prenorm": Case(_T, _f("--encoder-normalize-before --decoder-normalize-before"), "pre-norm × sinusoidal"),
    "lc_learned_pos": Case(_T, _f("--encoder-learned-pos --decoder-learned-pos"), "learned positions × post-norm"),
    "lc_prenorm_learned_pos": Case(_T, _f("--encoder-normalize-before --decoder-normalize-before "
                                          "--encoder-learned-pos --decoder-learned-pos"), "pre-norm × learned"),
    "lc_share_decoder_io": Case(_T, (), "share_decoder_input_output_embed (not share_all)",
                                share="decoder"),
    "lc_unshared": Case(_T, (), "no shared embeddings", share="none"),
    "lc_conv_dim": Case(_T, _f("--encoder-conv-dim 8 --decoder-conv-dim 8"), "conv_dim != embed_dim (both)"),
    "lc_nonjoined": Case(_T, (), "separate source and target dictionaries", joined=False, share="none"),
    "lc_side_ffn": Case(_T, _f("--decoder-ffn-embed-dim 32"), "per side: ffn_embed_dim"),
    "lc_side_heads": Case(_T, _f("--decoder-attention-heads 2"), "per side: attention_heads"),
    "lc_side_normalize_before": Case(_T, _f("--encoder-normalize-before"), "per side: normalize_before"),
    "lc_side_learned_pos": Case(_T, _f("--decoder-learned-pos"), "per side: learned_pos"),
    "lc_side_glu": Case(_T, _f("--decoder-glu False"), "per side: glu"),
    "lc_side_conv_dim": Case(_T, _f("--encoder-conv-dim 8"), "per side: conv_dim"),
    "lc_side_conv_type": Case(_T, _f("--decoder-conv-type lightweight"), "per side: conv_type"),
    "lc_side_kernels": Case(_T, _f("--encoder-kernel-size-list [7,3] --decoder-kernel-size-list [2,6]"),
                            "per side: kernel_size_list (even decoder kernels, K longer than early prefixes)"),
    # lightconv's decoder attends to the encoder without kdim/vdim: fairseq's lightconv cannot run with
    # encoder_embed_dim != decoder_embed_dim, so that per-side flag is covered by the transformer only.
    # --- transformer translation -------------------------------------------------------------------------
    "tf_base": Case(_T, (), "baseline: ReLU, post-norm, sinusoidal positions, shared embeddings"),
    "tf_prenorm_learned_pos": Case(_T, _f("--encoder-normalize-before --decoder-normalize-before "
                                          "--encoder-learned-pos --decoder-learned-pos"), "pre-norm × learned"),
    "tf_gelu": Case(_T, _f("--activation-fn gelu"), "activation_fn=gelu"),
    "tf_layernorm_embedding": Case(_T, _f("--layernorm-embedding"), "layernorm_embedding"),
    "tf_decoder_output_dim": Case(_T, _f("--decoder-output-dim 8"),
                                  "decoder_output_dim != decoder_embed_dim (project_out_dim)", share="none"),
    "tf_no_positions": Case(_T, _f("--no-token-positional-embeddings"), "no_token_positional_embeddings"),
    "tf_no_scale_embedding": Case(_T, _f("--no-scale-embedding"), "no_scale_embedding"),
    "tf_unshared": Case(_T, (), "no shared embeddings", share="none"),
    "tf_nonjoined": Case(_T, (), "separate dictionaries, decoder input/output tied", joined=False,
                         share="decoder"),
    "tf_side_embed_dim": Case(_T, _f("--encoder-embed-dim 20"), "per side: embed_dim", share="decoder"),
    "tf_side_ffn": Case(_T, _f("--encoder-ffn-embed-dim 32"), "per side: ffn_embed_dim"),
    "tf_side_heads": Case(_T, _f("--encoder-attention-heads 2"), "per side: attention_heads"),
    "tf_side_normalize_before": Case(_T, _f("--decoder-normalize-before"), "per side: normalize_before"),
    "tf_side_learned_pos": Case(_T, _f("--encoder-learned-pos"), "per side: learned_pos"),
    # --- language models ---------------------------------------------------------------------------------
    "lclm_base": Case(_L, (), "lightconv_lm, tied input/output embedding", share="decoder"),
    "lclm_adaptive_softmax": Case(_L, _f(_ADAPTIVE_SOFTMAX), "adaptive softmax (factor 3)", share="none"),
    "lclm_adaptive_input": Case(_L, _f(_ADAPTIVE_INPUT), "adaptive input (factor 2), plain output", share="none"),
    "lclm_adaptive_tied": Case(_L, _f(_ADAPTIVE_TIED), "adaptive input × softmax, tie_adaptive_weights", share="none"),
    "lclm_adaptive_tied_proj": Case(_L, _f(_ADAPTIVE_TIED + " --tie-adaptive-proj"),
                                    "adaptive input × softmax, tie_adaptive_weights + tie_adaptive_proj", share="none"),
    "lclm_io_dims": Case(_L, _f(_IO_DIMS), "decoder_input_dim / decoder_output_dim != embed_dim", share="none"),
    "lclm_no_positions": Case(_L, _f("--no-token-positional-embeddings"), "no_token_positional_embeddings",
                              share="decoder"),
    "tflm_base": Case(_L, (), "transformer_lm, tied input/output embedding", share="decoder"),
    "tflm_adaptive_softmax": Case(_L, _f(_ADAPTIVE_SOFTMAX), "adaptive softmax (factor 3)", share="none"),
    "tflm_adaptive_input": Case(_L, _f(_ADAPTIVE_INPUT), "adaptive input (factor 2), plain output", share="none"),
    "tflm_adaptive_tied": Case(_L, _f(_ADAPTIVE_TIED), "adaptive input × softmax, tie_adaptive_weights", share="none"),
    "tflm_adaptive_tied_proj": Case(_L, _f(_ADAPTIVE_TIED + " --tie-adaptive-proj"),
                                    "adaptive input × softmax, tie_adaptive_weights + tie_adaptive_proj", share="none"),
    "tflm_io_dims": Case(_L, _f(_IO_DIMS), "decoder_input_dim / decoder_output_dim != embed_dim", share="none"),
    "tflm_no_positions": Case(_L, _f("--no-token-positional-embeddings"), "no_token_positional_embeddings",
                              share="decoder"),
    # transformer_lm only: fairseq's LightConvDecoder has no embedding norm and a ReLU FFN whatever
    # --activation-fn says (lightconv_lm takes neither flag)
    "tflm_layernorm_embedding": Case(_L, _f("--layernorm-embedding"), "layernorm_embedding", share="decoder"),
    "tflm_gelu": Case(_L, _f("--activation-fn gelu"), "activation_fn=gelu", share="decoder"),
    "tflm_gelu_accurate": Case(_L, _f("--activation-fn gelu_accurate"), "activation_fn=gelu_accurate (tanh)",
                               share="decoder"),
}


def flags(name: str) -> tuple[str, ...]:
    """The case's full flag list: its family's base flags, then its own."""
    case = CASES[name]
    share = {"all": _f("--share-all-embeddings"), "decoder": _f("--share-decoder-input-output-embed"), "none": ()}
    return BASES[name.split("_")[0]] + share[case.share] + case.flags
