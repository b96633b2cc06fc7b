"""MoE grouped NVFP4 GEMM (fprop / dgrad): all experts in one launch, no host sync.

``out[rows of g] = round(fp32(s_a[row] * s_b[g]) * img_a[rows of g] @ img_b[g]^T (+ bias[g]))``,
the contract of ``nvfp4.grouped_gemm_reference``. Rows of ``a`` are sorted by expert;
``offsets`` (int32 ``[G + 1]``, on the device) delimit them, so routing that produced the
offsets on the GPU needs no host round trip: the grid is sized from an upper bound
(``ceil(M / BLOCK_M) + G`` row tiles) and each program finds its expert from the offsets
(a prefix sum over the experts' tile counts). Empty experts own no tile; tiles past the last
one exit at once.

Operands: ``a_img`` bf16 ``[M, K]`` (rows past an expert's end are read but never stored);
``b_img`` bf16 ``[G, N, K]``, or for dgrad the transposed view of ``[G, K, N]`` weights (3D
TMA boxes stay inside one expert, so no expert reads another's weights); ``a_scale`` fp32
``[M]`` or ``[1]``; ``b_scale`` fp32 ``[G]`` (one per expert); ``bias`` ``[G, N]`` or None.
Accumulation as :mod:`.gemm` (tensor-core order, or ``canonical=True`` for the contract's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_megatron.nvfp4.group_sizes import DeviceGroupSizes, GroupSizes

from minite_kernels.triton.nvfp4._gemm_common import epilogue, mma_tile
from minite_kernels.triton.nvfp4._nvfp4_math import exact_launch, interpreting, round_to
from minite_kernels.triton.nvfp4.gemm import OUT_DTYPES
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2


@triton.jit
def _expert_of_tile(offs_ptr, tile_m, G, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    """(valid, expert, first row, end row, first row of this tile) of virtual row tile ``tile_m``."""
    gi = tl.arange(0, G_POW2)
    starts = tl.load(offs_ptr + gi, mask=gi < G, other=0)
    ends = tl.load(offs_ptr + gi + 1, mask=gi < G, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, axis=0)
    valid = tile_m < tl.sum(tiles, axis=0)
    g = tl.sum((cum <= tile_m).to(tl.int32), axis=0)
    sel = gi == g
    row_start = tl.sum(tl.where(sel, starts, 0), axis=0)
    row_end = tl.sum(tl.where(sel, ends, 0), axis=0)
    first_tile = tl.sum(tl.where(sel, cum - tiles, 0), axis=0)
    return valid, g, row_start, row_end, row_start + (tile_m - first_tile) * BLOCK_M


@triton.jit
def _grouped_gemm_kernel(
    a_desc, b_desc, c_ptr, offs_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K, G, s_cm,
    SA_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, B_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
    DOT_FP32: tl.constexpr, CANONICAL: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    tile_m = pid // num_n
    pid_n = pid % num_n
    valid, g, row_start, row_end, m0 = _expert_of_tile(offs_ptr, tile_m, G, BLOCK_M, G_POW2)
    if valid:
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([m0, k0])
            if B_KMAJOR:
                b = tl.reshape(b_desc.load([g, k0, n0]), (BLOCK_K, BLOCK_N))
            else:
                b = tl.reshape(b_desc.load([g, n0, k0]), (BLOCK_N, BLOCK_K)).T
            acc = mma_tile(acc, a, b, DOT_FP32, CANONICAL)
        rm = m0 + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        rmask = rm < row_end
        if SA_ROWS:
            sa = tl.load(sa_ptr + rm, mask=rmask, other=1.0)
        else:
            sa = tl.full((BLOCK_M,), tl.load(sa_ptr), tl.float32)
        sb = tl.full((BLOCK_N,), tl.load(sb_ptr + g), tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        else:
            bias = sb
        out = epilogue(acc, sa, sb, bias, HAS_BIAS)
        c_ptrs = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :]
        tl.store(c_ptrs, round_to(out, c_ptr.dtype.element_ty, DOT_FP32), mask=rmask[:, None] & (rn < N)[None, :])


STRICT_CONFIG = (128, 256, 64, 8, 3)
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of strict mode, for every routing. A row's bits
depend on BLOCK_K (the K order of its MMA chain), not on BLOCK_M / BLOCK_N (the rollout's strict decode
kernels, 32-row tiles, reproduce it): the default's faster 128 x 256 tile (was 128 x 128)."""
DEFAULT_CONFIG = (128, 256, 64, 8, 3)
"""Outside strict mode, more than 64 rows per expert on average: the fastest entry of
``python -m benchmarks.kernels --sections sweep_grouped`` (fc1 and fc2, fprop and dgrad; BENCHMARKS.md).
A launch may replace it (``config``: ``TritonOptions.grouped_gemm_tile``)."""
SMALL_CONFIG = (64, 128, 64, 4, 4)
"""Experts with few tokens on average (<= 64): less padding waste per tile."""


