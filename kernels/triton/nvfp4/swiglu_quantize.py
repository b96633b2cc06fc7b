"""Fused SwiGLU -> NVFP4 (per-row global scale): one read of ``h`` writes ``a`` and its quantization.

``swiglu_quantize(h)`` returns ``(a, q)`` for ``h`` [M, 2F] (``gate = h[:, :F]``,
``up = h[:, F:]``: Megatron's ``torch.chunk(h, 2, -1)``):

* ``a = round(fp32(round(silu(gate))) * fp32(up))`` [M, F] in ``h.dtype``, ``silu(g) = g / (1 +
  exp(-g))`` in fp32: Megatron's ``fused_bias_swiglu.swiglu`` (``F.silu(y_1) * y_2``) as eager
  torch computes it, two roundings (the product of two 16-bit values is exact in fp32).
  ``exp`` is libdevice's ``__nv_expf`` (the ``expf`` torch's CUDA ``silu`` kernel calls,
  compiled the way nvcc does by default: FMA contraction on, no flush-to-zero), the division is
  IEEE ``div_rn`` (nvcc's default ``-prec-div=true``). FMA contraction cannot change the
  result: ``expf`` ends with ``ex2(f) * 2^i`` (exact), so ``fma(ex2(f), 2^i, 1) == 1 + expf``.
  Under the interpreter ``exp`` is numpy's (no libdevice on a CPU), which may differ from
  torch's CPU ``exp`` by an fp32 ulp: ``a`` then differs from the reference in the rare
  elements whose silu lies within that ulp of a 16-bit rounding boundary (the tests bound it).
* ``q`` bitwise equal to ``nvfp4.quantize_reference(a, global_scale="row", with_image=...)``
  (always: it is computed from the ``a`` the kernel writes).
* with ``probs`` (``[M]`` fp32, the MoE routing probability of each row): ``a`` is multiplied
  by its row's probability as Megatron's ``TEGroupedMLP`` does after the activation,
  ``round(fp32(a) * p)`` (``(x * permuted_probs).to(dtype)``: one fp32 product, one rounding to
  ``h.dtype``; no add follows, so contraction cannot touch it), and quantized after that.
* with ``inline_glu``: ``up + 0.0`` first, as Megatron's inline GLU ``silu(gate) * (up +
  glu_linear_offset)`` does with the offset 0 (exact; turns -0.0 into +0.0, and is kept in the
  PTX: no-signed-zeros folding is off). :mod:`.weighted_swiglu` launches this kernel without the
  quantization (``QUANTIZE=False``) for BF16 layers.

Reference (CPU path without a GPU): :func:`minite_megatron.nvfp4.producers.swiglu_quantize_reference`.

Layout (:mod:`.quantize_rows`' technique): gate and up are read as int32 words, one thread per
16-element output block (two 16-byte loads of each), ``a`` is formed per word, stored as words,
and the block is quantized by the same thread with ``quantize_rows._quantize_chunk`` (the
E2M1 magic-add rounding, bit-built image). Rows of at most ``MAX_CHUNKS`` chunks keep ``a`` in
registers (h read once, nothing read back); longer rows store ``a`` in a first pass and read it
back (same threads; from L2) to quantize. The quantize steps are exact with FMA contraction on
(see :mod:`.norm_quantize`).

Compiled for sm_90a on the CPU (:func:`aot_kernel`, Triton 3.6): F=768 bf16 (MoE fc1, 16
threads x 2 rows per 1-warp program, 3 chunks held): 152 registers, no spills, 2920 SASS
instructions per program = 61 per element per thread (~20 of them the IEEE division and ~10 the
accurate ``expf``), 105 MUFU, 12 LDG.128 + 12 STG.128; F=6144 (dense, 4 warps per row, 3
chunks): 147 registers, no spills, the same per-element count. Against a build with
``enable_fp_fusion=False`` the PTX differs only by 48 ``fma(ex2(f) * 2^i, 1)`` (= ``1 + expf``,
exact product) and 3 ``fma(y, 512, 2^23)`` (exact); ptxas adds no contraction of its own.
At ~61 instructions per element the F=768 case issues ~95 us of instructions on an H200 against
~105 us of HBM traffic: expect it near, but maybe not at, the copy bandwidth (measure).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from minite_megatron.nvfp4.producers import checked_output, swiglu_quantize_reference, validate_swiglu
from minite_megatron.nvfp4.quantize import check_finite
from minite_megatron.nvfp4.tensor import NVFP4Tensor

from minite_kernels.triton.nvfp4._nvfp4_math import ONE_SIXTH, canonical_nan_f32, global_scales_from_amax, interpreting, max_propagate_nan
from minite_kernels.triton.nvfp4.norm_quantize import as_nvfp4, round_half
from minite_kernels.triton.nvfp4.quantize_rows import _chunk_block_max, _load_chunk, _quantize_chunk, _unpack
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv


#: Warps per program when a row takes at most 32 threads (quantize_rows' measured best: 1).
GPU_SWIGLU_WARPS = 1
#: Threads per row: start at a warp; rows with more than MAX_CHUNKS chunks take up to 4 warps.
GPU_SWIGLU_NB = 32
MAX_NB = 128
MAX_CHUNKS = 4
#: Launch options: contraction as nvcc's default (on), libdevice without flush-to-zero.
LAUNCH = {"enable_reflect_ftz": False}


def config(r: int, f: int) -> tuple[int, int, int, int]:
    """(BLOCK_NB, BLOCK_R, num_warps, CHUNKS) for [r, 2f] -> [r, f]: BLOCK_NB (threads per row)
    the largest power of two <= GPU_SWIGLU_NB dividing the block count, doubled (up to MAX_NB,
    more warps per row) while the row has more than MAX_CHUNKS chunks; CHUNKS = 0 (store, read
    back) when it still has."""
    nb = f // 16
    block_nb = 1
    while block_nb * 2 <= GPU_SWIGLU_NB and nb % (block_nb * 2) == 0:
        block_nb *= 2
    while nb // block_nb > MAX_CHUNKS and block_nb * 2 <= MAX_NB and nb % (block_nb * 2) == 0:
        block_nb *= 2
    chunks = nb // block_nb
    if block_nb > 32:
        warps, block_r = block_nb // 32, 1
    else:
        warps = GPU_SWIGLU_WARPS
        block_r = (32 // block_nb) * (4 if interpreting() else warps)  # interpreter: fewer programs
    return block_nb, block_r, warps, chunks if chunks <= MAX_CHUNKS else 0


@triton.jit
def silu_f32(g, ACCURATE_EXP: tl.constexpr):
    """torch's CUDA silu in fp32: ``g / (1 + exp(-g))``, IEEE division; libdevice ``expf`` on
    the GPU (``ACCURATE_EXP``), numpy's exp under the interpreter."""
    if ACCURATE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    return tl.math.div_rn(g, 1.0 + e)


