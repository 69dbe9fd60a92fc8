"""``python -m lconv.import_fairseq --checkpoint=model.pt --dict=dict.txt --spm=spm.model --workdir=runs/x``:
a fairseq translation or language model checkpoint as an lconv workdir (``lconv.interop.fairseq_workdir``;
docs/fairseq.md)."""
from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from absl import app, flags, logging

    from lconv import console
    from lconv.cli import runtime
    from lconv.interop import fairseq_workdir
    from lconv.run import compilation_cache

    flags.DEFINE_string("checkpoint", None, "fairseq checkpoint (.pt) of a lightconv* or transformer* translation "
                        "model, or a lightconv_lm* or transformer_lm* language model.")
    flags.DEFINE_string("dict", None, "The dictionary it was trained with (dict.txt; the source side's when the "
                        "model has separate dictionaries).")
    flags.DEFINE_string("target_dict", "", "The target side's dictionary, for a model trained without "
                        "--joined-dictionary: lconv's one vocabulary is then the target's symbols, then the source's "
                        "others, and the decoder predicts only the target's.")
    flags.DEFINE_string("spm", None, "The SentencePiece model whose pieces the dictionary lists. Without it, "
                        "text is given already split into the dictionary's pieces (Moses + BPE).")
    flags.DEFINE_string("bpe_continuation", "@@", "Without --spm: the marker of a piece continued by the next "
                        "(subword-nmt's @@), removed when decoding as fairseq's --remove-bpe.")
    flags.DEFINE_string("workdir", None, "The lconv workdir to write (new, or without checkpoints).")
    flags.DEFINE_string("dataset", "", "config.data.dataset of the workdir (what eval.py scores without "
                        "--source_file), e.g. wmt14/en_de.")
    defaults = fairseq_workdir.GENERATE_DEFAULTS  # fairseq-generate's; a language model's import reads none
    flags.DEFINE_integer("beam_size", defaults["beam_size"], "config.decode.beam_size (fairseq --beam).")
    flags.DEFINE_float("lenpen", defaults["lenpen"], "config.decode.lenpen (fairseq --lenpen).")
    flags.DEFINE_float("max_len_a", defaults["max_len_a"], "config.decode.max_len_a (fairseq --max-len-a).")
    flags.DEFINE_integer("max_len_b", defaults["max_len_b"], "config.decode.max_len_b (fairseq --max-len-b).")
    flags.DEFINE_bool("compound_split", False, "config.decode.compound_split: eval.py's tokenized BLEU splits "
                      "hyphenated compounds, as the paper's WMT En-De BLEU.")
    flags.DEFINE_bool("trust_checkpoint", False, "Unpickle any object the file holds (only for files you trust); "
                      "without it only tensors, containers and argparse.Namespace are read.")
    flags.mark_flags_as_required(["checkpoint", "dict", "workdir"])
    F = flags.FLAGS

    def run(args: list[str]) -> None:
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments: {args[1:]}")
        with runtime.user_errors():
            runtime.check_backend()
            compilation_cache.use_user_folder()  # an entry is code: never from a folder another user could fill
            decode = {name: F[name].value for name in (*defaults, "compound_split")}
            fairseq_workdir.import_checkpoint(F.checkpoint, F.dict, F.spm, F.workdir, dataset=F.dataset, decode=decode,
                                              continuation=F.bpe_continuation,
                                              target_dictionary=F.target_dict, trust=F.trust_checkpoint)

    logging.set_verbosity(logging.WARNING)  # orbax's info lines
    console.show_log("stdout")
    app.run(run, argv=argv, flags_parser=runtime.parse_flags)


if __name__ == "__main__":
    main()
