"""MoE decode GEMM on packed FP4 expert weights: rows routed to experts, unsorted.

``out[r] = round(fp32(s_a[r] * s_w[e]) * img_a[r] @ image(W[e])^T)`` with ``e = expert_ids[r]``:
the contract of ``nvfp4.grouped.decode_grouped_gemm_reference``. Only the selected experts'
weight bytes are read, once per (expert, N tile, K range), however many rows chose it.

No host sync, so a CUDA graph can capture it: the grid is fixed by R and E alone,
``(min(R, E) expert slots, N tiles, SPLIT)``. Every program reads the R expert ids (a few
hundred int32), counts the rows per expert (``tl.histogram``), and finds its slot's expert:
slot s takes the s-th expert (in index order) that some row chose; slots past the number of
distinct experts exit at once. Its rows are gathered from the ids in chunks of ``M_PAD``
(a one-hot reduction over R), the weight tile is dequantized in registers and multiplied with
the chunk on the tensor cores (:func:`._decode_common.decode_k_loop`, swap-AB), and the
outputs are scattered back to the rows' places.

Configurations: default (:data:`GPU_GROUPED_DECODE`) runs at most ``MAX_CHUNKS`` K steps per
program and splits K beyond that (fp32 partials ``[SPLIT, R, N]``, added in split order by the
last program of a (slot, N tile), an atomic counter); strict (``batch_invariant=True``, also the
default-mode engine's choice: ``RolloutEngine(invariant_gemm=True)``) runs the whole K per program
in the learner's strict chain of 16-wide MMA steps. A row whose expert id is outside ``[0, E)`` gets NaN (the eager entry
point raises before launching; inside a CUDA graph the NaN rows are the only signal).

Inputs: ``a_img`` bf16 ``[R, K]``; ``w_codes`` uint8 ``[E*N, K/2]``; ``w_scales`` uint8 (E4M3
bits) ``[E*N, K/16]`` linear; ``a_scale`` fp32 ``[R]``/``[1]``; ``w_scale`` fp32 ``[E]`` (one per
expert) or ``[E*N]`` (per row); ``expert_ids`` int32 ``[R]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.decode._decode_common import check_expert_weights, decode_k_loop, dequant_tables, load_tables, rolled_group, splits_k
from minite_kernels.triton.nvfp4._nvfp4_math import exact_launch, interpreting, round_to
from minite_kernels.triton.decode.decode_gemm import GPU_STRICT_DECODE, split_counters, strict_config
from minite_kernels.triton.nvfp4.gemm import OUT_DTYPES
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2


@triton.jit
def _slot_expert(ids_ptr, slot, R, E, R_POW2: tl.constexpr, E_POW2: tl.constexpr):
    """(ids [R_POW2] (-1 past R), valid mask, expert of this slot, its number of rows)."""
    r = tl.arange(0, R_POW2)
    ids = tl.load(ids_ptr + r, mask=r < R, other=-1)
    valid = (ids >= 0) & (ids < E)
    counts = tl.histogram(tl.where(valid, ids, 0), E_POW2, mask=valid)
    present = (counts > 0).to(tl.int32)
    sel = (present > 0) & (tl.cumsum(present, axis=0) == slot + 1)
    expert = tl.sum(tl.where(sel, tl.arange(0, E_POW2), 0), axis=0)
    rows = tl.sum(tl.where(sel, counts, 0), axis=0)
    return ids, valid, expert, rows


@triton.jit
def _chunk_rows(mine, pos, c0, R_POW2: tl.constexpr, M_PAD: tl.constexpr):
    """Row indices ``[M_PAD]`` of this expert's rows ``c0 .. c0 + M_PAD - 1`` (0 past its end)."""
    j = c0 + tl.arange(0, M_PAD)
    hit = mine[None, :] & (pos[None, :] == j[:, None])
    return tl.sum(tl.where(hit, tl.arange(0, R_POW2)[None, :], 0), axis=1)


