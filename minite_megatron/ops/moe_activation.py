"""The routed experts' activation times the routing probabilities, fused (issue 16).

Megatron's ``TEGroupedMLP`` computes, between fc1 and fc2, ``(activation_func(h) *
permuted_probs).to(h.dtype)`` (the activation module under ``use_te_activation_func``, else its
inline GLU ``silu(gate) * (up + glu_linear_offset)``): a SwiGLU kernel, an fp32 product, a cast
(measured on the H200 at 16384 tokens of the qwen3-moe preset: ~4.9 ms of the forward, ~3 ms of
autograd's elementwise backward), and fc2 then reads the result again to quantize it.
:func:`weighted_swiglu` computes it in one op, with the same bits::

    y = round(fp32(round(round(silu(gate)) * up)) * p)        h [R, 2F] -> y [R, F], p [R]

(with ``inline_glu`` ``up + 0.0`` first, the inline GLU's add of its zero offset: it turns an
``up`` of -0.0 into +0.0 and changes nothing else)

* NVFP4 ``linear_fc2`` (``slot``: their :class:`~.handoff.Handoff`): on a backend with the fused
  kernel (``backend.swiglu_quantize(..., probs=p)``: Triton) one read of ``h`` writes ``y`` and
  its per-token NVFP4, which fc2 takes from the slot instead of quantizing ``y`` again;
* BF16 ``linear_fc2`` (the BF16 twin, BF16 layers): on a GPU the same kernel without the
  quantization (:func:`minite_kernels.triton.moe.weighted_swiglu.weighted_swiglu`);
* elsewhere (CPU tensors, fp32) Megatron's own composition: ``act_fn(h)`` (the activation
  module's unfused SwiGLU), the product, the cast -- then, for an NVFP4 slot, the quantization
  fc2 would make, offered the same way.

The backward is one kernel on the GPU (:func:`minite_kernels.triton.moe.weighted_swiglu.
weighted_swiglu_backward`): ``dh`` [R, 2F] and ``dp`` [R] from ``dy``, ``h`` and ``p`` in fp32
with one rounding (:func:`weighted_swiglu_backward_reference` is the same formula in torch, which
CPU tensors run); it saves ``h`` and ``p`` only (autograd's chain saves ``gate``, ``silu(gate)``,
``up``, the product and ``p``). ``dp`` reaches the router in ``probs.dtype``.
"""

from __future__ import annotations

import torch

from ..nvfp4.backends import kernel_backend
from ..nvfp4.moe_reference import weighted_swiglu_backward_reference, weighted_swiglu_reference  # noqa: F401
from .handoff import Handoff, activation_key
from .linear import backend_for

def _kernel_shape(h: torch.Tensor) -> dict:
    """The operand facts the backend's ``supports("weighted_swiglu", ...)`` reads."""
    return {"dtype": h.dtype, "width": h.shape[1] if h.dim() == 2 else 0}


def weighted_swiglu_backward(dy: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, *,
                             kernels_on_cpu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh, dp)`` of :func:`weighted_swiglu`: the backend's ``weighted_swiglu_backward`` for
    ``h``'s device (:func:`~minite_megatron.nvfp4.backends.kernel_backend`: a kernel where it has
    one, else the contract's reference; ``kernels_on_cpu``: the Triton kernel on CPU tensors too,
    under ``TRITON_INTERPRET=1``)."""
    return kernel_backend(h.device, kernels_on_cpu).weighted_swiglu_backward(dy, h, probs)


def _forward(h: torch.Tensor, p32: torch.Tensor, slot: Handoff | None, act_fn, inline_glu: bool) -> torch.Tensor:
    """y (see the module docstring), offering its quantization to ``slot``."""
    if slot is not None:
        recipe = slot.recipe
        backend = backend_for(recipe, h.device)
        if h.dim() == 2 and recipe.activation_scale == "row" and backend.supports(
                "swiglu_quantize", dtype=h.dtype, width=h.shape[-1], global_scale="row") is None:
            y, q = backend.swiglu_quantize(h, with_image=True, nonfinite=recipe.nonfinite, probs=p32, inline_glu=inline_glu)
            slot.offer(y, q, activation_key(recipe, backend))
            return y
    kernels = kernel_backend(h.device)
    if kernels.supports("weighted_swiglu", **_kernel_shape(h)) is None:
        y = kernels.weighted_swiglu(h, p32, inline_glu=inline_glu)
    else:
        y = weighted_swiglu_reference(h, p32, act_fn)
    if slot is not None:
        from .producers import _offer_unfused

        _offer_unfused(y, slot, backend)
    return y


class WeightedSwiGLUFunction(torch.autograd.Function):
    """``y = weighted_swiglu(h, probs)`` with the fused backward; ``h`` [R, 2F], ``probs`` [R]."""

    @staticmethod
    def forward(ctx, h, probs, slot, act_fn, inline_glu, kernels_on_cpu):
        p32 = probs.detach().float()
        with torch.no_grad():
            y = _forward(h, p32, slot, act_fn, inline_glu)
        ctx.save_for_backward(h, p32)
        ctx.probs_dtype = probs.dtype
        ctx.kernels_on_cpu = kernels_on_cpu
        return y

    @staticmethod
    def backward(ctx, dy):
        h, p32 = ctx.saved_tensors
        dh, dp = weighted_swiglu_backward(dy, h, p32, kernels_on_cpu=ctx.kernels_on_cpu)
        return dh, dp.to(ctx.probs_dtype), None, None, None, None


def weighted_swiglu(h: torch.Tensor, probs: torch.Tensor, slot: Handoff | None = None, act_fn=None, *,
                    inline_glu: bool = False, kernels_on_cpu: bool = False) -> torch.Tensor:
    """The experts' ``(swiglu(h) * probs[:, None]).to(h.dtype)`` in one op (module docstring).

    Args:
        h: fc1's output ``[R, 2F]`` (gate half, up half), R >= 0.
        probs: ``[R]`` routing probabilities (fp32 or h's dtype; differentiable).
        slot: the NVFP4 ``linear_fc2``'s :class:`~.handoff.Handoff` (None: a BF16 fc2).
        act_fn: the module's unfused SwiGLU, for the composition where no kernel runs.
        inline_glu: the activation is Megatron's inline GLU (``use_te_activation_func`` off):
            ``silu(gate) * (up + 0.0)``, whose add turns an ``up`` of -0.0 into +0.0; the kernels
            then do the same (``act_fn`` must be that composition).
        kernels_on_cpu: the backward's kernel on CPU tensors too (under ``TRITON_INTERPRET=1``;
            tests, CPU smoke runs); the CPU forward stays Megatron's composition.
    Returns:
        ``[R, F]`` in ``h.dtype``, bitwise Megatron's unfused result (on the GPU: the kernel
        reproduces torch's CUDA ``silu``; on the CPU it is that composition).
    Raises:
        ValueError when the shapes disagree.
    """
    if h.dim() != 2 or h.shape[-1] % 2 or probs.shape != (h.shape[0],):
        raise ValueError(f"weighted_swiglu: h must be [R, 2F] and probs [R], got {tuple(h.shape)} and {tuple(probs.shape)}")
    return WeightedSwiGLUFunction.apply(h, probs, slot, act_fn, bool(inline_glu), bool(kernels_on_cpu))
