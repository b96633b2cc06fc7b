"""Autograd functions: one per GEMM family (dense linear, grouped expert linear), fprop/dgrad/wgrad in NVFP4."""