@triton.jit(do_not_specialize=["SPLIT"])
def _decode_grouped_kernel(
    a_ptr, codes_ptr, scales_ptr, ids_ptr, out_ptr, part_ptr, cnt_ptr, sa_ptr, sw_ptr, lut_ptr,
    R, N, K, E, s_cn, s_sn, s_am, s_om, SPLIT,
    SA_ROWS: tl.constexpr, SW_ROWS: tl.constexpr, MASK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, NCHUNK: tl.constexpr, DEPTH: tl.constexpr,
    SPLIT_MAX: tl.constexpr, R_POW2: tl.constexpr, E_POW2: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr,
    GROUP: tl.constexpr = 0, ONE_SPLIT: tl.constexpr = False,
):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    num_n = tl.num_programs(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_safe = rn % N
    ids, valid, expert, n_rows = _slot_expert(ids_ptr, slot, R, E, R_POW2, E_POW2)

    if (slot == 0) & (pid_s == 0):
        # rows routed to no valid expert: NaN, never a silent value
        bad = ~valid & (tl.arange(0, R_POW2) < R)
        if tl.sum(bad.to(tl.int32), axis=0) > 0:
            rr = tl.arange(0, R_POW2)
            tl.store(out_ptr + rr[:, None] * s_om + rn[None, :],
                     tl.full((R_POW2, BLOCK_N), float("nan"), tl.float32).to(out_ptr.dtype.element_ty),
                     mask=bad[:, None] & (rn < N)[None, :])

    if n_rows > 0:
        mine = valid & (ids == expert)
        pos = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        wrow = expert.to(tl.int64) * N + rn_safe
        codes_rows = codes_ptr + wrow * s_cn
        scales_rows = scales_ptr + wrow * s_sn
        k_lo = pid_s * (NCHUNK * BLOCK_K)
        luts = load_tables(lut_ptr, rn_safe)
        if ONE_SPLIT:  # (the launch guarantees SPLIT == 1: no split-K code, fewer registers)
            is_last = True
        else:
            is_last = SPLIT == 1
        if splits_k(SPLIT, ONE_SPLIT):
            for c0 in range(0, n_rows, M_PAD):
                rows = _chunk_rows(mine, pos, c0, R_POW2, M_PAD)
                m_ok = (c0 + tl.arange(0, M_PAD) < n_rows)[None, :]
                acc = decode_k_loop(codes_rows, scales_rows, a_ptr + rows[None, :].to(tl.int64) * s_am, m_ok,
                                    k_lo, K, luts, BLOCK_N, BLOCK_K, M_PAD, NCHUNK, DEPTH, MASK_K, ASM, DOT_FP32, GROUP)
                tl.store(part_ptr + (pid_s * R + rows[None, :]).to(tl.int64) * N + rn[:, None], acc,
                         mask=m_ok & (rn < N)[:, None])
            done = tl.atomic_add(cnt_ptr + slot * num_n + pid_n, 1)  # acq_rel: orders the partials
            is_last = done == SPLIT - 1
        if is_last:
            if SW_ROWS:
                sw = tl.load(sw_ptr + wrow)
            else:
                sw = tl.full((BLOCK_N,), tl.load(sw_ptr + expert), tl.float32)
            for c0 in range(0, n_rows, M_PAD):
                rows = _chunk_rows(mine, pos, c0, R_POW2, M_PAD)
                row_ok = c0 + tl.arange(0, M_PAD) < n_rows
                m_ok = row_ok[None, :]
                if splits_k(SPLIT, ONE_SPLIT):
                    sp = tl.arange(0, SPLIT_MAX)
                    p = tl.load(part_ptr + ((sp[:, None, None] * R + rows[None, None, :]).to(tl.int64) * N
                                            + rn[None, :, None]),
                                mask=(sp < SPLIT)[:, None, None] & (rn < N)[None, :, None] & m_ok[None, :, :],
                                other=0.0, cache_modifier=".cg")
                    acc = tl.sum(p, axis=0)  # split order: deterministic run to run
                else:
                    acc = decode_k_loop(codes_rows, scales_rows, a_ptr + rows[None, :].to(tl.int64) * s_am, m_ok,
                                        k_lo, K, luts, BLOCK_N, BLOCK_K, M_PAD, NCHUNK, DEPTH, MASK_K, ASM, DOT_FP32, GROUP)
                if SA_ROWS:
                    sa = tl.load(sa_ptr + rows, mask=row_ok, other=1.0)
                else:
                    sa = tl.full((M_PAD,), tl.load(sa_ptr), tl.float32)
                out = acc * (sa[None, :] * sw[:, None])
                tl.store(out_ptr + rows[None, :].to(tl.int64) * s_om + rn[:, None],
                         round_to(out, out_ptr.dtype.element_ty, DOT_FP32), mask=m_ok & (rn < N)[:, None])
            if splits_k(SPLIT, ONE_SPLIT):
                tl.store(cnt_ptr + slot * num_n + pid_n, 0)  # leave the workspace zeroed


#: GPU launch of the default (split-K) configuration: tile (BLOCK_N weight rows x BLOCK_K per K
#: step), warps, K steps in flight (DEPTH) and the most K steps one program runs (MAX_CHUNKS; K is
#: split into ``cdiv(steps, MAX_CHUNKS)`` ranges): the fastest entry of
#: ``python -m benchmarks.kernels --sections decode_grouped_sweep`` (8 tokens x top-8 of 128 experts,
#: fc1 and fc2; BENCHMARKS.md). What bounds the kernel is the work per weight (dequantization and
#: layout changes), not the launch. The default-mode engine's MoE decode runs the integer-dot kernel
#: (``TritonOptions.idot_decode``), strict mode :data:`GPU_STRICT_GROUPED_DECODE`.
GPU_GROUPED_DECODE = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, DEPTH=4, MAX_CHUNKS=16)


