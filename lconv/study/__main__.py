"""``python -m lconv.study --config=configs/study.py[:quick|:gpu] --output_dir=DIR [--docs_dir=docs]
[--resume_from=docs]``.

Kept thin: flags and one-line errors here (``lconv.cli.runtime``), the work in ``lconv.study.driver``.
"""
import shlex
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from lconv import console
from lconv.cli import runtime
from lconv.run import host_memory

FLAGS = flags.FLAGS
runtime.expand_flag_files()  # ml_collections reads the command line (and its flag files) as --config is defined
config_flags.DEFINE_config_file("config", None, "The study config, e.g. configs/study.py[:quick|:gpu].",
                                lock_config=True)
flags.DEFINE_string("output_dir", None, "Where each run's workdir, the tokenizers and records.json go.")
flags.DEFINE_string("docs_dir", "docs", "Where results.md and results/ (plots, results.json, results.csv) go.")
flags.DEFINE_bool("report_only", False, "Write the report from the runs already in --output_dir; train nothing.")
flags.DEFINE_string("resume_from", None, "A study's docs dir (e.g. docs): its archived finished runs "
                    "(results/runs/) are copied into --output_dir instead of trained again; their configs must "
                    "equal the plan's.")
flags.DEFINE_bool("speed", False, "First measure the speed table: every mixer's train and decode speed at the "
                  "study's sizes, side by side in this one process (run it on an idle host); with --report_only, "
                  "that and the report only.")
flags.DEFINE_list("retrain", [], "Runs of the --resume_from archive to train again, e.g. lm/transformer/seed0: only "
                  "these are trained, and each figure is set against the archived one and its seeds' spread "
                  "(<output_dir>/retrained.json); the report goes to a --docs_dir other than the archive's.")
flags.mark_flags_as_required(["config", "output_dir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.show_log("stdout")  # the study's progress, a line per run
    with runtime.user_errors():
        host_memory.reuse_freed_memory()  # before the speed table's models bring up the backend
        from lconv import outputs
        from lconv.study import driver

        # Each folder new, empty or a study's; the committed docs/ only by --docs_dir's default (lconv.outputs).
        outputs.claim_directory(FLAGS.output_dir, "study", "--output_dir")
        docs_default = FLAGS.docs_dir if not FLAGS["docs_dir"].present else None
        outputs.claim_directory(FLAGS.docs_dir, "study", "--docs_dir", committed_ok=docs_default)
        for flag, folder in (("--output_dir", FLAGS.output_dir), ("--docs_dir", FLAGS.docs_dir)):
            outputs.refuse_links_within(folder, flag)  # the study writes and reads everything below them by name
        command = "python -m lconv.study " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        records = driver.run_study(FLAGS.config, FLAGS.output_dir, FLAGS.docs_dir, report_only=FLAGS.report_only,
                                   resume_from=FLAGS.resume_from, command=command, measure_speed=FLAGS.speed,
                                   retrain_runs=FLAGS.retrain)
    failed = sum(r["status"] == "failed" for r in records)
    print(f"{len(records)} runs: {sum(r['status'] == 'ok' for r in records)} ok, {failed} failed, "
          f"{sum(r['status'] == 'n/a' for r in records)} n/a; report in {FLAGS.docs_dir}/results.md")


def _parse_flags(argv: list[str]) -> list[str]:
    from lconv.study import plan

    return runtime.parse_flags(plan.quote_word_lists(argv))


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    app.run(main, flags_parser=_parse_flags)
