"""Grouped (MoE) GEMMs of the contract: all local experts in one op.

Rows (tokens) are sorted by expert; ``group_sizes[g]`` rows belong to expert g.

* fprop / dgrad (:func:`grouped_gemm_reference`): ``out[rows of g] = a[rows of g] @ b[g].T``
  with ``b`` a ``[G, N, K]`` tensor quantized with one global scale per expert (``"group"``).
* wgrad (:func:`grouped_wgrad_reference`): ``dW[g] = dY_g^T @ X_g``, K = the expert's tokens.
  Quantization blocks run along tokens and must not straddle experts, so each expert's tokens
  are zero-padded to a multiple of 16 (:func:`pad_groups`); both operands are then quantized
  once, as whole ``[N, T_pad]`` / ``[K, T_pad]`` matrices (one global scale per tensor or per
  row, over all experts), and expert g's product uses its own columns. A single expert with
  ``T`` a multiple of 16 is exactly the dense wgrad.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .formats import BLOCK
from .gemm import block_partials_accumulate, epilogue, gemm_reference
from .quantize import quantize_reference
from .tensor import NVFP4Tensor


def padded_group_sizes(group_sizes: Sequence[int], multiple: int = BLOCK) -> list[int]:
    return [-(-int(s) // multiple) * multiple for s in group_sizes]


def pad_groups(x: torch.Tensor, group_sizes: Sequence[int], multiple: int = BLOCK) -> torch.Tensor:
    """``[T, H]`` rows sorted by group -> ``[T_pad, H]``: each group zero-padded to ``multiple``
    (``x`` itself when every group already is a multiple)."""
    padded = padded_group_sizes(group_sizes, multiple)
    if list(padded) == [int(s) for s in group_sizes]:
        return x  # nothing to pad
    out = x.new_zeros(sum(padded), x.shape[1])
    src = dst = 0
    for size, psize in zip(group_sizes, padded):
        out[dst : dst + size] = x[src : src + size]
        src += size
        dst += psize
    return out


def grouped_gemm_reference(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    group_sizes: Sequence[int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """MoE fprop/dgrad: rows of ``a`` [M, K] are sorted by group; group g uses ``b.group(g)``.

    ``b`` is a ``[G, N, K]`` tensor quantized with ``global_scale="group"``;
    ``sum(group_sizes) == M``; ``bias`` is ``[G, N]`` or None. Returns ``[M, N]``.
    """
    if b.global_scale != "group" or len(b.shape) != 3:
        raise ValueError("grouped_gemm: b must be a [G, N, K] tensor with global_scale='group'")
    groups, n = b.shape[0], b.shape[1]
    if len(group_sizes) != groups:
        raise ValueError(f"grouped_gemm: {len(group_sizes)} group sizes for {groups} groups")
    am = a.matrix()
    if sum(group_sizes) != am.rows:
        raise ValueError(f"grouped_gemm: group sizes sum to {sum(group_sizes)}, a has {am.rows} rows")
    out = torch.empty(am.rows, n, dtype=out_dtype, device=a.device)
    start = 0
    for g, size in enumerate(group_sizes):
        if size:
            out[start : start + size] = gemm_reference(
                am.row_slice(start, start + size), b.group(g), None if bias is None else bias[g], out_dtype
            )
        start += size
    return out


def grouped_wgrad_gemm_reference(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    padded_group_sizes: Sequence[int],
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The GEMM half of the MoE wgrad: ``out[g] = a[:, cols_g] @ b[:, cols_g].T`` -> ``[G, N, K]``.

    ``a`` ``[N, T_pad]`` and ``b`` ``[K, T_pad]`` are the token-major operands quantized along
    tokens (:func:`pad_groups` then ``quantize(t.t())``); ``cols_g`` are expert g's padded
    columns (every size a multiple of 16). An expert with no tokens gets zeros.
    """
    if any(int(s) % BLOCK for s in padded_group_sizes):
        raise ValueError(f"grouped_wgrad_gemm: padded group sizes must be multiples of {BLOCK}: {list(padded_group_sizes)}")
    if a.k != b.k or a.k != sum(padded_group_sizes):
        raise ValueError(
            f"grouped_wgrad_gemm: operands have K={a.k} and K={b.k}, padded groups sum to {sum(padded_group_sizes)}"
        )
    ia, ib = a.image_fp32(), b.image_fp32()
    out = torch.zeros(len(padded_group_sizes), a.rows, b.rows, dtype=out_dtype, device=a.device)
    col = 0
    for g, psize in enumerate(padded_group_sizes):
        if psize:
            acc = block_partials_accumulate(ia[:, col : col + psize], ib[:, col : col + psize])
            out[g] = epilogue(acc, a.row_global_decode(), b.row_global_decode(), None, out_dtype)
        col += psize
    return out


def quantize_wgrad_operand(
    t: torch.Tensor,
    group_sizes: Sequence[int],
    *,
    global_scale: str = "tensor",
    rounding: str = "nearest",
    seed: int | None = None,
    rht_seed: int | None = None,
    nonfinite: str = "propagate",
    quantize=quantize_reference,
    amax_fn=None,
) -> NVFP4Tensor:
    """``[T, H]`` token-major rows sorted by expert -> NVFP4 ``[H, T_pad]`` along tokens.

    ``amax_fn(padded_t)`` may supply the global amax (e.g. max-reduced across ranks)."""
    padded_t = pad_groups(t, group_sizes).t()
    return quantize(
        padded_t,
        global_scale=global_scale,
        rounding=rounding,
        seed=seed,
        rht_seed=rht_seed,
        amax=None if amax_fn is None else amax_fn(padded_t),
        nonfinite=nonfinite,
    )


def grouped_wgrad_reference(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    group_sizes: Sequence[int],
    *,
    global_scale: str = "tensor",
    grad_rounding: str = "nearest",
    grad_seed: int | None = None,
    rht_seed: int | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``dW[g] = dY_g^T @ X_g`` in NVFP4 for ``grad_out`` [T, N] and ``x`` [T, K] -> ``[G, N, K]``.

    ``grad_out`` is quantized with ``grad_rounding`` (stochastic: ``grad_seed``), ``x`` with
    round-to-nearest; both get the same random Hadamard transform when ``rht_seed`` is set.
    An expert with no tokens gets zeros.
    """
    if grad_out.shape[0] != x.shape[0] or sum(group_sizes) != x.shape[0]:
        raise ValueError(
            f"grouped_wgrad: grad_out {tuple(grad_out.shape)}, x {tuple(x.shape)} and group sizes "
            f"summing to {sum(group_sizes)} disagree"
        )
    qa = quantize_wgrad_operand(
        grad_out, group_sizes, global_scale=global_scale, rounding=grad_rounding, seed=grad_seed, rht_seed=rht_seed
    )
    qb = quantize_wgrad_operand(x, group_sizes, global_scale=global_scale, rht_seed=rht_seed)
    return grouped_wgrad_gemm_reference(qa, qb, padded_group_sizes(group_sizes), out_dtype)
