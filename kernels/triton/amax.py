"""Global amax for per-tensor / per-group NVFP4 scales: one read of the input, no host sync.

``amax_forward(x2d, rows_per_group)`` returns fp32 ``[ceil(R / rows_per_group)]``: the max of
``|x|`` over each run of ``rows_per_group`` rows (one run = the whole tensor for a per-tensor
scale). NaN wins over everything (the contract's policy): the maximum is taken on the int32
bits of ``|x|``, where every NaN pattern is above +inf, with ``atomic_max`` (order-free, so
deterministic). ``x2d`` may be strided (e.g. ``x.t()``); bf16, fp16 or fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _amax_kernel(
    x_ptr, out_ptr, R, K, stride_r, stride_k, rows_per_group,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    best = tl.zeros((BLOCK_R,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_k,
                    mask=mask, other=0.0)
        bits = tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)
        best = tl.maximum(best, tl.max(bits, axis=1))
    first = pid * BLOCK_R
    last = tl.minimum(first + BLOCK_R, R) - 1
    if first // rows_per_group == last // rows_per_group:
        tl.atomic_max(out_ptr + first // rows_per_group, tl.max(best, axis=0))
    else:
        tl.atomic_max(out_ptr + rows // rows_per_group, best, mask=rmask)


def _blocks(r: int, k: int) -> tuple[int, int]:
    block_k = min(triton.next_power_of_2(max(k, 16)), 256)
    block_r = max(1, min(64, 8192 // block_k))
    return block_r, block_k


@torch.library.custom_op("minite::amax", mutates_args=())
def amax_forward(x2d: torch.Tensor, rows_per_group: int) -> torch.Tensor:
    """fp32 ``[ceil(R / rows_per_group)]``: amax of ``|x2d|`` per run of rows (NaN wins)."""
    r, k = x2d.shape
    groups = -(-r // rows_per_group) if r else 1
    out = torch.zeros(groups, dtype=torch.int32, device=x2d.device)
    if r and k:
        block_r, block_k = _blocks(r, k)
        _amax_kernel[(triton.cdiv(r, block_r),)](
            x2d, out, r, k, x2d.stride(0), x2d.stride(1), rows_per_group,
            BLOCK_R=block_r, BLOCK_K=block_k,
        )
    return out.view(torch.float32)


@amax_forward.register_fake
def _(x2d, rows_per_group):
    r = x2d.shape[0]
    return x2d.new_empty((-(-r // rows_per_group) if r else 1,), dtype=torch.float32)
