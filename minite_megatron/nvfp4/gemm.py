"""The NVFP4 GEMM contract and its pure-torch reference (dense; grouped ops in :mod:`.grouped`).

``out[m, n] = round_out(alpha[m, n] * acc[m, n] (+ bias[n]))`` with
``alpha[m, n] = fp32(S_dec_a[m] * S_dec_b[n])`` and ``acc`` the fp32 sum over k of
``img_a[m, k] * img_b[n, k]``, ``img = e2m1(code) * fp32(block scale)``. The epilogue order is
part of the contract: scale (one fp32 product), then bias (fp32 add), then one rounding to the
output dtype.

Canonical accumulation order. Within one 16-element K block both operands have one block
scale each, so every partial sum of ``img_a * img_b`` over that block is an integer multiple
of ``sf_a * sf_b / 4`` below ``2304 * sf_a * sf_b``: at most 20 significant bits, exact in fp32
whatever order (or tensor-core instruction) computes it. The reference therefore computes the
exact block partials ``P_j`` and adds them in a fixed order, ``acc = (((0 + P_0) + P_1) + ...)``,
one fp32 rounding per block. The result of row ``m`` depends only on row ``m`` of ``a`` and on
``b``: it is batch invariant by construction and bitwise equal on every device. Kernels that
accumulate in another order (or whose tensor cores round differently) are held to the bound
in :func:`fp32_accumulation_bound`; in strict mode a kernel must be batch invariant itself.
"""

from __future__ import annotations

import torch

from .formats import BLOCK
from .tensor import NVFP4Tensor


def check_gemm_operands(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    """The errors every backend's GEMM raises for operands it cannot multiply."""
    if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
        raise TypeError("nvfp4.gemm takes two NVFP4Tensor operands (quantize them first)")
    if a.k != b.k:
        raise ValueError(f"nvfp4.gemm: K mismatch, a has K={a.k} and b has K={b.k}")
    if a.device != b.device:
        raise ValueError(f"nvfp4.gemm: operands on {a.device} and {b.device}")


def block_partials_accumulate(img_a: torch.Tensor, img_b: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N]: the canonical-order sum over K blocks of exact block partial products."""
    m, k = img_a.shape
    n = img_b.shape[0]
    kb = k // BLOCK
    acc = torch.zeros(m, n, dtype=torch.float32, device=img_a.device)
    # all block partials of a chunk of blocks in one batched product: each is exact (at most 20
    # significant bits) whatever order the BLAS uses (TF32 is exact on images too) ...
    chunk = max(1, min(kb, (1 << 26) // max(1, m * n)))
    a3 = img_a.reshape(m, kb, BLOCK).transpose(0, 1)
    b3 = img_b.reshape(n, kb, BLOCK).permute(1, 2, 0)
    for j0 in range(0, kb, chunk):
        partials = torch.bmm(a3[j0 : j0 + chunk], b3[j0 : j0 + chunk])
        # ... and they are added in K order, one fp32 rounding per block
        for p in partials:
            acc = acc + p
    return acc


def epilogue(
    acc: torch.Tensor,
    row_scale_a: torch.Tensor,
    row_scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Scale (fp32 alpha = s_a[m] * s_b[n], one product), bias (fp32), one rounding."""
    alpha = row_scale_a.to(torch.float32).unsqueeze(1) * row_scale_b.to(torch.float32).unsqueeze(0)
    out = acc * alpha
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def gemm_reference(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``a @ b.T`` for NVFP4 ``a`` [..., K] and ``b`` [N, K]: returns ``[..., N]``."""
    check_gemm_operands(a, b)
    bm = b.matrix()
    acc = block_partials_accumulate(a.image_fp32(), bm.image_fp32())
    out = epilogue(acc, a.row_global_decode(), bm.row_global_decode(), bias, out_dtype)
    return out.reshape(*a.shape[:-1], bm.rows)


def fp32_accumulation_bound(a: NVFP4Tensor, b: NVFP4Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound): the fp64 value of the contract's product before the output rounding, and
    a per-element bound on how far any fp32 accumulation order can move it.

    ``|fl32_any_order(sum) - sum| <= gamma_K * sum|products|`` with ``gamma_K = K u / (1 - K u)``,
    ``u = 2^-24``; the epilogue adds at most two fp32 roundings (scale, bias). An output
    rounded to a format with unit roundoff ``u_out`` may then differ from the exact value by
    ``bound + u_out * |exact|`` (one rounding of a value within ``bound``), plus one more
    ``u_out * |exact|`` when compared against another rounded result.
    """
    bm = b.matrix()
    ia, ib = a.image_fp32().double(), bm.image_fp32().double()
    alpha = a.row_global_decode().double().unsqueeze(1) * bm.row_global_decode().double().unsqueeze(0)
    exact = (ia @ ib.t()) * alpha
    mag = (ia.abs() @ ib.abs().t()) * alpha.abs()
    if bias is not None:
        exact = exact + bias.double()
    u = 2.0**-24
    kk = a.k
    gamma = kk * u / (1 - kk * u)
    bound = gamma * mag + 2 * u * (mag + exact.abs())
    return exact.reshape(*a.shape[:-1], bm.rows), bound.reshape(*a.shape[:-1], bm.rows)
