"""Decode (rollout) NVFP4 GEMM: M = 1..64 rows against *packed* FP4 weights.

Small-M GEMMs are memory-bound on the weight bytes, so this kernel reads the packed codes
(0.5 byte per weight) and E4M3 block scales (1/16 byte) instead of a bf16 image (2 bytes):
3.56x fewer bytes. Each weight tile is dequantized in registers to its exact bf16 image
(:func:`._decode_common.dequant_tile`: byte permutes, 2.5 instructions per weight) and
multiplied on the tensor cores with the weights as the MMA's M side (swap-AB: ``out^T [N, M]
= W [N, K] @ x^T [K, M]``, M padded to ``M_PAD``).

A program owns ``BLOCK_N`` weight rows and ``NCHUNK`` K steps of ``BLOCK_K`` (unrolled); the
loads of ``DEPTH`` steps are in flight before the first step is computed
(:func:`._decode_common.decode_k_loop`), so a one-wave grid has the whole weight matrix
requested at once. Two configurations (:func:`select_config`):

* default (``batch_invariant=False``): K is split into ``SPLIT`` ranges of ``NCHUNK`` steps so
  the grid fills the GPU; each program writes an fp32 partial and the last program of an N tile
  to finish (an atomic counter, acquire/release) adds the partials in split order
  (deterministic run to run) and applies the epilogue. Within ``nvfp4.fp32_accumulation_bound``
  of the contract.
* strict (``batch_invariant=True``): no split; every program runs the whole K in 16-wide
  tensor-core steps from a zero accumulator, in K order -- the same chain of MMA steps on the
  same exact bf16 products as the learner's strict image GEMM (``gemm.STRICT_CONFIG``), so
  every row is bitwise equal to it for every M. That the tensor cores round the same way for
  the swapped operands and the smaller MMA shapes is a hardware fact that only the GPU can
  answer: ``tests/kernels/test_decode_strict_bitwise_gpu.py`` checks it at the model's shapes.

Epilogue (the contract's order): ``fp32(s_a[m] * s_b[n]) * acc (+ bias)``, one rounding.

Inputs: ``a_img`` bf16 ``[M, K]`` (M <= 64), ``b_codes`` uint8 ``[N, K/2]``, ``b_scales``
uint8 (E4M3 bits) ``[N, K/16]`` linear layout, ``a_scale`` fp32 ``[M]``/``[1]``, ``b_scale``
fp32 ``[N]``/``[1]``, ``bias`` ``[N]`` or None. Raises ValueError for M > 64 or bad shapes.
The split-K counters live in a per-device workspace that every launch leaves zeroed: one
stream at a time per device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.decode._decode_common import decode_k_loop, dequant_tables, load_tables
from minite_kernels.triton.nvfp4._nvfp4_math import exact_launch, interpreting, round_to
from minite_kernels.triton.nvfp4.gemm import OUT_DTYPES
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2

MAX_M = 64
MAX_SPLIT = 32


@triton.jit(do_not_specialize=["SPLIT"])
def _decode_gemm_kernel(
    a_ptr, codes_ptr, scales_ptr, out_ptr, part_ptr, cnt_ptr, sa_ptr, sb_ptr, bias_ptr, lut_ptr,
    M, N, K, s_cn, s_sn, s_am, s_om, SPLIT,
    SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, NCHUNK: tl.constexpr, DEPTH: tl.constexpr,
    SPLIT_MAX: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_safe = rn if EVEN_N else rn % N  # rows past N read row rn % N (never stored)
    rm = tl.arange(0, M_PAD)
    k_lo = pid_s * (NCHUNK * BLOCK_K)
    codes_rows = codes_ptr + rn_safe.to(tl.int64) * s_cn
    scales_rows = scales_ptr + rn_safe.to(tl.int64) * s_sn
    a_rows = a_ptr + rm[None, :] * s_am
    m_ok = (rm < M)[None, :]
    acc = decode_k_loop(codes_rows, scales_rows, a_rows, m_ok, k_lo, K, load_tables(lut_ptr, rn_safe),
                        BLOCK_N, BLOCK_K, M_PAD, NCHUNK, DEPTH, MASK_K, ASM, DOT_FP32)

    is_last = SPLIT == 1
    out_mask = m_ok & (rn < N)[:, None]
    if SPLIT > 1:
        # partials [SPLIT, M, N] (like the output: stores and loads coalesced along N, padded
        # rows never written)
        tile = rm[None, :] * N + rn[:, None]
        tl.store(part_ptr + pid_s * M * N + tile, acc, mask=out_mask)
        done = tl.atomic_add(cnt_ptr + pid_n, 1)  # acq_rel: orders the partial stores
        is_last = done == SPLIT - 1
        if is_last:
            # every partial's load in flight together, then summed in split order: deterministic
            acc = tl.load(part_ptr + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            for sp in tl.static_range(1, SPLIT_MAX):
                acc += tl.load(part_ptr + sp * M * N + tile, mask=out_mask & (sp < SPLIT), other=0.0,
                               cache_modifier=".cg")
            tl.store(cnt_ptr + pid_n, 0)  # leave the workspace zeroed for the next launch
    if is_last:
        if SA_ROWS:
            sa = tl.load(sa_ptr + rm, mask=rm < M, other=1.0)
        else:
            sa = tl.full((M_PAD,), tl.load(sa_ptr), tl.float32)
        if SB_ROWS:
            sb = tl.load(sb_ptr + rn_safe)
        else:
            sb = tl.full((BLOCK_N,), tl.load(sb_ptr), tl.float32)
        out = acc * (sa[None, :] * sb[:, None])
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + rn_safe).to(tl.float32)[:, None]
        tl.store(out_ptr + rm[None, :] * s_om + rn[:, None], round_to(out, out_ptr.dtype.element_ty, DOT_FP32),
                 mask=out_mask)


#: GPU launch parameters of the default configuration: tile (BLOCK_N weight rows x BLOCK_K per
#: step), warps, the steps in flight per program (DEPTH), the most steps one program runs
#: (MAX_CHUNKS) and the programs per SM the K split aims for (``default_config``). M is padded
#: to >= 16 (wgmma; M_PAD 8 compiles to mma.sync, whose operand moves cost ~1 SASS instruction
#: per weight more). 2 steps per program, 4 programs per SM was the fastest entry of the sweep
#: (``python -m benchmarks.kernels --sections decode_sweep``; BENCHMARKS.md).
GPU_DECODE = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, DEPTH=2, MAX_CHUNKS=2, per_sm=4, min_m_pad=16)
#: The strict configuration: no split, the whole K per program (unrolled) in 16-wide wgmma steps
#: from a zero accumulator (the learner's strict chain), M padded to the next power of two >= 16
#: (``M_PAD`` None). Its bits equal the learner's strict GEMM's at the model's shapes
#: (``tests/kernels/test_decode_strict_bitwise_gpu.py``). M_PAD 64 would cost 4x the activation
#: tile (registers, shared memory) and spills at K = 4096 (CPU-AOT).
GPU_STRICT_DECODE = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, DEPTH=4, M_PAD=None)


def _m_pad(m: int, floor: int) -> int:
    return max(floor, next_pow2(m))


def default_config(m: int, n: int, k: int, sm_count: int, entry: dict) -> dict:
    """A default-mode launch from a :data:`GPU_DECODE`-style entry: the K split that gives the
    grid ``per_sm`` programs per SM with at most ``MAX_CHUNKS`` steps per program (at least one
    step per split, at most :data:`MAX_SPLIT` splits)."""
    bn, bk = entry["BLOCK_N"], entry["BLOCK_K"]
    steps = cdiv(k, bk)
    tiles = max(cdiv(n, bn), 1)
    split = max(1, min(steps, MAX_SPLIT, cdiv(entry["per_sm"] * sm_count, tiles)))
    nchunk = min(cdiv(steps, split), entry["MAX_CHUNKS"])
    split = cdiv(steps, nchunk)
    if split > MAX_SPLIT:  # very long K: more steps per program
        split = MAX_SPLIT
        nchunk = cdiv(steps, split)
    cfg = {key: v for key, v in entry.items() if key not in ("per_sm", "min_m_pad", "MAX_CHUNKS")}
    return dict(cfg, M_PAD=_m_pad(m, entry.get("min_m_pad", 16)), SPLIT=split, NCHUNK=nchunk)


def strict_config(m: int, k: int, entry: dict) -> dict:
    """A strict launch from a :data:`GPU_STRICT_DECODE`-style entry: one program per N tile runs
    the whole K (``M_PAD`` None: the natural padding, >= 16)."""
    mp = entry.get("M_PAD") or _m_pad(m, 16)
    return dict(entry, M_PAD=mp, SPLIT=1, NCHUNK=cdiv(k, entry["BLOCK_K"]))


def select_config(m: int, n: int, k: int, sm_count: int, batch_invariant: bool) -> dict:
    """Launch parameters: BLOCK_N, BLOCK_K, M_PAD, SPLIT, NCHUNK, DEPTH, num_warps."""
    if interpreting():
        # BLOCK_K = 16 and no split in strict mode: the interpreter's fp32 dot then adds exact
        # block partials in K order, the contract's order (the learner's strict GEMM there)
        if batch_invariant:
            return dict(BLOCK_N=16, BLOCK_K=16, M_PAD=_m_pad(m, 16), SPLIT=1, NCHUNK=cdiv(k, 16), DEPTH=2,
                        num_warps=4)
        steps = cdiv(k, 32)
        split = max(1, min(2, steps))
        return dict(BLOCK_N=16, BLOCK_K=32, M_PAD=_m_pad(m, 16), SPLIT=split, NCHUNK=cdiv(steps, split),
                    DEPTH=1, num_warps=4)
    if batch_invariant:
        return strict_config(m, k, GPU_STRICT_DECODE)
    return default_config(m, n, k, sm_count, GPU_DECODE)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 ``[n]`` zeros: the split-K arrival counters (a cached workspace that every launch
    leaves zeroed; a fresh buffer while a CUDA graph is being captured without one)."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf[:n]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    _COUNTERS[device] = buf
    return buf[:n]


def launch_decode_gemm(a, b_codes, b_scales, a_scale, b_scale, bias, out, cfg: dict, asm: bool | None = None) -> None:
    """Run the kernel with the launch parameters ``cfg`` (:func:`select_config` or a sweep's)."""
    m, k = a.shape
    n = b_codes.shape[0]
    bn, bk, nchunk = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["NCHUNK"]
    split = cdiv(k, nchunk * bk)  # (cfg's SPLIT, recomputed: NCHUNK steps per program cover K)
    num_n = cdiv(n, bn)
    part = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=a.device)
    cnt = split_counters(a.device, num_n) if split > 1 else part
    _decode_gemm_kernel[(num_n, split)](
        a, b_codes, b_scales, out, part, cnt, a_scale, b_scale, bias if bias is not None else b_scale,
        dequant_tables(a.device), m, n, k, b_codes.stride(0), b_scales.stride(0), a.stride(0), out.stride(0), split,
        SA_ROWS=a_scale.numel() != 1 or m == 1, SB_ROWS=b_scale.numel() != 1 or n == 1,
        HAS_BIAS=bias is not None, MASK_K=k % (nchunk * bk) != 0, EVEN_N=n % bn == 0,
        BLOCK_N=bn, BLOCK_K=bk, M_PAD=cfg["M_PAD"], NCHUNK=nchunk, DEPTH=cfg["DEPTH"],
        SPLIT_MAX=next_pow2(split), ASM=(not interpreting()) if asm is None else asm,
        DOT_FP32=interpreting(), num_warps=cfg["num_warps"], num_stages=1,
        **exact_launch(),
    )


