"""``python -m lconv.study --config=configs/study.py[:quick|:gpu] --output_dir=DIR [--docs_dir=docs]
[--resume_from=docs]``.

Kept thin: flags and one-line errors here (``lconv.cli.runtime``), the work in ``lconv.study.driver``.
"""
import os
import shlex
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from lconv import console
from lconv.cli import runtime

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "The study config, e.g. configs/study.py[:quick|:gpu].",
                                lock_config=True)
flags.DEFINE_string("output_dir", None, "Where each run's workdir, the tokenizers and records.json go.")
flags.DEFINE_string("docs_dir", "docs", "Where results.md and results/ (plots, results.json, results.csv) go.")
flags.DEFINE_bool("report_only", False, "Write the report from the runs already in --output_dir; train nothing.")
flags.DEFINE_string("resume_from", None, "A study's docs dir (e.g. docs): its archived finished runs "
                    "(results/runs/) are copied into --output_dir instead of trained again; their configs must "
                    "equal the plan's.")
flags.mark_flags_as_required(["config", "output_dir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.show_log("stdout")  # the study's progress, a line per run
    with runtime.user_errors():
        from lconv.errors import UserError
        from lconv.study import driver

        for flag in ("output_dir", "docs_dir"):
            path = os.path.abspath(os.path.expanduser(getattr(FLAGS, flag)))
            if os.path.exists(path) and not os.path.isdir(path):
                raise UserError(f"--{flag}={getattr(FLAGS, flag)} is a file; it must be a directory")
        command = "python -m lconv.study " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        records = driver.run_study(FLAGS.config, FLAGS.output_dir, FLAGS.docs_dir, report_only=FLAGS.report_only,
                                   resume_from=FLAGS.resume_from, command=command)
    failed = sum(r["status"] == "failed" for r in records)
    print(f"{len(records)} runs: {sum(r['status'] == 'ok' for r in records)} ok, {failed} failed, "
          f"{sum(r['status'] == 'n/a' for r in records)} n/a; report in {FLAGS.docs_dir}/results.md")


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    app.run(main, flags_parser=runtime.parse_flags)
