"""Batch-invariant RMSNorm: one program per row, one fixed reduction order.

Reference: :func:`minite_megatron.invariant.rmsnorm.rms_norm_torch` (same formula and rounding
points: ``y = round(fp32(x) * (1 / sqrt_rn(sum(x^2) / H + eps)) * w)``, ``w`` or ``1 + w``; the sum
of squares is a different fixed tree, so the two are not bitwise equal).

Invariance: every row is reduced by its own program with the same block size (a function of H
only): ``BLOCK`` lanes accumulate the squares of the chunks ``0, BLOCK, 2*BLOCK, ...`` in order,
then one ``tl.sum`` over the lanes. Nothing depends on how many rows are in the call.

``x`` [M, H] (row stride any, unit column stride not required), ``weight`` [H]; returns
[M, H] contiguous in ``x.dtype``. Raises ValueError for a bad weight shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.invariant.bi_common import finish, kernel_out_dtype
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import next_pow2

MAX_BLOCK = 4096


@triton.jit
def _bi_rmsnorm_kernel(
    x_ptr, w_ptr, out_ptr, H, sxm, sxh, som, eps,
    ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + lanes
        x = tl.load(x_ptr + row * sxm + cols.to(tl.int64) * sxh, mask=cols < H, other=0.0).to(tl.float32)
        acc += x * x
    ms = tl.sum(acc, axis=0) / H
    r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    for h0 in range(0, H, BLOCK):
        cols = h0 + lanes
        cmask = cols < H
        x = tl.load(x_ptr + row * sxm + cols.to(tl.int64) * sxh, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        y = x * r * w
        tl.store(out_ptr + row * som + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


@custom_op("minite::bi_rmsnorm", mutates_args=())
def _bi_rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    m, h = x.shape
    out = torch.empty(m, h, dtype=kernel_out_dtype(x.dtype), device=x.device)
    if m and h:
        block = min(next_pow2(h), MAX_BLOCK)
        _bi_rmsnorm_kernel[(m,)](
            x, weight, out, h, x.stride(0), x.stride(1), out.stride(0), eps,
            ZERO_CENTERED=zero_centered_gamma, BLOCK=block, num_warps=4,
        )
    return finish(out, x.dtype)


@_bi_rmsnorm_op.register_fake
def _(x, weight, eps, zero_centered_gamma):
    return torch.empty_like(x)


def bi_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False) -> torch.Tensor:
    """Batch-invariant RMSNorm of ``x`` [M, H] with ``weight`` [H] -> [M, H] in ``x.dtype``."""
    if x.dim() != 2 or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"bi_rmsnorm: x {tuple(x.shape)} must be [M, H] and weight {tuple(weight.shape)} [H]")
    return _bi_rmsnorm_op(x, weight, float(eps), bool(zero_centered_gamma))
