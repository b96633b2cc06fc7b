"""Batch-invariant matmul ``out = x @ w.T (+ bias)`` for strict mode's high-precision linears.

Reference: :func:`minite_megatron.invariant.matmul.linear_torch` (the same epilogue order: fp32
accumulator, fp32 bias add, one rounding to ``out_dtype``; not the same reduction tree, so not
bitwise equal to it).

Why a row's result cannot depend on M (the batch-invariance argument):
- one tile configuration per operand path for every shape (:data:`MMA_CONFIG` for bf16/fp16
  operands on the tensor cores, :data:`FMA_CONFIG` for fp32 or mixed operands and under the
  interpreter): no autotuning, no heuristic keyed on M, so every output tile runs the same
  instruction sequence whatever M is or where the row lands inside its tile;
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

from minite_kernels.triton.invariant.bi_common import finish, interpreting, kernel_out_dtype, tile_dot
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). The tensor-core path (bf16 / fp16 operands of
#: one dtype: strict mode's FP32-output LM head and router) ran the FMA tile until issue 16 round
#: 2: 11.6 ms for the LM head and 4 routers of the 16384-token step on the H200 (cuBLAS ~3 ms).
#: A larger tile keeps each element's k16 MMA sequence (K walked upwards in steps of 16 into one
#: fp32 accumulator), so it is expected to give the same bits as the old 64x64x32 tile
#: (``test_gpu_bi_matmul_tile_keeps_the_bits`` checks it on the GPU).
MMA_CONFIG = (128, 128, 64, 8, 3)
FMA_CONFIG = (64, 64, 32, 4, 3)


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


def tile_config(x_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """The fixed (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of these operand dtypes."""
    cast = interpreting() or x_dtype != w_dtype or x_dtype == torch.float32
    return FMA_CONFIG if cast else MMA_CONFIG


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
            config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=kernel_out_dtype(out_dtype), device=x.device)
    if m == 0 or n == 0:
        return finish(out, out_dtype)
    cast = interpreting() or x.dtype != w.dtype or x.dtype == torch.float32
    block_m, block_n, block_k, warps, stages = config or tile_config(x.dtype, w.dtype)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _bi_matmul_kernel[grid](
        x, w, bias if bias is not None else out, out, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, CAST_FP32=cast, PRECISION="ieee" if cast else "tf32",
        AS_SUM=interpreting(),
        BM=block_m, BN=block_n, BK=block_k, num_warps=warps, num_stages=stages,
    )
    return finish(out, out_dtype)


@custom_op("minite::bi_matmul", mutates_args=())
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
