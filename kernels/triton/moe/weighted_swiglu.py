"""The routed experts' weighted SwiGLU without quantization, and its fused backward.

Megatron's grouped experts (``TEGroupedMLP``, ``use_te_activation_func``) compute, for fc1's
output ``h`` [R, 2F] (``gate = h[:, :F]``, ``up = h[:, F:]``) and the rows' routing
probabilities ``p`` [R]::

    y = round(fp32(round(round(silu(gate)) * up)) * p)          three roundings to h.dtype

* :func:`weighted_swiglu` ``(h, p) -> y`` [R, F]: that forward in one pass, bitwise equal to
  eager torch on the GPU: it is :mod:`.swiglu_quantize`'s kernel (``WEIGHTED``) with its
  quantization compiled out (``QUANTIZE=False``), so the two share every arithmetic step (the
  libdevice ``expf``, the IEEE division, the RNE roundings). The BF16 twin runs it; NVFP4
  layers run :func:`~.swiglu_quantize.swiglu_quantize` with ``probs=`` (the same ``y`` plus its
  per-token NVFP4 for fc2). Under the interpreter ``exp`` is numpy's (see that module).
  ``inline_glu=True`` adds ``0.0`` to ``up`` first, as Megatron's inline GLU
  (``use_te_activation_func`` off) does with its ``glu_linear_offset`` (an ``up`` of -0.0
  becomes +0.0; nothing else changes).
* :func:`weighted_swiglu_backward` ``(dy, h, p) -> (dh [R, 2F] h.dtype, dp [R] fp32)``: the
  gradient of ``y = silu(gate) * up * p`` in fp32 from the 16-bit ``dy``, ``h`` and fp32 ``p``,
  one rounding of each ``dh`` element::

      sig = 1 / (1 + exp(-gate)),  silu = gate * sig,  da = dy * p
      d gate = round(da * up * sig * (1 + gate * (1 - sig)))
      d up   = round(da * silu)
      dp     = sum_F(dy * silu * up)                  fp32, a fixed order per row

  It is not bitwise autograd's chain through the three roundings (which rounds ``da``, ``d
  silu`` and ``d up`` to 16 bits on the way); its error against the exact gradient is one
  rounding plus fp32 noise (the tests bound it). ``exp`` is ``tl.exp`` (fast ``ex2``: a few
  fp32 ulps, far below the 16-bit rounding); ``dp`` sums each row's terms in chunks of
  ``BLOCK_F`` columns (a tree inside a chunk, chunks in order), so it depends on the row alone.

References (torch, CPU): :func:`minite_megatron.ops.moe_activation.weighted_swiglu_reference`
and :func:`minite_megatron.ops.moe_activation.weighted_swiglu_backward_reference`.

Layout of the backward: ``BLOCK_R`` rows x ``BLOCK_F`` columns per tile (BLOCK_F the largest
power of two <= 256 dividing F, so no column masks), the row loop over ``F / BLOCK_F`` chunks;
16-bit values are loaded as int16 and widened on the bits (exact: the interpreter's bf16 cast
mishandles subnormals) and rounded on the bits under the interpreter (its fp32 -> bf16 cast
truncates). Traffic: dy and h read once, dh written once (10 bytes per output column of a row
in bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.nvfp4._nvfp4_math import interpreting
from minite_kernels.triton.nvfp4.norm_quantize import round_half
from minite_kernels.triton.nvfp4.swiglu_quantize import LAUNCH, _swiglu_quantize_kernel, config
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv

_HALF = (torch.bfloat16, torch.float16)
#: Backward tile: rows per program, widest column chunk, warps.
BWD_BLOCK_R = 4
BWD_MAX_BLOCK_F = 256
BWD_WARPS = 4


def _check(h: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    if not isinstance(h, torch.Tensor) or h.dtype not in _HALF:
        raise TypeError(f"{what}: h must be a bfloat16 or float16 tensor, got {getattr(h, 'dtype', type(h))}")
    if h.dim() != 2 or h.shape[1] % 32 or h.shape[1] == 0:
        raise ValueError(f"{what}: h must be [R, 2F] with F a positive multiple of 16, got {tuple(h.shape)}")
    if (not isinstance(probs, torch.Tensor) or probs.dtype != torch.float32 or tuple(probs.shape) != (h.shape[0],)
            or probs.device != h.device):
        raise ValueError(f"{what}: probs must be an fp32 [{h.shape[0]}] tensor on {h.device}, got "
                         f"{getattr(probs, 'dtype', type(probs))} {tuple(getattr(probs, 'shape', ()))}")


# ---- forward: the swiglu_quantize kernel without its quantization -----------------------------
@custom_op("minite::weighted_swiglu", mutates_args=())
def weighted_swiglu_op(h: torch.Tensor, probs: torch.Tensor, inline_glu: bool = False) -> torch.Tensor:
    """Kernel launch: ``h`` [R, 2F] bf16/fp16 (unit stride along the last dim, rows on 4-byte
    boundaries), ``probs`` [R] fp32 contiguous -> ``y`` [R, F] in ``h.dtype``."""
    m, f2 = h.shape
    f = f2 // 2
    y = torch.empty(m, f, dtype=h.dtype, device=h.device)
    if m == 0:
        return y
    block_nb, block_r, warps, chunks = config(m, f)
    interp = interpreting()
    _swiglu_quantize_kernel[(cdiv(m, block_r),)](
        h, y, y, y, probs, y, probs, m, f, h.stride(0) // 2,
        IS_FP16=h.dtype == torch.float16, WITH_IMAGE=False, BITWISE_BF16=interp and h.dtype == torch.bfloat16,
        ACCURATE_EXP=not interp, BLOCK_NB=block_nb, BLOCK_R=block_r, CHUNKS=chunks, WEIGHTED=True, QUANTIZE=False,
        UP_PLUS_ZERO=inline_glu, num_warps=warps,
        **({} if interp else LAUNCH),
    )
    return y


@weighted_swiglu_op.register_fake
def _(h, probs, inline_glu=False):
    return h.new_empty((h.shape[0], h.shape[1] // 2))


def weighted_swiglu(h: torch.Tensor, probs: torch.Tensor, *, inline_glu: bool = False) -> torch.Tensor:
    """``round(fp32(swiglu(h)) * probs[:, None])`` [R, F] in ``h.dtype`` (module docstring).

    Args:
        h: ``[R, 2F]`` bf16 / fp16, F a positive multiple of 16, R >= 0 (made contiguous if its
            rows are not word aligned).
        probs: ``[R]`` fp32 on h's device.
        inline_glu: ``up + 0.0`` first (Megatron's inline GLU: :func:`.swiglu_quantize.swiglu_quantize`).
    Raises:
        TypeError / ValueError naming ``h`` or ``probs``.
    """
    _check(h, probs, "weighted_swiglu")
    if h.stride(1) != 1 or h.stride(0) % 2 or h.data_ptr() % 4:
        h = h.contiguous()
    return weighted_swiglu_op(h, probs.contiguous(), bool(inline_glu))


# ---- backward -----------------------------------------------------------------------------------
@triton.jit
def _widen(v, IS_FP16: tl.constexpr):
    """int16 bits of bf16 / fp16 values -> fp32, exact."""
    if IS_FP16:
        return v.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _weighted_swiglu_bwd_kernel(
    dy_ptr, h_ptr, p_ptr, dh_ptr, dp_ptr,
    R, F, stride_dy, stride_h, stride_dh,
    IS_FP16: tl.constexpr, BITWISE_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """BLOCK_R rows per program; columns in chunks of BLOCK_F (F a multiple of BLOCK_F)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    r64 = rows.to(tl.int64)[:, None]
    mask = rmask[:, None]
    cols = tl.arange(0, BLOCK_F)[None, :]
    p = tl.load(p_ptr + rows, mask=rmask, other=0.0)[:, None]
    acc = tl.zeros((BLOCK_R, BLOCK_F), tl.float32)
    for c in range(0, F // BLOCK_F):
        j = c * BLOCK_F + cols
        dy = _widen(tl.load(dy_ptr + r64 * stride_dy + j, mask=mask, other=0), IS_FP16)
        g = _widen(tl.load(h_ptr + r64 * stride_h + j, mask=mask, other=0), IS_FP16)
        u = _widen(tl.load(h_ptr + r64 * stride_h + F + j, mask=mask, other=0), IS_FP16)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        da = dy * p
        dg_bits, _v = round_half(da * u * (sig * (1.0 + g * (1.0 - sig))), IS_FP16, BITWISE_BF16)
        du_bits, _v2 = round_half(da * silu, IS_FP16, BITWISE_BF16)
        tl.store(dh_ptr + r64 * stride_dh + j, dg_bits.to(tl.int16), mask=mask)
        tl.store(dh_ptr + r64 * stride_dh + F + j, du_bits.to(tl.int16), mask=mask)
        acc += dy * (silu * u)
    tl.store(dp_ptr + rows, tl.sum(acc, axis=1), mask=rmask)


def backward_block_f(f: int) -> int:
    """The largest power of two <= BWD_MAX_BLOCK_F dividing ``f`` (a multiple of 16)."""
    b = BWD_MAX_BLOCK_F
    while f % b:
        b //= 2
    return b


@custom_op("minite::weighted_swiglu_backward", mutates_args=())
def weighted_swiglu_backward_op(dy: torch.Tensor, h: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel launch: ``dy`` [R, F], ``h`` [R, 2F] (same 16-bit dtype, unit stride along the last
    dim), ``probs`` [R] fp32 contiguous -> ``(dh [R, 2F] h.dtype, dp [R] fp32)``."""
    m, f2 = h.shape
    f = f2 // 2
    dh = torch.empty(m, f2, dtype=h.dtype, device=h.device)
    dp = torch.empty(m, dtype=torch.float32, device=h.device)
    if m == 0:
        return dh, dp
    interp = interpreting()
    _weighted_swiglu_bwd_kernel[(cdiv(m, BWD_BLOCK_R),)](
        dy.view(torch.int16), h.view(torch.int16), probs, dh.view(torch.int16), dp,
        m, f, dy.stride(0), h.stride(0), dh.stride(0),
        IS_FP16=h.dtype == torch.float16, BITWISE_BF16=interp and h.dtype == torch.bfloat16,
        BLOCK_R=BWD_BLOCK_R, BLOCK_F=backward_block_f(f), num_warps=BWD_WARPS,
    )
    return dh, dp


@weighted_swiglu_backward_op.register_fake
def _(dy, h, probs):
    return h.new_empty(h.shape), h.new_empty((h.shape[0],), dtype=torch.float32)


def weighted_swiglu_backward(dy: torch.Tensor, h: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`weighted_swiglu` (module docstring): ``(dh, dp)``.

    Args:
        dy: ``[R, F]`` gradient of the output, h's dtype (another float dtype is cast to it).
        h: ``[R, 2F]`` bf16 / fp16, F a positive multiple of 16 (the forward's input).
        probs: ``[R]`` fp32 (the forward's).
    Returns:
        ``dh`` ``[R, 2F]`` in ``h.dtype`` (gate half, up half), ``dp`` ``[R]`` fp32.
    Raises:
        TypeError / ValueError naming the bad argument.
    """
    _check(h, probs, "weighted_swiglu_backward")
    if not isinstance(dy, torch.Tensor) or tuple(dy.shape) != (h.shape[0], h.shape[1] // 2):
        raise ValueError(f"weighted_swiglu_backward: dy must be [{h.shape[0]}, {h.shape[1] // 2}], got "
                         f"{tuple(getattr(dy, 'shape', ()))}")
    if dy.dtype != h.dtype:
        dy = dy.to(h.dtype)
    if h.stride(1) != 1:
        h = h.contiguous()
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    return weighted_swiglu_backward_op(dy, h, probs.contiguous())


def aot_kernels(r: int = 131072, f: int = 768, dtype: str = "bf16", inline_glu: bool = False):
    """``(forward, backward)`` at their GPU launch configs for [r, 2f] ``dtype``, compiled for
    sm_90a on this machine (needs a process without ``TRITON_INTERPRET``)."""
    from minite_kernels.triton._build._aot import compile_for

    block_nb, block_r, warps, chunks = config(r, f)
    fwd_sig = {"h_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "codes_ptr": f"*{dtype}", "scales_ptr": f"*{dtype}",
               "sdec_ptr": "*fp32", "image_ptr": f"*{dtype}", "p_ptr": "*fp32", "R": "i32", "F": "i32", "stride_w": "i32"}
    fwd = compile_for(_swiglu_quantize_kernel, fwd_sig,
                      dict(IS_FP16=dtype == "fp16", WITH_IMAGE=False, BITWISE_BF16=False, ACCURATE_EXP=True,
                           BLOCK_NB=block_nb, BLOCK_R=block_r, CHUNKS=chunks, WEIGHTED=True, QUANTIZE=False,
                           UP_PLUS_ZERO=inline_glu),
                      num_warps=warps, divisible=("F", "stride_w"), **LAUNCH)
    bwd_sig = {"dy_ptr": "*i16", "h_ptr": "*i16", "p_ptr": "*fp32", "dh_ptr": "*i16", "dp_ptr": "*fp32", "R": "i32",
               "F": "i32", "stride_dy": "i32", "stride_h": "i32", "stride_dh": "i32"}
    bwd = compile_for(_weighted_swiglu_bwd_kernel, bwd_sig,
                      dict(IS_FP16=dtype == "fp16", BITWISE_BF16=False, BLOCK_R=BWD_BLOCK_R, BLOCK_F=backward_block_f(f)),
                      num_warps=BWD_WARPS, divisible=("F", "stride_dy", "stride_h", "stride_dh"))
    return fwd, bwd
