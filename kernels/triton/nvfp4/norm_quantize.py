"""Fused RMSNorm -> NVFP4 (per-row global scale): one kernel writes ``y`` and its quantization.

``rmsnorm_quantize(x, weight, eps, zero_centered_gamma)`` returns ``(y, q)`` with

* ``y`` bitwise equal to :func:`.bi_rmsnorm.bi_rmsnorm` ``(x, weight, eps, zero_centered_gamma)``;
* ``q`` bitwise equal to ``nvfp4.quantize_reference(y, global_scale="row", with_image=...)``
  (codes, E4M3 block scales, fp32 per-row global decode scales, bf16 image).

Reference (CPU path without a GPU): :func:`minite_megatron.nvfp4.producers.rmsnorm_quantize_reference`.

What guarantees ``y == bi_rmsnorm(x)`` (phase 1 is bi_rmsnorm's reduction, unchanged):

1. One program per row, ``num_warps=4``, ``BLOCK = min(next_pow2(H), 4096)`` (bi_rmsnorm's), and
   the same statements: ``BLOCK`` lanes accumulate ``acc += x * x`` over the chunks
   ``0, BLOCK, ...`` (the same load expression, so Triton gives the loads and ``acc`` the same
   layout), one ``tl.sum``, ``/ H`` (Triton's ``div.full.f32``), ``div_rn(1, sqrt_rn(ms + eps))``.
   The sum's tree (in-thread order, warp shuffles, cross-warp step) is a function of that layout.
2. The same compile options as bi_rmsnorm (Triton's defaults: FMA contraction *on*). This is
   load-bearing: the sm_90a build of bi_rmsnorm accumulates with ``fma.rn.f32``, and ptxas
   merges ``div.full``'s multiply with ``+ eps`` into one FFMA; a kernel built with
   ``enable_fp_fusion=False`` rounds those steps separately and differs in the last bit.
   :func:`tests.kernels.triton.nvfp4.test_triton_producers` compiles both kernels for sm_90a and
   checks that the PTX of the reduction (every instruction up to ``sqrt.rn``) is the same.
3. ``y = x * r * w`` is element-wise (independent of layout), rounded once to ``x.dtype``.

The quantize steps are exact with contraction on as well: they are the bit-level helpers of
:mod:`._nvfp4_math` / :mod:`.quantize_rows` whose only multiply feeding an addition is the E4M3
subnormal rounding ``y * 512 + 2^23`` (``y * 512`` is exact, so an FMA gives the same bits);
every division is ``div_rn``; nothing is flushed (``enable_reflect_ftz`` only affects
libdevice calls, and there are none here).

Phase 2 reads the row again as int32 *words* in :mod:`.quantize_rows`' layout (one thread per
16-element block, 16-byte loads; the row was just read, so this read hits L1/L2, not HBM),
forms ``y`` (stored as words), the block amax, the row amax, and quantizes with
``quantize_rows._quantize_chunk``. A row of at most ``MAX_CHUNKS`` chunks of ``BLOCK_NB``
blocks stays in registers; a longer one (H > 4096 on the GPU) stores ``y`` in a first pass and
reads it back (same threads) to quantize. x is read from HBM once.

Compiled for sm_90a on the CPU (:func:`aot_kernel`, Triton 3.6, ptxas from its wheel; H=2048
bf16, image written; one row per program, 4 warps, one block per thread): 56 registers, no
spills (bi_rmsnorm: 32), 944 SASS instructions per 2048-element row (0.46 per element,
bi_rmsnorm 432), 6 LDG.128 (x, then x and w as words) and 4 STG.128 (y, image). The PTX of the
reduction (every fp32 / shuffle / barrier instruction up to ``sqrt.rn``) is identical to
bi_rmsnorm's at H = 2048 bf16, 4096 fp16 and 8192 bf16; after it the only ``fma.rn.f32`` is
``fma(y, 512, 2^23)`` (exact, above); ptxas contracts exactly one more mul+add than with
``--fmad=false`` in both kernels (``div.full``'s multiply with ``+ eps``). The tests pin these.

The residual variant (:func:`add_rmsnorm_quantize`, the decode step's bias-dropout-add fused
into the next norm): the program first writes ``h = round(residual + out)`` (each operand
loaded to fp32, one fp32 add, one RNE to the 16-bit dtype: torch's add; double rounding through
fp32 is innocuous for a sum of two 16-bit values, so ptxas's single-rounding ``add.bf16x2``
gives the same bits) to ``h``'s buffer, then ``bar.sync`` (the row's stores visible to every
thread of the program), then the kernel above with ``x = h`` read back. Before that barrier the
reduction list holds nothing (the add is element-wise); after it the reduction PTX is
bi_rmsnorm's (tests/kernels/triton/nvfp4/test_residual_norm.py pins both). The extra traffic per row:
two reads and one write of ``H`` 16-bit values (h's read-back hits L1/L2); unfused it is two
kernels (torch's add, then the norm) and one more read of ``h`` from memory.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from minite_megatron.nvfp4.producers import (
    checked_output,
    rmsnorm_quantize_reference,
    validate_rmsnorm,
)
from minite_megatron.nvfp4.moe_reference import ordered_sum_reference
from minite_megatron.nvfp4.quantize import check_finite
from minite_megatron.nvfp4.tensor import NVFP4Tensor

from minite_kernels.triton.nvfp4._nvfp4_math import ONE_SIXTH, canonical_nan_f32, global_scales_from_amax, interpreting, max_propagate_nan
from minite_kernels.triton.invariant.bi_rmsnorm import MAX_BLOCK
from minite_kernels.triton.nvfp4.quantize_rows import _chunk_block_max, _load_chunk, _quantize_chunk, _unpack
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import next_pow2


#: bi_rmsnorm's num_warps (part of the reduction layout: do not change one without the other).
NORM_WARPS = 4
#: Rows of at most this many chunks (of BLOCK_NB blocks) keep y in registers.
MAX_CHUNKS = 4


def config(h: int) -> tuple[int, int, int]:
    """(BLOCK, BLOCK_NB, CHUNKS): BLOCK is bi_rmsnorm's; BLOCK_NB the largest power of two <=
    128 (the program's threads) dividing the row's block count; CHUNKS = blocks / BLOCK_NB if
    <= MAX_CHUNKS (y in registers), else 0 (e.g. H = 80: 5 chunks of one block; H = 16384)."""
    block = min(next_pow2(h), MAX_BLOCK)
    nb = h // 16
    cap = 32 * NORM_WARPS
    block_nb = 1
    while block_nb * 2 <= cap and nb % (block_nb * 2) == 0:
        block_nb *= 2
    chunks = nb // block_nb
    return block, block_nb, chunks if chunks <= MAX_CHUNKS else 0


@triton.jit
def _load_f32(ptr, mask, BITWISE_BF16: tl.constexpr):
    """bi_rmsnorm's ``tl.load(...).to(tl.float32)``; under the interpreter (whose bf16 -> fp32
    cast mangles subnormals) a bf16 load converted on the bits instead: the same values."""
    if BITWISE_BF16:
        b = tl.load(ptr.to(tl.pointer_type(tl.int16)), mask=mask, other=0)
        return (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def round_half(v, IS_FP16: tl.constexpr, BITWISE_BF16: tl.constexpr):
    """fp32 ``v`` -> (its RNE 16-bit pattern in the low half of an int32, that value in fp32).

    On the GPU ``cvt.rn`` (what bi_rmsnorm's store and torch do); under the interpreter, whose
    fp32 -> bf16 cast truncates, bf16 is rounded on the bits (NaN -> 0x7FC0, torch's pattern).
    """
    if IS_FP16:
        hv = v.to(tl.float16)
        bits = hv.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        val = hv.to(tl.float32)
    else:
        if BITWISE_BF16:
            b = v.to(tl.int32, bitcast=True)
            bits = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
            bits = tl.where(v != v, 0x7FC0, bits)
        else:
            bits = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        val = (bits << 16).to(tl.float32, bitcast=True)
    return bits, val


@triton.jit
def _weight_pair(w_ptr, jw, c, BLOCK_NB: tl.constexpr, W_KIND: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """fp32 weights of the low / high element of each word of chunk ``c`` ([NB, 1, 4] each)."""
    woff = c * (BLOCK_NB * 8) + jw
    if W_KIND == 2:  # fp32 weights: two strided loads
        w_lo = tl.load(w_ptr + 2 * woff)
        w_hi = tl.load(w_ptr + 2 * woff + 1)
    else:
        w_lo, w_hi = _unpack(tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + woff), W_KIND == 1)
    if ZERO_CENTERED:
        w_lo = w_lo + 1.0
        w_hi = w_hi + 1.0
    return w_lo, w_hi


@triton.jit
def _norm_half(xw, w_lo, w_hi, r, IS_FP16: tl.constexpr, BITWISE_BF16: tl.constexpr):
    """Words of x -> words of ``y = round(x * r * w)`` (bi_rmsnorm's expression)."""
    x_lo, x_hi = _unpack(xw, IS_FP16)
    b_lo, _v = round_half(x_lo * r * w_lo, IS_FP16, BITWISE_BF16)
    b_hi, _v2 = round_half(x_hi * r * w_hi, IS_FP16, BITWISE_BF16)
    return b_lo | (b_hi << 16)


@triton.jit
def _norm_chunk(x_row, y_row, w_ptr, jw, c, r, rmask3,
                BLOCK_NB: tl.constexpr, IS_FP16: tl.constexpr, BITWISE_BF16: tl.constexpr,
                W_KIND: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """y of chunk ``c``: stored, and returned as words (0-3, 4-7 of each block) with the block amax."""
    xa, xb = _load_chunk(x_row, jw, c, BLOCK_NB, rmask3)
    wla, wha = _weight_pair(w_ptr, jw, c, BLOCK_NB, W_KIND, ZERO_CENTERED)
    wlb, whb = _weight_pair(w_ptr, jw + 4, c, BLOCK_NB, W_KIND, ZERO_CENTERED)
    ya = _norm_half(xa, wla, wha, r, IS_FP16, BITWISE_BF16)
    yb = _norm_half(xb, wlb, whb, r, IS_FP16, BITWISE_BF16)
    off = y_row + c * (BLOCK_NB * 8) + jw
    tl.store(off, ya, mask=rmask3)
    tl.store(off + 4, yb, mask=rmask3)
    return ya, yb, _chunk_block_max(ya, yb, IS_FP16)


@triton.jit
def _rmsnorm_quantize_kernel(
    x_ptr, w_ptr, y_ptr, codes_ptr, scales_ptr, sdec_ptr, image_ptr,
    H, sxm, sxh, eps,
    ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr,
    IS_FP16: tl.constexpr, W_KIND: tl.constexpr, WITH_IMAGE: tl.constexpr, BITWISE_BF16: tl.constexpr,
    BLOCK_NB: tl.constexpr, CHUNKS: tl.constexpr,
    r_ptr=None, o_ptr=None, s_r=0, s_o=0, RESIDUAL: tl.constexpr = False, c_ptr=None, COMBINE: tl.constexpr = 0,
):
    """One row per program (bi_rmsnorm's grid and warps). ``sxh`` is 1 (unit stride along H;
    kept as an argument so phase 1's load expression is bi_rmsnorm's). See the module docstring.
    ``RESIDUAL``: first ``x = round(residual + out)`` is written to ``x_ptr`` (the residual add of
    Megatron's bias-dropout-add: an fp32 add rounded once to the 16-bit dtype, as torch adds), then
    a barrier, then the kernel as without it (phase 1 reads ``x`` back: the same load expression).
    ``COMBINE`` (k > 0): ``out`` is the MoE layer's expert rows, row ``t``'s being ``c_ptr[t * k + j]``,
    added in that order from ``+0`` with each sum rounded to the 16-bit dtype (the deterministic
    combine, ``moe_combine.moe_sum_rows``' arithmetic) before the residual add."""
    if RESIDUAL:
        row0 = tl.program_id(0).to(tl.int64)
        for h0 in range(0, H, BLOCK):
            cols0 = h0 + tl.arange(0, BLOCK)
            m0 = cols0 < H
            a = _load_f32(r_ptr + row0 * s_r + cols0, m0, BITWISE_BF16)
            if COMBINE > 0:
                b = tl.zeros((BLOCK,), tl.float32)  # +0.0
                for j in tl.static_range(COMBINE):
                    src = tl.load(c_ptr + row0 * COMBINE + j).to(tl.int64)
                    _bb, b = round_half(b + _load_f32(o_ptr + src * s_o + cols0, m0, BITWISE_BF16), IS_FP16,
                                        BITWISE_BF16)
            else:
                b = _load_f32(o_ptr + row0 * s_o + cols0, m0, BITWISE_BF16)
            hb, _hv = round_half(a + b, IS_FP16, BITWISE_BF16)
            tl.store(x_ptr.to(tl.pointer_type(tl.int16)) + row0 * sxm + cols0, hb.to(tl.int16), mask=m0)
        tl.debug_barrier()  # x's stores are visible to every thread's loads below
    # ---- phase 1: bi_rmsnorm's reduction, statement for statement
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + lanes
        x = _load_f32(x_ptr + row * sxm + cols.to(tl.int64) * sxh, cols < H, BITWISE_BF16)
        acc += x * x
    ms = tl.sum(acc, axis=0) / H
    r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))

    # ---- phase 2: y and its quantization, one thread per 16-block ([NB, 1, 4] word tiles)
    rows = tl.zeros((1, 1), tl.int32) + tl.program_id(0)  # [1, BR=1]
    rmask = rows >= 0
    rmask3 = rmask[:, :, None]
    x_row = x_ptr.to(tl.pointer_type(tl.int32)) + row * (sxm // 2)
    y_row = y_ptr.to(tl.pointer_type(tl.int32)) + row * (H // 2)
    jw = (tl.arange(0, BLOCK_NB) * 8)[:, None, None] + tl.arange(0, 4)[None, None, :]
    inner = tl.zeros((1, 1, 1), tl.uint32)
    if CHUNKS > 0:  # y of the whole row in registers
        ya0, yb0, bm0 = _norm_chunk(x_row, y_row, w_ptr, jw, 0, r, rmask3, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                    W_KIND, ZERO_CENTERED)
        m = bm0
        if CHUNKS > 1:
            ya1, yb1, bm1 = _norm_chunk(x_row, y_row, w_ptr, jw, 1, r, rmask3, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                        W_KIND, ZERO_CENTERED)
            m = tl.maximum(m, bm1, propagate_nan=tl.PropagateNan.ALL)
        if CHUNKS > 2:
            ya2, yb2, bm2 = _norm_chunk(x_row, y_row, w_ptr, jw, 2, r, rmask3, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                        W_KIND, ZERO_CENTERED)
            m = tl.maximum(m, bm2, propagate_nan=tl.PropagateNan.ALL)
        if CHUNKS > 3:
            ya3, yb3, bm3 = _norm_chunk(x_row, y_row, w_ptr, jw, 3, r, rmask3, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                        W_KIND, ZERO_CENTERED)
            m = tl.maximum(m, bm3, propagate_nan=tl.PropagateNan.ALL)
    else:  # long rows: y stored chunk by chunk, read back below by the same threads
        m = tl.zeros((BLOCK_NB, 1), tl.float32)
        for c in range(0, H // (16 * BLOCK_NB)):
            ya, yb, bm = _norm_chunk(x_row, y_row, w_ptr, jw, c, r, rmask3, BLOCK_NB, IS_FP16, BITWISE_BF16,
                                     W_KIND, ZERO_CENTERED)
            m = tl.maximum(m, bm, propagate_nan=tl.PropagateNan.ALL)
    amax = tl.reduce(m, 0, max_propagate_nan, keep_dims=True)  # [1, 1]
    s_enc, s_dec = global_scales_from_amax(amax)
    tl.store(sdec_ptr + rows, canonical_nan_f32(s_dec))
    scale_mul = s_enc * ONE_SIXTH
    if CHUNKS > 0:
        _quantize_chunk(ya0, yb0, bm0, rows, 0, rmask, H, scale_mul, s_dec, inner, codes_ptr, scales_ptr, image_ptr,
                        0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)
        if CHUNKS > 1:
            _quantize_chunk(ya1, yb1, bm1, rows, 1, rmask, H, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                            image_ptr, 0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)
        if CHUNKS > 2:
            _quantize_chunk(ya2, yb2, bm2, rows, 2, rmask, H, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                            image_ptr, 0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)
        if CHUNKS > 3:
            _quantize_chunk(ya3, yb3, bm3, rows, 3, rmask, H, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                            image_ptr, 0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)
    else:
        tl.debug_barrier()  # y's stores are visible to the loads below (they are the same threads' anyway)
        for c in range(0, H // (16 * BLOCK_NB)):
            ya, yb = _load_chunk(y_row, jw, c, BLOCK_NB, rmask3)
            _quantize_chunk(ya, yb, _chunk_block_max(ya, yb, IS_FP16), rows, c, rmask, H, scale_mul, s_dec, inner,
                            codes_ptr, scales_ptr, image_ptr, 0, False, WITH_IMAGE, False, IS_FP16, BLOCK_NB)


def _w_kind(weight: torch.Tensor) -> int:
    return {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[weight.dtype]


@custom_op("minite::rmsnorm_quantize", mutates_args=())
def rmsnorm_quantize_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool, with_image: bool,
    residual: torch.Tensor | None = None, combine: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel launch: ``x`` [M, H] bf16/fp16 (unit stride along H, rows on 4-byte boundaries),
    ``weight`` [H] contiguous bf16/fp16/fp32. Returns ``(y [M, H], codes [M, H/2] uint8,
    scales [M, H/16] uint8 (E4M3 bits), global decode [M] fp32, image [M, H] bf16 or [0],
    x + residual [M, H] or [0])``; with ``residual`` ([M, H], x's dtype, unit stride along H) the
    kernel normalizes ``x + residual``; with ``combine`` (int32 ``[M * k]``) ``x`` holds expert rows
    ``[P, H]`` and row ``t`` of ``x`` is first their ordered sum ``x[combine[t * k + j]]``, ``j < k``."""
    m, h = (x.shape if combine is None else (residual.shape[0], x.shape[1]))
    dev = x.device
    summed = torch.empty((m, h) if residual is not None else (0,), dtype=x.dtype, device=dev)
    y = torch.empty(m, h, dtype=x.dtype, device=dev)
    codes = torch.empty(m, h // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(m, h // 16, dtype=torch.uint8, device=dev)
    sdec = torch.empty(m, dtype=torch.float32, device=dev)
    image = torch.empty((m, h) if with_image else (0,), dtype=torch.bfloat16, device=dev)
    if m == 0:
        return y, codes, scales, sdec, image, summed
    block, block_nb, chunks = config(h)
    extra = {}
    if residual is not None:
        extra = dict(r_ptr=residual, o_ptr=x, s_r=residual.stride(0), s_o=x.stride(0), RESIDUAL=True)
        if combine is not None:
            extra.update(c_ptr=combine, COMBINE=combine.numel() // m)
    # bi_rmsnorm's launch options (Triton's defaults: FMA contraction on), see the module docstring
    xin = summed if residual is not None else x
    _rmsnorm_quantize_kernel[(m,)](
        xin, weight, y, codes, scales, sdec, image if with_image else codes,
        h, xin.stride(0), xin.stride(1), eps,
        ZERO_CENTERED=zero_centered_gamma, BLOCK=block, IS_FP16=x.dtype == torch.float16, W_KIND=_w_kind(weight),
        WITH_IMAGE=with_image, BITWISE_BF16=interpreting() and x.dtype == torch.bfloat16,
        BLOCK_NB=block_nb, CHUNKS=chunks, num_warps=NORM_WARPS, **extra,
    )
    return y, codes, scales, sdec, image, summed


@rmsnorm_quantize_op.register_fake
def _(x, weight, eps, zero_centered_gamma, with_image, residual=None, combine=None):
    m, h = x.shape if combine is None else (residual.shape[0], x.shape[1])
    return (x.new_empty((m, h)), x.new_empty((m, h // 2), dtype=torch.uint8),
            x.new_empty((m, h // 16), dtype=torch.uint8), x.new_empty((m,), dtype=torch.float32),
            x.new_empty((m, h) if with_image else (0,), dtype=torch.bfloat16),
            x.new_empty((m, h) if residual is not None else (0,)))


def as_nvfp4(codes, scales, sdec, image, shape, with_image: bool) -> NVFP4Tensor:
    """The kernel outputs as the reference's NVFP4Tensor (row scales, 1x16 blocks, linear)."""
    return NVFP4Tensor(
        codes=codes, block_scales=scales.view(torch.float8_e4m3fn), global_decode=sdec, shape=torch.Size(shape),
        global_scale="row", tile=(1, 16), image=image if with_image else None,
    )


def rmsnorm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    *,
    with_image: bool = True,
    nonfinite: str = "propagate",
) -> tuple[torch.Tensor, NVFP4Tensor]:
    """Batch-invariant RMSNorm fused with NVFP4 quantization of its output (per-row scales).

    Args:
        x: ``[M, H]`` bf16 / fp16 with unit stride along H, H a positive multiple of 16, M >= 0.
        weight: ``[H]`` bf16 / fp16 / fp32.
        eps, zero_centered_gamma: as :func:`.bi_rmsnorm.bi_rmsnorm`.
        with_image: also write the bf16 image (codes x block scales) for the emulated GEMMs.
        nonfinite: ``"propagate"`` (a row with NaN/inf gets NaN scales) or ``"raise"``
            (ValueError naming the first non-finite element of x, then of y).
    Returns:
        ``(y, q)``: ``y`` [M, H] in ``x.dtype`` (bitwise ``bi_rmsnorm``), ``q`` the NVFP4Tensor of
        ``y`` (bitwise ``quantize_reference(y, global_scale="row", with_image=with_image)``:
        codes [M, H/2], linear E4M3 scales [M, H/16], global decode [M]).
    Raises:
        TypeError / ValueError as :func:`~minite_megatron.nvfp4.producers.validate_rmsnorm`.
    Without a GPU (and outside the interpreter) the torch reference runs instead.
    """
    validate_rmsnorm(x, weight, nonfinite)
    if not x.is_cuda and not interpreting():
        return rmsnorm_quantize_reference(x, weight, eps, zero_centered_gamma, with_image=with_image,
                                          nonfinite=nonfinite)
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    if nonfinite == "raise":
        check_finite(x)
    weight = weight if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else weight.float()
    weight = weight.contiguous()
    if weight.dtype != torch.float32 and weight.data_ptr() % 4:
        weight = weight.clone()
    y, codes, scales, sdec, image, _ = rmsnorm_quantize_op(x, weight, float(eps), bool(zero_centered_gamma),
                                                           bool(with_image))
    if nonfinite == "raise":
        checked_output(y, "rmsnorm_quantize: the normalized output y")
    return y, as_nvfp4(codes, scales, sdec, image, x.shape, with_image)


def aot_kernel(h: int = 2048, dtype: str = "bf16"):
    """The kernel as launched on the GPU for [M, h] ``dtype`` rows and weights (image written),
    compiled for sm_90a on this machine (needs a process without ``TRITON_INTERPRET``)."""
    from minite_kernels.triton._build._aot import compile_for

    block, block_nb, chunks = config(h)
    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "codes_ptr": "*u8",
           "scales_ptr": "*u8", "sdec_ptr": "*fp32", "image_ptr": "*bf16", "H": "i32", "sxm": "i32",
           "sxh": "i32", "eps": "fp32"}
    ce = dict(ZERO_CENTERED=False, BLOCK=block, IS_FP16=dtype == "fp16", W_KIND=1 if dtype == "fp16" else 0,
              WITH_IMAGE=True, BITWISE_BF16=False, BLOCK_NB=block_nb, CHUNKS=chunks, sxh=1)
    sig.pop("sxh")
    return compile_for(_rmsnorm_quantize_kernel, sig, ce, num_warps=NORM_WARPS, divisible=("H", "sxm"))


def aot_bi_rmsnorm(h: int = 2048, dtype: str = "bf16"):
    """bi_rmsnorm's kernel as launched for [M, h] contiguous ``dtype`` rows, compiled for sm_90a."""
    from minite_kernels.triton._build._aot import compile_for
    from minite_kernels.triton.invariant.bi_rmsnorm import _bi_rmsnorm_kernel

    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "H": "i32", "sxm": "i32",
           "som": "i32", "eps": "fp32"}
    return compile_for(_bi_rmsnorm_kernel, sig, dict(ZERO_CENTERED=False, BLOCK=min(next_pow2(h),
                                                                                    MAX_BLOCK), sxh=1),
                       num_warps=4, divisible=("H", "sxm", "som"))


def reduction_ptx(ptx: str) -> list[str]:
    """The fp32 arithmetic, shuffle and barrier instructions of a kernel's PTX up to its first
    ``sqrt.rn.f32`` (the sum of squares and ``ms + eps``), register names dropped: equal lists
    mean the same reduction tree and rounding steps."""
    out = []
    for line in ptx.splitlines():
        m = re.match(r"\s*(@%p\d+\s+)?((?:fma|add|mul|div|sqrt)[\w.]*\.f32|shfl[\w.]*|bar[\w.]*)", line)
        if m:
            out.append(m.group(2))
            if m.group(2).startswith("sqrt.rn"):
                break
    return out


def add_rmsnorm_quantize(
    residual: torch.Tensor,
    out: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    *,
    with_image: bool = True,
    combine: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, NVFP4Tensor]:
    """The residual add of a transformer layer fused into the next norm: ``h = residual + out``
    (torch's 16-bit add: the fp32 sum rounded once), then :func:`rmsnorm_quantize` of ``h``.

    Args:
        residual, out: ``[M, H]`` bf16 / fp16, the same dtype, unit stride along H.
        weight, eps, zero_centered_gamma, with_image: as :func:`rmsnorm_quantize`.
        combine: int32 / int64 ``[M * k]``: ``out`` is an MoE layer's expert rows ``[P, H]`` and the
            layer's output row ``t`` is their deterministic combine first (``nvfp4.moe_reference``'s
            ``ordered_sum_reference`` of rows ``combine[t * k:(t + 1) * k]``, what
            ``moe_combine.moe_sum_rows`` computes), in the same kernel.
    Returns:
        ``(h, y, q)``: ``h`` bitwise ``residual + out``; ``y`` bitwise ``bi_rmsnorm(h)``; ``q`` bitwise
        ``quantize_reference(y, global_scale="row")`` (the kernel's phase 1 reads ``h`` back with
        bi_rmsnorm's load expression; the sm_90a reduction PTX after the barrier is pinned equal).
    Raises:
        TypeError / ValueError as :func:`rmsnorm_quantize`, and for a mismatched ``residual``.
    """
    validate_rmsnorm(out, weight, "propagate")
    if combine is not None:
        rows_out = residual.shape[0] if isinstance(residual, torch.Tensor) and residual.dim() == 2 else 0
        if (combine.dim() != 1 or combine.dtype not in (torch.int32, torch.int64) or rows_out == 0
                or combine.numel() % rows_out or combine.device != out.device):
            raise ValueError(f"add_rmsnorm_quantize: combine must be int32/int64 [M * k] on {out.device} for the "
                             f"residual's M rows, got {combine.dtype} {tuple(combine.shape)} on {combine.device}")
        combined = (rows_out, out.shape[1])
    if not isinstance(residual, torch.Tensor) or residual.dtype != out.dtype or (
            residual.shape != (out.shape if combine is None else combined)):
        raise ValueError(f"add_rmsnorm_quantize: residual {getattr(residual, 'dtype', None)} "
                         f"{tuple(getattr(residual, 'shape', ()))} vs out {out.dtype} {tuple(out.shape)}")
    if not out.is_cuda and not interpreting():
        if combine is not None:
            k = combine.numel() // residual.shape[0]
            out = ordered_sum_reference(out.index_select(0, combine.long()).view(residual.shape[0], k, out.shape[1]))
        h = residual + out
        y, q = rmsnorm_quantize_reference(h, weight, eps, zero_centered_gamma, with_image=with_image)
        return h, y, q
    out = out if out.stride(1) == 1 else out.contiguous()
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    weight = weight if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else weight.float()
    weight = weight.contiguous()
    if weight.dtype != torch.float32 and weight.data_ptr() % 4:
        weight = weight.clone()
    y, codes, scales, sdec, image, h = rmsnorm_quantize_op(out, weight, float(eps), bool(zero_centered_gamma),
                                                           bool(with_image), residual,
                                                           None if combine is None else combine.to(torch.int32).contiguous())
    return h, y, as_nvfp4(codes, scales, sdec, image, residual.shape, with_image)


def aot_add_kernel(h: int = 2048, dtype: str = "bf16", combine: int = 0):
    """The residual-add variant as launched (image written; ``combine``: the MoE combine of that
    many expert rows first), compiled for sm_90a on this machine."""
    from minite_kernels.triton._build._aot import compile_for

    block, block_nb, chunks = config(h)
    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "codes_ptr": "*u8",
           "scales_ptr": "*u8", "sdec_ptr": "*fp32", "image_ptr": "*bf16", "H": "i32", "sxm": "i32",
           "eps": "fp32", "r_ptr": f"*{dtype}", "o_ptr": f"*{dtype}", "s_r": "i32", "s_o": "i32"}
    ce = dict(ZERO_CENTERED=False, BLOCK=block, IS_FP16=dtype == "fp16", W_KIND=1 if dtype == "fp16" else 0,
              WITH_IMAGE=True, BITWISE_BF16=False, BLOCK_NB=block_nb, CHUNKS=chunks, sxh=1, RESIDUAL=True,
              COMBINE=combine)
    if combine:
        sig["c_ptr"] = "*i32"
    return compile_for(_rmsnorm_quantize_kernel, sig, ce, num_warps=NORM_WARPS, divisible=("H", "sxm", "s_r", "s_o"))


def reduction_ptx_after_residual(ptx: str) -> tuple[list[str], list[str]]:
    """``(before, reduction)``: :func:`reduction_ptx`'s instructions split after the residual
    pass's barrier (the first ``bar``): what precedes it must be the residual add alone."""
    red = reduction_ptx(ptx)
    cut = next((i for i, op in enumerate(red) if op.startswith("bar")), -1)
    return red[: cut + 1], red[cut + 1 :]
