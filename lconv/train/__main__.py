"""``python -m lconv.train --config=default --workdir=runs/default``: train.py from an installed package."""
from lconv.cli import programs

if __name__ == "__main__":
    programs.train()