def grouped_config(r: int, k: int, experts: int, entry: dict) -> dict:
    """A default-mode launch from a :data:`GPU_GROUPED_DECODE`-style entry: at most
    ``MAX_CHUNKS`` K steps per program, M padded for the expected rows per expert (>= 16, wgmma)."""
    slots = max(1, min(r, experts))
    bk = entry["BLOCK_K"]
    steps = cdiv(k, bk)
    nchunk = max(1, min(steps, entry["MAX_CHUNKS"]))
    m_pad = max(16, min(32, next_pow2(cdiv(r, slots))))
    return dict(BLOCK_N=entry["BLOCK_N"], BLOCK_K=bk, num_warps=entry["num_warps"], DEPTH=min(entry["DEPTH"], nchunk),
                NCHUNK=nchunk, SPLIT=cdiv(steps, nchunk), M_PAD=m_pad)


#: The strict (batch-invariant) launch: ``GPU_STRICT_DECODE``'s tile, the whole K per program in the
#: learner's chain of 16-wide wgmma steps (64 weight rows per program: wgmma; 32 rows compile to
#: mma.sync, whose bits differ). ``GROUP`` rolls the K steps into a loop of 2-step iterations
#: (:func:`._decode_common.decode_k_loop`: the same MMA chain; unrolled, the chain needs 255 registers
#: and spills at K = 2048 on sm_90a, the grouped kernel's routing state on top of the dense kernel's);
#: ``ONE_SPLIT`` compiles the split-K code, dead at one K range, out (128 instead of 210 registers at
#: K = 2048: 4 programs an SM instead of 2). Its bits equal the learner's strict grouped GEMM's at the
#: model's shapes (``tests/kernels/test_decode_strict_bitwise_gpu.py``); the fastest of the strict
#: launches compared (rolled by 4, Triton-pipelined K loops: slower), timed as ``strict_us`` by
#: ``python -m benchmarks.kernels --sections decode_grouped``.
GPU_STRICT_GROUPED_DECODE = dict(GPU_STRICT_DECODE, GROUP=2, ONE_SPLIT=True)


def select_config(r: int, n: int, k: int, experts: int, sm_count: int, batch_invariant: bool) -> dict:
    """Launch parameters (as :func:`.decode_gemm.select_config`; the grid counts expert slots)."""
    if interpreting():
        if batch_invariant:
            return dict(BLOCK_N=16, BLOCK_K=16, M_PAD=16, SPLIT=1, NCHUNK=cdiv(k, 16), DEPTH=2, num_warps=4)
        steps = cdiv(k, 32)
        split = max(1, min(2, steps))
        return dict(BLOCK_N=16, BLOCK_K=32, M_PAD=16, SPLIT=split, NCHUNK=cdiv(steps, split), DEPTH=1,
                    num_warps=4)
    if batch_invariant:
        return strict_config(16, k, GPU_STRICT_GROUPED_DECODE)
    return grouped_config(r, k, experts, GPU_GROUPED_DECODE)


