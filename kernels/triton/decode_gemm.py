"""Decode (rollout) NVFP4 GEMM: M = 1..64 rows against *packed* FP4 weights.

Small-M GEMMs are memory-bound on the weight bytes, so this kernel reads the packed codes
(0.5 byte per weight) and E4M3 block scales (1/16 byte) instead of a bf16 image (2 bytes):
3.56x fewer bytes. The weight tile is dequantized in registers to its exact bf16 image and
multiplied on the tensor cores with the weights as the MMA's M side (swap-AB: ``out^T [N, M]
= W [N, K] @ x^T [K, M]``), M padded to 16/32/64.

Parallelism: N / BLOCK_N tiles are too few to fill the GPU at decode shapes, so K is split
into ``SPLIT`` ranges; each program writes an fp32 partial, and the last program of an N tile
to finish (an atomic counter, acquire/release) loads all partials at once and adds them in
a fixed order (deterministic run to run) and applies the contract's epilogue
``fp32(s_a[m] * s_b[n]) * acc (+ bias)``, one rounding.

Accumulation order differs from the contract's canonical one (tensor-core order inside a K
range, then split order), within ``nvfp4.fp32_accumulation_bound``; strict (batch-invariant)
mode therefore never uses this kernel (see :mod:`.backend`).

Inputs: ``a_img`` bf16 ``[M, K]`` (M <= 64), ``b_codes`` uint8 ``[N, K/2]``, ``b_scales``
uint8 (E4M3 bits) ``[N, K/16]`` linear layout, ``a_scale`` fp32 ``[M]``/``[1]``, ``b_scale``
fp32 ``[N]``/``[1]``, ``bias`` ``[N]`` or None. Raises ValueError for M > 64 or bad shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._nvfp4_math import e2m1_value, e4m3_value, exact_launch, interpreting, round_to
from .gemm import OUT_DTYPES

MAX_M = 64
MAX_SPLIT = 16


@triton.jit(do_not_specialize=["SPLIT", "K_PER_SPLIT"])
def _decode_gemm_kernel(
    a_ptr, codes_ptr, scales_ptr, out_ptr, part_ptr, cnt_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K, K_PER_SPLIT, s_am, s_om, SPLIT,
    SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, SPLIT_MAX: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_safe = rn % N
    rm = tl.arange(0, M_PAD)
    k_lo = pid_s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        pk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        sk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        kk = k0 + tl.arange(0, BLOCK_K)
        packed = tl.load(codes_ptr + rn_safe[:, None].to(tl.int64) * (K // 2) + pk[None, :],
                         mask=(pk < k_hi // 2)[None, :], other=0).to(tl.int32)
        sf = tl.load(scales_ptr + rn_safe[:, None].to(tl.int64) * (K // 16) + sk[None, :],
                     mask=(sk < k_hi // 16)[None, :], other=0).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))
        w = tl.reshape(tl.reshape(e2m1_value(codes), (BLOCK_N, BLOCK_K // 16, 16)) * e4m3_value(sf)[:, :, None],
                       (BLOCK_N, BLOCK_K))
        x = tl.load(a_ptr + rm[None, :] * s_am + kk[:, None], mask=(rm < M)[None, :] & (kk < k_hi)[:, None],
                    other=0.0)
        if DOT_FP32:
            acc = tl.dot(w, x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(tl.bfloat16), x, acc)

    is_last = SPLIT == 1
    if SPLIT > 1:
        part = part_ptr + pid_s * N * M_PAD + rn[:, None] * M_PAD + rm[None, :]
        tl.store(part, acc, mask=(rn < N)[:, None])
        done = tl.atomic_add(cnt_ptr + pid_n, 1)  # acq_rel: orders the partial stores
        is_last = done == SPLIT - 1
        if is_last:
            # all partials in one load (independent, in flight together), summed in a fixed
            # order: deterministic run to run
            sp = tl.arange(0, SPLIT_MAX)
            p = tl.load(part_ptr + sp[:, None, None] * N * M_PAD + rn[None, :, None] * M_PAD + rm[None, None, :],
                        mask=(sp < SPLIT)[:, None, None] & (rn < N)[None, :, None], other=0.0, cache_modifier=".cg")
            acc = tl.sum(p, axis=0)
            tl.store(cnt_ptr + pid_n, 0)
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
                 mask=(rm < M)[None, :] & (rn < N)[:, None])


GPU_DECODE = {"block_n": 64, "warps": 4, "block_k": {16: 128, 32: 64, 64: 64}, "programs_per_sm": 2}
"""Decode launch parameters on the GPU (BLOCK_K by padded M; K is split until the grid has
``programs_per_sm`` programs per SM)."""


def select_config(m: int, n: int, k: int, sm_count: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, M_PAD, SPLIT, num_warps)."""
    m_pad = max(16, triton.next_power_of_2(m))
    if interpreting():
        return 16, 32, m_pad, max(1, min(2, k // 32)), 4
    block_n, block_k = GPU_DECODE["block_n"], GPU_DECODE["block_k"][m_pad]
    k_blocks = triton.cdiv(k, block_k)
    target = GPU_DECODE["programs_per_sm"] * sm_count
    split = max(1, min(k_blocks, MAX_SPLIT, target // max(triton.cdiv(n, block_n), 1)))
    return block_n, block_k, m_pad, split, GPU_DECODE["warps"]


@torch.library.custom_op("minite::decode_gemm", mutates_args=())
def decode_gemm_op(
    a_img: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a_img [M, K] @ dequant(b)[N, K]^T`` with the contract's epilogue, M <= 64 -> ``[M, N]``."""
    m, k = a_img.shape
    n = b_codes.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_img.device)
    if m == 0 or n == 0:
        return out
    sms = torch.cuda.get_device_properties(a_img.device).multi_processor_count if a_img.is_cuda else 1
    block_n, block_k, m_pad, split, warps = select_config(m, n, k, sms)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    split = triton.cdiv(k, k_per_split)
    num_n = triton.cdiv(n, block_n)
    part = torch.empty((split, n, m_pad) if split > 1 else (1,), dtype=torch.float32, device=a_img.device)
    cnt = torch.zeros(num_n if split > 1 else 1, dtype=torch.int32, device=a_img.device)
    a = a_img if a_img.stride(1) == 1 else a_img.contiguous()
    _decode_gemm_kernel[(num_n, split)](
        a, b_codes, b_scales, out, part, cnt, a_scale, b_scale, bias if bias is not None else b_scale,
        m, n, k, k_per_split, a.stride(0), out.stride(0), split,
        SA_ROWS=a_scale.numel() != 1 or m == 1, SB_ROWS=b_scale.numel() != 1 or n == 1,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, M_PAD=m_pad,
        SPLIT_MAX=triton.next_power_of_2(split),
        DOT_FP32=interpreting(), num_warps=warps, **exact_launch(),
    )
    return out


@decode_gemm_op.register_fake
def _(a_img, b_codes, b_scales, a_scale, b_scale, bias, out_dtype):
    return a_img.new_empty((a_img.shape[0], b_codes.shape[0]), dtype=out_dtype)


def decode_gemm_forward(a_img, b_codes, b_scales, a_scale, b_scale, bias=None, out_dtype=torch.bfloat16):
    """Checked entry point of :func:`decode_gemm_op` (see the module docstring)."""
    if a_img.dim() != 2 or a_img.shape[0] > MAX_M:
        raise ValueError(f"decode_gemm: a must be [M <= {MAX_M}, K], got {tuple(a_img.shape)}")
    k = a_img.shape[1]
    if b_codes.dim() != 2 or b_codes.shape[1] * 2 != k or b_scales.shape != (b_codes.shape[0], k // 16):
        raise ValueError(
            f"decode_gemm: b codes {tuple(b_codes.shape)} / scales {tuple(b_scales.shape)} do not match K={k}"
        )
    if a_img.dtype != torch.bfloat16:
        raise TypeError(f"decode_gemm: a image must be bfloat16, got {a_img.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"decode_gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    return decode_gemm_op(a_img, b_codes.contiguous(), b_scales.contiguous().view(torch.uint8),
                          a_scale.float().reshape(-1), b_scale.float().reshape(-1), bias, out_dtype)
