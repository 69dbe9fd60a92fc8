"""Trains (and then evaluates) a model: ``python train.py --config=configs/default.py --workdir=runs/default``.

Kept short on purpose: everything lives in ``lconv.train`` (``setup`` builds the run, ``loop`` trains it).
Re-running the same command resumes from the latest checkpoint in ``--workdir``. Override any config field:
``--config.model.dropout=0.2``.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from lconv.cli import runtime

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints, the tokenizer, logs and outputs.")
config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/default.py[:variant].",
                                lock_config=True)
flags.DEFINE_bool("accept_config_changes", False,
                  "Let a resumed run change config fields its checkpoints were trained with (model, data, optim); "
                  "without it such a change is an error.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    with runtime.user_errors():
        runtime.initialize()
        from lconv.train import loop  # after the runtime is set up (multi-host initialisation)

        result = loop.train_and_evaluate(FLAGS.config, FLAGS.workdir,
                                         accept_config_changes=FLAGS.accept_config_changes)
    runtime.print_summary(result)
    if result.get("stopped_by") == "SIGINT":
        sys.exit(130)  # the shell's code for Ctrl-C; the checkpoint is saved and the run resumes from it


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    app.run(main, flags_parser=runtime.parse_flags)
