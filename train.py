"""Trains (and then evaluates) a model: ``python train.py --config=configs/default.py --workdir=runs/default``.

Kept short on purpose: the flags are in ``lconv.cli.programs``, everything else in ``lconv.train`` (``setup``
builds the run, ``loop`` trains it). Re-running the same command resumes from the latest checkpoint in
``--workdir``. Override any config field: ``--config.model.dropout=0.2``. From an installed package the same
program is ``python -m lconv.train --config=default ...`` (a config file, or a packaged config by name).
"""
from lconv.cli import programs

if __name__ == "__main__":
    programs.train()
