"""NVFP4 kernels of the learner: quantize, the bf16 image, GEMMs and their fused producers.

Ops (each a ``minite::`` custom op equal to its reference in :mod:`minite_megatron.nvfp4`):
:mod:`.quantize` (with :mod:`.quantize_rows`, :mod:`.quantize_cols` and their launch tiles
:mod:`.quantize_tiles`), :mod:`.amax`, :mod:`.image`, :mod:`.gemm`, :mod:`.grouped_gemm`,
:mod:`.grouped_wgrad`, :mod:`.group_zero`, :mod:`.norm_quantize` (RMSNorm / add + RMSNorm -> NVFP4),
:mod:`.swiglu_quantize` (SwiGLU -> NVFP4). Shared pieces: :mod:`._nvfp4_math`, :mod:`._gemm_common`.
"""
