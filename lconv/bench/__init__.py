"""Benchmarks (not tests): ``python -m lconv.bench <suite>``; results in docs/benchmarks.md and docs/bench/."""
