"""One read of a [T, N] matrix writes its row-wise and its column-wise NVFP4 quantization.

``quantize_row_col_forward(x, ...) -> (q_row, q_col)`` equals
:func:`minite_megatron.nvfp4.row_col.quantize_row_col` bit for bit: ``q_row`` is
``quantize(x)`` (1x16 blocks along the N features: dgrad / fprop operand) and ``q_col`` is
``quantize(x.t())`` (1x16 blocks along the T tokens after the optional random Hadamard
transform: the wgrad operand), each with its own global scale (``"row"`` or ``"tensor"``),
rounding (nearest or the contract's stochastic rounding, independent hash streams), image.
``amax_row_col_forward`` is the read-only pass that gives both global amaxes (plain per token /
tensor, transformed per feature / tensor); the dual pass runs it only when an amax is missing.
Input: bf16 / fp16 ``[T, N]`` with unit stride along N, T and N multiples of 16 (else
ValueError: the caller falls back to two ``quantize`` calls). Scales: linear layout only.

Kernel layout: a program owns ``BLOCK_HB`` row blocks (16 features each) x ``BLOCK_NB`` token
blocks (16 tokens each) per iteration and walks ``groups_per_prog`` such groups along the
tokens. The input is read as int32 words (two 16-bit elements): the 16 tokens of a token
block are 16 loads of ``[NB, HB, 4, 2]`` words, i.e. each thread holds 2 words (4 features,
one 8-byte load) of every token of its blocks, and the 4 threads of a row block are adjacent
lanes. So:

* row side (per token): a row block's amax is an in-thread max and two lane shuffles; the
  per-block math (E4M3 scale, IEEE division) runs on the 4 lanes of the block; codes (2 bytes)
  and image (8 bytes) per lane and token are written by the owning lane, coalesced along N;
* column side (per feature): the thread holds all 16 tokens of its 4 features' blocks: the
  RHT (:func:`.quantize_cols._rht16`, the contract's butterfly order), the block amax and the
  per-block math are in-thread; done for the 2 low-half features, then the 2 high-half ones
  (32 fp32 values live at a time); each feature's 8 code bytes and 32 image bytes are
  stored as 8- and 16-byte vectors along tokens.

Global scales come precomputed: a tiny kernel turns the amaxes into ``S_enc * RN(1/6)`` and
the (canonical NaN) ``S_dec`` once per domain, so no per-token fp64 division runs in the hot
loop. Element steps are the bit-level ones of :mod:`._nvfp4_math` (launched with
``EXACT_LAUNCH``: no FMA, no flush).

Compiled for sm_90a on a CPU (``python -m minite_kernels.triton.quantize_dual``; Triton 3.6's
ptxas) at the GPU config (BLOCK_HB 8, BLOCK_NB 1, 1 warp: 128 features x 16 tokens per
group, 64 elements per thread), bf16 input, images written: see :data:`AOT_FACTS`. In short:
no spills, no shared memory, no ``BAR``; 16 ``LDG.E.64`` per group; row image ``STG.E.64``,
column image ``STG.E.128``. Instructions per element (SASS of the group loop, the column loop
body counted twice, incl. the never-taken slow paths of ``div.rn``): ~108 for the dy recipe
(SR on both sides + RHT, 255 registers), ~71 for the x recipe (per-token row scale, RHT,
168 registers), ~61 with neither; the amax pass ~11 (tensor scales) / ~18 (per-token: shuffles
and atomics). The separate kernels together spend about as many instructions (the work is the
same); the dual pass saves the reads (2 passes over x instead of 4 for dy, 3 for x) and the
column kernel's shared-memory transposes. Prediction for dy 16384 x 5120 (unmeasured):
~0.27 ms of issue time + the amax pass (~0.04 ms, memory-bound) vs ~0.45 ms for the separate
calls; the byte floor (read x once; write 2 x (codes 42 + image 168 MB) + 10.5 MB of scales,
598 MB) is ~0.15 ms at 4 TB/s: stochastic rounding (~18 instructions per element and side)
keeps the dual pass instruction-bound. Not measured on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_megatron.nvfp4.formats import BLOCK
from minite_megatron.nvfp4.quantize import check_finite
from minite_megatron.nvfp4.row_col import validate_row_col
from minite_megatron.nvfp4.tensor import NVFP4Tensor

from ._nvfp4_math import (
    ONE_SIXTH,
    block_encode_scales,
    canonical_nan_f32,
    e2m1_round_nearest,
    e2m1_round_stochastic,
    exact_launch,
    fmix32,
    global_scales_from_amax,
    interpreting,
)
from .quantize import rht_mask_of, sr_key
from .quantize_cols import _block_amax_bits, _pair, _rht16
from .quantize_rows import _sr_uniform, _unpack
from ..custom_op import custom_op

INF_BITS = tl.constexpr(0x7F800000)

#: (BLOCK_HB, BLOCK_NB, num_warps) on the GPU: BLOCK_HB * BLOCK_NB * 8 words per token load
#: = 2 words per thread. Not tuned on a GPU (no device time in this piece).
GPU_TILE = (8, 1, 1)
#: At most this many token groups per program, and at least this many programs.
GPU_GROUPS_PER_PROG = 8
GPU_MIN_PROGRAMS = 1024

#: sm_90a AOT facts at GPU_TILE (CPU compile, Triton 3.6, 2026-12; ``python -m
#: minite_kernels.triton.quantize_dual``): registers, spill bytes, SASS instructions of the loop
#: bodies (group loop incl. one column half; column half loop) per 64 elements per thread.
AOT_FACTS = {
    "dual dy (tensor/tensor, SR both, RHT)": dict(regs=255, spill_bytes=0, loops=(5296, 1649), per_element=108),
    "dual x (row/tensor, nearest, RHT)": dict(regs=168, spill_bytes=0, loops=(3537, 986), per_element=71),
    "dual plain (tensor/tensor, nearest)": dict(regs=168, spill_bytes=0, loops=(3108, 811), per_element=61),
    "amax dy (tensor/tensor, RHT)": dict(regs=128, spill_bytes=0, loops=(726,), per_element=11),
    "amax x (row/tensor, RHT)": dict(regs=128, spill_bytes=0, loops=(1156,), per_element=18),
}


def _tile(t: int, n: int) -> tuple[int, int, int]:
    if interpreting():  # few, large programs: the interpreter's cost is per operation
        hb = min(triton.next_power_of_2(n // BLOCK), 16)
        nb = min(triton.next_power_of_2(t // BLOCK), 8)
        return hb, nb, 1
    return GPU_TILE


def _grid(t: int, n: int) -> tuple[tuple[int, int], int, int, int, int]:
    """(grid, groups per program, BLOCK_HB, BLOCK_NB, num_warps)."""
    hb, nb, warps = _tile(t, n)
    groups = triton.cdiv(t // BLOCK, nb)
    ph = triton.cdiv(n // BLOCK, hb)
    per = 1 if interpreting() else max(1, min(GPU_GROUPS_PER_PROG, groups * ph // GPU_MIN_PROGRAMS))
    return (triton.cdiv(groups, per), ph), per, hb, nb, warps


# ---- shared pieces ---------------------------------------------------------------------------
@triton.jit
def _tile_index(pid_h, BLOCK_HB: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Index tensors of a [NB, HB, 4, 2] word tile: row block hb [1, HB, 1, 1], lane q
    [1, 1, 4, 1], word w [1, 1, 1, 2], token block offset nb [NB, 1, 1, 1]."""
    hb = (pid_h * BLOCK_HB + tl.arange(0, BLOCK_HB))[None, :, None, None]
    q = tl.arange(0, 4)[None, None, :, None]
    w = tl.arange(0, 2)[None, None, None, :]
    nb = tl.arange(0, BLOCK_NB)[:, None, None, None]
    return hb, q, w, nb


