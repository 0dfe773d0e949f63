"""Benchmarks; run each from the repository root as a module, e.g. `python -m bench.bench_step`."""
