"""Stochastic rounding to E2M1, reproducible bit for bit on every backend.

The random bits are a counter-based hash of (seed, row, column) of the element in the
logical [rows, K] matrix being quantized, so a Triton kernel, a CuTe kernel and this
reference draw the same bits for the same element whatever their tiling:

    key   = fmix32(seed mod 2^32)
    bits  = fmix32((fmix32((row + key) mod 2^32) + col) mod 2^32)      (murmur3's finalizer)
    u     = (bits >> 8) * 2^-24                                         uniform in [0, 1), exact

A magnitude ``a = |x * enc|`` below 6 lies between two neighbouring E2M1 values lo <= a < hi
whose gap is a power of two (0.5, 1 or 2), so ``frac = (a - lo) / gap`` is exact in fp32. The
code rounds up iff ``u < frac``: P(up) = ceil(frac * 2^24) / 2^24, unbiased to 2^-24.
Magnitudes >= 6 saturate to 6; NaN encodes as code 0; the sign bit is kept (code 8 is -0).
"""

from __future__ import annotations

import torch

from .formats import _with_sign, e2m1_values

_M32 = 0xFFFFFFFF


def _mul32(h, c: int):
    """(h * c) mod 2^32 for int64 h in [0, 2^32) (a tensor, or a Python int), without int64 overflow."""
    lo = h & 0xFFFF
    hi = h >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def fmix32(h):
    """murmur3's 32-bit finalizer on int64 tensors holding uint32 values, or on a Python int in
    [0, 2^32) (the same arithmetic: a host-side key without torch ops)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def random_bits(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """uint32 values (as int64) for elements at (rows, cols) (broadcast), see the module docstring."""
    key = fmix32(seed & _M32)
    inner = fmix32((rows.to(torch.int64) + key) & _M32)
    return fmix32((inner + cols.to(torch.int64)) & _M32)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 in [0, 1): the top 24 of 32 random bits, times 2^-24 (exact)."""
    return (bits >> 8).to(torch.float32) * (2.0**-24)


def e2m1_encode_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Stochastically round fp32 ``v`` to E2M1 codes with uniforms ``u`` (same shape)."""
    if v.dtype != torch.float32 or u.dtype != torch.float32:
        raise TypeError("e2m1_encode_stochastic expects float32 values and uniforms")
    a = v.abs()
    grid = e2m1_values(v.device)[:8]
    lo_idx = torch.bucketize(a.contiguous(), grid[1:], right=True)  # number of grid points (above 0) <= |v|
    saturated = lo_idx >= 7
    lo_idx = lo_idx.clamp(max=6)
    lo = grid[lo_idx]
    inv_gap = 1.0 / (grid[lo_idx + 1] - lo)  # 2, 1 or 0.5: exact
    frac = (a - lo) * inv_gap
    up = (u < frac) & ~saturated
    mag = torch.where(saturated, 7, lo_idx + up).to(torch.uint8)
    return _with_sign(mag, v)