@triton.jit
def _swiglu_half(gw, uw, p, IS_FP16: tl.constexpr, BITWISE_BF16: tl.constexpr, ACCURATE_EXP: tl.constexpr,
                 WEIGHTED: tl.constexpr, UP_PLUS_ZERO: tl.constexpr):
    """Words of gate and up -> words of ``a = round(round(silu(gate)) * up)`` (times the row's
    probability ``p``, rounded again, when ``WEIGHTED``); ``UP_PLUS_ZERO``: ``up + 0.0`` first
    (Megatron's inline GLU with ``glu_linear_offset`` 0: exact, except -0.0 -> +0.0)."""
    g_lo, g_hi = _unpack(gw, IS_FP16)
    u_lo, u_hi = _unpack(uw, IS_FP16)
    if UP_PLUS_ZERO:
        u_lo = u_lo + 0.0
        u_hi = u_hi + 0.0
    _b, s_lo = round_half(silu_f32(g_lo, ACCURATE_EXP), IS_FP16, BITWISE_BF16)
    _b2, s_hi = round_half(silu_f32(g_hi, ACCURATE_EXP), IS_FP16, BITWISE_BF16)
    a_lo, va_lo = round_half(s_lo * u_lo, IS_FP16, BITWISE_BF16)
    a_hi, va_hi = round_half(s_hi * u_hi, IS_FP16, BITWISE_BF16)
    if WEIGHTED:
        a_lo, _w = round_half(va_lo * p, IS_FP16, BITWISE_BF16)
        a_hi, _w2 = round_half(va_hi * p, IS_FP16, BITWISE_BF16)
    return a_lo | (a_hi << 16)


