"""Kernels of the rollout engine's decode step (M = 1..64 rows against packed FP4 weights).

Ops: :mod:`.decode_gemm` (dense), :mod:`.decode_grouped_gemm` (MoE experts, bf16 activations),
:mod:`.decode_grouped_idot` (MoE experts, integer dot products on both operands' codes),
:mod:`.qk_norm_rope` (q/k RMSNorm + RoPE + KV-cache write). Shared pieces: :mod:`._decode_common`.
"""
