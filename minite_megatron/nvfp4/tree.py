"""Fixed-order reductions: the building block of strict mode's torch formulation.

:func:`tree_sum` adds the elements along one dimension as the *aligned pairwise tree*: adjacent
pairs ``(x0 + x1), (x2 + x3), ...``, then adjacent pairs of those, and so on, the length padded
with ``+0.0`` to an even number at every level. Equivalently: the perfect binary tree over the
positions ``0 .. 2**p - 1`` (zero padded), whose subtrees are aligned power-of-two blocks.

Why this tree (the three properties strict mode rests on):

1. **Same bits on every path.** It is made of elementwise IEEE additions, each correctly
   rounded: the result cannot depend on vectorization, threading, how many rows share the call,
   or which row of the batch an element sits in (unlike BLAS or ATen's reductions, whose order
   may change with the shape).
2. **Zero-padding invariance.** Appending exact zeros does not change the result: a query's
   attention over its keys ``0..t`` gives the same bits whether the key axis is ``t + 1`` long
   (decode, KV cache) or ``T`` long with the keys after ``t`` masked to ``+0.0`` (prefill, learner).
   The only value zeros can touch is the sign of an exact zero, so the result is normalized with
   one ``+ 0.0`` (``-0.0`` becomes ``+0.0``; every other value is unchanged).
3. **Chunkable.** The sum over aligned chunks of ``2**c`` elements, then the tree over the chunk
   results, is the same tree: long reductions can be computed a chunk at a time
   (:func:`tree_sum_chunked`) with bounded memory and identical bits.

Cost: ``n - 1`` additions like any sum, in ``ceil(log2 n)`` elementwise kernel launches; the
pairwise tree also has the better error bound (``~log2(n) u`` instead of ``n u``).
"""

from __future__ import annotations

import torch


def _pair_level(t: torch.Tensor, dim: int) -> torch.Tensor:
    n = t.shape[dim]
    if n % 2:
        pad_shape = list(t.shape)
        pad_shape[dim] = 1
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
        n += 1
    even = t.narrow(dim, 0, n).unflatten(dim, (n // 2, 2))
    return even.select(dim + 1, 0) + even.select(dim + 1, 1)


def tree_sum_raw(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The aligned pairwise tree sum over ``dim`` without the final ``-0.0`` normalization (the
    form to combine chunk results with). Keeps ``x.dtype``; removes ``dim``."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        shape = list(x.shape)
        del shape[dim]
        return x.new_zeros(shape)
    t = x
    while t.shape[dim] > 1:
        t = _pair_level(t, dim)
    return t.squeeze(dim)


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum of ``x`` over ``dim`` in the aligned pairwise tree order (see the module docstring).

    Args:
        x: any floating dtype (the additions happen in ``x.dtype``: cast to fp32 first for an
            fp32 accumulation); any shape; ``dim`` may have length 0 (the sum is ``+0.0``).
    Returns:
        ``x.dtype``, ``x.shape`` without ``dim`` (or with length 1 there if ``keepdim``).
        An exact-zero sum is always ``+0.0``. Non-finite elements propagate (inf, NaN).
    Raises:
        TypeError for a non-floating ``x``.
    """
    if not x.dtype.is_floating_point:
        raise TypeError(f"tree_sum needs a floating tensor, got {x.dtype}")
    out = tree_sum_raw(x, dim) + 0.0
    return out.unsqueeze(dim % x.dim()) if keepdim else out


def tree_sum_chunked(fn, n: int, chunk: int, dim: int = -1) -> torch.Tensor:
    """The tree sum of ``fn(start, stop)`` over ``[0, n)`` computed one aligned chunk at a time.

    ``fn(start, stop)`` returns the terms for positions ``start .. stop - 1`` along ``dim``
    (the same shape every time but for that dimension). ``chunk`` must be a power of two; the
    result equals ``tree_sum(fn(0, n), dim)`` bitwise while holding one chunk of terms at a
    time. Raises ValueError for a ``chunk`` that is not a power of two or ``n < 1``.
    """
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"tree_sum_chunked: chunk must be a power of two, got {chunk}")
    if n < 1:
        raise ValueError("tree_sum_chunked: needs at least one term")
    if n <= chunk:
        return tree_sum(fn(0, n), dim)
    partials = [tree_sum_raw(fn(s, min(s + chunk, n)), dim) for s in range(0, n, chunk)]
    # a short last chunk is the tree over its zero-padded block: tree_sum_raw already is
    stacked = torch.stack(partials, dim=dim % (partials[0].dim() + 1))
    return tree_sum(stacked, dim)


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
