"""Batch-invariant linear layer: ``y = x @ W.T (+ b)`` whose row results cannot depend on M.

Neither cuBLAS nor the CPU's BLAS promises that a row's result is independent of how many rows
share the call (on this project's CPU, fp32 ``x[:1] @ W.T`` differs from ``(x @ W.T)[:1]`` in
most elements). Strict mode computes every high-precision linear (router, LM head, BF16
first/last layers, attention projections, experts) with one of two formulations:

- ``"torch"`` (any device, the CPU path): ``y[m, n] = round_out(tree_k(fp32(x[m, k]) *
  fp32(W[n, k])) (+ fp32(b[n])))`` -- exact fp32 products (exact for bf16 inputs, one rounding
  for fp32 inputs), the aligned pairwise tree over K (:mod:`minite_megatron.nvfp4.tree`), bias added in fp32, one
  rounding to the output dtype. Computed in chunks of rows and columns (at most
  ``2**22`` products at a time); every element is computed by elementwise ops, so chunking and
  batch composition cannot change a bit.
- a backend's ``bi_matmul`` kernel (:func:`minite_megatron.nvfp4.backends.invariant_backend` chooses the
  backend, its ``supports("bi_matmul")`` whether the kernel runs; the Triton one: one fixed tile
  configuration, K walked in order, fp32 accumulation, no split-K; same epilogue order).

Backward (dgrad, wgrad) uses ordinary matmuls: only the forward values have to agree between
the learner and the rollout engine.
"""

from __future__ import annotations

import torch

from ..nvfp4.backends import invariant_backend
from ..nvfp4.tree import tree_sum

_CHUNK_ELEMENTS = 1 << 22


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if not (x.dtype.is_floating_point and weight.dtype.is_floating_point):
        raise TypeError(f"strict linear needs floating tensors, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"strict linear: weight must be [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"strict linear: x has K={x.shape[-1]} but weight is {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"strict linear: x on {x.device}, weight on {weight.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"strict linear: bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")


def linear_torch(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The torch formulation (see the module docstring); ``x2d`` [M, K] -> [M, N] ``out_dtype``."""
    m, k = x2d.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x2d.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        acc = torch.zeros(m, n, dtype=torch.float32, device=x2d.device)
        if bias is not None:
            acc = acc + bias.to(torch.float32)
        return out.copy_(acc)
    xf = x2d.to(torch.float32)
    wf = weight.to(torch.float32)
    bf = bias.to(torch.float32) if bias is not None else None
    cols = min(n, max(1, _CHUNK_ELEMENTS // k))
    rows = min(m, max(1, _CHUNK_ELEMENTS // (cols * k)))
    for c0 in range(0, n, cols):
        w_chunk = wf[c0 : c0 + cols]
        for r0 in range(0, m, rows):
            acc = tree_sum(xf[r0 : r0 + rows, None, :] * w_chunk[None, :, :], dim=-1)
            if bf is not None:
                acc = acc + bf[c0 : c0 + cols]
            out[r0 : r0 + rows, c0 : c0 + cols] = acc
    return out


def _forward(x2d, weight, bias, out_dtype, kernels):
    if kernels is not None:
        return kernels.bi_matmul(x2d, weight, bias, out_dtype)
    return linear_torch(x2d, weight, bias, out_dtype)


class _BatchInvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, out_dtype, kernels):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _forward(x2d, weight, bias, out_dtype, kernels)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        # ordinary GEMMs in the operands' precision (fp32 when the operands' dtypes differ)
        cdt = weight.dtype if x2d.dtype == weight.dtype else torch.float32
        g = grad_out.to(cdt)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.to(cdt)).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x2d.to(cdt)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T + bias``.

    Args:
        x: ``[..., K]`` bf16 / fp16 / fp32 (any strides).
        weight: ``[N, K]`` floating (may differ in dtype from ``x``: both are read as fp32).
        bias: ``[N]`` or None, added in fp32 before the one output rounding.
        out_dtype: output dtype (default ``x.dtype``); fp32 for an FP32 LM head or router.
    Returns:
        ``[..., N]`` in ``out_dtype``; row ``m`` depends only on ``x[m]``, ``weight`` and ``bias``.
        Non-finite inputs propagate as in IEEE arithmetic. Differentiable (ordinary GEMMs in
        backward).
    Raises:
        TypeError / ValueError for non-floating inputs, mismatched shapes or devices.
    """
    _check(x, weight, bias)
    out_dtype = out_dtype or x.dtype
    backend = invariant_backend(x.device)
    kernels = backend if backend.supports("bi_matmul") is None else None  # None: the torch formulation
    x2d = x.reshape(-1, x.shape[-1])
    y = _BatchInvariantLinear.apply(x2d, weight, bias, out_dtype, kernels)
    return y.reshape(*x.shape[:-1], weight.shape[0])