def launch_decode_grouped(a, w_codes, w_scales, w_scale, expert_ids, a_scale, out, experts: int, cfg: dict,
                          asm: bool | None = None) -> None:
    """Run the kernel with launch parameters ``cfg`` (:func:`select_config` or a sweep's)."""
    r, k = a.shape
    n = out.shape[1]
    bn, bk, nchunk = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["NCHUNK"]
    split = cdiv(k, nchunk * bk)
    slots = min(r, experts)
    num_n = cdiv(n, bn)
    part = torch.empty((split, r, n) if split > 1 else (1,), dtype=torch.float32, device=a.device)
    cnt = split_counters(a.device, slots * num_n) if split > 1 else part
    _decode_grouped_kernel[(slots, num_n, split)](
        a, w_codes, w_scales, expert_ids, out, part, cnt, a_scale, w_scale, dequant_tables(a.device),
        r, n, k, experts, w_codes.stride(0), w_scales.stride(0), a.stride(0), out.stride(0), split,
        SA_ROWS=a_scale.numel() != 1 or r == 1, SW_ROWS=w_scale.numel() != experts or (n == 1 and experts == 1),
        MASK_K=k % (nchunk * bk) != 0, BLOCK_N=bn, BLOCK_K=bk, M_PAD=cfg["M_PAD"], NCHUNK=nchunk,
        DEPTH=cfg["DEPTH"], SPLIT_MAX=next_pow2(split), R_POW2=next_pow2(r),
        E_POW2=next_pow2(experts), ASM=(not interpreting()) if asm is None else asm,
        DOT_FP32=interpreting(), GROUP=rolled_group(nchunk, cfg.get("GROUP", 0)),
        ONE_SPLIT=split == 1 and bool(cfg.get("ONE_SPLIT", False)), num_warps=cfg["num_warps"], num_stages=1,
        **exact_launch(),
    )


@custom_op("minite::decode_grouped_gemm", mutates_args=())
def decode_grouped_gemm_op(
    a_img: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_scale: torch.Tensor,
    expert_ids: torch.Tensor,
    a_scale: torch.Tensor,
    experts: int,
    out_dtype: torch.dtype,
    batch_invariant: bool,
) -> torch.Tensor:
    """Rows of ``a_img [R, K]`` times their experts' ``[N, K]`` weights -> ``[R, N]``."""
    r, k = a_img.shape
    n = w_codes.shape[0] // experts
    out = torch.empty(r, n, dtype=out_dtype, device=a_img.device)
    if r == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    sms = torch.cuda.get_device_properties(a_img.device).multi_processor_count if a_img.is_cuda else 1
    a = a_img if a_img.stride(1) == 1 else a_img.contiguous()
    launch_decode_grouped(a, w_codes, w_scales, w_scale, expert_ids, a_scale, out, experts,
                          select_config(r, n, k, experts, sms, batch_invariant))
    return out


@decode_grouped_gemm_op.register_fake
def _(a_img, w_codes, w_scales, w_scale, expert_ids, a_scale, experts, out_dtype, batch_invariant):
    return a_img.new_empty((a_img.shape[0], w_codes.shape[0] // experts), dtype=out_dtype)


def decode_grouped_gemm_forward(a_img, w_codes, w_scales, w_scale, expert_ids, a_scale, experts: int,
                                out_dtype=torch.bfloat16, batch_invariant: bool = False) -> torch.Tensor:
    """Checked entry point of :func:`decode_grouped_gemm_op` (see the module docstring)."""
    if a_img.dim() != 2 or a_img.dtype != torch.bfloat16:
        raise ValueError(f"decode_grouped_gemm: a image must be bf16 [R, K], got {a_img.dtype} {tuple(a_img.shape)}")
    r, k = a_img.shape
    if k % 16:
        raise ValueError(f"decode_grouped_gemm: K must be a multiple of 16, got {k}")
    check_expert_weights("decode_grouped_gemm", k, w_codes, w_scales, w_scale, experts, a_scale, r, out_dtype,
                         OUT_DTYPES)
    return decode_grouped_gemm_op(a_img, w_codes.contiguous(), w_scales.contiguous().view(torch.uint8),
                                  w_scale.float().reshape(-1), expert_ids.to(torch.int32).reshape(-1),
                                  a_scale.float().reshape(-1), experts, out_dtype, batch_invariant)
