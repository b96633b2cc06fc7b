"""Pieces shared by the decode GEMMs (:mod:`.decode_gemm`, :mod:`.decode_grouped_gemm`): the
in-register dequantization of a packed FP4 weight tile to its exact bf16 image, the swap-AB
K loop, and the fixed-order split-K reduction.

Dequantization (``dequant_tile``). A weight tile arrives as packed E2M1 codes (uint8, two per
byte, element 2i in the low nibble) and its E4M3 block scales. On the GPU (``ASM=True``) one
inline-PTX block turns 4 code bytes (8 weights) into 4 bf16x2 registers with byte permutes
(``prmt``) instead of float arithmetic:

* ``prmt`` with the 3 magnitude bits of each nibble as byte selectors looks up the low and
  the high byte of the bf16 value of every E2M1 magnitude (two 8-entry tables held in two
  immediate pairs: 0, 0.5, 1, 1.5, 2, 3, 4, 6 are bf16 0x0000 0x3F00 0x3F80 0x3FC0 0x4000
  0x4040 0x4080 0x40C0);
* a third ``prmt`` in sign-replicate mode (selector bit 3 = the code's sign bit) turns the
  sign bits into 0xFF / 0x80 bytes, shifted into bit 7 of the high bytes;
* two ``prmt`` interleave low and high bytes into (element 2i, element 2i+1) bf16 pairs;
* ``mul.rn.bf16x2`` by the block scale (``e4m3 -> bf16`` is exact; ``e2m1 * e4m3`` has at most
  6 significant bits, so the product is exact too).

About 3 SASS instructions per weight instead of ~8 with fp32 bit arithmetic; every value is
the exact image ``e2m1(code) * fp32(scale)`` in bf16 (NaN scales give NaN). Under the
interpreter (``ASM=False``, CPU tests) the same values come from ``_nvfp4_math``'s fp32
decoders.

Which 4 bytes one asm invocation receives is up to Triton's layout (4 consecutive bytes of one
row along K when each thread owns >= 4 contiguous bytes: the load layout of a [BN, BK/2] uint8
tile with BK/2 >= 16); every byte is scaled by its own block's scale, so the values are right
whatever the grouping, and the element order is rebuilt from the (byte, nibble) positions.
GPU tests compare the tile to the image bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._nvfp4_math import e2m1_value, e4m3_value

# $0,$1: bf16 of elements (0,1),(2,3) of the 4 code bytes in $4; $2,$3: elements (4,5),(6,7).
# $5,$6: bf16 block scales (one 16-block holds all 4 bytes: both halves of $5 are its scale).
# $7, $11, $15, $19, $23: the lookup tables (int32 inputs take 4 registers each with pack=4;
# registers loaded at run time, so ptxas keeps them instead of re-materializing immediates).
_DEQUANT_ASM = tl.constexpr("""
{
.reg .b32 m, mh, ch, pl, ph, s, w0, w1, w2, w3;
and.b32 m, $4, 0x77777777;
prmt.b32 pl, $7, $11, m;
prmt.b32 ph, $15, $19, m;
prmt.b32 s, $23, $23, $4;
shl.b32 s, s, 1;
lop3.b32 ph, s, 0x80808080, ph, 0xEA;
prmt.b32 w0, pl, ph, 0x5140;
prmt.b32 w1, pl, ph, 0x7362;
shr.u32 mh, m, 16;
shr.u32 ch, $4, 16;
prmt.b32 pl, $7, $11, mh;
prmt.b32 ph, $15, $19, mh;
prmt.b32 s, $23, $23, ch;
shl.b32 s, s, 1;
lop3.b32 ph, s, 0x80808080, ph, 0xEA;
prmt.b32 w2, pl, ph, 0x5140;
prmt.b32 w3, pl, ph, 0x7362;
mul.rn.bf16x2 $0, w0, $5;
mul.rn.bf16x2 $1, w1, $5;
mul.rn.bf16x2 $2, w2, $5;
mul.rn.bf16x2 $3, w3, $5;
}
""")
#: The asm's tables: low bytes of bf16(0, .5, 1, 1.5) and (2, 3, 4, 6), high bytes likewise,
#: and 0x80808080 (sign-replicate source).
DEQUANT_TABLES = (0xC0800000, 0xC0804000, 0x3F3F3F00, 0x40404040, 0x80808080)


_TABLES: dict = {}


def dequant_tables(device) -> torch.Tensor:
    """int32 ``[5]`` on ``device``: :data:`DEQUANT_TABLES` (cached)."""
    t = _TABLES.get(device)
    if t is None:
        t = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in DEQUANT_TABLES], dtype=torch.int32,
                         device=device)
        _TABLES[device] = t
    return t


@triton.jit
def load_tables(lut_ptr):
    """The 5 int32 lookup words of the dequant asm (:data:`DEQUANT_TABLES`), as loaded scalars."""
    return (tl.load(lut_ptr), tl.load(lut_ptr + 1), tl.load(lut_ptr + 2), tl.load(lut_ptr + 3),
            tl.load(lut_ptr + 4))


@triton.jit
def dequant_tile(packed, sf_code, luts, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """uint8 codes ``[BN, BK/2]`` + uint8 E4M3 scales ``[BN, BK/16]`` -> the exact image ``[BN, BK]``
    (bf16 with ``ASM``; fp32 without, whose values are the same). ``luts``: :func:`load_tables`."""
    if ASM:
        t0, t1, t2, t3, t4 = luts
        z = tl.zeros((BLOCK_N, BLOCK_K // 2), tl.int32)
        sf = sf_code.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        sfb = tl.reshape(tl.broadcast_to(sf[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)), (BLOCK_N, BLOCK_K // 2))
        lo, hi = tl.inline_asm_elementwise(
            _DEQUANT_ASM, "=r,=r,=r,=r," + "r," * 22 + "r", [packed, sfb, z + t0, z + t1, z + t2, z + t3, z + t4],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
        # lo[4q + p] is element 8q + p, hi[4q + p] element 8q + 4 + p
        w = tl.join(tl.reshape(lo, (BLOCK_N, BLOCK_K // 8, 4)), tl.reshape(hi, (BLOCK_N, BLOCK_K // 8, 4)))
        return tl.reshape(tl.permute(w, (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))
    else:
        codes = packed.to(tl.int32)  # (luts unused: the interpreter runs no PTX)
        codes = tl.reshape(tl.join(codes & 15, codes >> 4), (BLOCK_N, BLOCK_K))
        sf = e4m3_value(sf_code.to(tl.int32))
        return tl.reshape(tl.reshape(e2m1_value(codes), (BLOCK_N, BLOCK_K // 16, 16)) * sf[:, :, None],
                          (BLOCK_N, BLOCK_K))


@triton.jit
def decode_k_loop(codes_rows, scales_rows, a_rows, m_ok, k_lo, k_hi, luts,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr,
                  EVEN_K: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr):
    """fp32 ``[BN, M_PAD]`` = sum over k in [k_lo, k_hi) of ``W[n, k] * x[m, k]`` (swap-AB).

    ``codes_rows`` / ``scales_rows``: ``[BN, 1]`` pointers to the weight rows' codes / scales at
    k = 0; ``a_rows``: ``[1, M_PAD]`` pointers to the activation image rows at k = 0 (rows with
    ``m_ok`` false read zeros). ``EVEN_K``: the range is a whole number of ``BLOCK_K`` steps
    (no K masks, 16-byte loads). The tensor cores add 16-wide K steps in K order from a zero
    accumulator (the learner's strict GEMM's chain; the interpreter adds each BLOCK_K step's
    exact fp32 product).
    """
    acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        pk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        sk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            packed = tl.load(codes_rows + pk[None, :])
            sf = tl.load(scales_rows + sk[None, :])
            x = tl.load(a_rows + kk[:, None], mask=m_ok, other=0.0)
        else:
            packed = tl.load(codes_rows + pk[None, :], mask=(pk < k_hi // 2)[None, :], other=0)
            sf = tl.load(scales_rows + sk[None, :], mask=(sk < k_hi // 16)[None, :], other=0)
            x = tl.load(a_rows + kk[:, None], mask=m_ok & (kk < k_hi)[:, None], other=0.0)
        w = dequant_tile(packed, sf, luts, BLOCK_N, BLOCK_K, ASM)
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
    return acc