@triton.jit
def _load_group(row_ptr, stride_w, m):
    """The 16 tokens of the token blocks at ``row_ptr`` (int32 word pointers [NB, HB, 4, 2] of
    each block's first token): 16 word tensors."""
    w0 = tl.load(row_ptr, mask=m, other=0)
    w1 = tl.load(row_ptr + stride_w, mask=m, other=0)
    w2 = tl.load(row_ptr + 2 * stride_w, mask=m, other=0)
    w3 = tl.load(row_ptr + 3 * stride_w, mask=m, other=0)
    w4 = tl.load(row_ptr + 4 * stride_w, mask=m, other=0)
    w5 = tl.load(row_ptr + 5 * stride_w, mask=m, other=0)
    w6 = tl.load(row_ptr + 6 * stride_w, mask=m, other=0)
    w7 = tl.load(row_ptr + 7 * stride_w, mask=m, other=0)
    w8 = tl.load(row_ptr + 8 * stride_w, mask=m, other=0)
    w9 = tl.load(row_ptr + 9 * stride_w, mask=m, other=0)
    w10 = tl.load(row_ptr + 10 * stride_w, mask=m, other=0)
    w11 = tl.load(row_ptr + 11 * stride_w, mask=m, other=0)
    w12 = tl.load(row_ptr + 12 * stride_w, mask=m, other=0)
    w13 = tl.load(row_ptr + 13 * stride_w, mask=m, other=0)
    w14 = tl.load(row_ptr + 14 * stride_w, mask=m, other=0)
    w15 = tl.load(row_ptr + 15 * stride_w, mask=m, other=0)
    return w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15


@triton.jit
def _half(w, HIGH: tl.constexpr, IS_FP16: tl.constexpr):
    lo, hi = _unpack(w, IS_FP16)
    if HIGH:
        return hi
    return lo


@triton.jit
def _halves(ws, HIGH: tl.constexpr, IS_FP16: tl.constexpr):
    """fp32 values of the low (features 4q + 2w) or high (4q + 2w + 1) halves of the 16 tokens."""
    return (_half(ws[0], HIGH, IS_FP16), _half(ws[1], HIGH, IS_FP16), _half(ws[2], HIGH, IS_FP16),
            _half(ws[3], HIGH, IS_FP16), _half(ws[4], HIGH, IS_FP16), _half(ws[5], HIGH, IS_FP16),
            _half(ws[6], HIGH, IS_FP16), _half(ws[7], HIGH, IS_FP16), _half(ws[8], HIGH, IS_FP16),
            _half(ws[9], HIGH, IS_FP16), _half(ws[10], HIGH, IS_FP16), _half(ws[11], HIGH, IS_FP16),
            _half(ws[12], HIGH, IS_FP16), _half(ws[13], HIGH, IS_FP16), _half(ws[14], HIGH, IS_FP16),
            _half(ws[15], HIGH, IS_FP16))


