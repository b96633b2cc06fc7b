"""Global amax for per-tensor / per-group NVFP4 scales: one read of the input, no host sync.

``amax_forward(x2d, rows_per_group)`` returns fp32 ``[ceil(R / rows_per_group)]``: the max of
``|x|`` over each run of ``rows_per_group`` rows (one run = the whole tensor for a per-tensor
scale). NaN wins over everything (the contract's policy): the maximum is taken on the int32
bits of ``|x|`` (bit operations only, so no flushed subnormal), where every NaN pattern is
above +inf, with ``atomic_max`` (order-free, so
deterministic). ``x2d`` may be strided (e.g. ``x.t()``); bf16, fp16 or fp32.

Contiguous inputs take a flat kernel: each run of rows is one contiguous range, read in large
vectorised chunks by enough programs to fill the GPU, the max kept element-wise in registers
and reduced once per program (one atomic per program). Strided inputs take a row-tile kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.nvfp4._nvfp4_math import exact_launch, interpreting
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2

#: Elements per program iteration of the flat kernel on the GPU, and its num_warps.
GPU_FLAT_BLOCK = 4096
GPU_FLAT_WARPS = 8
#: Target number of programs of the flat kernel (fills 132 SMs several times over).
GPU_FLAT_PROGRAMS = 1056


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits that order like the values (any NaN above +inf), without a float op
    (no flushed subnormal; the Triton interpreter flushes bf16 subnormals in casts): fp32
    bits for fp32 and bf16 (shifted up), for fp16 the 16-bit magnitude (see ``_to_f32``)."""
    if x.dtype == tl.float32:
        return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    elif x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF) << 16
    else:
        return x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF


@triton.jit
def _store_max(out_ptr, m, IS_FP16: tl.constexpr, mask=None):
    """``atomic_max`` of the fp32 bits of the maxima ``m`` (``_abs_bits`` encoding)."""
    if IS_FP16:
        m = m.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
    tl.atomic_max(out_ptr, m, mask=mask)


@triton.jit
def _amax_flat_kernel(x_ptr, out_ptr, group_len, total, iters, BLOCK: tl.constexpr, IS_FP16: tl.constexpr):
    """Program (chunk c, group g): ``iters`` blocks of ``BLOCK`` elements of the contiguous
    range ``[g * group_len, min((g + 1) * group_len, total))``; one atomic max per program."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    start = g.to(tl.int64) * group_len
    end = tl.minimum(start + group_len, total)
    base = start + pid.to(tl.int64) * iters * BLOCK
    best = tl.zeros((BLOCK,), tl.int32)
    for i in range(iters):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < end, other=0.0)
        best = tl.maximum(best, _abs_bits(x))
    _store_max(out_ptr + g, tl.max(best, axis=0), IS_FP16)


@triton.jit
def _amax_kernel(
    x_ptr, out_ptr, R, K, stride_r, stride_k, rows_per_group,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IS_FP16: tl.constexpr,
):
    """Strided input: BLOCK_R rows per program, the row max kept element-wise over the K loop."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    best = tl.zeros((BLOCK_R, BLOCK_K), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_k,
                    mask=mask, other=0.0)
        best = tl.maximum(best, _abs_bits(x))
    row_best = tl.max(best, axis=1)
    first = pid * BLOCK_R
    last = tl.minimum(first + BLOCK_R, R) - 1
    if first // rows_per_group == last // rows_per_group:
        _store_max(out_ptr + first // rows_per_group, tl.max(row_best, axis=0), IS_FP16)
    else:
        _store_max(out_ptr + rows // rows_per_group, row_best, IS_FP16, mask=rmask)


def _blocks(r: int, k: int) -> tuple[int, int]:
    block_k = min(next_pow2(max(k, 16)), 256)
    block_r = max(1, min(64, 8192 // block_k))
    return block_r, block_k


def _flat_launch(x2d: torch.Tensor, out: torch.Tensor, rows_per_group: int) -> None:
    r, k = x2d.shape
    groups = out.numel()
    group_len = min(rows_per_group, r) * k
    if interpreting():
        block, warps, programs = 256, 4, 4
    else:
        block, warps, programs = GPU_FLAT_BLOCK, GPU_FLAT_WARPS, GPU_FLAT_PROGRAMS
    chunks_per_group = cdiv(group_len, block)
    per_group = max(1, programs // groups)
    iters = cdiv(chunks_per_group, min(per_group, chunks_per_group))
    grid = (cdiv(chunks_per_group, iters), groups)
    _amax_flat_kernel[grid](x2d, out, group_len, r * k, iters, BLOCK=block, IS_FP16=x2d.dtype == torch.float16,
                            num_warps=warps, **exact_launch())


@custom_op("minite::amax", mutates_args=())
def amax_forward(x2d: torch.Tensor, rows_per_group: int) -> torch.Tensor:
    """fp32 ``[ceil(R / rows_per_group)]``: amax of ``|x2d|`` per run of rows (NaN wins)."""
    r, k = x2d.shape
    groups = -(-r // rows_per_group) if r else 1
    out = torch.zeros(groups, dtype=torch.int32, device=x2d.device)
    if r and k:
        if x2d.is_contiguous():
            _flat_launch(x2d, out, rows_per_group)
        else:
            block_r, block_k = _blocks(r, k)
            _amax_kernel[(cdiv(r, block_r),)](
                x2d, out, r, k, x2d.stride(0), x2d.stride(1), rows_per_group,
                BLOCK_R=block_r, BLOCK_K=block_k, IS_FP16=x2d.dtype == torch.float16, **exact_launch(),
            )
    return out.view(torch.float32)


@amax_forward.register_fake
def _(x2d, rows_per_group):
    r = x2d.shape[0]
    return x2d.new_empty((-(-r // rows_per_group) if r else 1,), dtype=torch.float32)
