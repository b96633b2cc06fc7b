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

A seed is a Python int, or a :class:`DeviceSeed`: the key of a seed held in device memory, read
by the kernels when they run (a CUDA graph replays its quantizations with the keys written
before each replay; ``ops.seeds``). The same seed gives the same bits either way.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def sr_key(seed: int) -> int:
    """``fmix32(seed mod 2^32)`` as a signed int32 (the value a kernel reinterprets as uint32)."""
    key = int(fmix32(seed & _M32))
    return key - (1 << 32) if key >= (1 << 31) else key


@dataclass(frozen=True, eq=False)
class DeviceSeed:
    """A stochastic-rounding seed in device memory: ``key`` is an int32 ``[1]`` tensor holding
    :func:`sr_key` of the seed, read by the quantize kernels when they run (no host value in the
    launch, so a captured launch draws whatever key is written there before a replay)."""

    key: torch.Tensor

    def __post_init__(self):
        k = self.key
        if not isinstance(k, torch.Tensor) or k.dtype != torch.int32 or k.numel() != 1:
            raise TypeError(f"DeviceSeed.key must be an int32 tensor of one element, got "
                            f"{type(k).__name__ if not isinstance(k, torch.Tensor) else f'{k.dtype} {tuple(k.shape)}'}")

    @staticmethod
    def of(seed: int, device: torch.device | str) -> "DeviceSeed":
        """The device seed holding ``seed``'s key (a host-to-device copy)."""
        return DeviceSeed(torch.tensor([sr_key(int(seed))], dtype=torch.int32, device=device))

    @property
    def device(self) -> torch.device:
        return self.key.device


def check_seed(seed, device: torch.device) -> None:
    """TypeError / ValueError, one line, for a seed that is neither an int nor a
    :class:`DeviceSeed` on ``device``."""
    if isinstance(seed, DeviceSeed):
        if seed.device != torch.device(device):
            raise ValueError(f"stochastic rounding: the DeviceSeed is on {seed.device}, the tensor on {device}")
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"stochastic rounding: seed must be an int or a DeviceSeed, got {type(seed).__name__}")


def random_bits(seed: "int | DeviceSeed", rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """uint32 values (as int64) for elements at (rows, cols) (broadcast), see the module docstring."""
    if isinstance(seed, DeviceSeed):  # its key, read on the device (tensor ops: no host sync)
        key = seed.key.to(torch.int64) & _M32
    else:
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
