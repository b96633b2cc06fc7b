"""Fast NVFP4 quantization along the tokens of a token-major matrix: the wgrad operands.

Quantizes ``S^T`` (``[R, K]``) where ``S`` is row-major ``[T_src, R]``: ``x.t()`` / ``dy.t()``
of a Linear, or the MoE wgrad's padded, expert-sorted tokens (``col_index``: quantized column
c reads source row ``col_index[c]``, zero where -1). Blocks of 16 run along the tokens (the
GEMM's K of ``dW = dY^T X``). Bitwise equal to ``nvfp4.quantize_reference(S.t(), ...)``
(codes, E4M3 scales, fp32 global decode scales, bf16 image), with:

* a global amax per run of ``rows_per_group`` quantized rows (features), given (tensor scale:
  one domain; computed by :func:`amax_launch`, which applies the same optional transform);
* round-to-nearest-even or the contract's stochastic rounding (hash of (feature, token));
* the optional 16x16 random Hadamard transform along tokens, fused: the contract's butterfly
  order (:mod:`minite_megatron.nvfp4.hadamard`: signs, strides 1, 2, 4, 8, times 0.25) in
  fp32 registers, so the transform costs no extra pass.

Layout: a program owns ``BLOCK_H`` features x ``BLOCK_NB`` token blocks. The 16 tokens of a
block are 16 separate loads ``[BLOCK_H, BLOCK_NB]`` (coalesced along features), so each
thread holds every token of its blocks: block amax, transform and per-block math are
in-thread and run once per block. Outputs are assembled per block (8 bytes of codes as two
int32 words, 32 bytes of image as 8 bf16-pair words) and Triton moves them through shared
memory to stores that run along tokens (coalesced in the ``[R, K]`` outputs).
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
)
from minite_kernels.triton.nvfp4.quantize_tiles import DEFAULT, QuantizeTiles
from minite_kernels.triton._build._host import cdiv


def supported(x2d: torch.Tensor, tile16: bool) -> bool:
    """``x2d`` [R, K] is the transpose of a row-major ``[K_src, R]`` matrix (``x.t()``), 1x16 blocks."""
    return not tile16 and x2d.dim() == 2 and x2d.stride(0) == 1 and (x2d.stride(1) >= x2d.shape[0] or x2d.shape[1] == 1)


@triton.jit
def _load_token(s_ptr, col_ptr, t, h2, hm2, K, stride_s, HAS_COL_INDEX: tl.constexpr):
    """fp32 ``[BH, NB]``: source rows of tokens ``t`` [1, NB] at features ``h2`` [BH, 1]."""
    tmask = t < K
    if HAS_COL_INDEX:
        src = tl.load(col_ptr + t, mask=tmask, other=-1)
        m = hm2 & (src >= 0)
        src = tl.where(src >= 0, src, 0)
    else:
        src = t
        m = hm2 & tmask
    x = tl.load(s_ptr + src.to(tl.int64) * stride_s + h2, mask=m, other=0.0)
    if x.dtype == tl.bfloat16:  # on the bits: exact for subnormals (the interpreter's cast flushes them)
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _sign(x, mask, j: tl.constexpr):
    """``x * signs[j]`` of the RHT: flip the sign bit where bit j of ``mask`` is set."""
    bits = x.to(tl.int32, bitcast=True)
    flip = ((mask >> j) & 1) << 31
    return (bits ^ flip).to(tl.float32, bitcast=True)


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, mask):
    """The contract's RHT of one 16-block: signs, butterflies of stride 1, 2, 4, 8, times 0.25."""
    x0, x1, x2, x3 = _sign(x0, mask, 0), _sign(x1, mask, 1), _sign(x2, mask, 2), _sign(x3, mask, 3)
    x4, x5, x6, x7 = _sign(x4, mask, 4), _sign(x5, mask, 5), _sign(x6, mask, 6), _sign(x7, mask, 7)
    x8, x9, x10, x11 = _sign(x8, mask, 8), _sign(x9, mask, 9), _sign(x10, mask, 10), _sign(x11, mask, 11)
    x12, x13, x14, x15 = _sign(x12, mask, 12), _sign(x13, mask, 13), _sign(x14, mask, 14), _sign(x15, mask, 15)
    # stride 1
    x0, x1 = _bf(x0, x1)
    x2, x3 = _bf(x2, x3)
    x4, x5 = _bf(x4, x5)
    x6, x7 = _bf(x6, x7)
    x8, x9 = _bf(x8, x9)
    x10, x11 = _bf(x10, x11)
    x12, x13 = _bf(x12, x13)
    x14, x15 = _bf(x14, x15)
    # stride 2
    x0, x2 = _bf(x0, x2)
    x1, x3 = _bf(x1, x3)
    x4, x6 = _bf(x4, x6)
    x5, x7 = _bf(x5, x7)
    x8, x10 = _bf(x8, x10)
    x9, x11 = _bf(x9, x11)
    x12, x14 = _bf(x12, x14)
    x13, x15 = _bf(x13, x15)
    # stride 4
    x0, x4 = _bf(x0, x4)
    x1, x5 = _bf(x1, x5)
    x2, x6 = _bf(x2, x6)
    x3, x7 = _bf(x3, x7)
    x8, x12 = _bf(x8, x12)
    x9, x13 = _bf(x9, x13)
    x10, x14 = _bf(x10, x14)
    x11, x15 = _bf(x11, x15)
    # stride 8
    x0, x8 = _bf(x0, x8)
    x1, x9 = _bf(x1, x9)
    x2, x10 = _bf(x2, x10)
    x3, x11 = _bf(x3, x11)
    x4, x12 = _bf(x4, x12)
    x5, x13 = _bf(x5, x13)
    x6, x14 = _bf(x6, x14)
    x7, x15 = _bf(x7, x15)
    return (x0 * 0.25, x1 * 0.25, x2 * 0.25, x3 * 0.25, x4 * 0.25, x5 * 0.25, x6 * 0.25, x7 * 0.25,
            x8 * 0.25, x9 * 0.25, x10 * 0.25, x11 * 0.25, x12 * 0.25, x13 * 0.25, x14 * 0.25, x15 * 0.25)


