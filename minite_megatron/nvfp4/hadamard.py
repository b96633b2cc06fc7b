"""The 16x16 random Hadamard transform (RHT) applied to wgrad operands before quantization.

Both operands of ``dW = dY^T @ X`` are transformed along the token (K) dimension, in blocks
of 16 aligned with the quantization blocks: ``y_block = (H16 / 4) @ (d * x_block)`` with
``d`` a vector of 16 random signs and ``H16`` the Sylvester Hadamard matrix. ``H16 / 4`` is
orthogonal and the same ``d`` is used on both operands, so the product is unchanged in exact
arithmetic while outliers are spread over the block before 4-bit rounding.

For bitwise reproducibility the transform is defined by its evaluation order, in fp32:
multiply by the signs, then four butterfly stages with strides 1, 2, 4, 8, each mapping the
pair (x[j], x[j + s]) to (x[j] + x[j + s], x[j] - x[j + s]), then multiply by 0.25 (exact).
"""

from __future__ import annotations

import torch

from .formats import BLOCK


def hadamard_matrix(n: int = BLOCK) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +-1), fp32; n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_signs(seed: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [16] of +-1. ``seed=None`` gives the fixed all-ones vector (a plain Hadamard)."""
    if seed is None:
        return torch.ones(BLOCK, dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (BLOCK,), generator=g)
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)


def rht16(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Apply the RHT along the last dimension in blocks of 16. Returns fp32 of x's shape."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"rht16: last dimension {k} is not a multiple of {BLOCK}")
    if signs.shape != (BLOCK,):
        raise ValueError(f"rht16: signs must have shape ({BLOCK},), got {tuple(signs.shape)}")
    y = x.to(torch.float32).reshape(-1, k // BLOCK, BLOCK) * signs.to(torch.float32, copy=False).to(x.device)
    s = 1
    while s < BLOCK:
        y = y.reshape(*y.shape[:2], BLOCK // (2 * s), 2, s)
        lo, hi = y[..., 0, :], y[..., 1, :]
        y = torch.stack([lo + hi, lo - hi], dim=-2)
        s *= 2
    return (y.reshape(x.shape) * 0.25).contiguous()
