"""Triton NVFP4 kernels (any CUDA GPU; run on CPU under TRITON_INTERPRET=1 for tests)."""
