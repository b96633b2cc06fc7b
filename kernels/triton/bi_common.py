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
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def tile_dot(a, b, acc, PRECISION: tl.constexpr, AS_SUM: tl.constexpr):
    if AS_SUM:
        return acc + tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)
