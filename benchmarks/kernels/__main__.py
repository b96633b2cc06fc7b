"""``python -m benchmarks.kernels``: see :mod:`benchmarks.kernels`."""

from benchmarks.kernels import main

main()
