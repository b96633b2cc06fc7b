"""Pieces shared by the decode GEMMs (:mod:`.decode_gemm`, :mod:`.decode_grouped_gemm`): the
in-register dequantization of a packed FP4 weight tile to its exact bf16 image and the swap-AB
K loop with all of a program's loads in flight at once.

Dequantization (``dequant_tile``). A weight tile arrives as packed E2M1 codes (uint8 ``[BN,
BK/2]``, two per byte, element 2i in the low nibble) and its E4M3 block scales. On the GPU
(``ASM=True``) one inline-PTX block takes 4 packed bytes (one 32-bit register, 8 weights) and
returns, for each byte, one 32-bit register holding the bf16 pair (low nibble, high nibble)
times that byte's block scale -- **each output depends only on its own byte and scale**, so it
is correct whatever 4 bytes Triton hands the block (its docs leave the grouping unspecified;
a first form that decoded 4 bytes into 8 *separately placed* outputs assumed they were
consecutive along K and was wrong on the H200 for some layouts, 2026-12-01). 20 PTX
instructions per 8 weights, all byte permutes (``prmt``) on whole words:

* ``m = W & 0x77777777``: the 3 magnitude bits of each nibble, used as ``prmt`` selectors;
* a first lookup (``prmt`` on the two words ``SELECTORS``) turns each magnitude into one
  selector *byte* ``[i_lo, i_hi]``: the positions, in an 8-byte table ``BYTES`` of the
  distinct bf16 bytes {00, 80, 3F, BF, 40, C0}, of the low and the high byte of the bf16 value
  of that E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6 = 0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040
  0x4080 0x40C0);
* the sign: ``prmt`` in sign-replicate mode on 0x80 bytes with the raw codes as selectors gives
  0xFF for negative codes and 0x80 for positive ones; its bit 4 is ORed into ``i_hi`` (the
  table keeps each negative high byte (80, BF, C0) right after its positive one (00, 3F, 40));
* the low 16 bits of the selector word (two bytes = 4 nibbles ``[i_lo(a), i_hi(a), i_lo(b),
  i_hi(b)]``) pick the bf16 pair of one packed byte from ``BYTES`` in one ``prmt``;
* ``mul.rn.bf16x2`` by the byte's block scale (``e4m3 -> bf16`` is exact; ``e2m1 * e4m3``
  has at most 6 significant bits, so the product is exact too; NaN scales give NaN).

Every value is the exact image ``e2m1(code) * fp32(scale)`` in bf16 (code 8 gives -0.0, as
``formats.e2m1_decode``). Under the interpreter (``ASM=False``, CPU tests) the same values come
from ``_nvfp4_math``'s fp32 decoders; ``tests/kernels/triton/decode/test_decode_asm.py`` runs the PTX
on the CPU through a small interpreter of its instructions.

K loop (``decode_k_loop``): the program's K range is ``NCHUNK`` steps of ``BLOCK_K``, unrolled
at compile time; the packed codes, scales and activation tile of the first ``DEPTH`` steps are
loaded before any step is computed, and step ``c + DEPTH``'s loads are issued right after step
``c``'s dequantization, so ``DEPTH`` steps of bytes are in flight per program (no loop-carried
registers, hence no register moves that would wait for the loads). Each step multiplies on the
tensor cores in 16-wide K steps from the running accumulator, in K order (the learner's strict
chain when there is one program per K range).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.nvfp4._nvfp4_math import e2m1_value, e4m3_value

# $0..$3: bf16x2 pairs of the 4 packed bytes of $4 (element j of the block = byte j of $4);
# $5..$8: each byte's block scale as a bf16x2 (s, s); $9, $13: SELECTORS; $17, $21: BYTES;
# $25: 0x80808080. (An int32 input takes 4 registers with pack=4; the table values are loaded
# at run time, so ptxas keeps them in registers instead of re-materializing immediates.)
_DEQUANT_ASM = tl.constexpr("""
{
.reg .b32 m, mh, wh, sa, sb, g, g2, sa2, sb2, p0, p1, p2, p3;
and.b32 m, $4, 0x77777777;
shr.u32 mh, m, 16;
shr.u32 wh, $4, 16;
prmt.b32 sa, $9, $13, m;
prmt.b32 sb, $9, $13, mh;
prmt.b32 g, $25, $25, $4;
prmt.b32 g2, $25, $25, wh;
lop3.b32 sa, g, 0x10101010, sa, 0xEA;
lop3.b32 sb, g2, 0x10101010, sb, 0xEA;
shr.u32 sa2, sa, 16;
shr.u32 sb2, sb, 16;
prmt.b32 p0, $17, $21, sa;
prmt.b32 p1, $17, $21, sa2;
prmt.b32 p2, $17, $21, sb;
prmt.b32 p3, $17, $21, sb2;
mul.rn.bf16x2 $0, p0, $5;
mul.rn.bf16x2 $1, p1, $6;
mul.rn.bf16x2 $2, p2, $7;
mul.rn.bf16x2 $3, p3, $8;
}
""")
#: The asm's tables: SELECTORS (two words: byte i = [i_lo, i_hi] of magnitude i), BYTES (two
#: words: the distinct bf16 bytes 00 80 3F BF 40 C0), and 0x80808080 (sign-replicate source).
DEQUANT_TABLES = (0x25212000, 0x45414440, 0xBF3F8000, 0x0000C040, 0x80808080)


_TABLES: dict = {}


def device_words(words: tuple, device) -> torch.Tensor:
    """The 32-bit lookup words ``words`` (unsigned) as an int32 tensor on ``device`` (cached per
    table and device: the decode kernels read their asm tables from it)."""
    t = _TABLES.get((words, device))
    if t is None:
        t = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in words], dtype=torch.int32, device=device)
        _TABLES[(words, device)] = t
    return t


def dequant_tables(device) -> torch.Tensor:
    """int32 ``[5]`` on ``device``: :data:`DEQUANT_TABLES` (cached)."""
    return device_words(DEQUANT_TABLES, device)


@triton.jit
def load_tables(lut_ptr, rows):
    """The 5 int32 lookup words of the dequant asm (:data:`DEQUANT_TABLES`) as ``[BN]`` tensors
    (``rows``: the program's weight rows, ``0 <= rows < 2**30``). Each word gets ``rows >> 30``
    (zero at run time) added: values per thread, so ptxas keeps them in ordinary registers --
    scalar table words landed in uniform registers and were copied back before every ``prmt``
    (~1 SASS instruction per weight, CPU-AOT count 2026-12-02)."""
    zero = rows >> 30
    return (tl.load(lut_ptr) + zero, tl.load(lut_ptr + 1) + zero, tl.load(lut_ptr + 2) + zero,
            tl.load(lut_ptr + 3) + zero, tl.load(lut_ptr + 4) + zero)


@triton.jit
def dequant_tile(packed, sf_code, luts, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """uint8 codes ``[BK/16, BN, 8]`` (the 8 bytes of each 16-element block; blocks first, so
    Triton's coalescer, which orders equally non-contiguous axes by index, spreads a warp along
    K) + uint8 E4M3 scales ``[BK/16, BN]`` -> the exact image ``[BN, BK]`` (bf16 with ``ASM``;
    fp32 without, whose values are the same). The scales broadcast along the trailing axis, so
    they need no layout change. ``luts``: :func:`load_tables`."""
    if ASM:
        q0, q1, t0, t1, x80 = luts
        sb = sf_code.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        sfp = tl.broadcast_to((sb | (sb << 16))[:, :, None], (BLOCK_K // 16, BLOCK_N, 8))
        z = tl.zeros((BLOCK_K // 16, BLOCK_N, 8), tl.int32)
        r = tl.inline_asm_elementwise(
            _DEQUANT_ASM, "=r,=r,=r,=r," + "r," * 24 + "r",
            [packed, sfp, z + q0[None, :, None], z + q1[None, :, None], z + t0[None, :, None], z + t1[None, :, None],
             z + x80[None, :, None]],
            dtype=tl.int32, is_pure=True, pack=4
        )
        lo = r.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.reshape(tl.permute(tl.join(lo, hi), (1, 0, 2, 3)), (BLOCK_N, BLOCK_K))
    else:
        codes = packed.to(tl.int32)  # (luts unused: the interpreter runs no PTX)
        vals = e2m1_value(tl.join(codes & 15, codes >> 4)) * e4m3_value(sf_code.to(tl.int32))[:, :, None, None]
        return tl.reshape(tl.permute(vals, (1, 0, 2, 3)), (BLOCK_N, BLOCK_K))


@triton.jit
def _load_codes(codes_rows, k0, k_hi, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr):
    """uint8 ``[BK/16, BN, 8]``: the packed codes of the K step at ``k0`` (zeros past ``k_hi``)."""
    pk = k0 // 2 + tl.arange(0, BLOCK_K // 16)[:, None] * 8 + tl.arange(0, 8)[None, :]
    if MASK_K:
        return tl.load(codes_rows[None, :, None] + pk[:, None, :], mask=(pk < k_hi // 2)[:, None, :], other=0)
    else:
        return tl.load(codes_rows[None, :, None] + pk[:, None, :])


@triton.jit
def _load_scales(scales_rows, k0, k_hi, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr):
    """uint8 ``[BK/16, BN]``: the E4M3 block scales of the K step at ``k0``."""
    sk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    if MASK_K:
        return tl.load(scales_rows[None, :] + sk[:, None], mask=(sk < k_hi // 16)[:, None], other=0)
    else:
        return tl.load(scales_rows[None, :] + sk[:, None])


@triton.jit
def _load_x(a_rows, m_ok, k0, k_hi, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr):
    """bf16 ``[BK, M_PAD]``: the activation image tile of the K step at ``k0``."""
    kk = k0 + tl.arange(0, BLOCK_K)
    if MASK_K:
        return tl.load(a_rows + kk[:, None], mask=m_ok & (kk < k_hi)[:, None], other=0.0)
    else:
        return tl.load(a_rows + kk[:, None], mask=m_ok, other=0.0)


@triton.jit
def _decode_k_steps(acc, codes_rows, scales_rows, a_rows, m_ok, k_lo, k_hi, luts,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NSTEPS: tl.constexpr, DEPTH: tl.constexpr,
                    MASK_K: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr):
    """``acc`` plus ``NSTEPS`` K steps of ``BLOCK_K`` from ``k_lo``, unrolled, ``DEPTH`` steps'
    loads in flight (see :func:`decode_k_loop`)."""
    # program order of the first DEPTH steps: every step's codes, then activations, then scales,
    # so no layout conversion (shared-memory store + barrier, which waits for its load) sits
    # between two steps' weight loads
    codes = ()
    xs = ()
    scales = ()
    for c in tl.static_range(NSTEPS):
        if c < DEPTH:
            codes = codes + (_load_codes(codes_rows, k_lo + c * BLOCK_K, k_hi, BLOCK_K, MASK_K),)
    for c in tl.static_range(NSTEPS):
        if c < DEPTH:
            xs = xs + (_load_x(a_rows, m_ok, k_lo + c * BLOCK_K, k_hi, BLOCK_K, MASK_K),)
    for c in tl.static_range(NSTEPS):
        if c < DEPTH:
            scales = scales + (_load_scales(scales_rows, k_lo + c * BLOCK_K, k_hi, BLOCK_K, MASK_K),)
    for c in tl.static_range(NSTEPS):
        w = dequant_tile(codes[c], scales[c], luts, BLOCK_N, BLOCK_K, ASM)
        x = xs[c]
        if c + DEPTH < NSTEPS:
            k1 = k_lo + (c + DEPTH) * BLOCK_K
            codes = codes + (_load_codes(codes_rows, k1, k_hi, BLOCK_K, MASK_K),)
            xs = xs + (_load_x(a_rows, m_ok, k1, k_hi, BLOCK_K, MASK_K),)
            scales = scales + (_load_scales(scales_rows, k1, k_hi, BLOCK_K, MASK_K),)
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(tl.bfloat16), x, acc)
    return acc


@triton.jit
def decode_k_loop(codes_rows, scales_rows, a_rows, m_ok, k_lo, k_hi, luts,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, NCHUNK: tl.constexpr,
                  DEPTH: tl.constexpr, MASK_K: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr,
                  GROUP: tl.constexpr = 0):
    """fp32 ``[BN, M_PAD]`` = sum over k in [k_lo, k_lo + NCHUNK * BLOCK_K) ∩ [0, k_hi) of
    ``W[n, k] * x[m, k]`` (swap-AB).

    ``codes_rows`` / ``scales_rows``: ``[BN]`` pointers to the weight rows' codes / scales at
    k = 0; ``a_rows``: ``[1, M_PAD]`` pointers to the activation image rows at k = 0 (rows with
    ``m_ok`` false read zeros). ``MASK_K``: some step may reach ``k_hi`` (masked loads; without
    it, 16-byte loads where the strides allow). ``DEPTH``: steps whose loads are in flight
    ahead of the one being computed (``DEPTH >= NCHUNK``: every load first). The tensor cores
    add 16-wide K steps in K order onto the running accumulator (the learner's strict GEMM's
    chain); the interpreter adds each BLOCK_K step's exact fp32 product.

    ``GROUP`` (0: off): the K steps run as a rolled loop of ``NCHUNK // GROUP`` iterations of
    ``GROUP`` unrolled steps (``NCHUNK % GROUP == 0``), ``min(DEPTH, GROUP)`` in flight within an
    iteration. The chain of MMA steps is the same as unrolled -- the same tiles added onto the same
    accumulator in the same K order -- so the result is the same bits; only the live ranges
    change: the whole-K unrolled loop of a strict program at K = 2048 (16 steps) needs 255
    registers and spills 4 KB per thread on sm_90a (CPU-AOT).
    """
    acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    if GROUP == 0:
        acc = _decode_k_steps(acc, codes_rows, scales_rows, a_rows, m_ok, k_lo, k_hi, luts, BLOCK_N, BLOCK_K, NCHUNK,
                              DEPTH, MASK_K, ASM, DOT_FP32)
    else:
        tl.static_assert(NCHUNK % GROUP == 0, "decode_k_loop: NCHUNK must be a multiple of GROUP")
        for g in range(0, NCHUNK // GROUP):
            acc = _decode_k_steps(acc, codes_rows, scales_rows, a_rows, m_ok, k_lo + g * (GROUP * BLOCK_K), k_hi, luts,
                                  BLOCK_N, BLOCK_K, GROUP, DEPTH if DEPTH < GROUP else GROUP, MASK_K, ASM, DOT_FP32)
    return acc


@triton.jit
def splits_k(SPLIT, ONE_SPLIT: tl.constexpr):
    """Whether a decode launch splits K: ``SPLIT > 1``, a compile-time False with ``ONE_SPLIT`` (a
    launch with one K range: the split-K code, partials and counters, is not compiled in; the
    grouped strict kernel then needs 128 instead of 210 registers at K = 2048, CPU-AOT sm_90a)."""
    if ONE_SPLIT:
        return False
    else:
        return SPLIT > 1


def rolled_group(nchunk: int, group: int) -> int:
    """The ``GROUP`` a launch of ``nchunk`` K steps uses for a configuration's ``GROUP`` (0: the
    K steps unrolled): the largest divisor of ``nchunk`` not above it, 0 where that leaves one
    iteration (nothing to roll)."""
    if group <= 0:
        return 0
    g = min(group, nchunk)
    while nchunk % g:
        g -= 1
    return 0 if g == nchunk else g


def check_expert_weights(name: str, k: int, w_codes, w_scales, w_scale, experts: int, a_scale, rows: int,
                         out_dtype, out_dtypes) -> None:
    """The decode GEMMs' shared operand checks (ValueError / TypeError naming the operand): weight
    codes ``[E*N, K/2]``, scales ``[E*N, K/16]``, ``[E]`` or ``[E*N]`` global scales, ``[1]`` or
    ``[rows]`` row scales, an output dtype of ``out_dtypes``."""
    if experts <= 0 or w_codes.dim() != 2 or w_codes.shape[0] % experts or w_codes.shape[1] * 2 != k:
        raise ValueError(f"{name}: weight codes {tuple(w_codes.shape)} are not [E*N, K/2] for E={experts}, K={k}")
    if tuple(w_scales.shape) != (w_codes.shape[0], k // 16):
        raise ValueError(f"{name}: weight scales {tuple(w_scales.shape)} are not {(w_codes.shape[0], k // 16)}")
    if w_scale.numel() not in (experts, w_codes.shape[0]):
        raise ValueError(f"{name}: {w_scale.numel()} weight global scales for {experts} experts")
    if a_scale.numel() not in (1, rows):
        raise ValueError(f"{name}: {a_scale.numel()} row global scales for {rows} rows")
    if out_dtype not in out_dtypes:
        raise TypeError(f"{name}: out_dtype must be one of {out_dtypes}, got {out_dtype}")
