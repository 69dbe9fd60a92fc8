"""``python eval.py``: from a clone, the program an installed package runs as ``python -m lconv.evaluate``. Its usage
(what ``--help`` prints) is lconv/evaluate.py's docstring, with this file's name."""
from lconv import evaluate
from lconv.cli import programs

__doc__ = evaluate.__doc__.replace("    python -m lconv.evaluate", "    python eval.py")  # what --help prints

if __name__ == "__main__":
    programs.evaluate()
