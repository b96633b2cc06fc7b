"""MoE weight-gradient GEMM on Blackwell FP4 tensor cores (CuTe DSL): groups along K.

The GEMM half of :func:`minite_megatron.nvfp4.grouped_wgrad_reference`: for token-major
operands quantized along tokens, ``a`` ``[N, T_pad]`` (``dY^T``) and ``b`` ``[K, T_pad]``
(``X^T``), expert g owns the columns ``cols_g`` (its padded size, a multiple of 16)::

    out[g, n, k] = round_out(fp32(S_dec_a[n] * S_dec_b[k]) * sum_{t in cols_g} a[n, t] b[k, t])

and an expert without tokens gets exact zeros. One launch: grid z = expert, the expert's
k-tile range read from device offsets. The kernel consumes 64-wide k-tiles and needs every
expert to start at a multiple of 64, so groups whose padded size is not a multiple of 64 are
first moved to 64-aligned columns, zero-filled (:func:`align_groups`): a zero code with a
zero block scale adds exactly nothing, so the contract's product is unchanged (checked
bitwise on a CPU against the reference).

Op ``minite_cute::nvfp4_grouped_wgrad_gemm`` (CUDA, sm_100a / sm_103a):
    a_codes uint8 ``[N, T/2]``, a_scales float8_e4m3fn swizzled ``[N, T/16]``, a_global fp32 ``[N]``;
    b_codes uint8 ``[K, T/2]``, b_scales swizzled ``[K, T/16]``, b_global fp32 ``[K]`` or ``[1]``;
    k_offsets int32 ``[G + 1]``: expert column offsets in units of 64 (last == T / 64).
    -> ``[G, N, K]`` in ``out_dtype`` (float32 by default, bfloat16, float16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from minite_megatron.nvfp4 import BLOCK, NVFP4Tensor

from . import _host
from ._host import device_arch, tma_operand
from .gemm import _OUT_DTYPE_NAMES, _check_codes, _check_global, _check_out_dtype, check_output_size
from .scales import check_swizzled, operand_scales
from .tiles import MMA_K, GemmConfig, check_k, choose_tile_n
from ..custom_op import custom_op


def _aligned_sizes(padded_group_sizes: Sequence[int], multiple: int = MMA_K) -> list[int]:
    return [-(-int(s) // multiple) * multiple for s in padded_group_sizes]


def align_groups(q: NVFP4Tensor, padded_group_sizes: Sequence[int], multiple: int = MMA_K) -> NVFP4Tensor:
    """``[rows, T_pad]`` operand whose K is split into groups (sizes multiples of 16) -> the same
    values with each group starting at a multiple of ``multiple``, gaps filled with zero codes
    and zero block scales. Returns ``q`` itself when every group size already is a multiple."""
    sizes = [int(s) for s in padded_group_sizes]
    if all(s % multiple == 0 for s in sizes):
        return q
    rows, k = q.rows, q.k
    codes = q.codes.reshape(rows, k // 2)
    scales = q.linear_scales().reshape(rows, k // BLOCK)
    # gather maps (destination column -> source column, or -1 for a zero) in 16-element units
    src_units, col = [], 0
    for size, aligned in zip(sizes, _aligned_sizes(sizes, multiple)):
        src_units += list(range(col // BLOCK, (col + size) // BLOCK)) + [-1] * ((aligned - size) // BLOCK)
        col += size
    units = torch.tensor(src_units, dtype=torch.int64, device=codes.device)
    units = torch.where(units < 0, k // BLOCK, units)  # the appended zero column
    zero_sf = torch.zeros(rows, 1, dtype=torch.uint8, device=codes.device)
    new_scales = torch.cat([scales.view(torch.uint8), zero_sf], 1).index_select(1, units).view(torch.float8_e4m3fn)
    byte_idx = (units.unsqueeze(1) * (BLOCK // 2) + torch.arange(BLOCK // 2, device=codes.device)).reshape(-1)
    zero_codes = torch.zeros(rows, BLOCK // 2, dtype=torch.uint8, device=codes.device)
    new_codes = torch.cat([codes, zero_codes], 1).index_select(1, byte_idx)
    new_k = len(src_units) * BLOCK
    return replace(
        q,
        codes=new_codes,
        block_scales=new_scales,
        shape=torch.Size([rows, new_k]),
        layout="linear",
        image=None,
    )


def validate_wgrad_operands(a_codes, a_scales, a_global, b_codes, b_scales, b_global, k_offsets, out_dtype):
    """Check the raw operands of the wgrad op; returns (N, K_out, T, G). Device-independent."""
    _check_codes(a_codes, "a_codes", 2)
    _check_codes(b_codes, "b_codes", 2)
    n, kout, t = a_codes.shape[0], b_codes.shape[0], 2 * a_codes.shape[1]
    if 2 * b_codes.shape[1] != t:
        raise ValueError(f"grouped wgrad GEMM: token mismatch, a has {t} columns and b has {2 * b_codes.shape[1]}")
    if t:
        check_k(t)
    if not isinstance(k_offsets, torch.Tensor) or k_offsets.dtype != torch.int32 or k_offsets.dim() != 1:
        raise ValueError("grouped wgrad GEMM: k_offsets must be a 1D int32 tensor of G + 1 offsets")
    g = k_offsets.numel() - 1
    if g < 1:
        raise ValueError("grouped wgrad GEMM: needs at least one group")
    check_swizzled(a_scales, n, t, 1, "a_scales")
    check_swizzled(b_scales, kout, t, 1, "b_scales")
    _check_global(a_global, "a_global", (n,))
    _check_global(b_global, "b_global", (kout, 1) if kout != 1 else (1,))
    _check_out_dtype(out_dtype)
    check_output_size(g * n * kout)
    devices = {x.device for x in (a_codes, a_scales, a_global, b_codes, b_scales, b_global, k_offsets)}
    if len(devices) != 1:
        raise ValueError(f"grouped wgrad GEMM: operands on several devices: {sorted(map(str, devices))}")
    if not (k_offsets.is_cuda and torch.cuda.is_current_stream_capturing()):
        values = k_offsets.tolist()  # one host sync; skipped while capturing a CUDA graph
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] != t // MMA_K:
            raise ValueError(
                f"grouped wgrad GEMM: k_offsets must rise from 0 to T / 64 = {t // MMA_K} (64-token "
                f"k-tiles), got {values[:8]}{' ...' if len(values) > 8 else ''}"
            )
    return n, kout, t, g


@custom_op("minite_cute::nvfp4_grouped_wgrad_gemm", mutates_args=())
def nvfp4_grouped_wgrad_gemm_op(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    a_global: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    b_global: torch.Tensor,
    k_offsets: torch.Tensor,
    out_dtype: torch.dtype,
    fill: float | None = None,
) -> torch.Tensor:
    """The launch (see the module docstring). Raises BackendUnavailable off Blackwell."""
    n, kout, t, g = validate_wgrad_operands(a_codes, a_scales, a_global, b_codes, b_scales, b_global, k_offsets, out_dtype)
    arch = device_arch(a_codes.device)
    if t == 0 or n == 0 or kout == 0:  # no tokens at all: every expert's gradient is zero
        return torch.zeros(g, n, kout, dtype=out_dtype, device=a_codes.device)
    out = _host.new_output(g, n, kout, dtype=out_dtype, device=a_codes.device, fill=fill)
    from . import _blockscaled_gemm_impl as impl

    config = GemmConfig(tile_n=choose_tile_n(kout), out_dtype=_OUT_DTYPE_NAMES[out_dtype], k_grouped=True)
    impl.launch(
        config,
        tma_operand(a_codes),
        tma_operand(b_codes),
        tma_operand(a_scales),
        tma_operand(b_scales),
        out,
        a_global.contiguous(),
        b_global.contiguous(),
        None,
        k_offsets.contiguous(),
        m=n,
        n=kout,
        k=t,
        groups=g,
        sb_strides=(1 if b_global.numel() == kout and kout != 1 else 0, 0),
        arch=arch,
    )
    return out


@nvfp4_grouped_wgrad_gemm_op.register_fake
def _(a_codes, a_scales, a_global, b_codes, b_scales, b_global, k_offsets, out_dtype, fill=None):
    return a_codes.new_empty((k_offsets.shape[0] - 1, a_codes.shape[0], b_codes.shape[0]), dtype=out_dtype)


def nvfp4_grouped_wgrad_gemm(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    padded_group_sizes: Sequence[int],
    out_dtype: torch.dtype = torch.float32,
    fill: float | None = None,
) -> torch.Tensor:
    """``out[g] = a[:, cols_g] @ b[:, cols_g].T`` -> ``[G, N, K]`` (see the module docstring).

    ``a`` ``[N, T_pad]`` and ``b`` ``[K, T_pad]`` are 2D NVFP4 tensors with ``"row"`` or
    ``"tensor"`` global scales, quantized along tokens; ``padded_group_sizes`` are multiples
    of 16 summing to ``T_pad``. Raises TypeError / ValueError for bad operands, then
    BackendUnavailable off Blackwell.
    """
    if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
        raise TypeError("nvfp4_grouped_wgrad_gemm takes two NVFP4Tensor operands (quantize them first)")
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ValueError(f"nvfp4_grouped_wgrad_gemm: operands must be 2D, got {tuple(a.shape)} and {tuple(b.shape)}")
    sizes = [int(s) for s in padded_group_sizes]
    if not sizes or any(s < 0 or s % BLOCK for s in sizes):
        raise ValueError(f"nvfp4_grouped_wgrad_gemm: padded group sizes must be non-negative multiples of {BLOCK}: {sizes}")
    if a.k != b.k or a.k != sum(sizes):
        raise ValueError(f"nvfp4_grouped_wgrad_gemm: operands have K={a.k} and K={b.k}, padded groups sum to {sum(sizes)}")
    for name, q in (("a", a), ("b", b)):
        if q.global_scale not in ("row", "tensor"):
            raise ValueError(f"nvfp4_grouped_wgrad_gemm: {name} needs a 'row' or 'tensor' global scale, got {q.global_scale!r}")
    a2, b2 = align_groups(a, sizes), align_groups(b, sizes)
    offsets = [0]
    for s in _aligned_sizes(sizes):
        offsets.append(offsets[-1] + s // MMA_K)
    k_offsets = torch.tensor(offsets, dtype=torch.int32).to(a.device)
    b_global = b2.global_decode if b2.global_scale == "tensor" else b2.row_global_decode()
    return nvfp4_grouped_wgrad_gemm_op(
        a2.codes.reshape(a2.rows, a2.k // 2),
        operand_scales(a2),
        a2.row_global_decode().contiguous(),
        b2.codes.reshape(b2.rows, b2.k // 2),
        operand_scales(b2),
        b_global.reshape(-1),
        k_offsets,
        out_dtype,
        fill,
    )
