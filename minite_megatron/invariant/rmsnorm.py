"""Batch-invariant RMSNorm (layer norm, qk-layernorm, final norm): one row, one fixed order.

``y = round_out(fp32(x) * (1 / sqrt(tree_h(fp32(x)^2) / H + eps)) * w)`` with ``w = weight`` or
``1 + weight`` (``zero_centered_gamma``), all in fp32, one rounding to ``x.dtype``. The sum of
squares is the aligned pairwise tree of :mod:`minite_megatron.nvfp4.tree` (:func:`rms_norm_torch`) or
the backend's ``bi_rmsnorm`` kernel where :func:`minite_megatron.nvfp4.backends.invariant_backend` has
one (Triton: one fixed-size block reduction per row); ``sqrt`` and the division are correctly rounded
IEEE operations, so a row's result depends on nothing but the row. Backward uses the ordinary
formulas: the backend's one-pass ``bi_rmsnorm_backward`` where it supports the width, else
:func:`rms_norm_backward_torch`.
"""

from __future__ import annotations

import torch

from ..nvfp4.backends import invariant_backend
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
    def forward(ctx, x2d, weight, eps, zero_centered_gamma, kernels):
        if kernels is not None:
            y = kernels.bi_rmsnorm(x2d, weight, eps, zero_centered_gamma)
        else:
            y = rms_norm_torch(x2d, weight, eps, zero_centered_gamma)
        RMSNormFunction.save(ctx, x2d, weight, eps, zero_centered_gamma)
        return y


def rms_norm_backward(gy, x2d, weight, eps: float, zero_centered_gamma: bool, weight_grad: bool = True):
    """The ordinary RMSNorm gradients (fp32 math): ``(dx in x2d.dtype, dweight or None)``. Where the
    backend of :func:`~minite_megatron.nvfp4.backends.invariant_backend` supports it for this width,
    one pass (``bi_rmsnorm_backward``: the same formulas, sums in another fixed order); else
    :func:`rms_norm_backward_torch`."""
    backend = invariant_backend(x2d.device)
    if backend.supports("bi_rmsnorm_backward", width=x2d.shape[-1]) is None:
        return backend.bi_rmsnorm_backward(gy, x2d, weight, eps, zero_centered_gamma, weight_grad)
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
    backend = invariant_backend(x.device)
    kernels = backend if backend.supports("bi_rmsnorm") is None else None  # None: the torch formulation
    x2d = x.reshape(-1, x.shape[-1])
    return _RMSNorm.apply(x2d, weight, float(eps), bool(zero_centered_gamma), kernels).reshape(x.shape)
