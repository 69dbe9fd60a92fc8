"""What the command-line programs (``train.py``, ``eval.py``) do beyond parsing flags: process set-up,
one-line user errors, and eval.py's driver. The top layer: it may use every other part of lconv."""
