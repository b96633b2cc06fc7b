"""Pieces shared by the decode GEMMs (:mod:`.decode_gemm`, :mod:`.decode_grouped_gemm`): the
in-register dequantization of a packed FP4 weight tile to its exact bf16 image, the swap-AB
K loop, and the fixed-order split-K reduction.

Dequantization (``dequant_tile``). A weight tile arrives as packed E2M1 codes (uint8, two per
byte, element 2i in the low nibble) and its E4M3 block scales. Each element gets the packed
byte that holds its code and a nibble flag (``join(packed, packed)``, ``join(0x00, 0xFF)``); then, on
the GPU (``ASM=True``), one inline-PTX block turns 4 elements into 2 bf16x2 registers with byte permutes (``prmt``)
instead of float arithmetic:

* each element's nibble is selected (``lop3`` on the byte and the byte shifted by 4) and the 4
  nibbles are gathered into one 16-bit selector (``and``, ``shr``, ``or``, ``prmt``);
* ``prmt`` with the 3 magnitude bits of each nibble as byte selectors looks up the low and
  the high byte of the bf16 value of every E2M1 magnitude (two 8-entry tables: 0, 0.5, 1, 1.5,
  2, 3, 4, 6 are bf16 0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0);
* a third ``prmt`` in sign-replicate mode (selector bit 3 = the code's sign bit) turns the
  sign bits into 0xFF / 0x80 bytes, shifted into bit 7 of the high bytes;
* two ``prmt`` interleave low and high bytes into bf16 pairs;
* ``mul.rn.bf16x2`` by each element's block scale (``e4m3 -> bf16`` is exact; ``e2m1 * e4m3``
  has at most 6 significant bits, so the product is exact too).

Every value is the exact image ``e2m1(code) * fp32(scale)`` in bf16 (NaN scales give NaN).
The asm is element-wise: each output depends only on its own code byte and scale, because
Triton decides which 4 elements one invocation receives ("unspecified" in its docs). A first
version that decoded 4 *packed* bytes (8 weights) per invocation assumed those bytes were
consecutive along K; on the H200 (2026-12-01) that held for some layouts and silently gave
wrong values for others (it depended on M's divisibility by 16), so it was replaced.
Under the interpreter (``ASM=False``, CPU tests) the same values come from
``_nvfp4_math``'s fp32 decoders (also usable on the GPU: bf16 after the decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._nvfp4_math import e2m1_value, e4m3_value

# Element-wise (Triton gives an asm block 4 elements of its choosing, so every output may depend
# only on its own inputs): byte p of $2 is the packed byte that holds element p's code and byte p
# of $3 says which nibble (0xFF: the high one, 0x00: the low one); $0 / $1 are bf16x2 of elements (0, 1) / (2, 3);
# $4 / $5 their bf16 block scales (one per element). $6, $10, $14, $18, $22: the lookup tables
# (an int32 input takes 4 registers with pack=4; the values are loaded at run time, so ptxas
# keeps them in registers instead of re-materializing immediates).
_DEQUANT_ASM = tl.constexpr("""
{
.reg .b32 h, c, t, u, cs, ms, pl, ph, s, w0, w1;
shr.u32 h, $2, 4;
lop3.b32 c, h, $2, $3, 0xE4;
and.b32 c, c, 0x0F0F0F0F;
shr.u32 t, c, 4;
or.b32 u, c, t;
prmt.b32 cs, u, u, 0x0020;
and.b32 ms, cs, 0x7777;
prmt.b32 pl, $6, $10, ms;
prmt.b32 ph, $14, $18, ms;
prmt.b32 s, $22, $22, cs;
shl.b32 s, s, 1;
lop3.b32 ph, s, 0x80808080, ph, 0xEA;
prmt.b32 w0, pl, ph, 0x5140;
prmt.b32 w1, pl, ph, 0x7362;
mul.rn.bf16x2 $0, w0, $4;
mul.rn.bf16x2 $1, w1, $5;
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
        # per element: the byte holding its code, and which nibble (element order along K)
        byte = tl.reshape(tl.join(packed, packed), (BLOCK_N, BLOCK_K))
        zero8 = tl.zeros((BLOCK_N, BLOCK_K // 2), tl.uint8)
        nibble = tl.reshape(tl.join(zero8, zero8 + 255), (BLOCK_N, BLOCK_K))
        z = tl.zeros((BLOCK_N, BLOCK_K), tl.int32)
        sf = sf_code.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        sfb = tl.reshape(tl.broadcast_to(sf[:, :, None], (BLOCK_N, BLOCK_K // 16, 16)), (BLOCK_N, BLOCK_K))
        return tl.inline_asm_elementwise(
            _DEQUANT_ASM, "=r,=r," + "r," * 23 + "r", [byte, nibble, sfb, z + t0, z + t1, z + t2, z + t3, z + t4],
            dtype=tl.bfloat16, is_pure=True, pack=4
        )
    else:
        codes = packed.to(tl.int32)  # (luts unused: the interpreter runs no PTX)
        codes = tl.reshape(tl.join(codes & 15, codes >> 4), (BLOCK_N, BLOCK_K))
        sf = e4m3_value(sf_code.to(tl.int32))
        return tl.reshape(tl.reshape(e2m1_value(codes), (BLOCK_N, BLOCK_K // 16, 16)) * sf[:, :, None],
                          (BLOCK_N, BLOCK_K))


@triton.jit
def _load_step(codes_rows, scales_rows, a_rows, m_ok, k0, k_hi, live,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MASKED: tl.constexpr):
    """The packed codes, scales and activation tile of the K step at ``k0`` (zeros where
    ``MASKED`` and not ``live``)."""
    pk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    sk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    kk = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K and not MASKED:
        packed = tl.load(codes_rows + pk[None, :])
        sf = tl.load(scales_rows + sk[None, :])
        x = tl.load(a_rows + kk[:, None], mask=m_ok, other=0.0)
    elif EVEN_K:
        packed = tl.load(codes_rows + pk[None, :], mask=live, other=0)
        sf = tl.load(scales_rows + sk[None, :], mask=live, other=0)
        x = tl.load(a_rows + kk[:, None], mask=m_ok & live, other=0.0)
    else:
        packed = tl.load(codes_rows + pk[None, :], mask=(pk < k_hi // 2)[None, :] & live, other=0)
        sf = tl.load(scales_rows + sk[None, :], mask=(sk < k_hi // 16)[None, :] & live, other=0)
        x = tl.load(a_rows + kk[:, None], mask=m_ok & (kk < k_hi)[:, None] & live, other=0.0)
    return packed, sf, x


@triton.jit
def decode_k_loop(codes_rows, scales_rows, a_rows, m_ok, k_lo, k_hi, luts,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr,
                  EVEN_K: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr, PREFETCH: tl.constexpr = False):
    """fp32 ``[BN, M_PAD]`` = sum over k in [k_lo, k_hi) of ``W[n, k] * x[m, k]`` (swap-AB).

    ``codes_rows`` / ``scales_rows``: ``[BN, 1]`` pointers to the weight rows' codes / scales at
    k = 0; ``a_rows``: ``[1, M_PAD]`` pointers to the activation image rows at k = 0 (rows with
    ``m_ok`` false read zeros). ``EVEN_K``: the range is a whole number of ``BLOCK_K`` steps
    (no K masks, 16-byte loads). ``PREFETCH``: the next step's loads are issued before this
    step's dequantization (one step in flight in registers). The tensor cores add 16-wide K
    steps in K order from a zero accumulator (the learner's strict GEMM's chain; the
    interpreter adds each BLOCK_K step's exact fp32 product).
    """
    acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    if PREFETCH:
        packed_n, sf_n, x_n = _load_step(codes_rows, scales_rows, a_rows, m_ok, k_lo, k_hi, k_lo < k_hi,
                                         BLOCK_K, EVEN_K, True)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            packed, sf, x = packed_n, sf_n, x_n
            packed_n, sf_n, x_n = _load_step(codes_rows, scales_rows, a_rows, m_ok, k0 + BLOCK_K, k_hi,
                                             k0 + BLOCK_K < k_hi, BLOCK_K, EVEN_K, True)
            w = dequant_tile(packed, sf, luts, BLOCK_N, BLOCK_K, ASM)
            if DOT_FP32:
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(tl.bfloat16), x, acc)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            packed, sf, x = _load_step(codes_rows, scales_rows, a_rows, m_ok, k0, k_hi, True, BLOCK_K, EVEN_K, False)
            w = dequant_tile(packed, sf, luts, BLOCK_N, BLOCK_K, ASM)
            if DOT_FP32:
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(tl.bfloat16), x, acc)
    return acc
