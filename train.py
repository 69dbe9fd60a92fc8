"""Trains (and then evaluates) a model: ``python train.py --config=configs/default.py --workdir=runs/default``.

Kept short on purpose: the flags are in ``lconv.train.__main__``, everything else in ``lconv.train`` (``setup``
builds the run, ``loop`` trains it). Re-running the same command resumes from the latest checkpoint in
``--workdir``. Override any config field: ``--config.model.dropout=0.2``. From an installed package the same
program is ``python -m lconv.train --config=default ...`` (a config file, or a packaged config by name).
"""
from lconv.train import __main__ as train_program

if __name__ == "__main__":
    train_program.train()
