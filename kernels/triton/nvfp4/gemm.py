"""Dense NVFP4 GEMM on bf16 images (exact emulation on Hopper's BF16 tensor cores).

``out[m, n] = round(fp32(s_a[m] * s_b[n]) * sum_k img_a[m, k] * img_b[n, k] (+ bias[n]))``:
the contract of :mod:`minite_megatron.nvfp4.gemm`, ``a @ b.T``.

Layouts: both images are read through their strides, so every GEMM of a Linear layer runs
without a copy: fprop ``x [M, K] @ W [N, K]^T``; dgrad ``dY [M, N] @ W`` with
``W.transpose()`` (16x16 tiles: its image is ``W.image.t()``, a strided view); wgrad
``dY^T [N, T] @ X^T [K, T]^T`` on the column-wise quantized operands.

Accumulation (see :mod:`._gemm_common`): the default is the tensor core's own order (wgmma
on the H200), within ``nvfp4.fp32_accumulation_bound`` of the contract; ``canonical=True``
adds exact 16-element block partials in K order with round-to-nearest adds, which *is* the
contract, bit for bit. ``batch_invariant=True`` (strict mode) uses one fixed tile config and
K order for every M (no split-K, no choice keyed on M), so row r's result does not depend on
how many rows share the call.

Inputs: ``a_img`` bf16 [M, K], ``b_img`` bf16 [N, K] (any strides), ``a_scale`` fp32 [M] or
[1], ``b_scale`` fp32 [N] or [1], ``bias`` [N] (any float dtype; used as fp32) or None;
``out_dtype`` bf16 / fp16 / fp32. Raises ValueError on mismatched shapes, TypeError on dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.nvfp4._gemm_common import epilogue, mma_k_loop, mma_tile
from minite_kernels.triton.nvfp4._nvfp4_math import exact_launch, interpreting, round_to
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K, s_am, s_ak, s_bn, s_bk, s_cm, s_cn,
    SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr, CANONICAL: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles share each column tile while it is hot in L2.
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the M / N tails read in-bounds rows (never stored), so the K loop needs no row mask.
    a_base = a_ptr + (rm % M)[:, None].to(tl.int64) * s_am
    b_base = b_ptr + (rn % N)[None, :].to(tl.int64) * s_bn
    acc = mma_k_loop(a_base, b_base, (rm < M)[:, None], (rn < N)[None, :], 0, K, s_ak, s_bk,
                     BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, CANONICAL)

    if SA_ROWS:
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=1.0)
    else:
        sa = tl.full((BLOCK_M,), tl.load(sa_ptr), tl.float32)
    if SB_ROWS:
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=1.0)
    else:
        sb = tl.full((BLOCK_N,), tl.load(sb_ptr), tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    else:
        bias = sb
    out = epilogue(acc, sa, sb, bias, HAS_BIAS)
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
    tl.store(c_ptrs, round_to(out, c_ptr.dtype.element_ty, DOT_FP32), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _gemm_tma_kernel(
    a_desc, b_desc, c_desc, sa_ptr, sb_ptr, bias_ptr, M, N, K,
    SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, B_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr, CANONICAL: tl.constexpr,
):
    """Hopper path: operands and output move through TMA descriptors (no address registers).

    ``b_desc`` covers the ``[N, K]`` operand (``B_KMAJOR=False``, blocks [BN, BK]) or its
    transpose stored ``[K, N]`` (``B_KMAJOR=True``: dgrad on ``W.image.t()``, blocks [BK, BN]).
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([m0, k0])
        if B_KMAJOR:
            b = b_desc.load([k0, n0])
        else:
            b = b_desc.load([n0, k0]).T
        acc = mma_tile(acc, a, b, DOT_FP32, CANONICAL)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    if SA_ROWS:
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=1.0)
    else:
        sa = tl.full((BLOCK_M,), tl.load(sa_ptr), tl.float32)
    if SB_ROWS:
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=1.0)
    else:
        sb = tl.full((BLOCK_N,), tl.load(sb_ptr), tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    else:
        bias = sb
    out = epilogue(acc, sa, sb, bias, HAS_BIAS)
    c_desc.store([m0, n0], round_to(out, c_desc.dtype, DOT_FP32))


#: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
STRICT_CONFIG = (128, 128, 64, 8, 8, 3)
"""The one config of strict (batch-invariant) mode, for every M."""
CANONICAL_CONFIG = (128, 128, 16, 8, 8, 8)
"""Canonical (contract-order) accumulation: 16-wide K steps, deep pipeline."""
DEFAULT_CONFIG = (128, 128, 64, 8, 8, 3)
"""Outside strict mode, M > 64 (1.05-1.10x cuBLAS time on the H200; 128x256 ran 1.11-1.23x). A launch
may replace it (``config``: ``TritonOptions.gemm_tile``; ``python -m benchmarks.kernels --sections gemm_sweep``)."""
SMALL_M_CONFIG = (64, 128, 64, 8, 4, 4)


def select_config(m: int, n: int, k: int, batch_invariant: bool, canonical: bool, gpu: bool | None = None,
                  default: tuple = DEFAULT_CONFIG) -> tuple:
    """Tile config: fixed in strict mode; otherwise a small heuristic on the problem shape (``default``
    for M > 64)."""
    if not (gpu if gpu is not None else not interpreting()):
        # BLOCK_K = 16: the interpreter's tl.dot(a, b, acc) then adds exact block partials in
        # K order, i.e. the contract's own accumulation.
        return (16, 16, 16, 4, 4, 1) if batch_invariant else (32, 32, 16, 4, 4, 1)
    if canonical:
        return CANONICAL_CONFIG
    if batch_invariant:
        return STRICT_CONFIG
    if m <= 64:
        return SMALL_M_CONFIG
    return default


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2D tensor TMA can describe: unit last stride, 16-byte aligned base and row stride."""
    return (t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.shape[0] > 0 and t.shape[1] > 0)


def use_tma(device: torch.device) -> bool:
    """TMA descriptors: Hopper and newer, and the interpreter (which emulates them)."""
    if interpreting():
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@custom_op("minite::gemm", mutates_args=())
def gemm_op(
    a_img: torch.Tensor,
    b_img: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    batch_invariant: bool,
    canonical: bool,
    config: list[int] | None = None,
) -> torch.Tensor:
    """``a_img [M, K] @ b_img [N, K]^T`` with the contract's epilogue -> ``[M, N]`` ``out_dtype``
    (``config``: the default-mode launch for M > 64 in place of :data:`DEFAULT_CONFIG`, as a list)."""
    m, k = a_img.shape
    n = b_img.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_img.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn, bk, gm, warps, stages = select_config(m, n, k, batch_invariant, canonical,
                                                  default=tuple(config) if config else DEFAULT_CONFIG)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    common = dict(
        SA_ROWS=a_scale.numel() != 1 or m == 1, SB_ROWS=b_scale.numel() != 1 or n == 1,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
        DOT_FP32=interpreting(), CANONICAL=canonical, num_warps=warps, num_stages=stages, **exact_launch(),
    )
    bias_arg = bias if bias is not None else a_scale
    b_kmajor = b_img.stride(0) == 1 and b_img.stride(1) != 1
    b_phys = b_img.t() if b_kmajor else b_img
    if use_tma(a_img.device) and _tma_ok(a_img) and _tma_ok(b_phys) and _tma_ok(out):
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a_img, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(b_phys, [bk, bn] if b_kmajor else [bn, bk])
        c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
        _gemm_tma_kernel[grid](a_desc, b_desc, c_desc, a_scale, b_scale, bias_arg, m, n, k,
                               B_KMAJOR=b_kmajor, **common)
    else:
        _gemm_kernel[grid](
            a_img, b_img, out, a_scale, b_scale, bias_arg,
            m, n, k, a_img.stride(0), a_img.stride(1), b_img.stride(0), b_img.stride(1),
            out.stride(0), out.stride(1), **common,
        )
    return out


@gemm_op.register_fake
def _(a_img, b_img, a_scale, b_scale, bias, out_dtype, batch_invariant, canonical, config=None):
    return a_img.new_empty((a_img.shape[0], b_img.shape[0]), dtype=out_dtype)


def check_gemm_args(a_img, b_img, a_scale, b_scale, bias, out_dtype) -> None:
    """Clear errors for operands the kernel does not take."""
    if a_img.dim() != 2 or b_img.dim() != 2:
        raise ValueError(f"gemm: images must be 2D, got {tuple(a_img.shape)} and {tuple(b_img.shape)}")
    if a_img.shape[1] != b_img.shape[1]:
        raise ValueError(f"gemm: K mismatch, {a_img.shape[1]} vs {b_img.shape[1]}")
    if a_img.dtype != torch.bfloat16 or b_img.dtype != torch.bfloat16:
        raise TypeError(f"gemm: images must be bfloat16, got {a_img.dtype} and {b_img.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if a_scale.numel() not in (1, a_img.shape[0]) or b_scale.numel() not in (1, b_img.shape[0]):
        raise ValueError("gemm: global scales must have one element or one per row")
    if bias is not None and bias.shape != (b_img.shape[0],):
        raise ValueError(f"gemm: bias must have shape ({b_img.shape[0]},), got {tuple(bias.shape)}")


def gemm_forward(
    a_img: torch.Tensor,
    b_img: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool = False,
    canonical: bool = False,
    config: list[int] | None = None,
) -> torch.Tensor:
    """Checked entry point of :func:`gemm_op` (see the module docstring)."""
    check_gemm_args(a_img, b_img, a_scale, b_scale, bias, out_dtype)
    return gemm_op(a_img, b_img, a_scale.float().reshape(-1), b_scale.float().reshape(-1),
                   bias, out_dtype, batch_invariant, canonical, config)
