"""MoE wgrad in NVFP4: ``dW[g] = dY_g^T @ X_g`` for every expert in one launch.

Equal to ``nvfp4.grouped_wgrad_reference``: quantization blocks run along tokens and must not
straddle experts, so each expert's token range is zero-padded to a multiple of 16 and both
operands are quantized as whole ``[N, T_pad]`` / ``[K, T_pad]`` matrices (global scale
``"tensor"`` or ``"row"``, over all experts). Here the padding costs no copy: the quantize
kernel reads ``dY.t()`` / ``X.t()`` in place through a column gather (``col_index``: padded
token -> source token, -1 for padding), in the same pass that writes codes, scales and the
bf16 image. Stochastic rounding draws its bits at the padded (row, column), like the
reference. The random Hadamard transform runs fused in the same kernel (the contract's
butterfly order on the gathered, zero-padded blocks).

The GEMM: one program per (expert, N tile, K tile) runs over its expert's padded token range,
TMA tiles of ``BLOCK_T`` tokens then one masked tail (a multiple of 16 tokens), in token
order; epilogue ``fp32(s_a[n] * s_b[k]) * acc``, one rounding to ``out_dtype``; an expert
without tokens gets zeros. ``group_sizes``: list of ints (exact padding), or an int tensor or a
``DeviceGroupSizes`` on the device (no host sync; the padded width is then the bound ``T + 15 G``
rounded up to 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_megatron.nvfp4.formats import BLOCK
from minite_megatron.nvfp4.group_sizes import DeviceGroupSizes, GroupSizes
from minite_megatron.nvfp4.quantize import check_finite
from minite_megatron.nvfp4.tensor import NVFP4Tensor

from minite_kernels.triton.nvfp4._gemm_common import mma_tile
from minite_kernels.triton.nvfp4._nvfp4_math import exact_launch, interpreting, round_to
from minite_kernels.triton.nvfp4.amax import amax_forward
from minite_kernels.triton.nvfp4.grouped_gemm import group_offsets
from minite_kernels.triton.nvfp4 import quantize_cols
from minite_kernels.triton.nvfp4.quantize import key_args, quantize_op, rht_mask_of
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv


@triton.jit
def _grouped_wgrad_kernel(
    a_desc, b_desc, a_ptr, b_ptr, out_ptr, poffs_ptr, sa_ptr, sb_ptr,
    N, KX, T_PAD,
    SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_FP32: tl.constexpr, CANONICAL: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(N, BLOCK_M)
    num_n = tl.cdiv(KX, BLOCK_N)
    g = pid // (num_m * num_n)
    tile = pid % (num_m * num_n)
    m0 = (tile // num_n) * BLOCK_M
    n0 = (tile % num_n) * BLOCK_N
    p0 = tl.load(poffs_ptr + g)
    p1 = tl.load(poffs_ptr + g + 1)
    full_end = p0 + ((p1 - p0) // BLOCK_T) * BLOCK_T
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for t0 in range(p0, full_end, BLOCK_T):
        a = a_desc.load([m0, t0])
        b = b_desc.load([n0, t0]).T
        acc = mma_tile(acc, a, b, DOT_FP32, CANONICAL)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    if full_end < p1:  # the tail: fewer than BLOCK_T tokens (a multiple of 16), masked loads
        tt = full_end + tl.arange(0, BLOCK_T)
        tmask = tt < p1
        a = tl.load(a_ptr + (rm % N)[:, None].to(tl.int64) * T_PAD + tt[None, :], mask=tmask[None, :], other=0.0)
        b = tl.load(b_ptr + (rn % KX)[None, :].to(tl.int64) * T_PAD + tt[:, None], mask=tmask[:, None], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee" if DOT_FP32 else None)
    if SA_ROWS:
        sa = tl.load(sa_ptr + rm, mask=rm < N, other=1.0)
    else:
        sa = tl.full((BLOCK_M,), tl.load(sa_ptr), tl.float32)
    if SB_ROWS:
        sb = tl.load(sb_ptr + rn, mask=rn < KX, other=1.0)
    else:
        sb = tl.full((BLOCK_N,), tl.load(sb_ptr), tl.float32)
    out = acc * (sa[:, None] * sb[None, :])
    out = tl.where(p1 > p0, out, 0.0)  # an expert without tokens gets zeros (even with NaN scales)
    ptrs = out_ptr + g.to(tl.int64) * N * KX + rm[:, None].to(tl.int64) * KX + rn[None, :]
    tl.store(ptrs, round_to(out, out_ptr.dtype.element_ty, DOT_FP32), mask=(rm < N)[:, None] & (rn < KX)[None, :])


#: The GPU launch (BLOCK_M, BLOCK_N, BLOCK_T, num_warps, num_stages): the fastest entry of
#: ``python -m benchmarks.kernels --sections sweep_wgrad`` (fc1 and fc2; BENCHMARKS.md). A launch may
#: replace it (``config``: ``TritonOptions.grouped_wgrad_tile``).
DEFAULT_CONFIG = (128, 256, 64, 8, 3)


def select_config(canonical: bool, gpu: bool | None = None, default: tuple = DEFAULT_CONFIG) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_T, num_warps, num_stages): ``default`` on a GPU outside canonical mode."""
    if not (gpu if gpu is not None else not interpreting()):
        return (16, 16, 16, 4, 1)
    if canonical:
        return (128, 128, 16, 8, 8)
    return default


