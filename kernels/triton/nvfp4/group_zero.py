"""Zero the slices of a grouped output whose group has no rows, with counts that stay on the device.

A weight gradient of a grouped GEMM, ``dw[g] = dy_g^T x_g`` (``torch._grouped_mm`` with offsets on
K), has nothing to sum for an expert that got no tokens, and the kernel's empty groups are not
relied on. With host counts the caller zeroes those slices by index; with device counts
(:class:`minite_megatron.nvfp4.group_sizes.DeviceGroupSizes`, the MoE layer without its routing
wait) the reference, ``out.masked_fill_(counts == 0, 0)``, reads and writes all of ``out``: 6.6 ms
of the BF16 twin's 16384-token step on the H200 (BENCHMARKS.md run 13, call 3). This kernel writes
only the empty slices: one program per (group, chunk) reads its group's count and returns at once
when it is not 0, so a step without empty experts costs one launch.

Reference: :func:`zero_empty_groups_reference`. Bits: an empty group's slice becomes ``+0.0``
(whatever was there, NaN included), every other element is left as it was (no read, no write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.custom_op import custom_op
from minite_megatron.nvfp4.moe_reference import zero_empty_groups_reference  # noqa: F401  (the contract)
from minite_kernels.triton._build._host import cdiv

BLOCK = 1024
CHUNKS = 32  # blocks per program: 32768 elements


@triton.jit
def _zero_empty_groups_kernel(out_ptr, counts_ptr, slice_numel, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    g = tl.program_id(0)
    if tl.load(counts_ptr + g) == 0:
        start = tl.program_id(1).to(tl.int64) * (CHUNKS * BLOCK)
        base = out_ptr + g.to(tl.int64) * slice_numel
        zero = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
        for i in range(CHUNKS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            tl.store(base + offs, zero, mask=offs < slice_numel)


@custom_op("minite::zero_empty_groups", mutates_args=("out",))
def _zero_empty_groups_op(out: torch.Tensor, counts: torch.Tensor) -> None:
    groups = out.shape[0]
    slice_numel = out.numel() // groups if groups else 0
    if slice_numel:
        _zero_empty_groups_kernel[(groups, cdiv(slice_numel, CHUNKS * BLOCK))](
            out, counts, slice_numel, BLOCK=BLOCK, CHUNKS=CHUNKS)


@_zero_empty_groups_op.register_fake
def _(out: torch.Tensor, counts: torch.Tensor) -> None:
    return None


def zero_empty_groups(out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`zero_empty_groups_reference` in one launch that writes only the empty groups' slices.
    ``out`` contiguous, ``counts`` a ``[G]`` integer tensor on ``out``'s device; returns ``out``."""
    if not out.is_contiguous() or counts.shape != (out.shape[0],) or counts.device != out.device:
        raise ValueError(f"zero_empty_groups: out {tuple(out.shape)} (contiguous: {out.is_contiguous()}) and counts "
                         f"{tuple(counts.shape)} on {counts.device}: need a contiguous out and [G] counts on {out.device}")
    if counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"zero_empty_groups: counts must be integers, got {counts.dtype}")
    _zero_empty_groups_op(out, counts)
    return out
