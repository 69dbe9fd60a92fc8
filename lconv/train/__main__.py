"""``python -m lconv.train --config=default --workdir=runs/default``: the training program (train.py from a clone
runs it too). Its flags and ``main``; the process set-up and one-line errors are the CLIs' (``lconv.cli``), the work
``lconv.train.loop``'s. It sits above both, so that the CLIs never import training."""
from __future__ import annotations

import sys

from absl import app, flags

from lconv import console
from lconv.cli import programs, runtime

FLAGS = flags.FLAGS


def train(argv: list[str] | None = None) -> None:
    """``train.py``: ``--config`` (a file, or a config packaged with lconv by name: ``default``,
    ``wmt_en_de:dynamic,big``, ...), ``--workdir``, ``--accept_config_changes``."""
    from ml_collections import config_flags

    flags.DEFINE_string("workdir", None, "Directory for checkpoints, the tokenizer, logs and outputs.")
    runtime.expand_flag_files()  # ml_collections reads the command line (and its flag files) as --config is defined
    config_flags.DEFINE_config_file(
        "config", None, "Config file, e.g. configs/default.py[:variant], or the name of a config packaged with "
        f"lconv ({', '.join(runtime.packaged_configs())}), e.g. default:transformer.", lock_config=True)
    flags.DEFINE_bool("accept_config_changes", False,
                      "Let a resumed run change config fields its checkpoints were trained with (model, data, "
                      "optim); without it such a change is an error.")
    programs.define_compilation_cache()
    programs.define_trust_plugins()  # for config.train.init_from: a run from elsewhere
    flags.mark_flags_as_required(["config", "workdir"])
    programs.run_program(_train_main, argv)


def _train_main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.show_log("stdout")
    with runtime.user_errors():
        runtime.initialize()
        runtime.enable_compilation_cache(FLAGS.workdir, FLAGS.compilation_cache)
        from lconv.run import restore
        from lconv.train import loop  # after the runtime is set up (multi-host initialisation)

        with restore.trusting_plugins(FLAGS.trust_plugins):
            result = loop.train_and_evaluate(FLAGS.config, FLAGS.workdir,
                                             accept_config_changes=FLAGS.accept_config_changes)
    runtime.print_summary(result)
    if result.get("stopped_by") == "SIGINT":
        sys.exit(130)  # the shell's code for Ctrl-C; the checkpoint is saved and the run resumes from it


if __name__ == "__main__":
    train()
