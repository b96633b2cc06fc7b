"""Row-wise and column-wise NVFP4 quantization of one matrix: the contract of the dual op.

A Linear quantizes each of its GEMM inputs twice: the gradient ``dy`` [T, N] row-wise for
dgrad (blocks of 16 features) and column-wise for wgrad (``dy.t()``: blocks of 16 tokens,
after the optional random Hadamard transform); the activation ``x`` likewise in the forward.
A kernel may do both in one read of the matrix; this module defines what it must return,
in pure torch, as two calls of :func:`.quantize.quantize_reference`::

    q_row = quantize_reference(x,     global_scale=row_scale, rounding=row_rounding, seed=row_seed,
                               amax=row_amax, with_image=..., nonfinite=...)
    q_col = quantize_reference(x.t(), global_scale=col_scale, rounding=col_rounding, seed=col_seed,
                               rht_seed=col_rht_seed, amax=col_amax, with_image=..., nonfinite=...)

so everything about the chain (scales, rounding, stochastic-rounding bits, the non-finite
policy) is :mod:`.quantize`'s. Stochastic rounding draws independent streams: the hash of
(seed, row, col) of *each output matrix*; for ``q_col`` the matrix is ``x.t()``, so row =
feature and col = token. ``col_scale="row"`` is one global scale per feature.

:func:`amax_row_col` is the one read-only pass that gives both global amaxes at once (so a
caller can max-reduce them across tensor-parallel ranks before quantizing): the plain amax of
``x`` (per token or per tensor) and the amax of the transformed ``x.t()`` (per feature or per
tensor). A domain holding a NaN or an infinity reports ``+inf`` (it wins every max, NaN might
not in a collective, and it quantizes exactly like the NaN amax: the whole domain NaN).

Inputs (both functions): ``x`` a bf16 / fp16 ``[T, N]`` matrix with unit stride along N, T and
N multiples of 16; anything else raises ValueError (callers fall back to two quantize calls).
"""

from __future__ import annotations

import torch

from .formats import BLOCK
from .hadamard import rht16, rht_signs
from .quantize import quantize_reference
from .tensor import NVFP4Tensor

_SCALES = ("row", "tensor")


def validate_row_col(x: torch.Tensor, row_scale: str, col_scale: str) -> None:
    """Raise ValueError (TypeError for a non-tensor) for input the dual op does not take."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_row_col expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"quantize_row_col: x must be a 2D [T, N] matrix, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_row_col: x must be bfloat16 or float16, got {x.dtype}")
    t, n = x.shape
    if t % BLOCK or n % BLOCK:
        raise ValueError(
            f"quantize_row_col: T={t} and N={n} must both be multiples of {BLOCK} "
            "(quantize x and x.t() separately otherwise)"
        )
    if n > 1 and x.stride(1) != 1:
        raise ValueError(f"quantize_row_col: x needs unit stride along N, got strides {tuple(x.stride())}")
    if row_scale not in _SCALES or col_scale not in _SCALES:
        raise ValueError(
            f"quantize_row_col: row_scale and col_scale must be 'row' or 'tensor', got {row_scale!r}, {col_scale!r}"
        )


def quantize_row_col(
    x: torch.Tensor,
    *,
    row_scale: str = "tensor",
    row_rounding: str = "nearest",
    row_seed: int | None = None,
    row_amax: torch.Tensor | None = None,
    col_scale: str = "tensor",
    col_rounding: str = "nearest",
    col_seed: int | None = None,
    col_rht_seed: int | None = None,
    col_amax: torch.Tensor | None = None,
    with_image: bool = True,
    nonfinite: str = "propagate",
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """``(q_row, q_col)``: ``x`` [T, N] quantized along N and ``x.t()`` [N, T] along T (module
    docstring). ``row_amax``: fp32 ``[T]`` (``row_scale="row"``) or ``[1]``; ``col_amax``: of
    the transformed ``x.t()``, ``[N]`` or ``[1]``. Raises like :func:`validate_row_col` and
    :func:`.quantize.quantize_reference` (e.g. ValueError for non-finite input with
    ``nonfinite="raise"``, for stochastic rounding without a seed)."""
    validate_row_col(x, row_scale, col_scale)
    q_row = quantize_reference(
        x, global_scale=row_scale, rounding=row_rounding, seed=row_seed, amax=row_amax,
        with_image=with_image, nonfinite=nonfinite,
    )
    q_col = quantize_reference(
        x.t(), global_scale=col_scale, rounding=col_rounding, seed=col_seed, rht_seed=col_rht_seed,
        amax=col_amax, with_image=with_image, nonfinite=nonfinite,
    )
    return q_row, q_col


def _domain_amax(v: torch.Tensor, per_row: bool) -> torch.Tensor:
    """fp32 amax of ``v`` [R, K] per row ``[R]`` or of everything ``[1]``; +inf where non-finite."""
    a = v.abs()
    bad = ~torch.isfinite(v)
    if per_row:
        m, b = (a.amax(dim=1), bad.any(dim=1)) if v.shape[1] else (a.new_zeros(v.shape[0]), bad.new_zeros(v.shape[0]))
    else:
        m = a.amax().reshape(1) if v.numel() else a.new_zeros(1)
        b = bad.any().reshape(1)
    return torch.where(b, torch.full_like(m, float("inf")), m)


def amax_row_col(
    x: torch.Tensor, *, row_scale: str = "tensor", col_scale: str = "tensor", col_rht_seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_amax, col_amax)`` fp32: ``|x|`` per token ``[T]`` (``row_scale="row"``) or ``[1]``;
    ``|rht16(x.t())|`` (or ``|x.t()|`` without ``col_rht_seed``) per feature ``[N]`` or ``[1]``.
    A non-finite domain gives ``+inf``."""
    validate_row_col(x, row_scale, col_scale)
    xf = x.to(torch.float32)
    xt = xf.t()
    if col_rht_seed is not None and x.numel():
        xt = rht16(x.t(), rht_signs(None if col_rht_seed < 0 else col_rht_seed, device=x.device))
    return _domain_amax(xf, row_scale == "row"), _domain_amax(xt, col_scale == "row")


__all__ = ["quantize_row_col", "amax_row_col", "validate_row_col"]
