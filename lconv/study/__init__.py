"""The reproduction study (``python -m lconv.study``): every token mixer trained and scored on the same data, step
budget, data order and seeds, on three bundled DDTP tasks; the table, plots and the comparison with the paper written to
``docs/results.md``. Modules: ``plan``, ``run``, ``measure``, ``driver``, ``report``; the budgets are in
``configs/study.py``."""
from __future__ import annotations

import pathlib

RESULTS = "results"  # lconv/study/results: a link to docs/results in a clone, its tables shipped in the package


def results_file(name: str = "results.json") -> pathlib.Path:
    """A file of the study's committed results (``results.json``, ``results.csv``): docs/results in a clone, the
    copy shipped with the package otherwise, so an installed lconv (Colab) reads the same numbers."""
    return pathlib.Path(__file__).parent / RESULTS / name