@triton.jit
def _signed(w, rht_mask, j: tl.constexpr):
    """Token j's words with both halves' sign bits flipped where RHT sign j is -1 (exact: the
    same values as multiplying by the sign after the conversion)."""
    return w ^ (((rht_mask >> j) & 1) * -2147450880)  # 0x80008000


@triton.jit
def _transformed(ws, rht_mask, HIGH: tl.constexpr, RHT: tl.constexpr, IS_FP16: tl.constexpr):
    """The column side's 16 fp32 tokens of one half: the contract's RHT (signs applied on the
    words, then :func:`.quantize_cols._rht16`'s butterflies with all-plus signs), or the plain
    values. ``rht_mask`` is 0 without the transform: the XOR with a runtime zero keeps the
    compiler from sharing the row side's unpacked values (which kept 64 of them live and
    spilled); it costs one integer op per word."""
    xs = _halves((_signed(ws[0], rht_mask, 0), _signed(ws[1], rht_mask, 1), _signed(ws[2], rht_mask, 2),
                  _signed(ws[3], rht_mask, 3), _signed(ws[4], rht_mask, 4), _signed(ws[5], rht_mask, 5),
                  _signed(ws[6], rht_mask, 6), _signed(ws[7], rht_mask, 7), _signed(ws[8], rht_mask, 8),
                  _signed(ws[9], rht_mask, 9), _signed(ws[10], rht_mask, 10), _signed(ws[11], rht_mask, 11),
                  _signed(ws[12], rht_mask, 12), _signed(ws[13], rht_mask, 13), _signed(ws[14], rht_mask, 14),
                  _signed(ws[15], rht_mask, 15)), HIGH, IS_FP16)
    if RHT:
        return _rht16(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], xs[8], xs[9], xs[10], xs[11],
                      xs[12], xs[13], xs[14], xs[15], 0)
    return xs


