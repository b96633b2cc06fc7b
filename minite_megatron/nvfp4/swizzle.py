"""Block-scale layouts: linear ``[rows, K/16]`` and the 128x4 swizzled layout.

The swizzled layout is the one block-scaled GEMMs read on Blackwell (cuBLASLt, CUTLASS,
torch's ``_scaled_mm`` and vLLM use the same): the scale matrix is padded with zeros to
``[ceil(rows/128)*128, ceil(cols/4)*4]`` and cut into 128x4 tiles of 512 bytes, tiles in
row-major order; inside a tile, the scale of (row r, column c) sits at byte
``(r % 32) * 16 + (r // 32) * 4 + c``.
"""

from __future__ import annotations

import torch


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def swizzled_numel(rows: int, cols: int) -> int:
    """Bytes of the swizzled layout for a ``[rows, cols]`` scale matrix (padding included)."""
    return _ceil(rows, 128) * _ceil(cols, 4)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[rows, cols]`` scales -> flat swizzled tensor of :func:`swizzled_numel` elements.

    Any dtype (``float8_e4m3fn`` block scales are moved as raw bytes). Padding is zero.
    """
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales expects [rows, K/16], got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    pr, pc = _ceil(rows, 128), _ceil(cols, 4)
    padded = raw.new_zeros(pr, pc)
    padded[:rows, :cols] = raw
    # [rt, r32 (r // 32 within tile), r (r % 32), ct, c] -> [rt, ct, r, r32, c]
    tiles = padded.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    out = tiles.reshape(-1)
    return out.view(scales.dtype) if raw is not scales else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: flat swizzled -> linear ``[rows, cols]``."""
    pr, pc = _ceil(rows, 128), _ceil(cols, 4)
    if swizzled.numel() != pr * pc:
        raise ValueError(
            f"unswizzle_scales: {swizzled.numel()} elements, expected {pr * pc} for [{rows}, {cols}]"
        )
    raw = swizzled.reshape(-1)
    raw = raw.view(torch.uint8) if raw.element_size() == 1 else raw
    tiles = raw.view(pr // 128, pc // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    out = tiles.reshape(pr, pc)[:rows, :cols].contiguous()
    return out.view(swizzled.dtype) if raw.dtype != swizzled.dtype else out
