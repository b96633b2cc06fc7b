"""Shared pieces of the batch-invariant (``bi_*``) Triton kernels.

``tile_dot(a, b, acc, ...)``: ``acc + a @ b`` for one tile. On the GPU it is ``tl.dot`` (tensor
cores, or ``input_precision="ieee"`` FMA for fp32): each output element is computed by the same
MMA instruction sequence whichever row of the tile it sits in, which is what makes a fixed tile
configuration batch invariant. The Triton *interpreter* runs ``tl.dot`` as a numpy (BLAS) matmul
whose result for a row depends on the row's position in the tile (measured with OpenBLAS:
hundreds of differing elements in a 32x16x32 tile), so under ``TRITON_INTERPRET=1`` the kernels
use an explicit elementwise product and ``tl.sum`` over K instead, which is row invariant there.
The CPU tests therefore check each kernel's *logic* (tile and block order, masking, epilogue,
online softmax); the MMA's own row invariance is checked by the GPU tests.

``kernel_out_dtype(dtype)``: the interpreter converts fp32 to bf16/fp16 by truncation (and its
explicit ``rtne`` mode rounds ties away and drops the carry), while the GPU rounds to nearest
even. Under the interpreter the kernels therefore store fp32 and the wrapper rounds with torch
(``finish``); on the GPU they store the output dtype directly. Either way: one RNE rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_megatron.nvfp4.backends import triton_interpreting as interpreting


def kernel_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel should store (fp32 under the interpreter, see the module docstring)."""
    return torch.float32 if interpreting() else dtype


def finish(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a kernel's output to ``dtype`` if the kernel stored fp32 (interpreter only)."""
    return out if out.dtype == dtype else out.to(dtype)


@triton.jit
def tile_dot(a, b, acc, PRECISION: tl.constexpr, AS_SUM: tl.constexpr):
    if AS_SUM:
        return acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)
