"""The deterministic MoE combine in one pass: each token gathers its expert rows and adds them.

Reference: :func:`minite_megatron.modules.deterministic_moe.deterministic_unpermute_reference` and
:func:`minite_megatron.modules.deterministic_moe.ordered_sum_reference` (torch gathers, ``where``s and adds, one
launch per slot). The kernels compute the same sum with the same roundings, bit for bit:

    out[t] = round(... round(round(+0.0 + r_0) + r_1) ... + r_{c-1})

over the ``c`` rows of token ``t`` in increasing permuted position (for ``ordered_sum``: the
slots ``0..k-1``), each add in fp32 of two values of the rows' dtype and rounded to nearest even
to that dtype, which is what torch's elementwise add does on a CPU and on a GPU. A token without
rows gets ``+0.0``. Each output element is written by one program in that fixed order, so the
result depends on nothing but the token's rows (not on the batch, the tile or the device).

Rounding under the Triton interpreter: it converts fp32 to bf16 by truncation, so there the
per-add rounding to bf16 is written out on the bits (round half to even on the 16 dropped bits;
NaN kept). Conversions of values the target dtype represents exactly are exact either way.
fp16 rows run on a GPU only (the interpreter has no exact fp16 rounding here).

Backward of the combine: a gather, ``grad_rows[p] = grad_out[token(p)] + 0.0`` (no atomics). The
``+ 0.0`` gives the reference's bits: its gradient is accumulated into zeros, which turns a
``-0.0`` into ``+0.0`` (for ``ordered_sum`` only when ``k > 1``: with one slot nothing is added).

Ops (``torch.library``, namespace ``minite::``, with fake implementations):
``moe_sum_rows(src, order, bounds, k)`` and ``moe_gather_rows(src, index, k, rows, canonical)``.
Public functions: :func:`deterministic_unpermute`, :func:`ordered_sum` (the references'
signatures, differentiable) and :func:`token_rows` (the row lists of every token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.invariant.bi_common import interpreting
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2

SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_H = 2048


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``DTYPE``, returned as fp32."""
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _moe_sum_rows_kernel(
    src_ptr, order_ptr, bounds_ptr, out_ptr, H, s_row, s_slot, s_col, s_out,
    K: tl.constexpr, BLOCK_H: tl.constexpr, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    col_off = cols.to(tl.int64) * s_col
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)  # +0.0
    if K > 0:  # rows [T, K, H]: token t's slot j
        for j in tl.static_range(K):
            x = tl.load(src_ptr + t * s_row + j * s_slot + col_off, mask=cmask, other=0.0)
            acc = _round_to(acc + x.to(tl.float32), DTYPE, EMULATE_BF16)
    else:  # rows [P, H]: order[bounds[t]:bounds[t + 1]] are token t's rows, increasing
        begin = tl.load(bounds_ptr + t)
        end = tl.load(bounds_ptr + t + 1)
        for i in range(begin, end):
            row = tl.load(order_ptr + i).to(tl.int64)
            x = tl.load(src_ptr + row * s_row + col_off, mask=cmask, other=0.0)
            acc = _round_to(acc + x.to(tl.float32), DTYPE, EMULATE_BF16)
    tl.store(out_ptr + t * s_out + cols, acc.to(DTYPE), mask=cmask)


