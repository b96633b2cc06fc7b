"""Fused producers of NVFP4 activations, in pure torch: the oracle of the fused Triton kernels
(``minite_kernels.triton.nvfp4.norm_quantize`` / ``.swiglu_quantize``) and their CPU path.

Each producer returns the 16-bit result of the op *and* its NVFP4 quantization with one global
scale per row (per token), so the next GEMM's operand is written by the op that makes it:

* :func:`rmsnorm_quantize_reference` ``(x [M, H], weight [H]) -> (y, q)``:
  ``y = round_x.dtype(fp32(x) * (1 / sqrt(tree(fp32(x)^2) / H + eps)) * w)`` with ``w = weight``
  or ``1 + weight``, all fp32, one rounding: the formula of
  ``minite_megatron.invariant.rmsnorm.rms_norm_torch`` (the sum of squares is the aligned pairwise
  tree of :mod:`.tree`; a test pins the two bitwise). The Triton kernel instead reproduces ``bi_rmsnorm``'s own fixed
  reduction (another order), so its ``y`` equals ``bi_rmsnorm``'s, not this one's, in the last
  bit of a few rows.
* :func:`swiglu_quantize_reference` ``(h [M, 2F]) -> (a, q)``: Megatron's
  ``fused_bias_swiglu.swiglu`` as eager torch runs it: ``gate, up = torch.chunk(h, 2, -1)``,
  ``s = round(silu(gate))`` with ``silu(g) = g / (1 + exp(-g))`` in fp32 (torch's opmath), then
  ``a = round(fp32(s) * fp32(up))`` (that product of two 16-bit values is exact in fp32, so
  ``a`` has exactly two roundings). The formula is spelled out in torch ops on every device:
  ATen's CPU ``silu`` rounds an element differently in its vector body and its scalar tail
  (``minite_megatron.invariant.activations``), and its CUDA kernel is this formula with ``expf``
  and IEEE ops, so the spelled-out one gives its bits (a GPU test pins it:
  ``tests/kernels/triton/nvfp4/test_triton_producers.py -k cuda_silu``).

``q = quantize_reference(y_or_a, global_scale="row", with_image=...)`` in both: the chain of
:mod:`.quantize`, computed from the *rounded* 16-bit output.

Non-finite values follow :mod:`.quantize`'s policy for the quantized tensor: ``"propagate"``
gives the row NaN scales; ``"raise"`` checks the input first (a ``ValueError`` naming its first
non-finite element), then the op's output (an op can overflow: ``silu(g) * u`` beyond the
16-bit range, ``x * r * w`` with a huge weight).
"""

from __future__ import annotations

import torch

from .quantize import check_finite, quantize_reference
from .tree import tree_sum
from .tensor import NVFP4Tensor

_HALF = (torch.bfloat16, torch.float16)


def validate_rmsnorm(x: torch.Tensor, weight: torch.Tensor, nonfinite: str) -> None:
    """The argument checks of the fused RMSNorm + quantize (shared with the kernel wrapper)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("rmsnorm_quantize: x and weight must be torch.Tensor")
    if x.dtype not in _HALF:
        raise TypeError(f"rmsnorm_quantize: x must be bfloat16 or float16, got {x.dtype}")
    if not weight.dtype.is_floating_point:
        raise TypeError(f"rmsnorm_quantize: weight must be floating, got {weight.dtype}")
    if x.dim() != 2:
        raise ValueError(f"rmsnorm_quantize: x must be 2D [M, H], got shape {tuple(x.shape)}")
    if x.shape[1] % 16 or x.shape[1] == 0:
        raise ValueError(f"rmsnorm_quantize: H={x.shape[1]} must be a positive multiple of 16")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"rmsnorm_quantize: weight shape {tuple(weight.shape)} != ({x.shape[1]},)")
    if nonfinite not in ("propagate", "raise"):
        raise ValueError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")


def validate_swiglu(h: torch.Tensor, nonfinite: str, probs: torch.Tensor | None = None) -> None:
    """The argument checks of the fused SwiGLU + quantize (shared with the kernel wrapper)."""
    if not isinstance(h, torch.Tensor):
        raise TypeError("swiglu_quantize: h must be a torch.Tensor")
    if h.dtype not in _HALF:
        raise TypeError(f"swiglu_quantize: h must be bfloat16 or float16, got {h.dtype}")
    if h.dim() != 2:
        raise ValueError(f"swiglu_quantize: h must be 2D [M, 2F], got shape {tuple(h.shape)}")
    if h.shape[1] % 32 or h.shape[1] == 0:
        raise ValueError(f"swiglu_quantize: h's last dimension ({h.shape[1]}) must be 2F with F a positive "
                         f"multiple of 16")
    if nonfinite not in ("propagate", "raise"):
        raise ValueError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")
    if probs is not None and (not isinstance(probs, torch.Tensor) or probs.dtype != torch.float32
                              or tuple(probs.shape) != (h.shape[0],) or probs.device != h.device):
        raise ValueError(f"swiglu_quantize: probs must be an fp32 [{h.shape[0]}] tensor on {h.device}, got "
                         f"{getattr(probs, 'dtype', type(probs))} {tuple(getattr(probs, 'shape', ()))}")


def checked_output(t: torch.Tensor, what: str) -> None:
    """``check_finite`` on an op's output, the message saying which output it was."""
    try:
        check_finite(t)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                      zero_centered_gamma: bool = False) -> torch.Tensor:
    """``rms_norm_torch``'s formula: [M, H] -> [M, H] in ``x.dtype`` (see the module docstring)."""
    xf = x.to(torch.float32)
    ms = tree_sum(xf * xf, dim=-1, keepdim=True) / xf.shape[-1]
    r = 1.0 / torch.sqrt(ms + eps)
    w = weight.to(torch.float32)
    if zero_centered_gamma:
        w = w + 1.0
    return (xf * r * w).to(x.dtype)


