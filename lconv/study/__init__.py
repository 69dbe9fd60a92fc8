"""The reproduction study (``python -m lconv.study``): every token mixer trained and scored on the same data,
step budget, data order and seeds, on three bundled DDTP tasks; the table, plots and the comparison with the
paper written to ``docs/results.md`` from the numbers.

- ``plan``: the runs, what each mixer means per task, parameter counts matched by the FFN width;
- ``run``: one run in its own process (train, score the averaged checkpoints, measure), resumable;
- ``measure``: training tokens/s, train-step memory, peak RSS, LM decoding speed, per-word perplexity;
- ``driver``: tokenizers, plan, runs, report; ``report`` / ``plots``: results.md, results.json/csv, PNGs.

The budgets (``full``, ``quick``, ``gpu``) are in ``configs/study.py``.
"""
from __future__ import annotations

import pathlib

RESULTS = "results"  # lconv/study/results: a link to docs/results in a clone, its tables shipped in the package


def results_file(name: str = "results.json") -> pathlib.Path:
    """A file of the study's committed results (``results.json``, ``results.csv``): docs/results in a clone, the
    copy shipped with the package otherwise, so an installed lconv (Colab) reads the same numbers."""
    return pathlib.Path(__file__).parent / RESULTS / name
