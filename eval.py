"""Evaluates a trained run with the config stored in its workdir.

    python eval.py --workdir=runs/default [--split=test] [--average_last=5 | --checkpoint=best]
                   [--beam_size=5 --lenpen=1.0]
    python eval.py --workdir=runs/default --source_file=F [--reference_file=R] --output_file=O

Writes hypotheses and a JSON of scores (sacreBLEU with its signature, ROUGE-1/2/L, or an LM's perplexity).
Bad flags, unreadable or non-UTF-8 input files and unwritable outputs are reported in one line (exit code 2)
before anything is loaded. A blank --source_file line gets an empty output line; blank and over-long lines are
counted in the log and in the scores.
"""
from absl import app, flags, logging

from lconv.cli import runtime

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A directory written by train.py.")
flags.DEFINE_string("split", "test", "Split of the run's dataset to score.")
flags.DEFINE_integer("average_last", 1, "Average the parameters of the last N >= 1 checkpoints.")
flags.DEFINE_enum("checkpoint", "latest", ["latest", "best"], "The latest checkpoint(s), or the best by validation.")
flags.DEFINE_integer("beam_size", None, "Beam size >= 1 (default: the stored config's).")
flags.DEFINE_float("lenpen", None, "Length penalty, finite and >= 0 (default: the stored config's).")
flags.DEFINE_string("source_file", None, "Translate/summarise this UTF-8 file, one example per line.")
flags.DEFINE_string("reference_file", None, "References for --source_file, one per line.")
flags.DEFINE_string("output_file", None, "Where --source_file's outputs go (default: <workdir>/output.txt).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    with runtime.user_errors():
        runtime.initialize()
        from lconv.cli import evaluate

        evaluate.run(FLAGS.workdir, split=FLAGS.split, average_last=FLAGS.average_last,
                     checkpoint=FLAGS.checkpoint, beam_size=FLAGS.beam_size,
                     lenpen=FLAGS.lenpen, source_file=FLAGS.source_file, reference_file=FLAGS.reference_file,
                     output_file=FLAGS.output_file)


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    app.run(main, flags_parser=runtime.parse_flags)