def swiglu_reference(h: torch.Tensor, inline_glu: bool = False) -> torch.Tensor:
    """Megatron's ``swiglu`` in eager torch: [M, 2F] -> [M, F] in ``h.dtype`` (module docstring);
    ``inline_glu``: its inline GLU's ``up + glu_linear_offset`` with the offset 0 (-0.0 -> +0.0)."""
    gate, up = torch.chunk(h, 2, -1)
    if inline_glu:
        up = up + 0.0
    gf = gate.to(torch.float32)
    s = (gf / (1.0 + torch.exp(-gf))).to(h.dtype)
    return s * up


def rmsnorm_quantize_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    *,
    with_image: bool = True,
    nonfinite: str = "propagate",
) -> tuple[torch.Tensor, NVFP4Tensor]:
    """RMSNorm then NVFP4 with per-row global scales: ``(y [M, H] x.dtype, q)``.

    Args:
        x: ``[M, H]`` bf16 / fp16, H a positive multiple of 16 (M may be 0).
        weight: ``[H]`` floating (read as fp32).
        eps, zero_centered_gamma: as ``rms_norm`` (``1 + weight`` when zero centered).
        with_image: also return the bf16 image of ``q``.
        nonfinite: ``"propagate"`` or ``"raise"`` (module docstring).
    Raises:
        TypeError (dtype), ValueError (shape, H, weight shape, ``nonfinite``, non-finite values
        with ``nonfinite="raise"``).
    """
    validate_rmsnorm(x, weight, nonfinite)
    if nonfinite == "raise":
        check_finite(x)
    y = rmsnorm_reference(x, weight, eps, zero_centered_gamma)
    if nonfinite == "raise":
        checked_output(y, "rmsnorm_quantize: the normalized output y")
    return y, quantize_reference(y, global_scale="row", with_image=with_image)


def swiglu_quantize_reference(
    h: torch.Tensor,
    *,
    with_image: bool = True,
    nonfinite: str = "propagate",
    probs: torch.Tensor | None = None,
    inline_glu: bool = False,
) -> tuple[torch.Tensor, NVFP4Tensor]:
    """Megatron's SwiGLU then NVFP4 with per-row global scales: ``(a [M, F] h.dtype, q)``.

    Args:
        h: ``[M, 2F]`` bf16 / fp16 (gate = first half, up = second half), F a positive multiple
            of 16 (M may be 0).
        with_image, nonfinite: as :func:`rmsnorm_quantize_reference`.
        probs: optional ``[M]`` fp32: ``a = (swiglu(h) * probs[:, None]).to(h.dtype)``, what
            Megatron's grouped experts compute after the activation (the MoE routing weights).
        inline_glu: as :func:`swiglu_reference`.
    Raises:
        TypeError (dtype), ValueError (shape, F, ``nonfinite``, non-finite values with
        ``nonfinite="raise"``).
    """
    validate_swiglu(h, nonfinite, probs)
    if nonfinite == "raise":
        check_finite(h)
    a = swiglu_reference(h, inline_glu)
    if probs is not None:
        a = (a * probs.unsqueeze(-1)).to(h.dtype)
    if nonfinite == "raise":
        checked_output(a, "swiglu_quantize: the activation a")
    return a, quantize_reference(a, global_scale="row", with_image=with_image)


__all__ = [
    "rmsnorm_quantize_reference",
    "rmsnorm_reference",
    "swiglu_quantize_reference",
    "swiglu_reference",
]
