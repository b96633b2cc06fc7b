"""Fused producers: RMSNorm and SwiGLU that also write the next NVFP4 linear's fprop operand.

``rms_norm_offering(x, weight, eps, zero_centered_gamma, slot, norm_fn)`` returns the RMSNorm of
``x`` and offers the per-token NVFP4 quantization of that output to the linear that consumes it
(their :class:`~.handoff.Handoff` ``slot``, with that linear's recipe), so the linear does not
read the activation again:

* on a backend that supports the fused kernel (``backend.supports("rmsnorm_quantize", ...)``: Triton),
  one read of ``x`` writes the norm output and the quantization (codes, scales, per-token global scale, image).
  The kernel's norm is the batch-invariant formulation (:mod:`minite_kernels.triton.invariant.bi_rmsnorm`'s
  arithmetic, bitwise), so strict mode takes it too;
* elsewhere (the reference backend: CPU) the module's own norm runs, then the quantizer: the
  same numbers as without the handoff, and the same code path through the consumer.

The backward is the ordinary RMSNorm gradient (:func:`minite_megatron.invariant.rmsnorm.rms_norm_backward`).

``swiglu_offering(h, slot, act_fn)`` does the same for SwiGLU (``h`` [..., 2F] -> [..., F]) in
front of ``linear_fc2``: ``backend.swiglu_quantize`` (Megatron's ``silu(gate) * up`` with its bf16
roundings, bitwise equal to torch on the GPU), backward by Megatron's own ``swiglu_back``.
"""

from __future__ import annotations

import torch

from ..recipe import Recipe
from ..invariant.rmsnorm import RMSNormFunction
from .handoff import Handoff, activation_key
from .linear import backend_for


def fused_supported(op: str, t: torch.Tensor, recipe: Recipe, backend) -> bool:
    """Can ``backend.<op>`` (``rmsnorm_quantize`` / ``swiglu_quantize``) produce ``t``'s consumer operand?"""
    return backend.supports(op, dtype=t.dtype, width=t.shape[-1], global_scale=recipe.activation_scale) is None


class _FusedRMSNormQuantize(RMSNormFunction):
    @staticmethod
    def forward(ctx, x2d, weight, eps, zero_centered_gamma, slot, backend):
        y, q = backend.rmsnorm_quantize(x2d, weight, eps, zero_centered_gamma, with_image=True,
                                        nonfinite=slot.recipe.nonfinite)
        slot.offer(y, q, activation_key(slot.recipe, backend))
        RMSNormFunction.save(ctx, x2d, weight, eps, zero_centered_gamma)
        return y


def rms_norm_offering(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool, slot: Handoff,
                      norm_fn) -> torch.Tensor:
    """RMSNorm of ``x`` [..., H] (``norm_fn(x)`` where no fused kernel runs), offering the
    per-token NVFP4 quantization of the output to the consuming linear's ``slot``."""
    backend = backend_for(slot.recipe, x.device)
    h = x.shape[-1]
    if fused_supported("rmsnorm_quantize", x, slot.recipe, backend):
        x2d = x.reshape(-1, h)
        return _FusedRMSNormQuantize.apply(x2d, weight, float(eps), bool(zero_centered_gamma), slot, backend).reshape(x.shape)
    return _offer_unfused(norm_fn(x), slot, backend)


def _offer_unfused(out: torch.Tensor, slot: Handoff, backend) -> torch.Tensor:
    """No fused kernel: quantize the producer's output as the consumer would, and offer it."""
    recipe, k = slot.recipe, out.shape[-1]
    if out.dtype in (torch.bfloat16, torch.float16, torch.float32) and k % 16 == 0 and recipe.activation_scale == "row":
        out2 = out.reshape(-1, k)
        with torch.no_grad():
            q = backend.quantize(out2.detach(), global_scale="row", with_image=True, nonfinite=recipe.nonfinite)
        slot.offer(out2, q, activation_key(recipe, backend))
    return out


class _FusedSwiGLUQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h2d, slot, backend):
        a, q = backend.swiglu_quantize(h2d, with_image=True, nonfinite=slot.recipe.nonfinite)
        slot.offer(a, q, activation_key(slot.recipe, backend))
        ctx.save_for_backward(h2d)
        return a

    @staticmethod
    def backward(ctx, ga):
        from megatron.core.fusions.fused_bias_swiglu import swiglu_back

        (h2d,) = ctx.saved_tensors
        return swiglu_back(ga, h2d), None, None


def swiglu_offering(h: torch.Tensor, slot: Handoff, act_fn) -> torch.Tensor:
    """SwiGLU of ``h`` [..., 2F] (``act_fn(h)`` where no fused kernel runs), offering the
    per-token NVFP4 quantization of the output to the consuming ``linear_fc2``'s ``slot``."""
    backend = backend_for(slot.recipe, h.device)
    if fused_supported("swiglu_quantize", h, slot.recipe, backend):
        two_f = h.shape[-1]
        a = _FusedSwiGLUQuantize.apply(h.reshape(-1, two_f), slot, backend)
        return a.reshape(*h.shape[:-1], two_f // 2)
    return _offer_unfused(act_fn(h), slot, backend)
