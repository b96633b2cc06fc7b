"""miniTE kernels, installed as ``minite_kernels``.

``minite_kernels.triton``: Triton kernels for any CUDA GPU (exact NVFP4 emulation on Hopper).
``minite_kernels.cute``: CUTLASS Python DSL (CuTe DSL) kernels for Blackwell FP4 tensor cores.
Every kernel equals the pure-torch contract in :mod:`minite_megatron.nvfp4`.
Every op is a ``torch.library`` custom op registered through :func:`.custom_op.custom_op`
(eager calls skip the dispatcher round trip; compiling and dispatch modes see the op).
"""