@triton.jit
def _load_block(s_ptr, col_ptr, t0, h2, hm2, K, stride_s, rht_mask, HAS_COL_INDEX: tl.constexpr, RHT: tl.constexpr):
    """The 16 tokens ``t0 + j`` ([1, NB] each, t0 the blocks' first tokens) as 16 fp32 tensors."""
    x0 = _load_token(s_ptr, col_ptr, t0 + 0, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x1 = _load_token(s_ptr, col_ptr, t0 + 1, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x2 = _load_token(s_ptr, col_ptr, t0 + 2, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x3 = _load_token(s_ptr, col_ptr, t0 + 3, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x4 = _load_token(s_ptr, col_ptr, t0 + 4, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x5 = _load_token(s_ptr, col_ptr, t0 + 5, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x6 = _load_token(s_ptr, col_ptr, t0 + 6, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x7 = _load_token(s_ptr, col_ptr, t0 + 7, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x8 = _load_token(s_ptr, col_ptr, t0 + 8, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x9 = _load_token(s_ptr, col_ptr, t0 + 9, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x10 = _load_token(s_ptr, col_ptr, t0 + 10, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x11 = _load_token(s_ptr, col_ptr, t0 + 11, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x12 = _load_token(s_ptr, col_ptr, t0 + 12, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x13 = _load_token(s_ptr, col_ptr, t0 + 13, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x14 = _load_token(s_ptr, col_ptr, t0 + 14, h2, hm2, K, stride_s, HAS_COL_INDEX)
    x15 = _load_token(s_ptr, col_ptr, t0 + 15, h2, hm2, K, stride_s, HAS_COL_INDEX)
    if RHT:
        return _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, rht_mask)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _amax_bits(x):
    """|x| as int32 bits: comparable as integers, any NaN above +inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _block_amax_bits(xs):
    m = tl.maximum(_amax_bits(xs[0]), _amax_bits(xs[1]))
    for j in tl.static_range(2, 16):
        m = tl.maximum(m, _amax_bits(xs[j]))
    return m


@triton.jit
def _pair(x0, x1, enc, sf, inner, t, STOCHASTIC: tl.constexpr):
    """Tokens t, t+1 of each block -> (their code byte, their bf16 image word)."""
    if STOCHASTIC:
        c0, r0 = e2m1_round_stochastic(x0 * enc, _uniform(inner, t))
        c1, r1 = e2m1_round_stochastic(x1 * enc, _uniform(inner, t + 1))
    else:
        c0, r0 = e2m1_round_nearest(x0 * enc)
        c1, r1 = e2m1_round_nearest(x1 * enc)
    b0 = x0.to(tl.int32, bitcast=True)
    b1 = x1.to(tl.int32, bitcast=True)
    byte = c0 | (c1 << 4) | ((b0 >> 28) & 8) | ((b1 >> 24) & 0x80)
    i0 = (r0 * sf).to(tl.uint32, bitcast=True)
    i1 = (r1 * sf).to(tl.uint32, bitcast=True)
    # exact bf16 values >= 0 (low 16 fp32 bits zero): the high halves; signs from the inputs
    word = (i0 >> 16).to(tl.int32, bitcast=True) | i1.to(tl.int32, bitcast=True) \
        | ((b0 >> 16) & 0x8000) | (b1 & -2147483648)
    return byte, word


@triton.jit
def _uniform(inner, t):
    bits = fmix32(inner + t.to(tl.uint32, bitcast=True))
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24


@triton.jit
def _store_group(xs, b0, bm, h2, hm2, K, s_enc, s_dec, inner, codes_ptr, scales_ptr, image_ptr, scale_cols_padded,
                 STOCHASTIC: tl.constexpr, WITH_IMAGE: tl.constexpr, SWIZZLED: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Quantize and store one group of token blocks: ``xs`` the 16 token tensors [BH, NB] of
    blocks ``b0 .. b0 + NB - 1``, ``bm`` their amax bits [BH, NB]."""
    blk = b0 + tl.arange(0, BLOCK_NB)
    sf_code, sf, enc, nan = block_encode_scales(bm.to(tl.float32, bitcast=True), (s_enc * ONE_SIXTH)[:, None],
                                                s_dec[:, None])
    t0 = (blk * 16)[None, :]
    y0, w0 = _pair(xs[0], xs[1], enc, sf, inner, t0 + 0, STOCHASTIC)
    y1, w1 = _pair(xs[2], xs[3], enc, sf, inner, t0 + 2, STOCHASTIC)
    y2, w2 = _pair(xs[4], xs[5], enc, sf, inner, t0 + 4, STOCHASTIC)
    y3, w3 = _pair(xs[6], xs[7], enc, sf, inner, t0 + 6, STOCHASTIC)
    y4, w4 = _pair(xs[8], xs[9], enc, sf, inner, t0 + 8, STOCHASTIC)
    y5, w5 = _pair(xs[10], xs[11], enc, sf, inner, t0 + 10, STOCHASTIC)
    y6, w6 = _pair(xs[12], xs[13], enc, sf, inner, t0 + 12, STOCHASTIC)
    y7, w7 = _pair(xs[14], xs[15], enc, sf, inner, t0 + 14, STOCHASTIC)
    lo = tl.where(nan, 0, y0 | (y1 << 8) | (y2 << 16) | (y3 << 24))
    hi = tl.where(nan, 0, y4 | (y5 << 8) | (y6 << 16) | (y7 << 24))
    bmask = hm2 & (blk < K // 16)[None, :]
    r64 = h2.to(tl.int64)
    # codes: 8 bytes per block = two int32 words, laid out along tokens ([BH, 2 NB] words)
    cw = tl.reshape(tl.join(lo, hi), (BLOCK_H, 2 * BLOCK_NB))
    cj = b0 * 2 + tl.arange(0, 2 * BLOCK_NB)
    tl.store(codes_ptr.to(tl.pointer_type(tl.int32)) + r64 * (K // 8) + cj[None, :], cw,
             mask=hm2 & (cj < K // 8)[None, :])
    if SWIZZLED:
        c2 = blk[None, :]
        soff = ((h2 // 128) * (scale_cols_padded // 4) + c2 // 4).to(tl.int64) * 512 \
            + (h2 % 32) * 16 + ((h2 // 32) % 4) * 4 + (c2 % 4)
    else:
        soff = r64 * (K // 16) + blk[None, :]
    tl.store(scales_ptr + soff, sf_code, mask=bmask)
    if WITH_IMAGE:
        # join nests the new axis last: index 4a + 2b + c of join(join(join(.,.)c, .)b, .)a -> w0..w7 in order
        img = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
        img = tl.reshape(img, (BLOCK_H, 8 * BLOCK_NB))
        ij = b0 * 8 + tl.arange(0, 8 * BLOCK_NB)
        tl.store(image_ptr.to(tl.pointer_type(tl.int32)) + r64 * (K // 2) + ij[None, :], img,
                 mask=hm2 & (ij < K // 2)[None, :])


@triton.jit(do_not_specialize=["key"])
def _quantize_cols_kernel(
    s_ptr, col_ptr, amax_ptr, codes_ptr, scales_ptr, sdec_ptr, image_ptr,
    R, K, stride_s, rows_per_group, key, rht_mask, scale_cols_padded, groups_per_prog,
    HAS_COL_INDEX: tl.constexpr, STOCHASTIC: tl.constexpr, WITH_IMAGE: tl.constexpr, SWIZZLED: tl.constexpr,
    RHT: tl.constexpr, AMAX_ONLY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_NB: tl.constexpr,
    PLAIN_AMAX: tl.constexpr = False, KEY_PTR: tl.constexpr = False,
):
    """Program (token range, feature group): BLOCK_H features x ``groups_per_prog`` groups of
    BLOCK_NB blocks of 16 tokens (the per-feature set-up is paid once per program).

    ``AMAX_ONLY``: the same reads (and transform) but only the amax per run of rows, max-reduced
    into ``amax_ptr`` (int32 bits of fp32, zero-initialised) with ``atomic_max``; with ``PLAIN_AMAX``
    also the amax of the values *before* the transform over the whole tensor, into ``sdec_ptr[0]``
    (unused by this mode otherwise; the same int32 bits)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < R
    h2 = h[:, None]
    hm2 = hm[:, None]
    g0 = pid_t * groups_per_prog
    if AMAX_ONLY:
        m = tl.zeros((BLOCK_H, BLOCK_NB), tl.int32)
        pm = tl.zeros((BLOCK_H, BLOCK_NB), tl.int32)
        for g in range(g0, g0 + groups_per_prog):
            blk = g * BLOCK_NB + tl.arange(0, BLOCK_NB)
            if PLAIN_AMAX:
                raw = _load_block(s_ptr, col_ptr, (blk * 16)[None, :], h2, hm2, K, stride_s, rht_mask, HAS_COL_INDEX, False)
                pm = tl.maximum(pm, _block_amax_bits(raw))
                if RHT:
                    xs = _rht16(raw[0], raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7], raw[8], raw[9], raw[10],
                                raw[11], raw[12], raw[13], raw[14], raw[15], rht_mask)
                else:
                    xs = raw
            else:
                xs = _load_block(s_ptr, col_ptr, (blk * 16)[None, :], h2, hm2, K, stride_s, rht_mask, HAS_COL_INDEX, RHT)
            m = tl.maximum(m, _block_amax_bits(xs))
        if PLAIN_AMAX:
            tl.atomic_max(sdec_ptr, tl.max(tl.max(pm, axis=1), axis=0))
        row_max = tl.max(m, axis=1)
        first = pid_h * BLOCK_H
        last = tl.minimum(first + BLOCK_H, R) - 1
        if first // rows_per_group == last // rows_per_group:
            tl.atomic_max(amax_ptr + first // rows_per_group, tl.max(row_max, axis=0))
        else:
            tl.atomic_max(amax_ptr + h // rows_per_group, row_max, mask=hm)
    else:
        amax = tl.load(amax_ptr + h // rows_per_group, mask=hm, other=0.0)
        s_enc, s_dec = global_scales_from_amax(amax)
        if pid_t == 0:
            tl.store(sdec_ptr + h // rows_per_group, canonical_nan_f32(s_dec), mask=hm & ((h % rows_per_group) == 0))
        if STOCHASTIC:
            inner = fmix32(h.to(tl.uint32, bitcast=True) + sr_key_u32(key, KEY_PTR))[:, None]
        else:
            inner = tl.zeros((BLOCK_H, 1), tl.uint32)
        for g in range(g0, g0 + groups_per_prog):
            blk = g * BLOCK_NB + tl.arange(0, BLOCK_NB)
            xs = _load_block(s_ptr, col_ptr, (blk * 16)[None, :], h2, hm2, K, stride_s, rht_mask, HAS_COL_INDEX, RHT)
            _store_group(xs, g * BLOCK_NB, _block_amax_bits(xs), h2, hm2, K, s_enc, s_dec, inner, codes_ptr, scales_ptr,
                         image_ptr, scale_cols_padded, STOCHASTIC, WITH_IMAGE, SWIZZLED, BLOCK_H, BLOCK_NB)


def _grid(r: int, k: int, tiles: QuantizeTiles) -> tuple[tuple[int, int], int, int, int, int]:
    """(grid, groups per program, BLOCK_H, BLOCK_NB, num_warps): enough programs to fill the
    GPU, each walking ``groups`` groups of BLOCK_NB token blocks."""
    bh, nb, warps = (32, 4, 1) if interpreting() else tiles.cols_tile
    groups = cdiv(k // 16, nb)
    ph = cdiv(r, bh)
    per = 1 if interpreting() else max(1, min(tiles.cols_grid[0], groups * ph // tiles.cols_grid[1]))
    return (cdiv(groups, per), ph), per, bh, nb, warps


def launch(x2d, amax, col_index, codes, scales, sdec, image, rows_per_group, stochastic, key, rht_mask,
           swizzled, cols_padded, tiles: QuantizeTiles = DEFAULT):
    """Quantize ``x2d`` [R, K] (``x2d.t()`` row-major; K = ``col_index`` length if given)."""
    src = x2d.t()
    r = x2d.shape[0]
    k = col_index.shape[0] if col_index is not None else x2d.shape[1]
    grid, per, bh, nb, warps = _grid(r, k, tiles)
    _quantize_cols_kernel[grid](
        src, col_index if col_index is not None else codes, amax, codes, scales, sdec, image,
        r, k, src.stride(0), rows_per_group, key, rht_mask, cols_padded, per,
        HAS_COL_INDEX=col_index is not None, STOCHASTIC=stochastic, WITH_IMAGE=image.numel() > 0,
        SWIZZLED=swizzled, RHT=rht_mask >= 0, AMAX_ONLY=False,
        BLOCK_H=bh, BLOCK_NB=nb, KEY_PTR=torch.is_tensor(key), num_warps=warps, **exact_launch(),
    )


def amax_launch(x2d, col_index, rows_per_group, rht_mask, tiles: QuantizeTiles = DEFAULT, plain: bool = False):
    """fp32 ``[ceil(R / rows_per_group)]`` amax of the (transformed) ``x2d`` [R, K] along the
    same reads as :func:`launch` (NaN wins: bit-pattern max). ``plain``: also the fp32 ``[1]`` amax
    of the untransformed values of the whole tensor from the same pass (padding columns are zeros:
    the amax of ``x2d`` itself), returned second."""
    src = x2d.t()
    r = x2d.shape[0]
    k = col_index.shape[0] if col_index is not None else x2d.shape[1]
    out = torch.zeros(-(-r // rows_per_group) if r else 1, dtype=torch.int32, device=x2d.device)
    plain_out = torch.zeros(1, dtype=torch.int32, device=x2d.device) if plain else out
    if r and k:
        grid, per, bh, nb, warps = _grid(r, k, tiles)
        _quantize_cols_kernel[grid](
            src, col_index if col_index is not None else out, out, out, out, plain_out, out,
            r, k, src.stride(0), rows_per_group, 0, rht_mask, 0, per,
            HAS_COL_INDEX=col_index is not None, STOCHASTIC=False, WITH_IMAGE=False, SWIZZLED=False,
            RHT=rht_mask >= 0, AMAX_ONLY=True, BLOCK_H=bh, BLOCK_NB=nb, PLAIN_AMAX=plain,
            num_warps=warps, **exact_launch(),
        )
    if plain:
        return out.view(torch.float32), plain_out.view(torch.float32)
    return out.view(torch.float32)
