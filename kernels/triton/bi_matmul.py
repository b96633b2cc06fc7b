"""Batch-invariant matmul ``out = x @ w.T (+ bias)`` for strict mode's high-precision linears.

Reference: :func:`minite_megatron.strict.matmul.linear_torch` (the same epilogue order: fp32
accumulator, fp32 bias add, one rounding to ``out_dtype``; not the same reduction tree, so not
bitwise equal to it).

Why a row's result cannot depend on M (the batch-invariance argument):
- one tile configuration for every shape (``BLOCK_M=64, BLOCK_N=64, BLOCK_K=32``, 4 warps):
  no autotuning, no heuristic keyed on M, so every output tile runs the same instruction
  sequence whatever M is or where the row lands inside its tile;
- K is walked from 0 upwards in ``BLOCK_K`` steps into one fp32 accumulator: no split-K, no
  stream-K, no reduction across programs, no atomics;
- rows past M are masked loads of zeros that only feed their own (discarded) output rows.
fp32 operands use ``input_precision="ieee"`` (no TF32); bf16/fp16 operands use the tensor cores
with fp32 accumulation; operands of different dtypes are both read as fp32. Under
``TRITON_INTERPRET=1`` (CPU tests) tiles are cast to fp32 and multiplied with an explicit
product-and-sum instead of ``tl.dot`` (see :mod:`.bi_common`).

``x`` [M, K] and ``w`` [N, K] may be strided; ``bias`` [N] or None; returns ``[M, N]``
contiguous in ``out_dtype``. Raises ValueError for mismatched shapes or devices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bi_common import finish, interpreting, kernel_out_dtype, tile_dot

BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 64, 32, 4, 3


@triton.jit
def _bi_matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    sxm, sxk, swn, swk, som, son,
    HAS_BIAS: tl.constexpr, CAST_FP32: tl.constexpr, PRECISION: tl.constexpr, AS_SUM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :].to(tl.int64) * sxk,
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * swn + rk[:, None].to(tl.int64) * swk,
                    mask=nmask[None, :] & kmask[:, None], other=0.0)
        if CAST_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tile_dot(a, b, acc, PRECISION, AS_SUM)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * som + rn[None, :].to(tl.int64) * son,
             acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=kernel_out_dtype(out_dtype), device=x.device)
    if m == 0 or n == 0:
        return finish(out, out_dtype)
    cast = interpreting() or x.dtype != w.dtype or x.dtype == torch.float32
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _bi_matmul_kernel[grid](
        x, w, bias if bias is not None else out, out, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, CAST_FP32=cast, PRECISION="ieee" if cast else "tf32",
        AS_SUM=interpreting(),
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return finish(out, out_dtype)


@torch.library.custom_op("minite::bi_matmul", mutates_args=())
def _bi_matmul_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return _launch(x, w, bias, out_dtype)


@_bi_matmul_op.register_fake
def _(x, w, bias, out_dtype):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


def bi_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batch-invariant ``x @ w.T (+ bias)``: ``x`` [M, K], ``w`` [N, K] -> [M, N] ``out_dtype``
    (default ``x.dtype``). See the module docstring."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"bi_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    if x.device != w.device or (bias is not None and bias.device != x.device):
        raise ValueError("bi_matmul: operands on different devices")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"bi_matmul: bias {tuple(bias.shape)} != ({w.shape[0]},)")
    return _bi_matmul_op(x, w, bias, out_dtype or x.dtype)
