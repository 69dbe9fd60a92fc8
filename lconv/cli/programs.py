"""The program behind ``eval.py`` (``python -m lconv.evaluate`` from an installed package): its flags and ``main``;
and what every program shares (``run_program``, the compilation cache's flag). The training program is
``lconv.train.program``, above training. Flags are defined when a program starts (not on import), so one process
may import several programs."""
from __future__ import annotations

import sys
from collections.abc import Callable

from absl import app, flags, logging

from lconv import console
from lconv.cli import runtime

FLAGS = flags.FLAGS


def define_compilation_cache() -> None:
    flags.DEFINE_string("compilation_cache", None, "Where compiled XLA programs are kept for later runs (default: "
                        "$JAX_COMPILATION_CACHE_DIR if set, else lconv/compilation_cache in this user's "
                        "$XDG_CACHE_HOME or ~/.cache, never the workdir's: an entry is code); 'none' compiles every "
                        "time.")


def define_trust_plugins() -> None:
    flags.DEFINE_bool("trust_plugins", False, "Import the plugin mixers ('module:Class') a stored config names, "
                      "running their code: only for runs whose source you trust.")


def evaluate(argv: list[str] | None = None) -> None:
    """``eval.py``: scores a split, decodes a file (translations, or an LM's continuations of prompts), or
    decodes stdin line by line (``--interactive``)."""
    flags.DEFINE_string("workdir", None, "A directory written by train.py.")
    flags.DEFINE_string("ensemble", None, "More runs' workdirs, comma-separated, decoding together with --workdir's "
                        "(fairseq-generate's --path a.pt:b.pt: the mean of their next-token probabilities); same task "
                        "and tokenizer; outputs go to --workdir as <split>.ensemble.hyp.txt / .scores.json (naming the "
                        "members) or output.ensemble.txt.")
    flags.DEFINE_string("split", "test", "Split of the run's dataset to score.")
    flags.DEFINE_integer("average_last", 1, "Average the parameters of the last N >= 1 checkpoints.")
    flags.DEFINE_enum("checkpoint", "latest", ["latest", "best"],
                      "The latest checkpoint(s), or the best by validation.")
    flags.DEFINE_integer("beam_size", None, "Beam size >= 1 (default: the stored config's). Translation runs.")
    flags.DEFINE_float("lenpen", None, "Length penalty, in [0, 10] (default: the stored config's).")
    flags.DEFINE_string("source_file", None, "Decode this UTF-8 file, one example per line: sources to "
                        "translate/summarise, or an LM's prompts.")
    flags.DEFINE_string("reference_file", None, "References for --source_file, one per line.")
    flags.DEFINE_string("output_file", None, "Where --source_file's outputs go (default: <workdir>/output.txt; "
                        "'-' or /dev/stdout: printed, the log on stderr).")
    flags.DEFINE_bool("interactive", False, "Read lines from stdin and print each one's output as it is decoded.")
    flags.DEFINE_integer("nbest", None, "Translation runs with --source_file or --interactive: the k best hypotheses "
                         "(or k samples) per source, k <= the beam size, written as fairseq-generate's H-<i> (score, "
                         "text) and P-<i> (token log-probabilities) lines.")
    flags.DEFINE_integer("max_len", None, "LM runs: new tokens per prompt (default 50).")
    flags.DEFINE_float("temperature", None, "Sampling temperature, 0 or in [1e-6, 1e6] (default 0: greedy for an "
                       "LM, beam search for a translation run); with --source_file or --interactive.")
    flags.DEFINE_integer("top_k", None, "Sample from the k most likely tokens (default 0: all).")
    flags.DEFINE_float("top_p", None, "Nucleus sampling, in [1e-6, 1] (default 1: off).")
    flags.DEFINE_integer("seed", None, "The sampling seed (default 0).")
    flags.DEFINE_integer("no_repeat_ngram_size", None, "No n-gram of this size twice in an output, its prefix or "
                         "prompt included (fairseq's --no-repeat-ngram-size; 0 = off; default: the stored config's).")
    flags.DEFINE_integer("min_len", None, "No EOS before this many output tokens (fairseq's --min-len; an LM's "
                         "continuation; 0 = off; default: the stored config's).")
    flags.DEFINE_string("data_dir", None, "Where a split's data is read, and prepared if it is not there (default: "
                        "the run's config.data.data_dir, read only if its copy is there already).")
    define_compilation_cache()
    define_trust_plugins()
    flags.mark_flags_as_required(["workdir"])
    run_program(_evaluate_main, argv)


def _evaluate_main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    printed = FLAGS.interactive or FLAGS.output_file in console.STDOUT_NAMES
    console.show_log("stderr" if printed else "stdout")  # then stdout holds the outputs only
    with runtime.user_errors():
        runtime.initialize()
        runtime.enable_compilation_cache(FLAGS.workdir, FLAGS.compilation_cache)
        from lconv.cli import eval_program
        from lconv.run import restore

        names = ("split", "average_last", "checkpoint", "beam_size", "lenpen", "source_file", "reference_file",
                 "output_file", "interactive", "nbest", "max_len", "temperature", "top_k", "top_p", "seed",
                 "no_repeat_ngram_size", "min_len", "ensemble", "data_dir")
        with restore.trusting_plugins(FLAGS.trust_plugins):
            eval_program.run(FLAGS.workdir, **{name: FLAGS[name].value for name in names})


def run_program(main: Callable[[list[str]], None], argv: list[str] | None) -> None:
    """Runs a program's ``main`` under absl with its flags listed by ``--help`` and lconv's flag parser."""
    for name in ("workdir", "config", "accept_config_changes", "compilation_cache", "split", "average_last",
                 "checkpoint", "beam_size", "lenpen", "source_file", "reference_file", "output_file", "interactive",
                 "nbest", "max_len", "temperature", "top_k", "top_p", "seed", "no_repeat_ngram_size", "min_len",
                 "trust_plugins", "ensemble", "data_dir"):
        if name in FLAGS:  # --help lists the flags of the program's main module: these are the program's own
            FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])
    logging.set_verbosity(logging.WARNING)
    app.run(main, argv=argv, flags_parser=runtime.parse_flags)
