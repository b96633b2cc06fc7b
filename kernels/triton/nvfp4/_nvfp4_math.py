"""Element-wise NVFP4 arithmetic shared by the Triton kernels, written to equal the contract
(:mod:`minite_megatron.nvfp4.quantize`, ``.formats``, ``.stochastic``) bit for bit.

Every rounding step is spelled out so the result does not depend on the compiler or on the
interpreter: IEEE division is ``tl.math.div_rn`` (plain ``/`` may lower to ``div.full.f32``),
the fp32 -> E4M3 conversion is done on the bits (RNE, satfinite, subnormals kept, NaN -> 0x7F)
instead of trusting an fp8 cast, clamps are ``tl.where`` on comparisons (``tl.minimum`` may
drop a NaN), and kernels that use these helpers are launched with ``enable_fp_fusion=False``
(no FMA may merge two roundings) and ``enable_reflect_ftz=False`` (no flushed subnormal).

NaN bit patterns are fixed to the ones the CPU reference produces, so results compare
bitwise: fp32 ``0x7FC00000``, bf16 ``0x7FC0``, E4M3 ``0x7F``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minite_megatron.nvfp4.backends import triton_interpreting as interpreting  # noqa: F401 (re-exported)

FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(0.1666666716337204)  # RN_fp32(1/6), the contract's 1/6 (exactly representable)
NAN_F32_BITS = tl.constexpr(0x7FC00000)
NAN_BF16_BITS = tl.constexpr(0x7FC0)

#: Launch options of every kernel that rounds (see the module docstring).
EXACT_LAUNCH = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def exact_launch() -> dict:
    """Launch kwargs for kernels that round; the interpreter takes no compile options."""
    return {} if interpreting() else dict(EXACT_LAUNCH)


@triton.jit
def global_scales_from_amax(amax):
    """Contract steps 1-2 on fp32 ``amax``: returns (S_enc, S_dec), NaN for a non-finite amax."""
    s_enc = tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax)
    s_enc = tl.where(s_enc > FLT_MAX, FLT_MAX, s_enc)
    s_enc = tl.where(amax == 0.0, 1.0, s_enc)
    finite = (amax == amax) & (amax != float("inf")) & (amax != float("-inf"))
    s_enc = tl.where(finite, s_enc, float("nan"))
    s_dec = (1.0 / s_enc.to(tl.float64)).to(tl.float32)
    return s_enc, s_dec


@triton.jit
def canonical_nan_f32(x):
    """``x`` with every NaN replaced by the fp32 pattern 0x7FC00000 (the CPU reference's)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, NAN_F32_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_rne_satfinite(y):
    """fp32 ``y >= 0`` (or NaN/inf) -> (uint8 E4M3 code, fp32 value of that code).

    Round to nearest even; values above 448 (and +inf) saturate to 448 (0x7E); subnormal
    scales (below 2^-6, step 2^-9) are kept; NaN gives code 0x7F and a NaN value.
    """
    nan = y != y
    y = tl.where(y > 448.0, 448.0, y)
    y = tl.where(nan, 0.0, y)
    bits = y.to(tl.int32, bitcast=True)
    # Normal range [2^-6, 448]: round the fp32 mantissa to 3 bits, ties to even, on the bits.
    rbits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # & 0xFFF00000
    n_val = rbits.to(tl.float32, bitcast=True)
    n_code = (((rbits >> 23) - 120) << 3) | ((rbits >> 20) & 7)
    # Subnormal range [0, 2^-6): multiples of 2^-9; y * 512 is exact and < 8, so adding and
    # subtracting 2^23 rounds it to the nearest integer, ties to even.
    t = y * 512.0
    r = (t + 8388608.0) - 8388608.0
    s_val = r * 0.001953125
    s_code = r.to(tl.int32)
    sub = y < 0.015625
    code = tl.where(sub, s_code, n_code)
    val = tl.where(sub, s_val, n_val)
    code = tl.where(nan, 0x7F, code)
    val = tl.where(nan, float("nan"), val)
    return code.to(tl.uint8), val


@triton.jit
def e2m1_nearest(v):
    """fp32 ``v`` -> E2M1 codes (int32 0..15): nearest, ties to the even code, |v| > 6 -> 6,
    the sign bit kept (code 8 is -0), NaN -> 0 (the bin edges of ``formats.E2M1_BIN_EDGES``).

    On the bits: for |v| >= 1 the fp32 mantissa is rounded to one bit, ties to even, and
    ``(biased exponent << 1 | bit) - 252`` is the code (1.0 -> 2 ... 6.0 -> 7, larger values
    saturate at 7); below 1, ``RNE(2 |v|)`` (adding and subtracting 2^23) is the code 0, 1 or 2.
    Equal to the seven bin-edge comparisons of the contract, in fewer instructions.
    """
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    norm = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252
    norm = tl.where(norm > 7, 7, norm)
    sub = (((a * 2.0) + 8388608.0) - 8388608.0).to(tl.int32)
    return _with_sign(tl.where(a < 1.0, sub, norm), v)


@triton.jit
def _with_sign(mag, v):
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    code = mag | (sign << 3)
    return tl.where(v != v, 0, code)


@triton.jit
def fmix32(h):
    """murmur3's 32-bit finalizer on uint32 tensors (wrapping arithmetic)."""
    h = h ^ (h >> 16)
    h = h * tl.full(h.shape, 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full(h.shape, 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def sr_key_u32(key, KEY_PTR: tl.constexpr):
    """The stochastic-rounding key as a uint32 scalar: the int32 argument itself, or (``KEY_PTR``)
    the int32 it points to (a ``DeviceSeed``: read when the kernel runs, so a CUDA-graph replay
    draws the key written before it)."""
    if KEY_PTR:
        return tl.load(key).to(tl.uint32, bitcast=True)
    else:
        return key.to(tl.uint32, bitcast=True)


@triton.jit
def sr_uniform(key, rows, cols):
    """Uniforms in [0, 1) of :mod:`minite_megatron.nvfp4.stochastic` for int32 ``rows`` [R, 1]
    and ``cols`` [1, C] of the logical matrix; ``key = fmix32(seed)`` as a uint32 scalar."""
    inner = fmix32(rows.to(tl.uint32, bitcast=True) + key)
    bits = fmix32(inner + cols.to(tl.uint32, bitcast=True))
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24, exact


@triton.jit
def e2m1_stochastic(v, u):
    """Stochastic E2M1 rounding of fp32 ``v`` with uniforms ``u`` -> int32 codes 0..15.

    Between neighbours lo <= |v| < hi (gap 0.5, 1 or 2), round up iff ``u < (|v| - lo) / gap``
    (exact); |v| >= 6 saturates to code 7; sign kept; NaN -> 0.
    """
    a = tl.abs(v)
    idx = (a >= 0.5).to(tl.int32)
    idx += (a >= 1.0).to(tl.int32)
    idx += (a >= 1.5).to(tl.int32)
    idx += (a >= 2.0).to(tl.int32)
    idx += (a >= 3.0).to(tl.int32)
    idx += (a >= 4.0).to(tl.int32)
    idx += (a >= 6.0).to(tl.int32)
    saturated = idx >= 7
    idx = tl.where(saturated, 6, idx)
    lo = tl.where(idx <= 4, idx.to(tl.float32) * 0.5, tl.where(idx == 5, 3.0, 4.0))
    inv_gap = tl.where(idx <= 3, 2.0, tl.where(idx <= 5, 1.0, 0.5))
    frac = (a - lo) * inv_gap
    up = (u < frac) & (~saturated)
    mag = tl.where(saturated, 7, idx + up.to(tl.int32))
    return _with_sign(mag, v)


@triton.jit
def e4m3_value(code):
    """int32 E4M3 bit patterns (0..255) -> fp32 values, built on the bits (0x7F/0xFF -> NaN)."""
    e = (code >> 3) & 15
    m = code & 7
    normal = ((e + 120) << 23) | (m << 20)
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    val = tl.where((code & 127) == 127, float("nan"), val)
    return _negate_if(val, (code & 128) != 0)


@triton.jit
def e2m1_value(code):
    """int32 E2M1 codes 0..15 -> fp32 values (code 8 is -0.0), built on the bits.

    The code's magnitude bits ``e1 e0 m`` are placed at fp32 bits 24..22 (exponent field e,
    top mantissa bit m) and the sign at bit 31; that float is ``2^(e-127) (1 + m/2)`` (or the
    subnormal ``2^-126 m/2`` for e = 0), so one exact multiply by 2^126 gives the E2M1 value
    (0, 0.5, 1, 1.5, 2, 3, 4, 6). Needs subnormals kept (no FTZ: ``EXACT_LAUNCH``).
    """
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _negate_if(val, neg):
    """Flip the sign bit where ``neg`` (Triton's unary minus is ``0 - x``, which loses -0.0)."""
    bits = val.to(tl.int32, bitcast=True)
    return tl.where(neg, bits ^ -2147483648, bits).to(tl.float32, bitcast=True)


@triton.jit
def bf16_image_bits(img):
    """fp32 image values -> their bf16 bits as int16 (exact values; NaN -> 0x7FC0)."""
    bits = img.to(tl.bfloat16).to(tl.int16, bitcast=True)
    return tl.where(img != img, NAN_BF16_BITS, bits)


@triton.jit
def round_to(x, dtype: tl.constexpr, BITWISE_BF16: tl.constexpr):
    """fp32 -> ``dtype`` with one round-to-nearest-even.

    The interpreter's fp32 -> bf16 cast truncates (Triton 3.6), so with ``BITWISE_BF16`` the
    bf16 rounding is done on the bits (NaN -> 0x7FC0); the GPU's ``cvt.rn`` is used otherwise.
    """
    if (dtype == tl.bfloat16) and BITWISE_BF16:
        bits = x.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(x != x, NAN_BF16_BITS, r)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


# ---- cheaper element steps of the fast quantize kernels (quantize_rows / quantize_cols) ------
#: 2^-126: multiplying an E2M1 magnitude by it puts the E2M1 bits ``e1 e0 m`` at fp32 bits 24..22.
TWO_M126 = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def e2m1_round_nearest(v):
    """fp32 ``v`` -> (magnitude code int32 0..7, rounded magnitude fp32 in {0, .5, 1, 1.5, 2, 3, 4, 6}).

    Round to nearest, ties to the even code, ``|v| > 6 -> 6`` (equal to the contract's bin
    edges, ``formats.E2M1_BIN_EDGES``). One rounding by a magic addition: the E2M1 grid has
    spacing 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], i.e. 2^(E-1) with E the exponent of
    ``max(|v|, 1)``, so adding ``2^(E + 22)`` (fp32 ulp = the grid spacing) and subtracting it
    rounds ``|v|`` once, ties to even (the even multiple of the spacing is the even code).
    The code is the fp32 bits of ``r * 2^-126`` shifted right by 22 (exact, subnormals kept:
    ``EXACT_LAUNCH``). The sign is not handled here; NaN gives garbage the callers mask by block.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    e = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    magic = (e + 0x0B000000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    code = (r * TWO_M126).to(tl.int32, bitcast=True) >> 22
    return code, r


@triton.jit
def e2m1_round_stochastic(v, u):
    """fp32 ``v``, uniforms ``u`` in [0, 1) -> (magnitude code 0..7, rounded magnitude fp32).

    The contract's rule (:mod:`minite_megatron.nvfp4.stochastic`): between the grid neighbours
    ``lo <= |v| < lo + gap`` round up iff ``u < (|v| - lo) * (1 / gap)`` (exact: the gap is a
    power of two); ``|v| >= 6`` saturates to 6. ``lo`` is ``|v|`` with its fp32 mantissa cut
    to one bit (``|v| >= 1``) or 0 / 0.5 below 1; the gap is ``2^(E-1)``, E the exponent of
    ``max(|v|, 1)``. NaN gives garbage the callers mask by block.
    """
    a = tl.minimum(tl.abs(v), 6.0)
    bits = a.to(tl.int32, bitcast=True)
    e = tl.maximum(bits & 0x7F800000, 0x3F800000)
    lo = tl.where(a >= 1.0, (bits & -4194304).to(tl.float32, bitcast=True), tl.where(a >= 0.5, 0.5, 0.0))
    gap = (e - 0x00800000).to(tl.float32, bitcast=True)
    inv_gap = (0x7F800000 - e).to(tl.float32, bitcast=True)
    r = tl.where(u < (a - lo) * inv_gap, lo + gap, lo)
    code = (r * TWO_M126).to(tl.int32, bitcast=True) >> 22
    return code, r


@triton.jit
def max_propagate_nan(a, b):
    """Combine function of a NaN-propagating max reduction (``tl.reduce(x, axis, max_propagate_nan)``)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_encode_scales(bmax, scale_mul, s_dec):
    """Contract steps 3-4 on block amax ``bmax`` (fp32, NaN for a NaN block) with broadcastable
    ``scale_mul = S_enc * RN(1/6)`` and ``s_dec``: (E4M3 code uint8, fp32 scale, fp32 encode
    scale ``min(1 / (sf * S_dec), FLT_MAX)``, NaN mask of the block)."""
    sf_code, sf = e4m3_rne_satfinite(bmax * scale_mul)
    enc = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * s_dec)
    enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)
    return sf_code, sf, enc, sf != sf