def select_config(m: int, n: int, k: int, groups: int, batch_invariant: bool, canonical: bool,
                  gpu: bool | None = None, default: tuple = DEFAULT_CONFIG) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); fixed in strict mode (``default``: the
    launch for more than 64 rows per group)."""
    if not (gpu if gpu is not None else not interpreting()):
        return (16, 16, 16, 4, 1)
    if canonical:
        return (128, 128, 16, 8, 8)
    if batch_invariant:
        return STRICT_CONFIG
    if m // max(groups, 1) <= 64:
        return SMALL_CONFIG
    return default


def group_offsets(group_sizes, device: torch.device) -> torch.Tensor:
    """int32 ``[G + 1]`` prefix offsets on ``device`` from a (device) tensor of sizes, or from host
    sizes (a list, or a :class:`~minite_megatron.nvfp4.group_sizes.GroupSizes` whose offsets are
    made once and shared): summed on the host, one pinned non-blocking copy, no host sync; a
    :class:`~minite_megatron.nvfp4.group_sizes.DeviceGroupSizes` gives its shared device offsets."""
    if isinstance(group_sizes, torch.Tensor):
        sizes = group_sizes.to(device=device, dtype=torch.int32).reshape(-1)
        return torch.nn.functional.pad(torch.cumsum(sizes, 0, dtype=torch.int32), (1, 0))
    try:
        return GroupSizes.of(group_sizes).offsets(device)
    except ValueError as e:
        raise ValueError(f"grouped_gemm: {e}") from None


@custom_op("minite::grouped_gemm", mutates_args=())
def grouped_gemm_op(
    a_img: torch.Tensor,
    b_img: torch.Tensor,
    offsets: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    batch_invariant: bool,
    canonical: bool,
    config: list[int] | None = None,
) -> torch.Tensor:
    """``a_img [M, K]`` (rows sorted by expert, ``offsets [G + 1]``) x ``b_img [G, N, K]`` -> ``[M, N]``
    (``config``: the default-mode launch in place of :data:`DEFAULT_CONFIG`, as a list)."""
    m, k = a_img.shape
    groups, n = b_img.shape[0], b_img.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=a_img.device)
    if m == 0 or n == 0 or groups == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn, bk, warps, stages = select_config(m, n, k, groups, batch_invariant, canonical,
                                              default=tuple(config) if config else DEFAULT_CONFIG)
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = a_img if a_img.stride(1) == 1 and (a_img.stride(0) * 2) % 16 == 0 else a_img.contiguous()
    b_kmajor = b_img.stride(1) == 1 and b_img.stride(2) != 1
    b_phys = b_img.transpose(1, 2) if b_kmajor else b_img
    if b_phys.stride(2) != 1 or (b_phys.stride(1) * 2) % 16 or (b_phys.stride(0) * 2) % 16:
        b_phys, b_kmajor = b_img.contiguous(), False
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b_phys, [1, bk, bn] if b_kmajor else [1, bn, bk])
    grid = ((cdiv(m, bm) + groups) * cdiv(n, bn),)
    _grouped_gemm_kernel[grid](
        a_desc, b_desc, out, offsets, a_scale, b_scale, bias if bias is not None else b_scale,
        m, n, k, groups, out.stride(0),
        SA_ROWS=a_scale.numel() != 1 or m == 1, HAS_BIAS=bias is not None, B_KMAJOR=b_kmajor,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, G_POW2=next_pow2(groups),
        DOT_FP32=interpreting(), CANONICAL=canonical, num_warps=warps, num_stages=stages, **exact_launch(),
    )
    return out


@grouped_gemm_op.register_fake
def _(a_img, b_img, offsets, a_scale, b_scale, bias, out_dtype, batch_invariant, canonical, config=None):
    return a_img.new_empty((a_img.shape[0], b_img.shape[1]), dtype=out_dtype)


def grouped_gemm_forward(
    a_img: torch.Tensor,
    b_img: torch.Tensor,
    group_sizes,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool = False,
    canonical: bool = False,
    config: list[int] | None = None,
) -> torch.Tensor:
    """Checked entry point: ``group_sizes`` is a list of ints (or a ``GroupSizes``), or an int tensor
    or a ``DeviceGroupSizes`` (device: no sync); ``config`` as :func:`grouped_gemm_op`."""
    if a_img.dim() != 2 or b_img.dim() != 3:
        raise ValueError(f"grouped_gemm: need a [M, K] and b [G, N, K], got {tuple(a_img.shape)}, {tuple(b_img.shape)}")
    if a_img.shape[1] != b_img.shape[2]:
        raise ValueError(f"grouped_gemm: K mismatch, {a_img.shape[1]} vs {b_img.shape[2]}")
    if a_img.dtype != torch.bfloat16 or b_img.dtype != torch.bfloat16:
        raise TypeError("grouped_gemm: images must be bfloat16")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"grouped_gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    groups = b_img.shape[0]
    if not isinstance(group_sizes, torch.Tensor):
        if len(group_sizes) != groups:
            raise ValueError(f"grouped_gemm: {len(group_sizes)} group sizes for {groups} groups")
        total = group_sizes.total if isinstance(group_sizes, (GroupSizes, DeviceGroupSizes)) else sum(group_sizes)
        if total != a_img.shape[0]:
            raise ValueError(f"grouped_gemm: group sizes sum to {total}, a has {a_img.shape[0]} rows")
    elif group_sizes.numel() != groups:
        raise ValueError(f"grouped_gemm: {group_sizes.numel()} group sizes for {groups} groups")
    if b_scale.numel() != groups:
        raise ValueError(f"grouped_gemm: b needs one global scale per group, got {b_scale.numel()}")
    if bias is not None and tuple(bias.shape) != (groups, b_img.shape[1]):
        raise ValueError(f"grouped_gemm: bias must be [G, N] = {(groups, b_img.shape[1])}, got {tuple(bias.shape)}")
    offsets = group_offsets(group_sizes, a_img.device)
    return grouped_gemm_op(a_img, b_img, offsets, a_scale.float().reshape(-1), b_scale.float().reshape(-1),
                           bias, out_dtype, batch_invariant, canonical, config)