def pad_index(group_sizes, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(col_index int32 [T_pad], padded offsets int32 [G + 1], T_pad) on ``device``.

    ``col_index[c]`` is the source token of padded column c, or -1 for padding. Host sizes (a
    list, or a :class:`~minite_megatron.nvfp4.group_sizes.GroupSizes`, whose tensors are made
    once and shared) give the exact ``T_pad`` and cost one pinned non-blocking copy at most;
    device sizes (a :class:`~minite_megatron.nvfp4.group_sizes.DeviceGroupSizes`, its tensors
    shared the same way, or an int tensor of sizes summing to ``t``) give the bound
    ``ceil16(T + 15 G)`` and no copy.
    """
    if isinstance(group_sizes, torch.Tensor):
        group_sizes = DeviceGroupSizes(group_sizes.reshape(-1), t, check=False)
    sizes = GroupSizes.of(group_sizes)
    return sizes.column_index(device), sizes.padded_offsets(device), sizes.padded().total


def _quantize_padded_t(x, col_index, t_pad, global_scale, stochastic, seed, rht_seed, with_image=True, amax=None):
    """Quantize ``pad_groups(x).t()`` ([H, T_pad]): ``(codes, scales, global decode, image)``.

    One kernel reads ``x.t()`` in place: the gather pads each expert's tokens and the RHT (if
    any) runs fused in the column kernel; a tensor scale takes one read-only amax pass first
    (of the transformed, padded blocks when there is an RHT: the zero padding changes them), unless
    the caller gives that ``amax`` (e.g. from :func:`dy_amaxes`' shared pass)."""
    x = x.contiguous()
    src, h = x.t(), x.shape[1]
    rht = rht_mask_of(rht_seed)
    if global_scale == "tensor":
        rpg = max(h, 1)
        if amax is None:
            amax = quantize_cols.amax_launch(src, col_index, rpg, rht) if rht >= 0 else amax_forward(x, max(x.shape[0], 1))
    else:
        amax, rpg = None, 1
    key, key_tensor = key_args(seed, x.device) if stochastic else (0, None)
    return quantize_op(src, amax, col_index, rpg, False, stochastic, key, with_image, False, rht, None, key_tensor)


def _check_scale_and_rounding(op: str, global_scale: str, rounding: str, seed) -> None:
    if global_scale not in ("tensor", "row"):
        raise ValueError(f"{op}: global_scale must be 'tensor' or 'row', got {global_scale!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"{op}: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic" and seed is None:
        raise ValueError(f"{op}: stochastic rounding needs a seed")


def quantize_wgrad_operand_forward(
    t: torch.Tensor,
    group_sizes,
    *,
    global_scale: str = "tensor",
    rounding: str = "nearest",
    seed: int | None = None,
    rht_seed: int | None = None,
    nonfinite: str = "propagate",
    with_image: bool = False,
    amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """``nvfp4.quantize_wgrad_operand``, bit for bit, without the padded copy: ``t`` [T, H] rows
    sorted by group (host ints, or a ``DeviceGroupSizes``) -> NVFP4 ``[H, T_pad]`` along tokens,
    each group zero-padded to a multiple of 16, read in place through the gather of the column
    kernel (RHT fused). Device sizes give ``T_pad`` = their width bound: the columns past the
    padded groups are zeros (the amax, codes and the wgrad GEMM of the groups unchanged).
    ``amax``: the tensor scale's fp32 ``[1]`` amax of the padded, transformed operand if the
    caller already has it (:func:`dy_amaxes`), else one amax pass runs first."""
    group_sizes = GroupSizes.of(group_sizes)
    if t.dim() != 2 or group_sizes.total != t.shape[0]:
        raise ValueError(f"quantize_wgrad_operand: t {tuple(t.shape)} and group sizes summing to "
                         f"{group_sizes.total} disagree")
    _check_scale_and_rounding("quantize_wgrad_operand", global_scale, rounding, seed)
    if nonfinite == "raise":
        check_finite(t)
    elif nonfinite != "propagate":
        raise ValueError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")
    h = t.shape[1]
    col_index, _, t_pad = pad_index(group_sizes, t.shape[0], t.device)
    if t_pad == 0 or h == 0:  # nothing to quantize: the contract's empty result (S_dec = 1 for empty domains)
        from minite_megatron.nvfp4.grouped import quantize_wgrad_operand

        return quantize_wgrad_operand(t, group_sizes, global_scale=global_scale, rounding=rounding, seed=seed,
                                      rht_seed=rht_seed, nonfinite=nonfinite)
    codes, scales, sdec, image = _quantize_padded_t(t, col_index, t_pad, global_scale, rounding == "stochastic", seed,
                                                    rht_seed, with_image, amax)
    return NVFP4Tensor(
        codes=codes, block_scales=scales.view(torch.float8_e4m3fn), global_decode=sdec, shape=torch.Size((h, t_pad)),
        global_scale=global_scale, tile=(1, BLOCK), layout="linear", rht_seed=rht_seed,
        image=image if with_image else None,
    )


def dy_amaxes(dy: torch.Tensor, group_sizes, rht_seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One read of a gradient ``dy`` [T, N] (rows sorted by group) for both of its tensor scales:
    ``(amax of dy, amax of its wgrad operand)`` -- the dgrad operand's plain amax, and the amax of
    ``pad_groups(dy).t()`` after the RHT of ``rht_seed`` (what :func:`quantize_wgrad_operand_forward`
    and ``quantize_forward`` compute in their own passes), each fp32 ``[1]``, bitwise those passes'.
    ``group_sizes``: host ints (a list or a ``GroupSizes``) or a ``DeviceGroupSizes``, summing to T
    (device sizes: always through their column index, the zero columns changing no max)."""
    sizes = GroupSizes.of(group_sizes)
    if dy.dim() != 2 or sizes.total != dy.shape[0]:
        raise ValueError(f"dy_amaxes: dy {tuple(dy.shape)} and group sizes summing to {sizes.total} disagree")
    x = dy.contiguous()
    gather = isinstance(sizes, DeviceGroupSizes) or any(s % BLOCK for s in sizes)
    col_index = pad_index(sizes, x.shape[0], x.device)[0] if gather else None
    wgrad, plain = quantize_cols.amax_launch(x.t(), col_index, max(x.shape[1], 1), rht_mask_of(rht_seed), plain=True)
    return plain, wgrad


def grouped_wgrad_forward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    group_sizes,
    *,
    global_scale: str = "tensor",
    grad_rounding: str = "nearest",
    grad_seed: int | None = None,
    rht_seed: int | None = None,
    out_dtype: torch.dtype = torch.float32,
    canonical: bool = False,
    config: list[int] | None = None,
) -> torch.Tensor:
    """``grad_out [T, N]``, ``x [T, K]`` (bf16/fp16/fp32, rows sorted by expert) -> ``[G, N, K]``
    (``config`` as :func:`grouped_wgrad_op`).

    Raises ValueError when the shapes and group sizes disagree, for a global scale other than
    ``"tensor"``/``"row"``, or stochastic rounding without ``grad_seed``.
    """
    t = x.shape[0]
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != t:
        raise ValueError(f"grouped_wgrad: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} disagree")
    if not isinstance(group_sizes, (torch.Tensor, DeviceGroupSizes)) and sum(int(s) for s in group_sizes) != t:
        raise ValueError(
            f"grouped_wgrad: grad_out {tuple(grad_out.shape)}, x {tuple(x.shape)} and group sizes "
            f"summing to {sum(group_sizes)} disagree"
        )
    _check_scale_and_rounding("grouped_wgrad", global_scale, grad_rounding, grad_seed)
    for name, tns in (("grad_out", grad_out), ("x", x)):
        if tns.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"grouped_wgrad: {name} must be bf16/fp16/fp32, got {tns.dtype}")
    groups = group_sizes.numel() if isinstance(group_sizes, torch.Tensor) else len(group_sizes)
    n, kx = grad_out.shape[1], x.shape[1]
    if n == 0 or kx == 0 or groups == 0:
        return torch.zeros(groups, n, kx, dtype=out_dtype, device=x.device)
    col_index, poffs, t_pad = pad_index(group_sizes, t, x.device)
    if t_pad == 0:
        return torch.zeros(groups, n, kx, dtype=out_dtype, device=x.device)
    _, _, sa, a_img = _quantize_padded_t(grad_out, col_index, t_pad, global_scale, grad_rounding == "stochastic",
                                         grad_seed, rht_seed)
    _, _, sb, b_img = _quantize_padded_t(x, col_index, t_pad, global_scale, False, None, rht_seed)
    return grouped_wgrad_op(a_img, b_img, poffs, sa, sb, groups, out_dtype, canonical, config)


@custom_op("minite::grouped_wgrad", mutates_args=())
def grouped_wgrad_op(
    a_img: torch.Tensor,
    b_img: torch.Tensor,
    poffs: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    groups: int,
    out_dtype: torch.dtype,
    canonical: bool,
    config: list[int] | None = None,
) -> torch.Tensor:
    """Images ``a [N, T_pad]``, ``b [K, T_pad]``, padded offsets ``[G + 1]`` -> ``[G, N, K]``
    (``config``: the GPU launch in place of :data:`DEFAULT_CONFIG`, as a list)."""
    n, t_pad = a_img.shape
    kx = b_img.shape[0]
    if n == 0 or kx == 0 or t_pad == 0 or groups == 0:
        return torch.zeros(groups, n, kx, dtype=out_dtype, device=a_img.device)
    out = torch.empty(groups, n, kx, dtype=out_dtype, device=a_img.device)
    bm, bn, bt, warps, stages = select_config(canonical, default=tuple(config) if config else DEFAULT_CONFIG)
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_desc = TensorDescriptor.from_tensor(a_img, [bm, bt])
    b_desc = TensorDescriptor.from_tensor(b_img, [bn, bt])
    grid = (groups * cdiv(n, bm) * cdiv(kx, bn),)
    _grouped_wgrad_kernel[grid](
        a_desc, b_desc, a_img, b_img, out, poffs, a_scale, b_scale, n, kx, t_pad,
        SA_ROWS=a_scale.numel() != 1 or n == 1, SB_ROWS=b_scale.numel() != 1 or kx == 1,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_T=bt, DOT_FP32=interpreting(), CANONICAL=canonical,
        num_warps=warps, num_stages=stages, **exact_launch(),
    )
    return out


@grouped_wgrad_op.register_fake
def _(a_img, b_img, poffs, a_scale, b_scale, groups, out_dtype, canonical, config=None):
    return a_img.new_empty((groups, a_img.shape[0], b_img.shape[0]), dtype=out_dtype)