@triton.jit
def _half_rt(w, h, IS_FP16: tl.constexpr):
    """fp32 of half ``h`` (a runtime 0 / 1) of each word: exact, on the bits."""
    if IS_FP16:
        return ((w >> (h * 16)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return ((w >> (h * 16)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _transformed_rt(ws, rht_mask, h, RHT: tl.constexpr, IS_FP16: tl.constexpr):
    """:func:`_transformed` of half ``h`` given at run time (the dual kernel's half loop)."""
    x0 = _half_rt(_signed(ws[0], rht_mask, 0), h, IS_FP16)
    x1 = _half_rt(_signed(ws[1], rht_mask, 1), h, IS_FP16)
    x2 = _half_rt(_signed(ws[2], rht_mask, 2), h, IS_FP16)
    x3 = _half_rt(_signed(ws[3], rht_mask, 3), h, IS_FP16)
    x4 = _half_rt(_signed(ws[4], rht_mask, 4), h, IS_FP16)
    x5 = _half_rt(_signed(ws[5], rht_mask, 5), h, IS_FP16)
    x6 = _half_rt(_signed(ws[6], rht_mask, 6), h, IS_FP16)
    x7 = _half_rt(_signed(ws[7], rht_mask, 7), h, IS_FP16)
    x8 = _half_rt(_signed(ws[8], rht_mask, 8), h, IS_FP16)
    x9 = _half_rt(_signed(ws[9], rht_mask, 9), h, IS_FP16)
    x10 = _half_rt(_signed(ws[10], rht_mask, 10), h, IS_FP16)
    x11 = _half_rt(_signed(ws[11], rht_mask, 11), h, IS_FP16)
    x12 = _half_rt(_signed(ws[12], rht_mask, 12), h, IS_FP16)
    x13 = _half_rt(_signed(ws[13], rht_mask, 13), h, IS_FP16)
    x14 = _half_rt(_signed(ws[14], rht_mask, 14), h, IS_FP16)
    x15 = _half_rt(_signed(ws[15], rht_mask, 15), h, IS_FP16)
    if RHT:
        return _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _word_abs_bits(w, IS_FP16: tl.constexpr):
    """max(|low half|, |high half|) of each word as comparable int32 fp32 bits (NaN above inf)."""
    lo, hi = _unpack(w, IS_FP16)
    return tl.maximum(lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF, hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF)


# ---- global scales from amaxes -------------------------------------------------------------
@triton.jit
def _scales_side(amax_ptr, mul_ptr, sdec_ptr, n, pid, BLOCK_S: tl.constexpr):
    i = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    m = i < n
    s_enc, s_dec = global_scales_from_amax(tl.load(amax_ptr + i, mask=m, other=0.0))
    tl.store(mul_ptr + i, s_enc * ONE_SIXTH, mask=m)
    tl.store(sdec_ptr + i, canonical_nan_f32(s_dec), mask=m)


@triton.jit
def _global_scales_kernel(ra_ptr, rmul_ptr, rdec_ptr, nr, ca_ptr, cmul_ptr, cdec_ptr, nc, BLOCK_S: tl.constexpr):
    """Contract steps 1-2 for both sides: ``S_enc * RN(1/6)`` (kernel input) and ``S_dec`` (output)."""
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _scales_side(ra_ptr, rmul_ptr, rdec_ptr, nr, pid, BLOCK_S)
    else:
        _scales_side(ca_ptr, cmul_ptr, cdec_ptr, nc, pid, BLOCK_S)


# ---- the amax pass ---------------------------------------------------------------------------
@triton.jit
def _amax_row_col_kernel(
    x_ptr, ra_ptr, ca_ptr, T, N, stride_w, rht_mask, groups_per_prog,
    ROW_PER_ROW: tl.constexpr, COL_PER_ROW: tl.constexpr, RHT: tl.constexpr, IS_FP16: tl.constexpr,
    BLOCK_HB: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    """Read-only: ``atomic_max`` of int32 fp32 bits into the zeroed ``ra`` ([T] or [1]: plain
    |x|) and ``ca`` ([N] or [1]: |transformed x.t()|); NaN bits are clamped to +inf."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    hb, q, w, nb = _tile_index(pid_h, BLOCK_HB, BLOCK_NB)
    fm = hb < N // 16
    f_lo = hb * 16 + q * 4 + w * 2
    wofs = hb * 8 + q * 2 + w
    racc = tl.zeros((BLOCK_NB, BLOCK_HB, 4, 2), tl.int32)
    cacc_lo = tl.zeros((BLOCK_NB, BLOCK_HB, 4, 2), tl.int32)
    cacc_hi = tl.zeros((BLOCK_NB, BLOCK_HB, 4, 2), tl.int32)
    g0 = pid_t * groups_per_prog
    for g in range(g0, g0 + groups_per_prog):
        tb = g * BLOCK_NB + nb
        m = (tb < T // 16) & fm
        row_ptr = x_ptr.to(tl.pointer_type(tl.int32)) + (tb * 16).to(tl.int64) * stride_w + wofs
        ws = _load_group(row_ptr, stride_w, m)
        if ROW_PER_ROW:
            for j in tl.static_range(16):
                b = tl.minimum(_word_abs_bits(ws[j], IS_FP16), INF_BITS)
                b = tl.max(tl.max(tl.max(b, axis=3, keep_dims=True), axis=2, keep_dims=True), axis=1, keep_dims=True)
                tl.atomic_max(ra_ptr + (tb * 16 + j), b, mask=tb < T // 16)
        else:
            for j in tl.static_range(16):
                racc = tl.maximum(racc, _word_abs_bits(ws[j], IS_FP16))
        cacc_lo = tl.maximum(cacc_lo, _block_amax_bits(_transformed(ws, rht_mask, False, RHT, IS_FP16)))
        cacc_hi = tl.maximum(cacc_hi, _block_amax_bits(_transformed(ws, rht_mask, True, RHT, IS_FP16)))
    if not ROW_PER_ROW:
        tl.atomic_max(ra_ptr, tl.minimum(tl.max(tl.reshape(racc, (BLOCK_NB * BLOCK_HB * 8,)), axis=0), INF_BITS))
    if COL_PER_ROW:
        lo = tl.minimum(tl.max(cacc_lo, axis=0, keep_dims=True), INF_BITS)
        hi = tl.minimum(tl.max(cacc_hi, axis=0, keep_dims=True), INF_BITS)
        fm4 = f_lo < N  # the mask in the values' shape (the interpreter's atomics do not broadcast it)
        tl.atomic_max(ca_ptr + f_lo, lo, mask=fm4)
        tl.atomic_max(ca_ptr + f_lo + 1, hi, mask=fm4)
    else:
        c = tl.maximum(cacc_lo, cacc_hi)
        tl.atomic_max(ca_ptr, tl.minimum(tl.max(tl.reshape(c, (BLOCK_NB * BLOCK_HB * 8,)), axis=0), INF_BITS))


# ---- the dual quantize pass ------------------------------------------------------------------
@triton.jit
def _row_token(w, t, tmask, hb, q, wi, fm, mul, dec, row_key, N, rcodes_ptr, rscales_ptr, rimage_ptr,
               ROW_SR: tl.constexpr, WITH_IMAGE: tl.constexpr, IS_FP16: tl.constexpr):
    """Row side of token ``t`` [NB, 1, 1, 1]: its blocks' 16 features on 4 lanes (2 words each)."""
    lo, hi = _unpack(w, IS_FP16)
    b = tl.maximum(lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF, hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    bm = tl.max(tl.max(b, axis=3, keep_dims=True), axis=2, keep_dims=True)  # [NB, HB, 1, 1]
    sf_code, sf, enc, nan = block_encode_scales(bm.to(tl.float32, bitcast=True), mul, dec)
    if ROW_SR:
        inner = fmix32(t.to(tl.uint32, bitcast=True) + row_key.to(tl.uint32, bitcast=True))
        col0 = hb * 16 + q * 4 + wi * 2
        c_lo, r_lo = e2m1_round_stochastic(lo * enc, _sr_uniform(inner, col0))
        c_hi, r_hi = e2m1_round_stochastic(hi * enc, _sr_uniform(inner, col0 + 1))
    else:
        c_lo, r_lo = e2m1_round_nearest(lo * enc)
        c_hi, r_hi = e2m1_round_nearest(hi * enc)
    byte = c_lo | (c_hi << 4) | ((w >> 12) & 8) | ((w >> 24) & 0x80)
    codes = tl.sum(byte << (wi * 8), axis=3, keep_dims=True)  # [NB, HB, 4, 1]: 4 codes of the lane
    codes = tl.where(nan, 0, codes)
    m = tmask & fm
    r64 = t.to(tl.int64)
    tl.store(rcodes_ptr.to(tl.pointer_type(tl.int16)) + r64 * (N // 4) + hb * 4 + q, codes.to(tl.int16), mask=m)
    tl.store(rscales_ptr + r64 * (N // 16) + hb, sf_code, mask=m)
    if WITH_IMAGE:
        i_lo = (r_lo * sf).to(tl.uint32, bitcast=True)
        i_hi = (r_hi * sf).to(tl.uint32, bitcast=True)
        img = (i_lo >> 16).to(tl.int32, bitcast=True) | i_hi.to(tl.int32, bitcast=True) | (w & -2147450880)
        tl.store(rimage_ptr.to(tl.pointer_type(tl.int32)) + r64 * (N // 2) + hb * 8 + q * 2 + wi, img, mask=m)


@triton.jit
def _col_half(xs, f, fm, tb, tmask, mul, dec, inner, T, ccodes_ptr, cscales_ptr, cimage_ptr,
              COL_SR: tl.constexpr, WITH_IMAGE: tl.constexpr):
    """Column side of features ``f`` [1, HB, 4, 2] (one half): ``xs`` the 16 (transformed)
    tokens [NB, HB, 4, 2] fp32 of token blocks ``tb`` [NB, 1, 1, 1]."""
    sf_code, sf, enc, nan = block_encode_scales(_block_amax_bits(xs).to(tl.float32, bitcast=True), mul, dec)
    t0 = tb * 16
    y0, w0 = _pair(xs[0], xs[1], enc, sf, inner, t0 + 0, COL_SR)
    y1, w1 = _pair(xs[2], xs[3], enc, sf, inner, t0 + 2, COL_SR)
    y2, w2 = _pair(xs[4], xs[5], enc, sf, inner, t0 + 4, COL_SR)
    y3, w3 = _pair(xs[6], xs[7], enc, sf, inner, t0 + 6, COL_SR)
    y4, w4 = _pair(xs[8], xs[9], enc, sf, inner, t0 + 8, COL_SR)
    y5, w5 = _pair(xs[10], xs[11], enc, sf, inner, t0 + 10, COL_SR)
    y6, w6 = _pair(xs[12], xs[13], enc, sf, inner, t0 + 12, COL_SR)
    y7, w7 = _pair(xs[14], xs[15], enc, sf, inner, t0 + 14, COL_SR)
    lo = tl.where(nan, 0, y0 | (y1 << 8) | (y2 << 16) | (y3 << 24))
    hi = tl.where(nan, 0, y4 | (y5 << 8) | (y6 << 16) | (y7 << 24))
    m = fm & tmask
    f64 = f.to(tl.int64)
    # codes: 8 bytes per (feature, token block) = two int32 words, one 8-byte store
    cw = tl.join(lo, hi)  # [NB, HB, 4, 2, 2]
    tl.store(ccodes_ptr.to(tl.pointer_type(tl.int32)) + (f64 * (T // 8) + tb * 2)[:, :, :, :, None]
             + tl.arange(0, 2)[None, None, None, None, :], cw, mask=m[:, :, :, :, None])
    tl.store(cscales_ptr + f64 * (T // 16) + tb, sf_code, mask=m)
    if WITH_IMAGE:
        # join nests the new axis last: w0..w7 in order after the reshape (see quantize_cols)
        img = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
        img = tl.reshape(img, (img.shape[0], img.shape[1], 4, 2, 8))
        tl.store(cimage_ptr.to(tl.pointer_type(tl.int32)) + (f64 * (T // 2) + tb * 8)[:, :, :, :, None]
                 + tl.arange(0, 8)[None, None, None, None, :], img, mask=m[:, :, :, :, None])


@triton.jit(do_not_specialize=["row_key", "col_key", "rht_mask", "halves"])
def _row_col_kernel(
    x_ptr, rmul_ptr, rdec_ptr, cmul_ptr, cdec_ptr,
    rcodes_ptr, rscales_ptr, rimage_ptr, ccodes_ptr, cscales_ptr, cimage_ptr,
    T, N, stride_w, row_key, col_key, rht_mask, groups_per_prog, halves,
    ROW_PER_ROW: tl.constexpr, COL_PER_ROW: tl.constexpr, ROW_SR: tl.constexpr, COL_SR: tl.constexpr,
    WITH_IMAGE: tl.constexpr, RHT: tl.constexpr, IS_FP16: tl.constexpr,
    BLOCK_HB: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    """Program (token range, feature tile): ``groups_per_prog`` groups of BLOCK_NB token
    blocks x BLOCK_HB row blocks; each group is read once and written twice (module docstring)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    hb, q, wi, nb = _tile_index(pid_h, BLOCK_HB, BLOCK_NB)
    fm = hb < N // 16
    f_lo = hb * 16 + q * 4 + wi * 2  # [1, HB, 4, 2]: features of the low halves
    wofs = hb * 8 + q * 2 + wi
    if not ROW_PER_ROW:
        rmul = tl.load(rmul_ptr)
        rdec = tl.load(rdec_ptr)
    if not COL_PER_ROW:
        cmul = tl.load(cmul_ptr)
        cdec = tl.load(cdec_ptr)
    g0 = pid_t * groups_per_prog
    for g in range(g0, g0 + groups_per_prog):
        tb = g * BLOCK_NB + nb  # [NB, 1, 1, 1]
        tmask = tb < T // 16
        row_ptr = x_ptr.to(tl.pointer_type(tl.int32)) + (tb * 16).to(tl.int64) * stride_w + wofs
        ws = _load_group(row_ptr, stride_w, tmask & fm)
        for j in tl.static_range(16):
            t = tb * 16 + j
            if ROW_PER_ROW:
                rmul = tl.load(rmul_ptr + t, mask=tmask, other=1.0)
                rdec = tl.load(rdec_ptr + t, mask=tmask, other=1.0)
            _row_token(ws[j], t, tmask, hb, q, wi, fm, rmul, rdec, row_key, N, rcodes_ptr, rscales_ptr, rimage_ptr,
                       ROW_SR, WITH_IMAGE, IS_FP16)
        # column side, one half (2 features per thread) per iteration of a loop the compiler
        # cannot unroll (``halves`` = 2 at run time): unrolled, both halves were scheduled
        # together and the kernel spilled (sm_90a AOT: 230 registers for the column side alone)
        for h in range(0, halves):
            f = f_lo + h  # [1, HB, 4, 2]
            if COL_PER_ROW:
                cmul = tl.load(cmul_ptr + f, mask=f < N, other=1.0)
                cdec = tl.load(cdec_ptr + f, mask=f < N, other=1.0)
            if COL_SR:
                inner = fmix32(f.to(tl.uint32, bitcast=True) + col_key.to(tl.uint32, bitcast=True))
            else:
                inner = tl.zeros((1, BLOCK_HB, 4, 2), tl.uint32)
            _col_half(_transformed_rt(ws, rht_mask, h, RHT, IS_FP16), f, fm, tb, tmask, cmul, cdec, inner,
                      T, ccodes_ptr, cscales_ptr, cimage_ptr, COL_SR, WITH_IMAGE)


# ---- launchers, custom ops -----------------------------------------------------------------
def _words_ok(x: torch.Tensor) -> torch.Tensor:
    """``x`` readable as int32 words (rows on 4-byte boundaries), else an aligned copy."""
    if x.stride(0) % 2 or x.data_ptr() % 4:
        return x.clone(memory_format=torch.contiguous_format)
    return x


@custom_op("minite::amax_row_col", mutates_args=())
def amax_row_col_op(x: torch.Tensor, row_per_row: bool, col_per_row: bool, rht_mask: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (row amax [T] or [1], col amax [N] or [1]) of ``x`` [T, N] (validated, word-readable)."""
    t, n = x.shape
    ra = torch.zeros(t if row_per_row else 1, dtype=torch.int32, device=x.device)
    ca = torch.zeros(n if col_per_row else 1, dtype=torch.int32, device=x.device)
    if t and n:
        grid, per, hb, nb, warps = _grid(t, n)
        _amax_row_col_kernel[grid](
            x, ra, ca, t, n, x.stride(0) // 2, max(rht_mask, 0), per,
            ROW_PER_ROW=row_per_row, COL_PER_ROW=col_per_row, RHT=rht_mask >= 0, IS_FP16=x.dtype == torch.float16,
            BLOCK_HB=hb, BLOCK_NB=nb, num_warps=warps, **exact_launch(),
        )
    return ra.view(torch.float32), ca.view(torch.float32)


@amax_row_col_op.register_fake
def _(x, row_per_row, col_per_row, rht_mask):
    t, n = x.shape
    return x.new_empty((t if row_per_row else 1,), dtype=torch.float32), \
        x.new_empty((n if col_per_row else 1,), dtype=torch.float32)


@custom_op("minite::quantize_row_col", mutates_args=())
def quantize_row_col_op(
    x: torch.Tensor, row_amax: torch.Tensor, col_amax: torch.Tensor, row_stochastic: bool, row_key: int,
    col_stochastic: bool, col_key: int, rht_mask: int, with_image: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dual pass on ``x`` [T, N] (validated, word-readable) with fp32 amaxes of their
    domains (row: [T] per token or [1]; col: [N] per feature or [1], of the transformed
    values). Returns (row codes [T, N/2], row scales uint8 [T, N/16], row S_dec, row image
    [T, N] or [0], col codes [N, T/2], col scales [N, T/16], col S_dec, col image [N, T] or [0])."""
    t, n = x.shape
    dev = x.device
    rcodes = torch.empty(t, n // 2, dtype=torch.uint8, device=dev)
    rscales = torch.empty(t, n // BLOCK, dtype=torch.uint8, device=dev)
    rimage = torch.empty((t, n) if with_image else (0,), dtype=torch.bfloat16, device=dev)
    ccodes = torch.empty(n, t // 2, dtype=torch.uint8, device=dev)
    cscales = torch.empty(n, t // BLOCK, dtype=torch.uint8, device=dev)
    cimage = torch.empty((n, t) if with_image else (0,), dtype=torch.bfloat16, device=dev)
    nr, nc = row_amax.numel(), col_amax.numel()
    rmul = torch.empty(nr, dtype=torch.float32, device=dev)
    rdec = torch.empty(nr, dtype=torch.float32, device=dev)
    cmul = torch.empty(nc, dtype=torch.float32, device=dev)
    cdec = torch.empty(nc, dtype=torch.float32, device=dev)
    bs = 256 if interpreting() else 1024
    _global_scales_kernel[(triton.cdiv(max(nr, nc), bs), 2)](
        row_amax, rmul, rdec, nr, col_amax, cmul, cdec, nc, BLOCK_S=bs, num_warps=4, **exact_launch())
    if t and n:
        grid, per, hb, nb, warps = _grid(t, n)
        _row_col_kernel[grid](
            x, rmul, rdec, cmul, cdec, rcodes, rscales, rimage, ccodes, cscales, cimage,
            t, n, x.stride(0) // 2, row_key, col_key, max(rht_mask, 0), per, 2,
            ROW_PER_ROW=nr > 1, COL_PER_ROW=nc > 1,  # T, N >= 16: one value is a tensor scale
            ROW_SR=row_stochastic, COL_SR=col_stochastic, WITH_IMAGE=with_image, RHT=rht_mask >= 0,
            IS_FP16=x.dtype == torch.float16, BLOCK_HB=hb, BLOCK_NB=nb, num_warps=warps, **exact_launch(),
        )
    return rcodes, rscales, rdec, rimage, ccodes, cscales, cdec, cimage


@quantize_row_col_op.register_fake
def _(x, row_amax, col_amax, row_stochastic, row_key, col_stochastic, col_key, rht_mask, with_image):
    t, n = x.shape
    u8, f32 = torch.uint8, torch.float32
    return (x.new_empty((t, n // 2), dtype=u8), x.new_empty((t, n // BLOCK), dtype=u8),
            x.new_empty((row_amax.numel(),), dtype=f32),
            x.new_empty((t, n) if with_image else (0,), dtype=torch.bfloat16),
            x.new_empty((n, t // 2), dtype=u8), x.new_empty((n, t // BLOCK), dtype=u8),
            x.new_empty((col_amax.numel(),), dtype=f32),
            x.new_empty((n, t) if with_image else (0,), dtype=torch.bfloat16))


def amax_row_col_forward(
    x: torch.Tensor, *, row_scale: str = "tensor", col_scale: str = "tensor", col_rht_seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`minite_megatron.nvfp4.row_col.amax_row_col` in one read-only pass, bit for bit
    (fp32 ``[T]`` / ``[1]`` and ``[N]`` / ``[1]``; a non-finite domain gives +inf)."""
    validate_row_col(x, row_scale, col_scale)
    return amax_row_col_op(_words_ok(x), row_scale == "row", col_scale == "row", rht_mask_of(col_rht_seed))


def _amax_arg(amax: torch.Tensor, n: int, per_row: bool, name: str, device) -> torch.Tensor:
    a = amax.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    want = n if per_row else 1
    if a.numel() != want:
        raise ValueError(f"quantize_row_col: {name} needs {want} value(s) for its scale, got {a.numel()}")
    return a


def quantize_row_col_forward(
    x: torch.Tensor,
    *,
    row_scale: str = "tensor",
    row_rounding: str = "nearest",
    row_seed: int | None = None,
    row_amax: torch.Tensor | None = None,
    col_scale: str = "tensor",
    col_rounding: str = "nearest",
    col_seed: int | None = None,
    col_rht_seed: int | None = None,
    col_amax: torch.Tensor | None = None,
    with_image: bool = True,
    nonfinite: str = "propagate",
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """``(q_row, q_col)`` of :func:`minite_megatron.nvfp4.row_col.quantize_row_col`, bit for bit.

    Missing amaxes come from one :func:`amax_row_col_forward` pass (given ones are used as
    they are), then one dual pass writes both quantizations. Raises ValueError for input the
    op does not take (not 2D bf16/fp16, T or N not a multiple of 16, N not unit-stride), bad
    options, an amax of the wrong size, or non-finite input with ``nonfinite="raise"``.
    """
    validate_row_col(x, row_scale, col_scale)
    for side, rounding, seed in (("row", row_rounding, row_seed), ("col", col_rounding, col_seed)):
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"{side}_rounding must be 'nearest' or 'stochastic', got {rounding!r}")
        if rounding == "stochastic" and seed is None:
            raise ValueError(f"{side}_rounding='stochastic' needs {side}_seed")
    if nonfinite == "raise":
        check_finite(x)
    elif nonfinite != "propagate":
        raise ValueError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")
    t, n = x.shape
    if x.numel() == 0:  # empty domains: the contract's result (nothing to launch)
        from minite_megatron.nvfp4.row_col import quantize_row_col

        return quantize_row_col(
            x, row_scale=row_scale, row_rounding=row_rounding, row_seed=row_seed, row_amax=row_amax,
            col_scale=col_scale, col_rounding=col_rounding, col_seed=col_seed, col_rht_seed=col_rht_seed,
            col_amax=col_amax, with_image=with_image)
    x = _words_ok(x)
    row_pr, col_pr = row_scale == "row", col_scale == "row"
    rht = rht_mask_of(col_rht_seed)
    if row_amax is not None:
        row_amax = _amax_arg(row_amax, t, row_pr, "row_amax", x.device)
    if col_amax is not None:
        col_amax = _amax_arg(col_amax, n, col_pr, "col_amax", x.device)
    if row_amax is None or col_amax is None:
        ra, ca = amax_row_col_op(x, row_pr, col_pr, rht)
        row_amax = ra if row_amax is None else row_amax
        col_amax = ca if col_amax is None else col_amax
    rc, rs, rd, ri, cc, cs, cd, ci = quantize_row_col_op(
        x, row_amax, col_amax, row_rounding == "stochastic", sr_key(row_seed) if row_rounding == "stochastic" else 0,
        col_rounding == "stochastic", sr_key(col_seed) if col_rounding == "stochastic" else 0, rht, with_image)
    e4m3 = torch.float8_e4m3fn
    q_row = NVFP4Tensor(codes=rc, block_scales=rs.view(e4m3), global_decode=rd, shape=torch.Size([t, n]),
                        global_scale=row_scale, image=ri if with_image else None)
    q_col = NVFP4Tensor(codes=cc, block_scales=cs.view(e4m3), global_decode=cd, shape=torch.Size([n, t]),
                        global_scale=col_scale, image=ci if with_image else None, rht_seed=col_rht_seed)
    return q_row, q_col


# ---- ahead-of-time compile for the H200 (CPU; a process without TRITON_INTERPRET) -------------
def aot_kernel(row_per_row=False, col_per_row=False, row_sr=True, col_sr=True, rht=True, amax_only=False):
    """The dual (or amax) kernel compiled for sm_90a at GPU_TILE, bf16 input, images written,
    with the argument specialisations a real launch sees (see :mod:`._aot`)."""
    from ._aot import compile_for
    from ._nvfp4_math import EXACT_LAUNCH

    hb, nb, warps = GPU_TILE
    if amax_only:
        sig = {"x_ptr": "*bf16", "ra_ptr": "*i32", "ca_ptr": "*i32", "T": "i32", "N": "i32", "stride_w": "i32",
               "rht_mask": "i32", "groups_per_prog": "i32"}
        ce = dict(ROW_PER_ROW=row_per_row, COL_PER_ROW=col_per_row, RHT=rht, IS_FP16=False, BLOCK_HB=hb, BLOCK_NB=nb)
        return compile_for(_amax_row_col_kernel, sig, ce, num_warps=warps, divisible=("T", "N", "stride_w"),
                           **EXACT_LAUNCH)
    sig = {"x_ptr": "*bf16", "rmul_ptr": "*fp32", "rdec_ptr": "*fp32", "cmul_ptr": "*fp32", "cdec_ptr": "*fp32",
           "rcodes_ptr": "*u8", "rscales_ptr": "*u8", "rimage_ptr": "*bf16", "ccodes_ptr": "*u8",
           "cscales_ptr": "*u8", "cimage_ptr": "*bf16", "T": "i32", "N": "i32", "stride_w": "i32",
           "row_key": "i32", "col_key": "i32", "rht_mask": "i32", "groups_per_prog": "i32", "halves": "i32"}
    ce = dict(ROW_PER_ROW=row_per_row, COL_PER_ROW=col_per_row, ROW_SR=row_sr, COL_SR=col_sr, WITH_IMAGE=True,
              RHT=rht, IS_FP16=False, BLOCK_HB=hb, BLOCK_NB=nb)
    return compile_for(_row_col_kernel, sig, ce, num_warps=warps, divisible=("T", "N", "stride_w"), **EXACT_LAUNCH)


def aot_kernels():
    """(name, compiled kernel) at the recipe's configurations."""
    yield "dual dy: tensor/tensor, SR both, RHT", aot_kernel()
    yield "dual x: row/tensor, nearest, RHT", aot_kernel(row_per_row=True, row_sr=False, col_sr=False)
    yield "dual plain: tensor/tensor, nearest, no RHT", aot_kernel(row_sr=False, col_sr=False, rht=False)
    yield "amax dy: tensor/tensor RHT", aot_kernel(amax_only=True)
    yield "amax x: row/tensor RHT", aot_kernel(row_per_row=True, amax_only=True)


def _loops(text: str) -> list[int]:
    """Instruction counts of the SASS ranges closed by a backward branch (the loop bodies)."""
    import re

    addrs, out = [], []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        addrs.append(addr)
        b = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", m.group(2))
        if b and int(b.group(1), 16) < addr:
            out.append(sum(1 for a in addrs if int(b.group(1), 16) <= a <= addr))
    return out


def _aot_main() -> None:  # pragma: no cover - a developer tool (no TRITON_INTERPRET)
    import re

    from ._aot import report, sass

    for name, kernel in aot_kernels():
        text = sass(kernel)
        extra = {"sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", text, flags=re.M)),
                 "loop_bodies": _loops(text), "BAR": len(re.findall(r"\bBAR\b", text)),
                 "LDG64": len(re.findall(r"LDG\.E\.64", text)), "STG128": len(re.findall(r"STG\.E\.128", text)),
                 "STG64": len(re.findall(r"STG\.E\.64", text)), "SHFL": len(re.findall(r"\bSHFL", text))}
        print(f"{name:45s} {report(kernel)} {extra}", flush=True)


if __name__ == "__main__":
    _aot_main()
