"""Grouped (MoE) NVFP4 GEMM on Blackwell FP4 tensor cores (CuTe DSL), one launch for all experts.

Rows of ``a`` ``[M, K]`` are sorted by expert, ``group_sizes[g]`` rows for expert g; expert g
multiplies by ``b[g]`` (``[G, N, K]``, one global scale per expert)::

    out[m, n] = round_out(fp32(S_dec_a[m] * S_dec_b[g]) * acc[m, n] (+ bias[g, n]))

with the contract's epilogue order (:mod:`minite_megatron.nvfp4.grouped`). The group row
offsets live on the device (int32 ``[G + 1]``); M tiles are aligned to the whole row range,
and the kernel runs one CTA per (tile, expert) pair (:func:`pair_schedule`), so a tile
straddling k experts is reduced by k CTAs side by side, each over the full K once, and each
stores its expert's rows only: no padding of the tokens, no host loop, no CTA running
several full-K passes in a row. Empty experts cost nothing.

Operands (``torch.library`` op ``minite_cute::nvfp4_grouped_gemm``, CUDA, sm_100a / sm_103a):
    a_codes   uint8 ``[M, K/2]``; a_scales float8_e4m3fn swizzled ``[M, K/16]``; a_global fp32 ``[M]``.
    b_codes   uint8 ``[G, N, K/2]``; b_scales float8_e4m3fn, G per-group swizzled ``[N, K/16]``
              matrices back to back (:func:`.scales.grouped_weight_scales`); b_global fp32 ``[G]``.
    offsets   int32 ``[G + 1]``: 0, then the running sums of the group sizes (last == M); on the
              operands' device, or on the CPU (then checked without a sync and copied over).
    bias      ``[G, N]`` or None; out_dtype bfloat16 (default), float16 or float32.
Limits: K a positive multiple of 64, or of 32 on sm_103a (whose K = 96 kernel runs the same
schedule; see :mod:`.gemm`); G >= 1. Raises like :mod:`.gemm`, plus ValueError for
group sizes that are negative or do not sum to M, and (in the raw op) for offsets that do
not start at 0, decrease, or do not end at M. Host offsets (what :func:`nvfp4_grouped_gemm`
passes for host group sizes) are checked for free; device offsets are read back once (one
host sync), except while a CUDA graph is being captured (reading is impossible then; the
kernel still never writes a row at or past M).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minite_megatron.nvfp4 import NVFP4Tensor

from . import _host
from ._host import blackwell_arch, device_arch, tma_operand
from .gemm import _OUT_DTYPE_NAMES, _check_bias, _check_codes, _check_global, _check_out_dtype, check_output_size
from .scales import check_swizzled, grouped_weight_scales, operand_scales
from .tiles import MMA_K, GemmConfig, check_k, choose_mma_k, choose_tile_n
from ..custom_op import custom_op


def group_offsets(group_sizes: Sequence[int] | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """int32 ``[G + 1]`` running offsets.

    Host sizes (a list, or a CPU tensor) are checked here against ``rows`` and give host
    offsets: the raw op checks them again for free and copies them to the device without a
    sync. A tensor of sizes on ``device`` is summed there (no host sync); the raw op then
    checks the offsets (its one read-back), so a wrong sum is still an error, never rows left
    unwritten.
    """
    if isinstance(group_sizes, torch.Tensor) and group_sizes.device.type != "cpu" and group_sizes.numel():
        if group_sizes.dim() != 1 or group_sizes.dtype.is_floating_point or group_sizes.dtype == torch.bool:
            raise ValueError(
                f"grouped NVFP4 GEMM: group sizes must be a 1D integer tensor, got {group_sizes.dtype} "
                f"{tuple(group_sizes.shape)}"
            )
        sizes = group_sizes.to(device=device, dtype=torch.int64)
        return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).to(torch.int32)
    sizes = group_sizes.tolist() if isinstance(group_sizes, torch.Tensor) else [int(s) for s in group_sizes]
    if not sizes:
        raise ValueError("grouped NVFP4 GEMM: needs at least one group")
    if any(s < 0 for s in sizes):
        raise ValueError(f"grouped NVFP4 GEMM: negative group size in {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"grouped NVFP4 GEMM: group sizes sum to {sum(sizes)}, a has {rows} rows")
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    if offsets[-1] >= 2**31:
        raise ValueError(f"grouped NVFP4 GEMM: {offsets[-1]} rows exceed the int32 offsets")
    return torch.tensor(offsets, dtype=torch.int32)


def check_row_offsets(offsets: torch.Tensor, m: int, g: int) -> None:
    """Raise ``ValueError`` (one line naming ``offsets``) unless ``offsets`` is int32 ``[G + 1]``,
    starts at 0, never decreases and ends at M. Reads the values to the host (one sync for a
    CUDA tensor), except while the current CUDA stream is capturing a graph, where only the
    dtype and shape can be checked."""
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or tuple(offsets.shape) != (g + 1,):
        got = (offsets.dtype, tuple(offsets.shape)) if isinstance(offsets, torch.Tensor) else type(offsets).__name__
        raise ValueError(f"grouped NVFP4 GEMM: offsets must be int32 [G + 1] = [{g + 1}], got {got}")
    if offsets.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    values = offsets.tolist()
    if values[0] != 0:
        raise ValueError(f"grouped NVFP4 GEMM: offsets must start at 0, got offsets[0] = {values[0]}")
    drops = [i for i in range(g) if values[i + 1] < values[i]]
    if drops:
        i = drops[0]
        raise ValueError(
            f"grouped NVFP4 GEMM: offsets must not decrease, got offsets[{i}] = {values[i]} > "
            f"offsets[{i + 1}] = {values[i + 1]} (a negative group size)"
        )
    if values[g] != m:
        raise ValueError(f"grouped NVFP4 GEMM: offsets must end at M = {m} (the rows of a), got offsets[{g}] = {values[g]}")


def pair_schedule(offsets: torch.Tensor) -> torch.Tensor:
    """int32 ``[G + 1]``: the first (128-row tile, expert) pair of each expert, then their count.

    The grouped kernel runs one CTA per pair (:func:`._blockscaled_gemm_impl.pair_of_cta`).
    Pairs are numbered expert by expert, tile by tile: expert g owns the tiles
    ``offs[g] // 128 .. (offs[g+1] - 1) // 128`` (none if empty), so its first pair is
    ``ceil(offs[g] / 128)`` plus the number of earlier non-empty experts that start inside a
    tile (each adds one pair to the tile it shares). Computed on ``offsets``' device with torch
    ops: no host sync, capturable in a CUDA graph. The count is at most ``ceil(M / 128) + G - 1``.
    """
    o = offsets.to(torch.int64)
    starts, ends = o[:-1], o[1:]
    shares_a_tile = ((ends > starts) & (starts % 128 != 0)).to(torch.int64)
    earlier = torch.cat([o.new_zeros(1), shares_a_tile.cumsum(0)])
    return ((o + 127) // 128 + earlier).to(torch.int32)


def validate_grouped_operands(
    a_codes, a_scales, a_global, b_codes, b_scales, b_global, offsets, bias, out_dtype, mma_k: int = MMA_K
) -> tuple[int, int, int, int]:
    """Check the raw operands of the grouped op for the kernel with MMA K ``mma_k``; returns
    (M, N, K, G). Device-independent."""
    _check_codes(a_codes, "a_codes", 2)
    _check_codes(b_codes, "b_codes", 3)
    m, k = a_codes.shape[0], 2 * a_codes.shape[1]
    g, n = b_codes.shape[0], b_codes.shape[1]
    if 2 * b_codes.shape[2] != k:
        raise ValueError(f"grouped NVFP4 GEMM: K mismatch, a has K={k} and b has K={2 * b_codes.shape[2]}")
    if g < 1:
        raise ValueError("grouped NVFP4 GEMM: b has no groups")
    check_k(k, mma_k)
    check_swizzled(a_scales, m, k, 1, "a_scales")
    check_swizzled(b_scales, n, k, g, "b_scales")
    _check_global(a_global, "a_global", (m,))
    _check_global(b_global, "b_global", (g,))
    _check_bias(bias, (g, n))
    _check_out_dtype(out_dtype)
    check_output_size(m * n)
    if isinstance(offsets, torch.Tensor):
        # host offsets are allowed (checked without a sync, copied to the device by the op)
        host_offsets = offsets.device.type == "cpu" and a_codes.device.type != "cpu"
        tensors = [a_codes, a_scales, a_global, b_codes, b_scales, b_global] + ([] if host_offsets else [offsets])
        tensors += [bias] if bias is not None else []
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"grouped NVFP4 GEMM: operands on several devices: {sorted(map(str, devices))}")
    check_row_offsets(offsets, m, g)
    return m, n, k, g


@custom_op("minite_cute::nvfp4_grouped_gemm", mutates_args=())
def nvfp4_grouped_gemm_op(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    a_global: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    b_global: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fill: float | None = None,
) -> torch.Tensor:
    """The launch (see the module docstring). Raises BackendUnavailable off Blackwell."""
    mma_k = choose_mma_k(blackwell_arch(a_codes.device))
    m, n, k, g = validate_grouped_operands(
        a_codes, a_scales, a_global, b_codes, b_scales, b_global, offsets, bias, out_dtype, mma_k
    )
    arch = device_arch(a_codes.device)
    out = _host.new_output(m, n, dtype=out_dtype, device=a_codes.device, fill=fill)
    if m == 0 or n == 0:
        return out
    from . import _blockscaled_gemm_impl as impl

    offsets_dev = offsets.to(a_codes.device, non_blocking=True).contiguous()
    config = GemmConfig(
        tile_n=choose_tile_n(n),
        out_dtype=_OUT_DTYPE_NAMES[out_dtype],
        has_bias=bias is not None,
        grouped=True,
        mma_k=mma_k,
    )
    impl.launch(
        config,
        tma_operand(a_codes),
        tma_operand(b_codes),
        tma_operand(a_scales),
        tma_operand(b_scales),
        out,
        a_global.contiguous(),
        b_global.contiguous(),
        None if bias is None else bias.to(torch.float32).contiguous(),
        offsets_dev,
        m=m,
        n=n,
        k=k,
        groups=g,
        sb_strides=(0, 1),
        arch=arch,
        schedule=pair_schedule(offsets_dev),
    )
    return out


@nvfp4_grouped_gemm_op.register_fake
def _(a_codes, a_scales, a_global, b_codes, b_scales, b_global, offsets, bias, out_dtype, fill=None):
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[1]), dtype=out_dtype)


def nvfp4_grouped_gemm(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    group_sizes: Sequence[int] | torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fill: float | None = None,
) -> torch.Tensor:
    """MoE GEMM: ``a`` ``[M, K]`` (rows sorted by group), ``b`` ``[G, N, K]`` with
    ``global_scale="group"`` -> ``[M, N]``. Both operands need swizzled block scales
    (``q.swizzled()``); see the module docstring for limits and errors."""
    if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
        raise TypeError("nvfp4_grouped_gemm takes two NVFP4Tensor operands (quantize them first)")
    if b.global_scale != "group" or len(b.shape) != 3:
        raise ValueError("nvfp4_grouped_gemm: b must be a [G, N, K] tensor with global_scale='group'")
    for name, q in (("a", a), ("b", b)):
        if q.layout != "swizzled":
            raise ValueError(
                f"nvfp4_grouped_gemm: operand {name} has linear block scales; the Blackwell kernel reads "
                f"the 128x4 swizzled layout: pass {name}.swizzled()"
            )
    g = b.shape[0]
    if (isinstance(group_sizes, torch.Tensor) and group_sizes.numel() != g) or (
        not isinstance(group_sizes, torch.Tensor) and len(group_sizes) != g
    ):
        raise ValueError(f"nvfp4_grouped_gemm: {len(group_sizes)} group sizes for {g} groups")
    offsets = group_offsets(group_sizes, a.rows, a.device)
    return nvfp4_grouped_gemm_op(
        a.codes.reshape(a.rows, a.k // 2),
        operand_scales(a),
        a.row_global_decode().contiguous(),
        b.codes,
        grouped_weight_scales(b),
        b.global_decode.reshape(-1),
        offsets,
        bias,
        out_dtype,
        fill,
    )
