"""NVFP4 quantization in Triton, bitwise equal to ``nvfp4.quantize_reference``.

One read of the input writes the packed E2M1 codes, the E4M3 block scales (linear
``[R, K/16]`` or the 128x4 swizzled layout), the fp32 global decode scale(s) and, on request,
the bf16 *image* ``e2m1(code) * fp32(scale)`` that the emulated (Hopper) GEMMs consume.

Dispatch (``quantize_op``; every kernel gives the same bits):
  * bf16 / fp16 rows with unit stride along K, 1x16 blocks, or 16x16 weight tiles with a
    tensor / group scale: :mod:`.quantize_rows` (one block per thread, word loads; the hot path
    of activations, dgrad operands and weights);
  * transposed sources (``x.t()`` / ``dy.t()``, read in place) and the MoE wgrad gather,
    1x16 blocks: :mod:`.quantize_cols` (blocks along tokens, the RHT fused);
  * everything else (fp32 rows, fp32 or odd-row-count weight tiles, odd strides): the generic
    kernel of this module (``_quantize_kernel``).

Supported (every option of the reference):
  * global scale ``"row"`` (computed in the kernel), ``"tensor"`` / ``"group"`` (one amax
    pass first: :mod:`.amax`, or the column kernel's own pass when it transforms), or an
    ``amax`` override of the global scale's shape;
  * ``(1, 16)`` blocks and ``(16, 16)`` tiles (weights);
  * round-to-nearest-even or seeded stochastic rounding with the contract's hash RNG;
  * the 16x16 random Hadamard transform along K (fused into the column kernel; elsewhere the
    contract's ``rht16`` runs first: bitwise by construction);
  * strided input and an optional column gather (``col_index``: column c of the quantized
    matrix reads source column ``col_index[c]``, or zero where it is -1; the MoE wgrad uses it
    to pad experts' token ranges to multiples of 16 without a padded copy);
  * non-finite input: ``"propagate"`` (NaN scales for the domain) or ``"raise"``.

Input: bf16 / fp16 / fp32 ``[..., K]``, K a multiple of 16 (``(16, 16)`` tiles: rows a
multiple of 16). Raises like the reference (TypeError / ValueError) on bad input.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from minite_megatron.nvfp4.formats import BLOCK
from minite_megatron.nvfp4.hadamard import rht16, rht_signs
from minite_megatron.nvfp4.quantize import check_finite, validate_input
from minite_megatron.nvfp4.stochastic import DeviceSeed, check_seed, sr_key
from minite_megatron.nvfp4.swizzle import swizzled_numel
from minite_megatron.nvfp4.tensor import NVFP4Tensor

from minite_kernels.triton.nvfp4._nvfp4_math import (
    FLT_MAX,
    ONE_SIXTH,
    bf16_image_bits,
    canonical_nan_f32,
    e2m1_nearest,
    e2m1_stochastic,
    e2m1_value,
    e4m3_rne_satfinite,
    exact_launch,
    global_scales_from_amax,
    interpreting,
    sr_key_u32,
    sr_uniform,
)
from minite_kernels.triton.nvfp4 import quantize_cols
from minite_kernels.triton.nvfp4 import quantize_rows
from minite_kernels.triton.nvfp4.amax import amax_forward
from minite_kernels.triton.nvfp4.quantize_tiles import DEFAULT, QuantizeTiles
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2


@triton.jit
def _block_max(a, nan, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TILE16: tl.constexpr):
    """[BR, BK] |x| and NaN mask -> [BR, BK/16] block amax (NaN wins), 1x16 or 16x16."""
    nb: tl.constexpr = BLOCK_K // 16
    m = tl.max(tl.reshape(a, (BLOCK_R, nb, 16)), axis=2)
    n = tl.max(tl.reshape(nan.to(tl.int32), (BLOCK_R, nb, 16)), axis=2)
    if TILE16:
        nt: tl.constexpr = BLOCK_R // 16
        m = tl.max(tl.reshape(m, (nt, 16, nb)), axis=1)
        n = tl.max(tl.reshape(n, (nt, 16, nb)), axis=1)
        m = tl.reshape(tl.broadcast_to(tl.reshape(m, (nt, 1, nb)), (nt, 16, nb)), (BLOCK_R, nb))
        n = tl.reshape(tl.broadcast_to(tl.reshape(n, (nt, 1, nb)), (nt, 16, nb)), (BLOCK_R, nb))
    return tl.where(n > 0, float("nan"), m)


@triton.jit
def _load_tile(x_ptr, col_ptr, rows, cols, R, K, stride_r, stride_k, HAS_COL_INDEX: tl.constexpr):
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    if HAS_COL_INDEX:
        src = tl.load(col_ptr + cols, mask=cols < K, other=-1)
        mask = mask & (src >= 0)[None, :]
        src = tl.where(src >= 0, src, 0)
    else:
        src = cols
    offs = rows[:, None].to(tl.int64) * stride_r + src[None, :].to(tl.int64) * stride_k
    return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_tile(
    x, rows, cols, k0, rmask, R, K, scale_mul, s_dec, key_u, codes_ptr, scales_ptr, image_ptr, scale_cols_padded,
    TILE16: tl.constexpr, STOCHASTIC: tl.constexpr, WITH_IMAGE: tl.constexpr, SWIZZLED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Steps 3-6 on one fp32 tile ``x`` [BR, BK] (rows x K columns k0..k0+BK) and its stores."""
    nb: tl.constexpr = BLOCK_K // 16
    cmask = cols < K
    # Step 3: block scales.
    bmax = _block_max(tl.abs(x), x != x, BLOCK_R, BLOCK_K, TILE16)
    sf_code, sf = e4m3_rne_satfinite(bmax * scale_mul)
    # Step 4: encode scale, IEEE division, clamped to FLT_MAX (NaN stays NaN).
    enc = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * s_dec[:, None])
    enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)
    # Step 5: E2M1 rounding.
    v = tl.reshape(tl.reshape(x, (BLOCK_R, nb, 16)) * enc[:, :, None], (BLOCK_R, BLOCK_K))
    if STOCHASTIC:
        codes = e2m1_stochastic(v, sr_uniform(key_u, rows[:, None], cols[None, :]))
    else:
        codes = e2m1_nearest(v)
    # Outputs: packed codes, block scales, image.
    lo, hi = tl.split(tl.reshape(codes, (BLOCK_R, BLOCK_K // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    pcols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    tl.store(codes_ptr + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :], packed,
             mask=rmask[:, None] & (pcols < K // 2)[None, :])
    scols = k0 // 16 + tl.arange(0, nb)
    tl.store(scales_ptr + _scale_offsets(rows[:, None], scols[None, :], K // 16, scale_cols_padded, SWIZZLED),
             sf_code, mask=rmask[:, None] & (scols < K // 16)[None, :])
    if WITH_IMAGE:
        img = tl.reshape(tl.reshape(e2m1_value(codes), (BLOCK_R, nb, 16)) * sf[:, :, None], (BLOCK_R, BLOCK_K))
        tl.store(image_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], bf16_image_bits(img),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _scale_offsets(r, c, cols, scale_cols_padded, SWIZZLED: tl.constexpr):
    """Offset of block scale (row r, block column c): linear, or the 128x4 swizzled layout."""
    if SWIZZLED:
        return ((r // 128) * (scale_cols_padded // 4) + c // 4).to(tl.int64) * 512 \
            + (r % 32) * 16 + ((r // 32) % 4) * 4 + (c % 4)
    else:
        return r.to(tl.int64) * cols + c


@triton.jit(do_not_specialize=["key"])
def _quantize_kernel(
    x_ptr, col_ptr, amax_ptr, codes_ptr, scales_ptr, sdec_ptr, image_ptr,
    R, K, stride_r, stride_k, rows_per_group, key, scale_cols_padded,
    HAS_COL_INDEX: tl.constexpr, ROW_AMAX: tl.constexpr, TILE16: tl.constexpr,
    STOCHASTIC: tl.constexpr, WITH_IMAGE: tl.constexpr, SWIZZLED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_PASS: tl.constexpr, KEY_PTR: tl.constexpr = False,
):
    """Row-major programs: BLOCK_R rows each; one pass when ``SINGLE_PASS`` (BLOCK_K >= K:
    the rows stay in registers), else one amax pass (row scales) and one quantize pass."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    if STOCHASTIC:
        key_u = sr_key_u32(key, KEY_PTR)
    else:
        key_u = 0
    if SINGLE_PASS:  # whole rows in registers
        cols = tl.arange(0, BLOCK_K)
        x = _load_tile(x_ptr, col_ptr, rows, cols, R, K, stride_r, stride_k, HAS_COL_INDEX)
        if ROW_AMAX:
            amax = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=1).to(tl.float32, bitcast=True)
        else:
            amax = tl.load(amax_ptr + rows // rows_per_group, mask=rmask, other=0.0)
        s_enc, s_dec = global_scales_from_amax(amax)
        tl.store(sdec_ptr + rows // rows_per_group, canonical_nan_f32(s_dec),
                 mask=rmask & ((rows % rows_per_group) == 0))
        _quantize_tile(x, rows, cols, 0, rmask, R, K, (s_enc * ONE_SIXTH)[:, None], s_dec, key_u,
                       codes_ptr, scales_ptr, image_ptr, scale_cols_padded,
                       TILE16, STOCHASTIC, WITH_IMAGE, SWIZZLED, BLOCK_R, BLOCK_K)
    else:
        # Steps 1-2: the global amax of each row's scale domain, then S_enc / S_dec.
        if ROW_AMAX:
            amax_bits = tl.zeros((BLOCK_R,), tl.int32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                x = _load_tile(x_ptr, col_ptr, rows, cols, R, K, stride_r, stride_k, HAS_COL_INDEX)
                amax_bits = tl.maximum(amax_bits, tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=1))
            amax = amax_bits.to(tl.float32, bitcast=True)  # NaN bits sort above +inf: NaN wins
        else:
            amax = tl.load(amax_ptr + rows // rows_per_group, mask=rmask, other=0.0)
        s_enc, s_dec = global_scales_from_amax(amax)
        tl.store(sdec_ptr + rows // rows_per_group, canonical_nan_f32(s_dec),
                 mask=rmask & ((rows % rows_per_group) == 0))
        scale_mul = (s_enc * ONE_SIXTH)[:, None]
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = _load_tile(x_ptr, col_ptr, rows, cols, R, K, stride_r, stride_k, HAS_COL_INDEX)
            _quantize_tile(x, rows, cols, k0, rmask, R, K, scale_mul, s_dec, key_u,
                           codes_ptr, scales_ptr, image_ptr, scale_cols_padded,
                           TILE16, STOCHASTIC, WITH_IMAGE, SWIZZLED, BLOCK_R, BLOCK_K)


@triton.jit(do_not_specialize=["key"])
def _quantize_t_kernel(
    s_ptr, col_ptr, amax_ptr, codes_ptr, scales_ptr, sdec_ptr, image_ptr,
    R, K, stride_s, T_SRC, rows_per_group, key, scale_cols_padded,
    HAS_COL_INDEX: tl.constexpr, STOCHASTIC: tl.constexpr, WITH_IMAGE: tl.constexpr, SWIZZLED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, KEY_PTR: tl.constexpr = False,
):
    """Quantize ``S^T`` where ``S`` is row-major ``[T_SRC, R]`` (row stride ``stride_s``): the
    wgrad operands ``x.t()`` / ``dy.t()``. The quantized matrix is ``[R, K]`` (K = tokens, or
    ``col_index``'s length: padded token c reads source row ``col_index[c]``, zero where -1).

    Each program loads a [BLOCK_T tokens, BLOCK_H features] tile of ``S`` (coalesced along
    features) and does the block math along tokens in that layout (no per-block work is
    replicated across threads); the transposed outputs are written through the store layout.
    Global amax comes precomputed (``amax_ptr``, one per ``rows_per_group`` rows).
    """
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # quantized columns (tokens)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # quantized rows (features)
    hmask = h < R
    tmask = t < K
    if HAS_COL_INDEX:
        src = tl.load(col_ptr + t, mask=tmask, other=-1)
        lmask = (src >= 0)[:, None] & hmask[None, :]
        src = tl.where(src >= 0, src, 0)
    else:
        src = t
        lmask = tmask[:, None] & hmask[None, :]
    x = tl.load(s_ptr + src[:, None].to(tl.int64) * stride_s + h[None, :], mask=lmask, other=0.0).to(tl.float32)
    amax = tl.load(amax_ptr + h // rows_per_group, mask=hmask, other=0.0)
    s_enc, s_dec = global_scales_from_amax(amax)
    if pid_t == 0:
        tl.store(sdec_ptr + h // rows_per_group, canonical_nan_f32(s_dec), mask=hmask & ((h % rows_per_group) == 0))
    nb: tl.constexpr = BLOCK_T // 16
    # Step 3 along tokens (axis 0): [nb, 16, BH] -> [nb, BH]
    x3 = tl.reshape(x, (nb, 16, BLOCK_H))
    bmax = tl.max(tl.abs(x3), axis=1)
    bnan = tl.max((x3 != x3).to(tl.int32), axis=1)
    bmax = tl.where(bnan > 0, float("nan"), bmax)
    sf_code, sf = e4m3_rne_satfinite(bmax * (s_enc * ONE_SIXTH)[None, :])
    enc = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * s_dec[None, :])
    enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)
    v = tl.reshape(x3 * enc[:, None, :], (BLOCK_T, BLOCK_H))
    if STOCHASTIC:
        codes = e2m1_stochastic(v, sr_uniform(sr_key_u32(key, KEY_PTR), h[None, :], t[:, None]))
    else:
        codes = e2m1_nearest(v)
    # codes [BT, BH] -> pairs of consecutive tokens -> bytes [BT/2, BH]
    lo, hi = tl.split(tl.permute(tl.reshape(codes, (BLOCK_T // 2, 2, BLOCK_H)), (0, 2, 1)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    tp = pid_t * (BLOCK_T // 2) + tl.arange(0, BLOCK_T // 2)
    tl.store(codes_ptr + h[None, :].to(tl.int64) * (K // 2) + tp[:, None], packed,
             mask=hmask[None, :] & (tp < K // 2)[:, None])
    ts = pid_t * nb + tl.arange(0, nb)
    tl.store(scales_ptr + _scale_offsets(h[None, :], ts[:, None], K // 16, scale_cols_padded, SWIZZLED), sf_code,
             mask=hmask[None, :] & (ts < K // 16)[:, None])
    if WITH_IMAGE:
        img = tl.reshape(tl.reshape(e2m1_value(codes), (nb, 16, BLOCK_H)) * sf[:, None, :], (BLOCK_T, BLOCK_H))
        tl.store(image_ptr + h[None, :].to(tl.int64) * K + t[:, None], bf16_image_bits(img),
                 mask=hmask[None, :] & tmask[:, None])


def _config(r: int, k: int, tile16: bool, stochastic: bool, tiles: QuantizeTiles = DEFAULT) -> tuple[int, int, int, bool]:
    """(BLOCK_R, BLOCK_K, num_warps, SINGLE_PASS) of the row-major kernel."""
    if interpreting():
        block_k = min(next_pow2(k), 64)
        block_r = 16 if tile16 else max(1, min(16, next_pow2(r)))
        return block_r, block_k, 4, block_k >= k
    kp = next_pow2(k)
    if r <= tiles.small_r and kp <= 16384 and not tile16:
        block_r = min(next_pow2(r), max(1, 8192 // kp))
        return block_r, kp, 4 if block_r * kp <= 4096 else 8, True
    if kp <= tiles.single_pass_k:
        elems = tiles.single_pass_elems // (2 if stochastic else 1)
        block_r = max(16 if tile16 else 1, min(64, elems // kp))
        warps = 8 if block_r * kp >= 8192 else 4
        return block_r, kp, warps, True
    tile_r, tile_k, warps = tiles.loop_tile
    if stochastic:  # the hash RNG needs registers: half the tile keeps the kernel spill-free
        tile_r = max(1, tile_r // 2)
    block_k = min(kp, tile_k)
    block_r = max(16 if tile16 else 1, min(64, tile_r * tile_k // block_k))
    return block_r, block_k, warps, False


def _transposed_source(x2d: torch.Tensor) -> bool:
    """``x2d`` is the transpose of a row-major matrix (``x.t()``): read it with the t-kernel."""
    return x2d.dim() == 2 and x2d.stride(0) == 1 and x2d.stride(1) != 1 and x2d.shape[0] > 1


def _tensor_amax(x2d: torch.Tensor, rows_per_group: int) -> torch.Tensor:
    """amax per run of rows, read in the orientation that is contiguous when there is one domain."""
    if rows_per_group >= x2d.shape[0] and _transposed_source(x2d):
        return amax_forward(x2d.t(), max(x2d.shape[1], 1))
    return amax_forward(x2d, rows_per_group)


@functools.lru_cache(maxsize=256)
def rht_mask_of(rht_seed: int | None) -> int:
    """The RHT sign vector of ``rht_seed`` (``nvfp4.rht_signs``) as 16 bits (bit j: sign j is
    -1); -1 for no transform. A negative seed is the fixed all-ones vector (mask 0)."""
    if rht_seed is None:
        return -1
    signs = rht_signs(None if rht_seed < 0 else rht_seed)
    return int(sum(1 << j for j in range(BLOCK) if float(signs[j]) < 0))


@functools.lru_cache(maxsize=64)
def _signs_of_mask(mask: int, device: torch.device) -> torch.Tensor:
    """fp32 [16] sign vector of ``mask`` on ``device`` (cached: no host-to-device copy per call,
    so a quantize call can be captured in a CUDA graph after its first run)."""
    return torch.tensor([-1.0 if (mask >> j) & 1 else 1.0 for j in range(BLOCK)], dtype=torch.float32, device=device)


def key_args(seed, device) -> tuple[int, torch.Tensor | None]:
    """``(key, key_tensor)`` of :func:`quantize_op` for a stochastic-rounding ``seed``: an int's
    key as a scalar, a ``DeviceSeed``'s key tensor (read by the kernel when it runs)."""
    check_seed(seed, device)
    if isinstance(seed, DeviceSeed):
        return 0, seed.key
    return sr_key(seed), None


@custom_op("minite::quantize", mutates_args=())
def quantize_op(
    x2d: torch.Tensor,
    amax: torch.Tensor | None,
    col_index: torch.Tensor | None,
    rows_per_group: int,
    tile16: bool,
    stochastic: bool,
    key: int,
    with_image: bool,
    swizzled: bool,
    rht_mask: int = -1,
    tiles: list[int] | None = None,
    key_tensor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel launch on a 2D (possibly strided) ``x2d`` ``[R, K]`` (K = ``col_index`` length if given).

    ``amax``: None (per-row amax computed in the kernel, ``rows_per_group`` must be 1) or fp32
    ``[ceil(R / rows_per_group)]`` (of the transformed values when ``rht_mask >= 0``).
    ``rht_mask``: -1, or the RHT sign vector as bits (bit j set: sign j is -1, see
    :func:`rht_mask_of`); the transform runs along K, fused into the column kernel for
    transposed sources, a separate ``rht16`` pass otherwise. ``tiles``: ``QuantizeTiles.as_list()``
    (None: the defaults). ``key_tensor``: an int32 [1] tensor holding the stochastic-rounding key
    (a ``DeviceSeed``'s), read by the kernel instead of ``key``. Returns ``(codes [R, K/2] uint8, scales uint8 (linear [R, K/16] or flat
    swizzled), global decode fp32 [domains], image bf16 [R, K] or [0])``.
    """
    r = x2d.shape[0]
    k = col_index.shape[0] if col_index is not None else x2d.shape[1]
    dev, t = x2d.device, QuantizeTiles.from_list(tiles) if tiles is not None else DEFAULT
    domains = -(-r // rows_per_group) if r else 0
    codes = torch.empty(r, k // 2, dtype=torch.uint8, device=dev)
    scale_cols = k // BLOCK
    if swizzled:
        scales = torch.zeros(swizzled_numel(r, scale_cols), dtype=torch.uint8, device=dev)
    else:
        scales = torch.empty(r, scale_cols, dtype=torch.uint8, device=dev)
    sdec = torch.empty(domains, dtype=torch.float32, device=dev)
    image = torch.empty((r, k) if with_image else (0,), dtype=torch.bfloat16, device=dev)
    if r == 0 or k == 0:
        return codes, scales, sdec, image
    cols_padded = -(-scale_cols // 4) * 4
    if key_tensor is not None:
        key = key_tensor  # the launchers pass it as a pointer (KEY_PTR)
    if rht_mask < 0 and quantize_rows.supported(x2d, tile16, col_index is not None, amax is not None):
        quantize_rows.launch(x2d, amax, codes, scales, sdec, image, rows_per_group, stochastic, key, swizzled,
                             cols_padded, tile16, t)
        return codes, scales, sdec, image
    if quantize_cols.supported(x2d, tile16):
        if amax is None:
            amax = quantize_cols.amax_launch(x2d, col_index, 1, rht_mask, t)
        quantize_cols.launch(x2d, amax, col_index, codes, scales, sdec, image, rows_per_group, stochastic, key,
                             rht_mask, swizzled, cols_padded, t)
        return codes, scales, sdec, image
    if rht_mask >= 0:  # layouts the column kernel does not take: transform first (exact, fp32)
        if col_index is not None:
            x2d = torch.where((col_index >= 0)[None, :], x2d[:, col_index.clamp(min=0).long()], 0)
            col_index = None
        x2d = rht16(x2d, _signs_of_mask(rht_mask, torch.device(x2d.device)))
    if _transposed_source(x2d) and not tile16:
        if amax is None:
            amax = amax_forward(x2d, 1)
        bt, bh, warps = (16, 16, 4) if interpreting() else t.transposed_tile
        src = x2d.t()
        _quantize_t_kernel[(cdiv(k, bt), cdiv(r, bh))](
            src, col_index if col_index is not None else codes, amax, codes, scales, sdec, image.view(torch.int16),
            r, k, src.stride(0), src.shape[0], rows_per_group, key, cols_padded,
            HAS_COL_INDEX=col_index is not None, STOCHASTIC=stochastic, WITH_IMAGE=with_image, SWIZZLED=swizzled,
            BLOCK_T=bt, BLOCK_H=bh, KEY_PTR=torch.is_tensor(key), num_warps=warps, **exact_launch(),
        )
        return codes, scales, sdec, image
    block_r, block_k, warps, single = _config(r, k, tile16, stochastic, t)
    _quantize_kernel[(cdiv(r, block_r),)](
        x2d, col_index if col_index is not None else codes, amax if amax is not None else sdec,
        codes, scales, sdec, image.view(torch.int16),
        r, k, x2d.stride(0), x2d.stride(1), rows_per_group, key, cols_padded,
        HAS_COL_INDEX=col_index is not None, ROW_AMAX=amax is None, TILE16=tile16,
        STOCHASTIC=stochastic, WITH_IMAGE=with_image, SWIZZLED=swizzled,
        BLOCK_R=block_r, BLOCK_K=block_k, SINGLE_PASS=single, KEY_PTR=torch.is_tensor(key), num_warps=warps,
        **exact_launch(),
    )
    return codes, scales, sdec, image


@quantize_op.register_fake
def _(x2d, amax, col_index, rows_per_group, tile16, stochastic, key, with_image, swizzled, rht_mask=-1, tiles=None,
      key_tensor=None):
    r = x2d.shape[0]
    k = col_index.shape[0] if col_index is not None else x2d.shape[1]
    scale_numel = swizzled_numel(r, k // BLOCK) if swizzled else r * (k // BLOCK)
    domains = -(-r // rows_per_group) if r else 0
    return (
        x2d.new_empty((r, k // 2), dtype=torch.uint8),
        x2d.new_empty((scale_numel,) if swizzled else (r, k // BLOCK), dtype=torch.uint8),
        x2d.new_empty((domains,), dtype=torch.float32),
        x2d.new_empty((r, k) if with_image else (0,), dtype=torch.bfloat16),
    )


def quantize_forward(
    x: torch.Tensor,
    *,
    global_scale: str = "row",
    tile: tuple[int, int] = (1, BLOCK),
    rounding: str = "nearest",
    seed: int | DeviceSeed | None = None,
    rht_seed: int | None = None,
    amax: torch.Tensor | None = None,
    with_image: bool = False,
    nonfinite: str = "propagate",
    scale_layout: str = "linear",
    tiles: QuantizeTiles = DEFAULT,
) -> NVFP4Tensor:
    """Quantize ``x`` [..., K] to NVFP4: the reference's signature and result, bit for bit.

    ``scale_layout="swizzled"`` writes the block scales in the 128x4 swizzled layout; ``tiles``: the GPU launch tiles.
    See :func:`minite_megatron.nvfp4.quantize` for the arguments and the errors raised.
    """
    validate_input(x, tile, global_scale)
    if nonfinite == "raise":
        check_finite(x)
    elif nonfinite != "propagate":
        raise ValueError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic" and seed is None:
        raise ValueError("stochastic rounding needs a seed (nvfp4.quantize draws one from `generator`)")
    key, key_tensor = key_args(seed, x.device) if rounding == "stochastic" else (0, None)
    if rht_seed is not None and tuple(tile) != (1, BLOCK):
        raise ValueError("the random Hadamard transform applies to 1x16 blocks only")
    if scale_layout not in ("linear", "swizzled"):
        raise ValueError(f"scale_layout must be 'linear' or 'swizzled', got {scale_layout!r}")

    shape = x.shape
    k = shape[-1]
    if x.numel() == 0:
        # Nothing to quantize (no rows, or K == 0): the contract's empty result, with the
        # (tensor / group) global scales of empty domains (amax 0 -> S_dec = 1).
        return _empty_domains(x, shape, global_scale, tile, rht_seed, amax, with_image)
    x2d = x.reshape(-1, k) if x.dim() != 2 else x
    tile16 = tuple(tile) == (BLOCK, BLOCK)
    rht = rht_mask_of(rht_seed)
    if rht >= 0 and not quantize_cols.supported(x2d, tile16):  # fused only there
        x2d = rht16(x2d, _signs_of_mask(rht, torch.device(x.device)))
        rht = -1
    rows = x2d.shape[0]
    if global_scale == "row":
        rpg = 1
    elif global_scale == "tensor":
        rpg = max(rows, 1)
    else:
        rpg = max(rows // shape[0], 1) if shape[0] else 1
    if amax is not None:
        amax = amax.to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
    elif global_scale != "row" and rows and k:
        amax = quantize_cols.amax_launch(x2d, None, rpg, rht, tiles) if rht >= 0 else _tensor_amax(x2d, rpg)
    codes, scales, sdec, image = quantize_op(
        x2d, amax, None, rpg, tile16, rounding == "stochastic",
        key, with_image, scale_layout == "swizzled", rht, None if tiles is DEFAULT else tiles.as_list(), key_tensor,
    )
    q = NVFP4Tensor(
        codes=codes.reshape(*shape[:-1], k // 2),
        block_scales=(scales.view(torch.float8_e4m3fn) if scale_layout == "swizzled"
                      else scales.view(torch.float8_e4m3fn).reshape(*shape[:-1], k // BLOCK)),
        global_decode=sdec,
        shape=shape,
        global_scale=global_scale,
        tile=tuple(tile),
        layout=scale_layout,
        rht_seed=rht_seed,
    )
    if with_image:
        q = replace(q, image=image.reshape(shape))
    return q


def _empty_domains(x, shape, global_scale, tile, rht_seed, amax, with_image) -> NVFP4Tensor:
    from minite_megatron.nvfp4.quantize import quantize_reference

    return quantize_reference(
        x, global_scale=global_scale, tile=tile, rht_seed=rht_seed, amax=amax, with_image=with_image
    )