@triton.jit
def _moe_gather_rows_kernel(
    src_ptr, index_ptr, out_ptr, H, s_src, s_col, s_out,
    K: tl.constexpr, CANONICAL: tl.constexpr, BLOCK_H: tl.constexpr, DTYPE: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    if K > 0:
        t = p // K
    else:
        t = tl.load(index_ptr + p).to(tl.int64)
    x = tl.load(src_ptr + t * s_src + cols.to(tl.int64) * s_col, mask=cmask, other=0.0)
    if CANONICAL:
        x = (x.to(tl.float32) + 0.0).to(DTYPE)  # -0.0 -> +0.0 (exact otherwise)
    tl.store(out_ptr + p * s_out + cols, x, mask=cmask)


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _config(h: int) -> tuple[int, int]:
    block = min(next_pow2(max(h, 1)), MAX_BLOCK_H)
    return block, max(1, min(8, block // 256))  # 8 elements (16 bytes of bf16) per thread


def _check_dtype(dtype: torch.dtype, where: str) -> None:
    if dtype not in SUPPORTED:
        raise TypeError(f"{where}: rows of dtype {dtype} are not supported (one of {SUPPORTED})")
    if dtype == torch.float16 and interpreting():
        raise TypeError(f"{where}: fp16 rows need a GPU (the interpreter has no exact fp16 rounding)")


@custom_op("minite::moe_sum_rows", mutates_args=())
def _moe_sum_rows_op(src: torch.Tensor, order: torch.Tensor, bounds: torch.Tensor, k: int) -> torch.Tensor:
    if k > 0:
        t, _, h = src.shape
        s_row, s_slot, s_col = src.stride()
    else:
        t, h = bounds.shape[0] - 1, src.shape[1]
        (s_row, s_col), s_slot = src.stride(), 0
    out = torch.empty(t, h, dtype=src.dtype, device=src.device)
    if t and h:
        block, warps = _config(h)
        _moe_sum_rows_kernel[(t, cdiv(h, block))](
            src, order, bounds, out, h, s_row, s_slot, s_col, out.stride(0),
            K=k, BLOCK_H=block, DTYPE=_TL_DTYPE[src.dtype],
            EMULATE_BF16=interpreting() and src.dtype == torch.bfloat16, num_warps=warps,
        )
    return out


@_moe_sum_rows_op.register_fake
def _(src, order, bounds, k):
    t = src.shape[0] if k > 0 else bounds.shape[0] - 1
    return src.new_empty(t, src.shape[-1])


@custom_op("minite::moe_gather_rows", mutates_args=())
def _moe_gather_rows_op(src: torch.Tensor, index: torch.Tensor, k: int, rows: int, canonical: bool) -> torch.Tensor:
    h = src.shape[1]
    out = torch.empty(rows, h, dtype=src.dtype, device=src.device)
    if rows and h:
        block, warps = _config(h)
        _moe_gather_rows_kernel[(rows, cdiv(h, block))](
            src, index, out, h, src.stride(0), src.stride(1), out.stride(0),
            K=k, CANONICAL=canonical, BLOCK_H=block, DTYPE=_TL_DTYPE[src.dtype], num_warps=warps,
        )
    return out


@_moe_gather_rows_op.register_fake
def _(src, index, k, rows, canonical):
    return src.new_empty(rows, src.shape[1])


def token_rows(sorted_indices: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's rows: ``(order [P] int64, bounds [T + 1] int32)`` such that
    ``order[bounds[t]:bounds[t + 1]]`` are the permuted positions of token ``t``, increasing.

    No host synchronization on a GPU: indices outside ``[0, T)`` are caught by a device-side
    assertion there (it ends the CUDA context: Megatron's permutation never produces them) and by
    a ValueError on a CPU.
    """
    vals, order = torch.sort(sorted_indices.to(torch.int32), stable=True)
    probes = torch.arange(num_tokens + 1, dtype=torch.int32, device=vals.device)
    bounds = torch.searchsorted(vals, probes, out_int32=True)
    inside = (bounds[0] == 0) & (bounds[-1] == vals.numel())
    msg = f"deterministic_unpermute: sorted_indices outside [0, {num_tokens})"
    if vals.is_cuda:
        torch._assert_async(inside, msg)
    elif not bool(inside):
        raise ValueError(msg)
    return order, bounds


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, sorted_indices, num_tokens):
        order, bounds = token_rows(sorted_indices, num_tokens)
        ctx.save_for_backward(sorted_indices)
        return _moe_sum_rows_op(permuted, order, bounds, 0)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return _moe_gather_rows_op(grad, index, 0, index.shape[0], True), None, None


class _OrderedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows):
        ctx.k = rows.shape[1]
        empty = rows.new_empty(0, dtype=torch.int32)
        return _moe_sum_rows_op(rows, empty, empty, ctx.k)

    @staticmethod
    def backward(ctx, grad):
        t, h = grad.shape
        empty = grad.new_empty(0, dtype=torch.int32)
        flat = _moe_gather_rows_op(grad, empty, ctx.k, t * ctx.k, ctx.k > 1)
        return flat.view(t, ctx.k, h)


def deterministic_unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[P, H]`` rows, ``[P]`` token of each row -> ``[T, H]`` in ``permuted.dtype``: each token's
    rows added in increasing row order from ``+0.0`` (module docstring). Differentiable.

    Raises ValueError for mismatched shapes (and, on a CPU, indices outside ``[0, T)``),
    TypeError for a dtype other than bf16 / fp16 / fp32."""
    if permuted.dim() != 2 or sorted_indices.shape != (permuted.shape[0],):
        raise ValueError(f"deterministic_unpermute: permuted {tuple(permuted.shape)} vs indices {tuple(sorted_indices.shape)}")
    _check_dtype(permuted.dtype, "deterministic_unpermute")
    if permuted.shape[0] == 0:
        return permuted.new_zeros(num_tokens, permuted.shape[1])
    return _Unpermute.apply(permuted, sorted_indices, int(num_tokens))


def ordered_sum(rows: torch.Tensor) -> torch.Tensor:
    """``[T, k, H]`` -> ``[T, H]`` in ``rows.dtype``: ``((+0 + rows[:, 0]) + rows[:, 1]) + ...``, one
    rounding per add (module docstring). Any strides. Differentiable; no host synchronization.

    Raises ValueError if ``rows`` is not 3-D, TypeError for an unsupported dtype."""
    if rows.dim() != 3:
        raise ValueError(f"ordered_sum: rows must be [T, k, H], got {tuple(rows.shape)}")
    _check_dtype(rows.dtype, "ordered_sum")
    if rows.shape[1] == 0:
        return rows.new_zeros(rows.shape[0], rows.shape[2])
    return _OrderedSum.apply(rows)
