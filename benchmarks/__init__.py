"""GPU benchmark scripts (``python -m benchmarks.<name>``); results in ``benchmarks/results/``."""
