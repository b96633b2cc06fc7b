"""miniTE kernels, installed as ``minite_kernels``.

``minite_kernels.triton``: Triton kernels for any CUDA GPU (exact NVFP4 emulation on Hopper).
``minite_kernels.cute``: CUTLASS Python DSL (CuTe DSL) kernels for Blackwell FP4 tensor cores.
Every kernel equals the pure-torch contract in :mod:`minite_megatron.nvfp4`.
"""
