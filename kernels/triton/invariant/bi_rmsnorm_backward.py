"""RMSNorm backward in one pass: ``dx`` and the weight gradient of ``y = x * r * w`` (``r = 1 /
sqrt(mean(x^2) + eps)``, ``w`` or ``1 + w``), fp32 math, for the batch-invariant RMSNorm's autograd
function (:class:`minite_megatron.invariant.rmsnorm.RMSNormFunction`).

Reference: :func:`minite_megatron.invariant.rmsnorm.rms_norm_backward_torch` -- the same formulas,
``dx = r * (g*w - n * mean(g*w * n))`` with ``n = x * r``, and ``dw = sum_rows(g * n)``; the sums run
in another fixed order, so the two agree to fp32 rounding, not bit for bit. The torch formulation
makes ~12 full fp32 passes over ``[M, H]`` (casts, products, means; on the H200 ~14 ms of a 167 ms
learner step of the qwen3-moe preset at 16384 tokens, the q/k norms over ``[T * heads, 128]`` the
largest, BENCHMARKS.md run 11); this kernel reads ``x`` and ``g`` once and writes ``dx`` (the same
step: 172.3 -> 155.2 ms with it, run 12). The Triton backend's ``bi_rmsnorm_backward`` runs it for
every row of at most ``MAX_H`` (``TritonBackend.supports("bi_rmsnorm_backward", width=H)``).

Deterministic: a program takes row tiles ``pid, pid + P, ...`` (``P`` fixed by M and H only, never
by the device) and writes its weight-gradient partial ``[H]``; the partials are summed in program
order. ``x``, ``g`` ``[M, H]`` (unit column stride), ``weight`` ``[H]``, ``H <= MAX_H``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2

MAX_H = 4096
#: most programs (weight-gradient partials) of one call
MAX_PROGRAMS = 1024


@triton.jit
def _bi_rmsnorm_backward_kernel(
    g_ptr, x_ptr, w_ptr, gx_ptr, dwp_ptr, M, H, s_g, s_x, s_gx, eps, n_prog,
    ZERO_CENTERED: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = tl.where(cmask, w + 1.0, 0.0)
    dw = tl.zeros((BLOCK_H,), tl.float32)
    for t in range(pid, tl.cdiv(M, BLOCK_M), n_prog):
        rows = (t * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        m2 = (rows < M)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * s_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * s_g + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        r = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / H + eps))
        n = x * r[:, None]
        gn = g * w[None, :]
        c = tl.sum(gn * n, axis=1) / H
        gx = r[:, None] * (gn - n * c[:, None])
        tl.store(gx_ptr + rows[:, None] * s_gx + cols[None, :], gx.to(gx_ptr.dtype.element_ty), mask=m2)
        if WEIGHT_GRAD:
            dw += tl.sum(g * n, axis=0)
    if WEIGHT_GRAD:
        tl.store(dwp_ptr + pid * H + cols, dw, mask=cmask)


def launch_config(m: int, h: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_H, programs, warps): tiles of ~4096 elements, at most :data:`MAX_PROGRAMS`."""
    block_h = next_pow2(h)
    block_m = max(1, min(64, 4096 // block_h))
    tiles = cdiv(m, block_m)
    return block_m, block_h, max(1, min(tiles, MAX_PROGRAMS)), 8 if block_h >= 2048 else 4


@custom_op("minite::bi_rmsnorm_backward", mutates_args=())
def _bi_rmsnorm_backward_op(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                            zero_centered_gamma: bool, weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, h = x.shape
    gx = torch.empty(m, h, dtype=x.dtype, device=x.device)
    block_m, block_h, progs, warps = launch_config(m, h)
    part = torch.empty(progs if weight_grad else 1, h, dtype=torch.float32, device=x.device)
    if m and h:
        _bi_rmsnorm_backward_kernel[(progs,)](
            g, x, weight, gx, part, m, h, g.stride(0), x.stride(0), gx.stride(0), eps, progs,
            ZERO_CENTERED=zero_centered_gamma, WEIGHT_GRAD=weight_grad, BLOCK_M=block_m, BLOCK_H=block_h,
            num_warps=warps,
        )
    elif weight_grad:
        part.zero_()
    return gx, part


@_bi_rmsnorm_backward_op.register_fake
def _(g, x, weight, eps, zero_centered_gamma, weight_grad):
    progs = launch_config(x.shape[0], x.shape[1])[2] if weight_grad else 1
    return torch.empty_like(x), x.new_empty((progs, x.shape[1]), dtype=torch.float32)


def bi_rmsnorm_backward(gy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        zero_centered_gamma: bool = False, weight_grad: bool = True):
    """``(dx [M, H] in x.dtype, dweight [H] in weight.dtype or None)`` of the RMSNorm of ``x``
    ``[M, H]`` with ``weight`` ``[H]``, for the output gradient ``gy`` ``[M, H]``. Raises ValueError
    for mismatched shapes or ``H > MAX_H``."""
    if x.dim() != 2 or tuple(gy.shape) != tuple(x.shape) or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"bi_rmsnorm_backward: gy {tuple(gy.shape)} and x {tuple(x.shape)} must be [M, H], "
                         f"weight {tuple(weight.shape)} [H]")
    if x.shape[1] > MAX_H:
        raise ValueError(f"bi_rmsnorm_backward: H = {x.shape[1]} > {MAX_H}")
    x = x if x.stride(1) == 1 else x.contiguous()
    gy = gy if gy.stride(1) == 1 else gy.contiguous()
    gx, part = _bi_rmsnorm_backward_op(gy, x, weight.contiguous(), float(eps), bool(zero_centered_gamma),
                                       bool(weight_grad))
    return gx, (part.sum(0).to(weight.dtype) if weight_grad else None)
