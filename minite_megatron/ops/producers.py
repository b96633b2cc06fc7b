"""Fused producers: RMSNorm that also writes the next NVFP4 linear's fprop operand.

``rms_norm_offering(x, weight, eps, zero_centered_gamma, recipe, batch_invariant)`` returns the
RMSNorm of ``x`` and offers the per-token NVFP4 quantization of that output to the linear that
consumes it (:mod:`.handoff`), so the linear does not read the activation again:

* on a backend with a fused kernel (``backend.rmsnorm_quantize``: Triton), one read of ``x``
  writes the norm output and the quantization (codes, scales, per-token global scale, image).
  The kernel's norm is the batch-invariant formulation (:mod:`minite_kernels.triton.bi_rmsnorm`'s
  arithmetic, bitwise), so strict mode takes it too;
* elsewhere (the reference backend: CPU) the module's own norm runs, then the quantizer: the
  same numbers as without the handoff, and the same code path through the consumer.

The backward is the ordinary RMSNorm gradient (:func:`minite_megatron.strict.rmsnorm.rms_norm_backward`).
"""

from __future__ import annotations

import torch

from ..recipe import Recipe
from ..strict.rmsnorm import rms_norm_backward
from . import handoff
from .linear import backend_for


def fused_norm_supported(x: torch.Tensor, recipe: Recipe, backend) -> bool:
    return (
        hasattr(backend, "rmsnorm_quantize")
        and recipe.activation_scale == "row"
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.shape[-1] % 16 == 0
    )


class _FusedRMSNormQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps, zero_centered_gamma, recipe, backend):
        y, q = backend.rmsnorm_quantize(x2d, weight, eps, zero_centered_gamma, with_image=True,
                                        nonfinite=recipe.nonfinite)
        handoff.offer(y, q, handoff.activation_key(recipe, backend))
        ctx.save_for_backward(x2d, weight)
        ctx.eps, ctx.zc = eps, zero_centered_gamma
        return y

    @staticmethod
    def backward(ctx, gy):
        x2d, weight = ctx.saved_tensors
        gx, gw = rms_norm_backward(gy, x2d, weight, ctx.eps, ctx.zc, ctx.needs_input_grad[1])
        return gx, gw, None, None, None, None


def rms_norm_offering(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool, recipe: Recipe,
                      norm_fn) -> torch.Tensor:
    """RMSNorm of ``x`` [..., H] (``norm_fn(x)`` where no fused kernel runs), offering the
    per-token NVFP4 quantization of the output to the consuming linear."""
    backend = backend_for(recipe, x.device)
    h = x.shape[-1]
    if fused_norm_supported(x, recipe, backend):
        x2d = x.reshape(-1, h)
        return _FusedRMSNormQuantize.apply(x2d, weight, float(eps), bool(zero_centered_gamma), recipe, backend).reshape(x.shape)
    y = norm_fn(x)
    if y.dtype in (torch.bfloat16, torch.float16, torch.float32) and h % 16 == 0 and recipe.activation_scale == "row":
        y2 = y.reshape(-1, h)
        with torch.no_grad():
            q = backend.quantize(y2.detach(), global_scale="row", with_image=True, nonfinite=recipe.nonfinite)
        handoff.offer(y2, q, handoff.activation_key(recipe, backend))
    return y
