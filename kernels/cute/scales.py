"""Block-scale layouts the Blackwell kernels read, built from :class:`NVFP4Tensor` operands.

Pure torch (no CUTLASS): host code and CPU tests use it.

The kernels read UE4M3 block scales in the 128x4 swizzled layout of
:mod:`minite_megatron.nvfp4.swizzle` (CUTLASS's block-scaled atom ``((32, 4), (16, 4))``
with strides ``((16, 4), (0, 1))``, atoms row-major): for a 2D ``[rows, K/16]`` matrix it is
exactly ``nvfp4.swizzle_scales``. A grouped weight ``[G, N, K]`` needs one swizzled matrix
*per group* (each padded to 128 rows), back to back, because the kernel addresses group g's
scales as a batch index; this equals ``swizzle_scales`` of the ``[G*N, K/16]`` matrix only
when N is a multiple of 128 (then no conversion is done).
"""

from __future__ import annotations

import torch

from minite_megatron.nvfp4 import BLOCK, NVFP4Tensor, swizzle_scales, swizzled_numel


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def per_group_swizzle(scales: torch.Tensor) -> torch.Tensor:
    """``[G, rows, cols]`` linear scales -> flat ``G * swizzled_numel(rows, cols)`` elements:
    ``torch.cat([swizzle_scales(scales[g]) for g in range(G)])``, in one pass."""
    if scales.dim() != 3:
        raise ValueError(f"per_group_swizzle expects [G, rows, K/16], got shape {tuple(scales.shape)}")
    g, rows, cols = scales.shape
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    pr, pc = _ceil(rows, 128), _ceil(cols, 4)
    padded = raw.new_zeros(g, pr, pc)
    padded[:, :rows, :cols] = raw
    # [g, rt, r32 (r // 32 within the tile), r (r % 32), ct, c] -> [g, rt, ct, r, r32, c]
    out = padded.view(g, pr // 128, 4, 32, pc // 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(-1)
    return out.view(scales.dtype) if raw is not scales else out


def operand_scales(q: NVFP4Tensor) -> torch.Tensor:
    """Flat swizzled scales of the 2D ``[rows, K]`` matrix view of ``q`` (no copy if already
    swizzled)."""
    if q.layout == "swizzled":
        return q.block_scales.reshape(-1)
    return swizzle_scales(q.linear_scales())


def grouped_weight_scales(b: NVFP4Tensor) -> torch.Tensor:
    """Flat per-group swizzled scales of a ``[G, N, K]`` weight (see the module docstring)."""
    if len(b.shape) != 3:
        raise ValueError(f"grouped weight scales need a [G, N, K] tensor, got shape {tuple(b.shape)}")
    g, n, k = b.shape
    if b.layout == "swizzled" and n % 128 == 0:
        return b.block_scales.reshape(-1)  # identical layouts: one 128-row-aligned matrix per group
    return per_group_swizzle(b.linear_scales().reshape(g, n, k // BLOCK))


def check_swizzled(scales: torch.Tensor, rows: int, k: int, groups: int, name: str) -> None:
    """Raise unless ``scales`` is a flat float8_e4m3fn tensor holding ``groups`` swizzled
    ``[rows, K/16]`` matrices (a 2D ``[rows, K/16]`` tensor is the linear layout: rejected)."""
    if scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: block scales must be torch.float8_e4m3fn (UE4M3), got {scales.dtype}")
    expected = groups * swizzled_numel(rows, k // BLOCK)
    if scales.dim() != 1 or scales.numel() != expected:
        raise ValueError(
            f"{name}: block scales must be in the flat 128x4 swizzled layout ({expected} elements for "
            f"{groups} x [{rows}, {k // BLOCK}]); got shape {tuple(scales.shape)}. Linear [rows, K/16] "
            f"scales must be converted first (nvfp4.swizzle_scales / NVFP4Tensor.swizzled())"
        )