@triton.jit
def _swiglu_chunk(g_row, a_row, F, jw, c, rmask3, p,
                  BLOCK_NB: tl.constexpr, IS_FP16: tl.constexpr, BITWISE_BF16: tl.constexpr,
                  ACCURATE_EXP: tl.constexpr, WEIGHTED: tl.constexpr, UP_PLUS_ZERO: tl.constexpr):
    """a of chunk ``c``: stored, and returned as words (0-3, 4-7 of each block) with the block amax."""
    ga, gb = _load_chunk(g_row, jw, c, BLOCK_NB, rmask3)
    ua, ub = _load_chunk(g_row + F // 2, jw, c, BLOCK_NB, rmask3)
    aa = _swiglu_half(ga, ua, p, IS_FP16, BITWISE_BF16, ACCURATE_EXP, WEIGHTED, UP_PLUS_ZERO)
    ab = _swiglu_half(gb, ub, p, IS_FP16, BITWISE_BF16, ACCURATE_EXP, WEIGHTED, UP_PLUS_ZERO)
    off = a_row + c * (BLOCK_NB * 8) + jw
    tl.store(off, aa, mask=rmask3)
    tl.store(off + 4, ab, mask=rmask3)
    return aa, ab, _chunk_block_max(aa, ab, IS_FP16)


@triton.jit
def _swiglu_quantize_kernel(
    h_ptr, a_ptr, codes_ptr, scales_ptr, sdec_ptr, image_ptr, p_ptr,
    R, F, stride_w,
    IS_FP16: tl.constexpr, WITH_IMAGE: tl.constexpr, BITWISE_BF16: tl.constexpr, ACCURATE_EXP: tl.constexpr,
    BLOCK_NB: tl.constexpr, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr, WEIGHTED: tl.constexpr = False,
    QUANTIZE: tl.constexpr = True, UP_PLUS_ZERO: tl.constexpr = False,
):
    """BLOCK_R rows per program, BLOCK_NB threads (one output block each) per row and chunk;
    tiles ``[BLOCK_NB, BLOCK_R, 4]`` words as in :mod:`.quantize_rows`. ``stride_w``: h's row
    stride in int32 words. ``QUANTIZE=False``: only ``a`` is written (:mod:`.weighted_swiglu`;
    the quantization pointers are not touched). See the module docstring."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R))[None, :]  # [1, BR]
    rmask = rows < R
    rmask3 = rmask[:, :, None]
    r64 = rows.to(tl.int64)[:, :, None]
    g_row = h_ptr.to(tl.pointer_type(tl.int32)) + r64 * stride_w
    a_row = a_ptr.to(tl.pointer_type(tl.int32)) + r64 * (F // 2)
    jw = (tl.arange(0, BLOCK_NB) * 8)[:, None, None] + tl.arange(0, 4)[None, None, :]
    inner = tl.zeros((1, BLOCK_R, 1), tl.uint32)
    p = 1.0
    if WEIGHTED:  # the rows' routing probabilities, [1, BR, 1]
        p = tl.load(p_ptr + rows, mask=rmask, other=0.0)[:, :, None]
    if CHUNKS > 0:  # a of the whole row in registers
        aa0, ab0, bm0 = _swiglu_chunk(g_row, a_row, F, jw, 0, rmask3, p, BLOCK_NB, IS_FP16, BITWISE_BF16, ACCURATE_EXP,
                                      WEIGHTED, UP_PLUS_ZERO)
        m = bm0
        if CHUNKS > 1:
            aa1, ab1, bm1 = _swiglu_chunk(g_row, a_row, F, jw, 1, rmask3, p, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                          ACCURATE_EXP, WEIGHTED, UP_PLUS_ZERO)
            m = tl.maximum(m, bm1, propagate_nan=tl.PropagateNan.ALL)
        if CHUNKS > 2:
            aa2, ab2, bm2 = _swiglu_chunk(g_row, a_row, F, jw, 2, rmask3, p, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                          ACCURATE_EXP, WEIGHTED, UP_PLUS_ZERO)
            m = tl.maximum(m, bm2, propagate_nan=tl.PropagateNan.ALL)
        if CHUNKS > 3:
            aa3, ab3, bm3 = _swiglu_chunk(g_row, a_row, F, jw, 3, rmask3, p, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                          ACCURATE_EXP, WEIGHTED, UP_PLUS_ZERO)
            m = tl.maximum(m, bm3, propagate_nan=tl.PropagateNan.ALL)
    else:  # long rows: a stored chunk by chunk, read back below by the same threads
        m = tl.zeros((BLOCK_NB, BLOCK_R), tl.float32)
        for c in range(0, F // (16 * BLOCK_NB)):
            aa, ab, bm = _swiglu_chunk(g_row, a_row, F, jw, c, rmask3, p, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                       ACCURATE_EXP, WEIGHTED, UP_PLUS_ZERO)
            m = tl.maximum(m, bm, propagate_nan=tl.PropagateNan.ALL)
    if QUANTIZE:
        amax = tl.reduce(m, 0, max_propagate_nan, keep_dims=True)  # [1, BR]
        s_enc, s_dec = global_scales_from_amax(amax)
        tl.store(sdec_ptr + rows, canonical_nan_f32(s_dec), mask=rmask)
        scale_mul = s_enc * ONE_SIXTH
        if CHUNKS > 0:
            _quantize_chunk(aa0, ab0, bm0, rows, 0, rmask, F, scale_mul, s_dec, inner, codes_ptr, scales_ptr, image_ptr,
                            0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)
            if CHUNKS > 1:
                _quantize_chunk(aa1, ab1, bm1, rows, 1, rmask, F, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                                image_ptr, 0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)
            if CHUNKS > 2:
                _quantize_chunk(aa2, ab2, bm2, rows, 2, rmask, F, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                                image_ptr, 0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)
            if CHUNKS > 3:
                _quantize_chunk(aa3, ab3, bm3, rows, 3, rmask, F, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                                image_ptr, 0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)
        else:
            tl.debug_barrier()  # a's stores are visible to the loads below (they are the same threads' anyway)
            for c in range(0, F // (16 * BLOCK_NB)):
                aa, ab = _load_chunk(a_row, jw, c, BLOCK_NB, rmask3)
                _quantize_chunk(aa, ab, _chunk_block_max(aa, ab, IS_FP16), rows, c, rmask, F, scale_mul, s_dec, inner,
                                codes_ptr, scales_ptr, image_ptr, 0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)


@custom_op("minite::swiglu_quantize", mutates_args=())
def swiglu_quantize_op(
    h: torch.Tensor, with_image: bool, probs: torch.Tensor | None = None, inline_glu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel launch: ``h`` [M, 2F] bf16/fp16 (unit stride along the last dim, rows on 4-byte
    boundaries), ``probs`` None or [M] fp32 contiguous. Returns ``(a [M, F], codes [M, F/2] uint8, scales [M, F/16] uint8 (E4M3 bits),
    global decode [M] fp32, image [M, F] bf16 or [0])``."""
    m, f2 = h.shape
    f = f2 // 2
    dev = h.device
    a = torch.empty(m, f, dtype=h.dtype, device=dev)
    codes = torch.empty(m, f // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(m, f // 16, dtype=torch.uint8, device=dev)
    sdec = torch.empty(m, dtype=torch.float32, device=dev)
    image = torch.empty((m, f) if with_image else (0,), dtype=torch.bfloat16, device=dev)
    if m == 0:
        return a, codes, scales, sdec, image
    block_nb, block_r, warps, chunks = config(m, f)
    interp = interpreting()
    _swiglu_quantize_kernel[(cdiv(m, block_r),)](
        h, a, codes, scales, sdec, image if with_image else codes, probs if probs is not None else sdec,
        m, f, h.stride(0) // 2,
        IS_FP16=h.dtype == torch.float16, WITH_IMAGE=with_image, BITWISE_BF16=interp and h.dtype == torch.bfloat16,
        ACCURATE_EXP=not interp, BLOCK_NB=block_nb, BLOCK_R=block_r, CHUNKS=chunks, WEIGHTED=probs is not None,
        UP_PLUS_ZERO=inline_glu, num_warps=warps,
        **({} if interp else LAUNCH),
    )
    return a, codes, scales, sdec, image


@swiglu_quantize_op.register_fake
def _(h, with_image, probs=None, inline_glu=False):
    m, f2 = h.shape
    f = f2 // 2
    return (h.new_empty((m, f)), h.new_empty((m, f // 2), dtype=torch.uint8),
            h.new_empty((m, f // 16), dtype=torch.uint8), h.new_empty((m,), dtype=torch.float32),
            h.new_empty((m, f) if with_image else (0,), dtype=torch.bfloat16))


def swiglu_quantize(
    h: torch.Tensor,
    *,
    with_image: bool = True,
    nonfinite: str = "propagate",
    probs: torch.Tensor | None = None,
    inline_glu: bool = False,
) -> tuple[torch.Tensor, NVFP4Tensor]:
    """Megatron's SwiGLU fused with NVFP4 quantization of its output (per-row scales).

    Args:
        h: ``[M, 2F]`` bf16 / fp16 with unit stride along the last dim (gate = ``h[:, :F]``,
            up = ``h[:, F:]``), F a positive multiple of 16, M >= 0.
        with_image: also write the bf16 image (codes x block scales) for the emulated GEMMs.
        nonfinite: ``"propagate"`` (a row whose ``a`` holds NaN/inf gets NaN scales) or
            ``"raise"`` (ValueError naming the first non-finite element of h, then of a).
        probs: optional ``[M]`` fp32 routing probabilities: ``a`` is each row's SwiGLU times its
            probability (Megatron's grouped experts), rounded to ``h.dtype``.
        inline_glu: Megatron's inline GLU (``use_te_activation_func`` off: ``silu(gate) * (up +
            glu_linear_offset)``, offset 0): ``up + 0.0`` first, which turns an ``up`` of -0.0
            into +0.0 (the sign of a zero in ``a``) and changes nothing else.
    Returns:
        ``(a, q)``: ``a`` [M, F] in ``h.dtype``, ``q`` the NVFP4Tensor of ``a``, bitwise
        ``quantize_reference(a, global_scale="row", with_image=with_image)``.
    Raises:
        TypeError / ValueError as :func:`~minite_megatron.nvfp4.producers.validate_swiglu`.
    Without a GPU (and outside the interpreter) the torch reference runs instead.
    """
    validate_swiglu(h, nonfinite, probs)
    if not h.is_cuda and not interpreting():
        return swiglu_quantize_reference(h, with_image=with_image, nonfinite=nonfinite, probs=probs, inline_glu=inline_glu)
    if h.stride(1) != 1 or h.stride(0) % 2 or h.data_ptr() % 4:
        h = h.contiguous()
    if nonfinite == "raise":
        check_finite(h)
    a, codes, scales, sdec, image = swiglu_quantize_op(h, bool(with_image), None if probs is None else probs.contiguous(),
                                                       bool(inline_glu))
    if nonfinite == "raise":
        checked_output(a, "swiglu_quantize: the activation a")
    return a, as_nvfp4(codes, scales, sdec, image, a.shape, with_image)


def aot_kernel(r: int = 65536, f: int = 768, dtype: str = "bf16", weighted: bool = False):
    """The kernel at its GPU launch config for [r, 2f] ``dtype`` (image written), compiled for
    sm_90a on this machine (needs a process without ``TRITON_INTERPRET``)."""
    from minite_kernels.triton._build._aot import compile_for

    block_nb, block_r, warps, chunks = config(r, f)
    sig = {"h_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "codes_ptr": "*u8", "scales_ptr": "*u8", "sdec_ptr": "*fp32",
           "image_ptr": "*bf16", "p_ptr": "*fp32", "R": "i32", "F": "i32", "stride_w": "i32"}
    ce = dict(IS_FP16=dtype == "fp16", WITH_IMAGE=True, BITWISE_BF16=False, ACCURATE_EXP=True,
              BLOCK_NB=block_nb, BLOCK_R=block_r, CHUNKS=chunks, WEIGHTED=weighted)
    return compile_for(_swiglu_quantize_kernel, sig, ce, num_warps=warps, divisible=("F", "stride_w"), **LAUNCH)
