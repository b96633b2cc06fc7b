"""Fast NVFP4 quantization of row-major 16-bit rows (activations, gradients), 1x16 blocks.

The hot path of :func:`.quantize.quantize_forward`: bitwise equal to
``nvfp4.quantize_reference`` (codes, E4M3 block scales, fp32 global decode scales, bf16
image), for bf16 / fp16 input ``[R, K]`` with unit stride along K, ``(1, 16)`` blocks, a per-row
global scale computed in the kernel or a given amax per run of rows (tensor / group scales),
round-to-nearest-even or the contract's stochastic rounding, linear or swizzled scales.

Layout (why it is fast): the input is read as int32 *words* (two 16-bit elements each). A
16-element block is 8 words, loaded as two 16-byte halves with the same offsets pattern, so
Triton gives both the same layout and one thread owns each whole block: the block amax is an
in-thread reduction, the per-block math (E4M3 scale, IEEE division) runs once per block, and
every output is written by the thread that owns the block with no layout conversion (8 bytes
of codes as one int64, 32 bytes of image as two 16-byte word vectors, one scale byte). Tiles
are ``[BLOCK_NB, BLOCK_R, 4]``, blocks first, one block per thread per chunk: Triton spreads
threads over the first non-contiguous axis first, so a warp walks one row (with rows first it
straddled rows and the stores needed shared-memory conversions). Element steps are the
bit-level ones of :mod:`._nvfp4_math` (``e2m1_round_nearest``: one magic addition; the image
is ``r * sf`` with the input's sign bits, assembled as bf16 pairs); NaN is handled per block
(a NaN block has NaN scale, zero codes and a NaN image).

Per-row scales need the row amax before the first block: rows of at most ``QuantizeTiles.rows[2]``
chunks stay in registers (one read); longer rows are read twice (an amax pass over the words,
then the quantize pass, the second read hitting L1/L2). Measured on the H200 (2026-11-30,
BENCHMARKS.md run 5): 41 us for 16384 x 2048 (87% of the copy bandwidth), 139 us for
16384 x 5120 (two reads, 65%).

16x16 tiles (weights, tensor or group global scale, rows a multiple of 16): the same kernel with
``TILE16``. A program holds ``BLOCK_R`` (a multiple of 16) whole rows; each chunk's block amax is
max-reduced over the tile's 16 rows before the scales, and the rows are read once (the global
amax comes from the separate amax pass). Issue 16: the generic kernel took 9.7 ms per training
step for the qwen3-moe weights (0.66 TB/s).

Raises nothing itself: :func:`.quantize.quantize_forward` validates and dispatches here only
when :func:`supported` holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.nvfp4._nvfp4_math import (
    ONE_SIXTH,
    block_encode_scales,
    canonical_nan_f32,
    e2m1_round_nearest,
    e2m1_round_stochastic,
    exact_launch,
    fmix32,
    sr_key_u32,
    global_scales_from_amax,
    interpreting,
    max_propagate_nan,
)
from minite_kernels.triton.nvfp4.quantize_tiles import DEFAULT, QuantizeTiles
from minite_kernels.triton._build._host import cdiv


def supported(x2d: torch.Tensor, tile16: bool, has_col_index: bool, has_amax: bool = False) -> bool:
    """Whether the fast row kernel takes ``x2d``: 16-bit floats, unit stride along K, rows
    that start on 4-byte boundaries (the input is read as int32 words), 1x16 blocks -- or 16x16
    tiles with a given global amax (tensor / group scale) and rows a multiple of 16."""
    return (
        (not tile16 or (has_amax and x2d.dim() == 2 and x2d.shape[0] % 16 == 0))
        and not has_col_index
        and x2d.dtype in (torch.bfloat16, torch.float16)
        and x2d.dim() == 2
        and (x2d.stride(1) == 1 or x2d.shape[1] == 1)
        and x2d.stride(0) % 2 == 0
        and x2d.data_ptr() % 4 == 0
    )


def config(r: int, k: int, tile16: bool = False, tiles: QuantizeTiles = DEFAULT,
           stochastic: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_NB, BLOCK_R, num_warps, CHUNKS): BLOCK_NB (threads per row) is the largest power
    of two <= ``tiles.rows[0]`` (``tiles.rows_stochastic`` with SR) dividing the row's block count, so
    chunks never straddle a row end; CHUNKS = blocks per row / BLOCK_NB when at most ``rows[2]`` (one read), else 0
    (two reads). 16x16 tiles: BLOCK_NB <= ``tiles.weight_tile[0]``, BLOCK_R a multiple of 16, CHUNKS = 0
    (one read: the amax is given)."""
    nb = k // 16
    row_tile = tiles.rows_stochastic if stochastic else tiles.rows
    if tile16:
        cap, warps = (2, 1) if interpreting() else tiles.weight_tile
    else:
        cap, warps = (4, 1) if interpreting() else row_tile[:2]
    block_nb = 1
    while block_nb * 2 <= cap and nb % (block_nb * 2) == 0:
        block_nb *= 2
    block_r = (32 // block_nb) * warps
    if tile16:
        return block_nb, max(16, block_r), warps, 0
    chunks = nb // block_nb
    return block_nb, block_r, warps, chunks if chunks <= row_tile[2] else 0  # rows[2] <= MAX_CHUNKS: QuantizeTiles checks


@triton.jit
def _unpack(w, IS_FP16: tl.constexpr):
    """int32 words -> (fp32 of the low halves, fp32 of the high halves): exact."""
    if IS_FP16:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _words_amax_bits(w, IS_FP16: tl.constexpr):
    """Element-wise max of the two |halves| of each word, as comparable int32 bits (any NaN
    orders above +inf): fp32 bits for bf16, 16-bit magnitudes for fp16."""
    if IS_FP16:
        return tl.maximum(w & 0x7FFF, (w >> 16) & 0x7FFF)
    else:
        return tl.maximum((w << 16) & 0x7FFF0000, w & 0x7FFF0000)


@triton.jit
def _amax_bits_to_f32(m, IS_FP16: tl.constexpr):
    if IS_FP16:
        return m.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return m.to(tl.float32, bitcast=True)


@triton.jit
def _sr_uniform(inner, col):
    """The contract's uniform for the element in column ``col`` of a row with ``inner =
    fmix32(row + key)`` (uint32)."""
    bits = fmix32(inner + col.to(tl.uint32, bitcast=True))
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24


@triton.jit
def _quantize_half(w, enc, sf, inner, col0, STOCHASTIC: tl.constexpr, IS_FP16: tl.constexpr):
    """8 elements per block (4 words ``[NB, BR, 4]``) -> (their 8 codes as one int32
    ``[NB, BR]``, element i in nibble i, and the bf16 image words ``[NB, BR, 4]``).

    ``col0``: column of each word's low element (stochastic rounding only)."""
    x_lo, x_hi = _unpack(w, IS_FP16)
    e3 = enc[:, :, None]
    if STOCHASTIC:
        c_lo, r_lo = e2m1_round_stochastic(x_lo * e3, _sr_uniform(inner, col0))
        c_hi, r_hi = e2m1_round_stochastic(x_hi * e3, _sr_uniform(inner, col0 + 1))
    else:
        c_lo, r_lo = e2m1_round_nearest(x_lo * e3)
        c_hi, r_hi = e2m1_round_nearest(x_hi * e3)
    # byte of word j: low element in the low nibble; sign bits 15 / 31 of the word -> 3 / 7
    byte = c_lo | (c_hi << 4) | ((w >> 12) & 8) | ((w >> 24) & 0x80)
    j = tl.arange(0, 4)
    codes = tl.sum(byte << (j * 8)[None, None, :], axis=2)
    s3 = sf[:, :, None]
    i_lo = (r_lo * s3).to(tl.uint32, bitcast=True)
    i_hi = (r_hi * s3).to(tl.uint32, bitcast=True)
    # image values are exact in bf16 and >= 0 (low 16 fp32 bits zero): the high halves are the
    # bf16 bits; the signs are the input's (0x80008000). A NaN block's NaN stays NaN.
    img = (i_lo >> 16).to(tl.int32, bitcast=True) | i_hi.to(tl.int32, bitcast=True) | (w & -2147450880)
    return codes, img


@triton.jit
def _chunk_block_max(wa, wb, IS_FP16: tl.constexpr):
    """[NB, BR] fp32 block amax (NaN wins), from the same unpacked values the quantize uses."""
    a_lo, a_hi = _unpack(wa, IS_FP16)
    b_lo, b_hi = _unpack(wb, IS_FP16)
    m = tl.maximum(tl.abs(a_lo), tl.abs(a_hi), propagate_nan=tl.PropagateNan.ALL)
    m = tl.maximum(m, tl.abs(b_lo), propagate_nan=tl.PropagateNan.ALL)
    m = tl.maximum(m, tl.abs(b_hi), propagate_nan=tl.PropagateNan.ALL)
    return tl.reduce(m, 2, max_propagate_nan)


@triton.jit
def _tile_max16(bm, BLOCK_NB: tl.constexpr, BLOCK_R: tl.constexpr):
    """[NB, BR] block amax -> the max over each group of 16 rows (a 16x16 tile), NaN wins,
    broadcast back to the tile's rows."""
    t = tl.reshape(bm, (BLOCK_NB, BLOCK_R // 16, 16))
    m = tl.reduce(t, 2, max_propagate_nan, keep_dims=True)
    return tl.reshape(tl.broadcast_to(m, (BLOCK_NB, BLOCK_R // 16, 16)), (BLOCK_NB, BLOCK_R))


@triton.jit
def _load_chunk(row_ptr, jw, c, BLOCK_NB: tl.constexpr, rmask3):
    """Words 0-3 and 4-7 of the blocks of chunk ``c`` ([NB, BR, 4] each)."""
    off = row_ptr + c * (BLOCK_NB * 8) + jw
    return tl.load(off, mask=rmask3, other=0), tl.load(off + 4, mask=rmask3, other=0)


@triton.jit
def _quantize_chunk(
    wa, wb, bm, rows, c, rmask, K, scale_mul, s_dec, inner, codes_ptr, scales_ptr, image_ptr, scale_cols_padded,
    STOCHASTIC: tl.constexpr, WITH_IMAGE: tl.constexpr, SWIZZLED: tl.constexpr, IS_FP16: tl.constexpr,
    BLOCK_NB: tl.constexpr,
):
    """Quantize chunk ``c`` of ``rows`` ([1, BR]): ``wa`` / ``wb`` the two halves (words 0-3 /
    4-7) of its blocks, ``bm`` their amax bits [NB, BR]; ``rmask`` [1, BR]."""
    blk = (c * BLOCK_NB + tl.arange(0, BLOCK_NB))[:, None]  # [NB, 1]
    sf_code, sf, enc, nan = block_encode_scales(bm, scale_mul, s_dec)
    col0 = (blk * 16)[:, :, None] + (tl.arange(0, 4) * 2)[None, None, :]
    ca, ia = _quantize_half(wa, enc, sf, inner, col0, STOCHASTIC, IS_FP16)
    cb, ib = _quantize_half(wb, enc, sf, inner, col0 + 8, STOCHASTIC, IS_FP16)
    # a NaN block (NaN input or a NaN scale domain) has code 0 everywhere
    ca = tl.where(nan, 0, ca)
    cb = tl.where(nan, 0, cb)
    codes = ca.to(tl.uint32, bitcast=True).to(tl.int64) | (cb.to(tl.uint32, bitcast=True).to(tl.int64) << 32)
    nbk = K // 16
    r64 = rows.to(tl.int64)
    tl.store(codes_ptr.to(tl.pointer_type(tl.int64)) + r64 * nbk + blk, codes, mask=rmask)
    if SWIZZLED:
        soff = ((rows // 128) * (scale_cols_padded // 4) + blk // 4).to(tl.int64) * 512 \
            + (rows % 32) * 16 + ((rows // 32) % 4) * 4 + (blk % 4)
    else:
        soff = r64 * nbk + blk
    tl.store(scales_ptr + soff, sf_code, mask=rmask)
    if WITH_IMAGE:
        ioff = r64[:, :, None] * (K // 2) + (blk * 8)[:, :, None] + tl.arange(0, 4)[None, None, :]
        iptr = image_ptr.to(tl.pointer_type(tl.int32)) + ioff
        tl.store(iptr, ia, mask=rmask[:, :, None])
        tl.store(iptr + 4, ib, mask=rmask[:, :, None])


@triton.jit(do_not_specialize=["key"])
def _quantize_rows_kernel(
    x_ptr, amax_ptr, codes_ptr, scales_ptr, sdec_ptr, image_ptr,
    R, K, stride_w, rows_per_group, key, scale_cols_padded,
    ROW_AMAX: tl.constexpr, STOCHASTIC: tl.constexpr, WITH_IMAGE: tl.constexpr, SWIZZLED: tl.constexpr,
    IS_FP16: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr,
    TILE16: tl.constexpr = False, KEY_PTR: tl.constexpr = False,
):
    """BLOCK_R rows per program, BLOCK_NB threads (one block each) per row and chunk. Tiles are
    ``[BLOCK_NB, BLOCK_R, 4]`` (blocks first: Triton spreads threads over the first
    non-contiguous axis first, so a warp walks one row). ``CHUNKS`` (1..4): the row's chunks
    stay in registers (one read); 0: loop, reading the row twice. ``stride_w``: row stride in
    int32 words. See the module docstring."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R))[None, :]  # [1, BR]
    rmask = rows < R
    rmask3 = rmask[:, :, None]
    nbk = K // 16
    row_ptr = x_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, :, None] * stride_w
    jw = (tl.arange(0, BLOCK_NB) * 8)[:, None, None] + tl.arange(0, 4)[None, None, :]
    if STOCHASTIC:
        inner = fmix32(rows.to(tl.uint32, bitcast=True) + sr_key_u32(key, KEY_PTR))[:, :, None]
    else:
        inner = tl.zeros((1, BLOCK_R, 1), tl.uint32)

    if CHUNKS > 0:  # every chunk of the row in registers: one read
        wa0, wb0 = _load_chunk(row_ptr, jw, 0, BLOCK_NB, rmask3)
        bm0 = _chunk_block_max(wa0, wb0, IS_FP16)
        m = bm0
        if CHUNKS > 1:
            wa1, wb1 = _load_chunk(row_ptr, jw, 1, BLOCK_NB, rmask3)
            bm1 = _chunk_block_max(wa1, wb1, IS_FP16)
            m = tl.maximum(m, bm1, propagate_nan=tl.PropagateNan.ALL)
        if CHUNKS > 2:
            wa2, wb2 = _load_chunk(row_ptr, jw, 2, BLOCK_NB, rmask3)
            bm2 = _chunk_block_max(wa2, wb2, IS_FP16)
            m = tl.maximum(m, bm2, propagate_nan=tl.PropagateNan.ALL)
        if CHUNKS > 3:
            wa3, wb3 = _load_chunk(row_ptr, jw, 3, BLOCK_NB, rmask3)
            bm3 = _chunk_block_max(wa3, wb3, IS_FP16)
            m = tl.maximum(m, bm3, propagate_nan=tl.PropagateNan.ALL)
        if ROW_AMAX:
            amax = tl.reduce(m, 0, max_propagate_nan, keep_dims=True)  # [1, BR]
        else:
            amax = tl.load(amax_ptr + rows // rows_per_group, mask=rmask, other=0.0)
    else:
        if ROW_AMAX:
            m = tl.zeros((BLOCK_NB, BLOCK_R), tl.int32)
            for c in range(0, nbk // BLOCK_NB):  # amax pass: int max of the words' |halves|
                wa, wb = _load_chunk(row_ptr, jw, c, BLOCK_NB, rmask3)
                m = tl.maximum(m, tl.maximum(tl.max(_words_amax_bits(wa, IS_FP16), axis=2),
                                             tl.max(_words_amax_bits(wb, IS_FP16), axis=2)))
            amax = _amax_bits_to_f32(tl.max(m, axis=0, keep_dims=True), IS_FP16)
        else:
            amax = tl.load(amax_ptr + rows // rows_per_group, mask=rmask, other=0.0)
    s_enc, s_dec = global_scales_from_amax(amax)
    tl.store(sdec_ptr + rows // rows_per_group, canonical_nan_f32(s_dec), mask=rmask & ((rows % rows_per_group) == 0))
    scale_mul = s_enc * ONE_SIXTH
    if CHUNKS > 0:
        _quantize_chunk(wa0, wb0, bm0, rows, 0, rmask, K, scale_mul, s_dec, inner, codes_ptr, scales_ptr, image_ptr,
                        scale_cols_padded, STOCHASTIC, WITH_IMAGE, SWIZZLED, IS_FP16, BLOCK_NB)
        if CHUNKS > 1:
            _quantize_chunk(wa1, wb1, bm1, rows, 1, rmask, K, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                            image_ptr, scale_cols_padded, STOCHASTIC, WITH_IMAGE, SWIZZLED, IS_FP16, BLOCK_NB)
        if CHUNKS > 2:
            _quantize_chunk(wa2, wb2, bm2, rows, 2, rmask, K, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                            image_ptr, scale_cols_padded, STOCHASTIC, WITH_IMAGE, SWIZZLED, IS_FP16, BLOCK_NB)
        if CHUNKS > 3:
            _quantize_chunk(wa3, wb3, bm3, rows, 3, rmask, K, scale_mul, s_dec, inner, codes_ptr, scales_ptr,
                            image_ptr, scale_cols_padded, STOCHASTIC, WITH_IMAGE, SWIZZLED, IS_FP16, BLOCK_NB)
    else:
        for c in range(0, nbk // BLOCK_NB):
            wa, wb = _load_chunk(row_ptr, jw, c, BLOCK_NB, rmask3)
            bm = _chunk_block_max(wa, wb, IS_FP16)
            if TILE16:
                bm = _tile_max16(bm, BLOCK_NB, BLOCK_R)
            _quantize_chunk(wa, wb, bm, rows, c, rmask, K, scale_mul, s_dec, inner,
                            codes_ptr, scales_ptr, image_ptr, scale_cols_padded,
                            STOCHASTIC, WITH_IMAGE, SWIZZLED, IS_FP16, BLOCK_NB)


def launch(x2d, amax, codes, scales, sdec, image, rows_per_group, stochastic, key, swizzled, cols_padded,
           tile16: bool = False, tiles: QuantizeTiles = DEFAULT):
    """Run the row kernel on ``x2d`` [R, K] (see :func:`supported`) into the given outputs."""
    r, k = x2d.shape
    block_nb, block_r, warps, chunks = config(r, k, tile16, tiles, stochastic)
    _quantize_rows_kernel[(cdiv(r, block_r),)](
        x2d, amax if amax is not None else sdec, codes, scales, sdec, image,
        r, k, x2d.stride(0) // 2, rows_per_group, key, cols_padded,
        ROW_AMAX=amax is None, STOCHASTIC=stochastic, WITH_IMAGE=image.numel() > 0, SWIZZLED=swizzled,
        IS_FP16=x2d.dtype == torch.float16, BLOCK_NB=block_nb, BLOCK_R=block_r, CHUNKS=chunks, TILE16=tile16,
        KEY_PTR=torch.is_tensor(key), num_warps=warps, **exact_launch(),
    )
