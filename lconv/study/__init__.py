"""The reproduction study (``python -m lconv.study``): every token mixer trained and scored on the same data,
step budget, data order and seeds, on three bundled DDTP tasks; the table, plots and the comparison with the
paper written to ``docs/results.md`` from the numbers.

- ``plan``: the runs, what each mixer means per task, parameter counts matched by the FFN width;
- ``run``: one run in its own process (train, score the averaged checkpoints, measure), resumable;
- ``measure``: training tokens/s, train-step memory, peak RSS, LM decoding speed, per-word perplexity;
- ``driver``: tokenizers, plan, runs, report; ``report`` / ``plots``: results.md, results.json/csv, PNGs.

The budgets (``full``, ``quick``, ``gpu``) are in ``configs/study.py``.
"""
