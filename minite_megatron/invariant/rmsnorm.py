"""Batch-invariant RMSNorm (layer norm, qk-layernorm, final norm): one row, one fixed order.

``y = round_out(fp32(x) * (1 / sqrt(tree_h(fp32(x)^2) / H + eps)) * w)`` with ``w = weight`` or
``1 + weight`` (``zero_centered_gamma``), all in fp32, one rounding to ``x.dtype``. The sum of
squares is the aligned pairwise tree of :mod:`minite_megatron.nvfp4.tree` (``"torch"``) or one fixed-size block
reduction per row (``"triton"``: ``minite_kernels.triton.invariant.bi_rmsnorm``); ``sqrt`` and the division
are correctly rounded IEEE operations, so a row's result depends on nothing but the row.
Backward uses the ordinary formulas.
"""

from __future__ import annotations

import torch

from . import backend as _backend
from ..nvfp4.tree import tree_sum


def rms_norm_torch(x2d: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """The torch formulation; ``x2d`` [M, H] -> [M, H] in ``x2d.dtype``."""
    xf = x2d.to(torch.float32)
    h = xf.shape[-1]
    ms = tree_sum(xf * xf, dim=-1, keepdim=True) / h
    r = 1.0 / torch.sqrt(ms + eps)
    w = weight.to(torch.float32)
    if zero_centered_gamma:
        w = w + 1.0
    return (xf * r * w).to(x2d.dtype)


class RMSNormFunction(torch.autograd.Function):
    """An autograd function whose output is the RMSNorm of its first two inputs ``(x2d, weight)``
    with ``eps`` and ``zero_centered_gamma`` as the next two: the forward computes the norm (and
    may do more with it) and calls :meth:`save`; the backward is :func:`rms_norm_backward`, no
    gradient for the other inputs."""

    @staticmethod
    def save(ctx, x2d, weight, eps, zero_centered_gamma) -> None:
        ctx.save_for_backward(x2d, weight)
        ctx.eps, ctx.zc = eps, zero_centered_gamma

    @staticmethod
    def backward(ctx, gy):
        x2d, weight = ctx.saved_tensors
        gx, gw = rms_norm_backward(gy, x2d, weight, ctx.eps, ctx.zc, ctx.needs_input_grad[1])
        return (gx, gw) + (None,) * (len(ctx.needs_input_grad) - 2)


class _RMSNorm(RMSNormFunction):
    @staticmethod
    def forward(ctx, x2d, weight, eps, zero_centered_gamma, which):
        if which == "triton":
            y = _backend.kernel("bi_rmsnorm")(x2d, weight, eps, zero_centered_gamma)
        else:
            y = rms_norm_torch(x2d, weight, eps, zero_centered_gamma)
        RMSNormFunction.save(ctx, x2d, weight, eps, zero_centered_gamma)
        return y


#: Widest row the one-pass backward kernel takes (``minite_kernels.triton.invariant.bi_rmsnorm_backward.MAX_H``).
_KERNEL_MAX_H = 4096
#: The one-pass backward kernel ran on a GPU: its tests (``tests/kernels/triton/invariant/test_bi_rmsnorm_backward.py``,
#: ``tests/strict/test_norm_softmax.py``: 18 passed) and the learner step with it (H200, 2026-12-01,
#: ``python -m benchmarks.learner_step --tokens 16384 --variants bf16,nvfp4,strict``: NVFP4 172.3 ->
#: 155.2 ms, strict 163.9 ms; BENCHMARKS.md run 12). False keeps CUDA tensors on the torch formulation.
ONE_PASS_BACKWARD_GPU_VERIFIED = True


def rms_norm_backward(gy, x2d, weight, eps: float, zero_centered_gamma: bool, weight_grad: bool = True):
    """The ordinary RMSNorm gradients (fp32 math): ``(dx in x2d.dtype, dweight or None)``. Where the
    Triton kernels run (:func:`.backend.resolve`; on a GPU once :data:`ONE_PASS_BACKWARD_GPU_VERIFIED`),
    one pass (``bi_rmsnorm_backward``: the same formulas, sums in another fixed order); else
    :func:`rms_norm_backward_torch`."""
    if (_backend.resolve(x2d.device) == "triton" and x2d.shape[-1] <= _KERNEL_MAX_H
            and (x2d.device.type != "cuda" or ONE_PASS_BACKWARD_GPU_VERIFIED)):
        return _backend.kernel("bi_rmsnorm_backward")(gy, x2d, weight, eps, zero_centered_gamma, weight_grad)
    return rms_norm_backward_torch(gy, x2d, weight, eps, zero_centered_gamma, weight_grad)


def rms_norm_backward_torch(gy, x2d, weight, eps: float, zero_centered_gamma: bool, weight_grad: bool = True):
    """The torch formulation of :func:`rms_norm_backward` (any device; ~12 fp32 passes over x)."""
    xf = x2d.to(torch.float32)
    g = gy.to(torch.float32)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * r
    w = weight.to(torch.float32) + (1.0 if zero_centered_gamma else 0.0)
    gn = g * w
    gx = r * (gn - n * (gn * n).mean(-1, keepdim=True))
    gw = (g * n).sum(0).to(weight.dtype) if weight_grad else None
    return gx.to(x2d.dtype), gw


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dimension.

    Args:
        x: ``[..., H]`` bf16 / fp16 / fp32.
        weight: ``[H]`` (any floating dtype, read as fp32).
        eps: added to the mean square (fp32).
        zero_centered_gamma: scale by ``1 + weight`` (Megatron's ``layernorm_zero_centered_gamma``).
    Returns:
        ``[..., H]`` in ``x.dtype``. Non-finite inputs propagate to their row.
    Raises:
        ValueError if ``weight`` is not ``[H]``; TypeError for non-floating ``x``.
    """
    if not x.dtype.is_floating_point:
        raise TypeError(f"rms_norm needs a floating tensor, got {x.dtype}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")
    which = _backend.resolve(x.device)
    x2d = x.reshape(-1, x.shape[-1])
    return _RMSNorm.apply(x2d, weight, float(eps), bool(zero_centered_gamma), which).reshape(x.shape)
