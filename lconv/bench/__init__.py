"""Benchmarks (not tests): ``python -m lconv.bench <suite>``; results in docs/benchmarks.md and docs/bench/.

Layers: ``timing`` (measuring, machine limits, cost formulas) and ``report`` (CSV, markdown, plots) at the
bottom; one module per suite above them (``mixers``, ``limits``, ``decode``, ``train``); ``__main__`` parses the
command line.
"""
