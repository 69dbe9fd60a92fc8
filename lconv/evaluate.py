"""``python -m lconv.evaluate --workdir=runs/default``: eval.py from an installed package (see eval.py)."""
from lconv.cli import programs

if __name__ == "__main__":
    programs.evaluate()
