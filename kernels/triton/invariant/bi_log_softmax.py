"""Batch-invariant fp32 log-softmax over the last dimension (LM-head log-probs).

Reference: :func:`minite_megatron.invariant.softmax.log_softmax_torch` (same formula
``(x - m) - log(sum exp(x - m))`` in fp32; a different fixed summation tree).

Invariance: one program per row, three passes over the row in chunks of a fixed ``BLOCK``
(a function of V only) walked in order: lane-wise max, lane-wise sum of ``exp(x - m)``, write.
Each pass ends with one reduction over the lanes. A row's result depends on nothing else.

``x`` [M, V] (bf16/fp16/fp32, strided rows allowed) -> fp32 [M, V] contiguous. A row of all
``-inf`` gives NaN (as the reference does); ``+inf``/NaN propagate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import next_pow2

MAX_BLOCK = 4096


@triton.jit
def _bi_log_softmax_kernel(x_ptr, out_ptr, V, sxm, sxv, som, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    mx = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + lanes
        x = tl.load(x_ptr + row * sxm + cols.to(tl.int64) * sxv, mask=cols < V, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, x)
    m = tl.max(mx, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + lanes
        x = tl.load(x_ptr + row * sxm + cols.to(tl.int64) * sxv, mask=cols < V, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - m)
    lse = tl.log(tl.sum(acc, axis=0))
    for v0 in range(0, V, BLOCK):
        cols = v0 + lanes
        cmask = cols < V
        x = tl.load(x_ptr + row * sxm + cols.to(tl.int64) * sxv, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * som + cols, (x - m) - lse, mask=cmask)


@custom_op("minite::bi_log_softmax", mutates_args=())
def _bi_log_softmax_op(x: torch.Tensor) -> torch.Tensor:
    m, v = x.shape
    out = torch.empty(m, v, dtype=torch.float32, device=x.device)
    if m and v:
        block = min(next_pow2(v), MAX_BLOCK)
        _bi_log_softmax_kernel[(m,)](x, out, v, x.stride(0), x.stride(1), out.stride(0), BLOCK=block, num_warps=8)
    return out


@_bi_log_softmax_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.float32)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Batch-invariant fp32 log-softmax of ``x`` [M, V] over V -> fp32 [M, V]."""
    if x.dim() != 2:
        raise ValueError(f"bi_log_softmax: x must be [M, V], got {tuple(x.shape)}")
    return _bi_log_softmax_op(x)