@custom_op("minite::decode_gemm", mutates_args=())
def decode_gemm_op(
    a_img: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``a_img [M, K] @ dequant(b)[N, K]^T`` with the contract's epilogue, M <= 64 -> ``[M, N]``."""
    m, k = a_img.shape
    n = b_codes.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_img.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    sms = torch.cuda.get_device_properties(a_img.device).multi_processor_count if a_img.is_cuda else 1
    a = a_img if a_img.stride(1) == 1 else a_img.contiguous()
    launch_decode_gemm(a, b_codes, b_scales, a_scale, b_scale, bias, out,
                       select_config(m, n, k, sms, batch_invariant))
    return out


@decode_gemm_op.register_fake
def _(a_img, b_codes, b_scales, a_scale, b_scale, bias, out_dtype, batch_invariant=False):
    return a_img.new_empty((a_img.shape[0], b_codes.shape[0]), dtype=out_dtype)


def check_decode_args(a_img, b_codes, b_scales, out_dtype) -> None:
    if a_img.dim() != 2 or a_img.shape[0] > MAX_M:
        raise ValueError(f"decode_gemm: a must be [M <= {MAX_M}, K], got {tuple(a_img.shape)}")
    k = a_img.shape[1]
    if k % 16:
        raise ValueError(f"decode_gemm: K must be a multiple of 16, got {k}")
    if b_codes.dim() != 2 or b_codes.shape[1] * 2 != k or tuple(b_scales.shape) != (b_codes.shape[0], k // 16):
        raise ValueError(
            f"decode_gemm: b codes {tuple(b_codes.shape)} / scales {tuple(b_scales.shape)} do not match K={k}"
        )
    if a_img.dtype != torch.bfloat16:
        raise TypeError(f"decode_gemm: a image must be bfloat16, got {a_img.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"decode_gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def decode_gemm_forward(a_img, b_codes, b_scales, a_scale, b_scale, bias=None, out_dtype=torch.bfloat16,
                        batch_invariant=False):
    """Checked entry point of :func:`decode_gemm_op` (see the module docstring)."""
    check_decode_args(a_img, b_codes, b_scales, out_dtype)
    return decode_gemm_op(a_img, b_codes.contiguous(), b_scales.contiguous().view(torch.uint8),
                          a_scale.float().reshape(-1), b_scale.float().reshape(-1), bias, out_dtype,
                          batch_invariant)
