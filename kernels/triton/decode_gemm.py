"""Decode (rollout) NVFP4 GEMM: M = 1..64 rows against *packed* FP4 weights.

Small-M GEMMs are memory-bound on the weight bytes, so this kernel reads the packed codes
(0.5 byte per weight) and E4M3 block scales (1/16 byte) instead of a bf16 image (2 bytes):
3.56x fewer bytes. Each weight tile is dequantized in registers to its exact bf16 image
(:func:`._decode_common.dequant_tile`: byte permutes, ~3 instructions per weight) and
multiplied on the tensor cores with the weights as the MMA's M side (swap-AB: ``out^T [N, M]
= W [N, K] @ x^T [K, M]``, M padded to ``M_PAD``).

Two configurations (:func:`select_config`):

* default (``batch_invariant=False``): K is split into ``SPLIT`` ranges so the grid fills the
  GPU; each program writes an fp32 partial and the last program of an N tile to finish (an
  atomic counter, acquire/release) adds the partials in split order (deterministic run to
  run) and applies the epilogue. Within ``nvfp4.fp32_accumulation_bound`` of the contract.
* strict (``batch_invariant=True``): no split; every program runs the whole K in 16-wide
  tensor-core steps from a zero accumulator, in K order -- the same chain of MMA steps on the
  same exact bf16 products as the learner's strict image GEMM (``gemm.STRICT_CONFIG``), so
  every row is meant to be bitwise equal to it for every M. Whether the tensor cores round
  the same way for the swapped operands and the smaller MMA shapes is a hardware fact that
  only the GPU can answer: ``STRICT_DECODE_VERIFIED`` records it, and the backend uses this
  configuration in strict mode only when it is True (tests compare the bits on the GPU).

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

from ._decode_common import decode_k_loop, dequant_tables, load_tables
from ._nvfp4_math import exact_launch, interpreting, round_to
from .gemm import OUT_DTYPES

MAX_M = 64
MAX_SPLIT = 32


@triton.jit(do_not_specialize=["SPLIT", "K_PER_SPLIT"])
def _decode_gemm_kernel(
    a_ptr, codes_ptr, scales_ptr, out_ptr, part_ptr, cnt_ptr, sa_ptr, sb_ptr, bias_ptr, lut_ptr,
    M, N, K, K_PER_SPLIT, s_am, s_om, SPLIT,
    SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, SPLIT_MAX: tl.constexpr,
    ASM: tl.constexpr, DOT_FP32: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_safe = rn % N
    rm = tl.arange(0, M_PAD)
    k_lo = pid_s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    codes_rows = codes_ptr + rn_safe[:, None].to(tl.int64) * (K // 2)
    scales_rows = scales_ptr + rn_safe[:, None].to(tl.int64) * (K // 16)
    a_rows = a_ptr + rm[None, :] * s_am
    m_ok = (rm < M)[None, :]
    acc = decode_k_loop(codes_rows, scales_rows, a_rows, m_ok, k_lo, k_hi, load_tables(lut_ptr),
                        BLOCK_N, BLOCK_K, M_PAD, EVEN_K, ASM, DOT_FP32, PREFETCH)

    is_last = SPLIT == 1
    if SPLIT > 1:
        part = part_ptr + pid_s * N * M + rn[:, None] * M + rm[None, :]
        tl.store(part, acc, mask=(rn < N)[:, None] & m_ok)
        done = tl.atomic_add(cnt_ptr + pid_n, 1)  # acq_rel: orders the partial stores
        is_last = done == SPLIT - 1
        if is_last:
            # all partials in one load (in flight together), summed in split order:
            # deterministic run to run
            sp = tl.arange(0, SPLIT_MAX)
            p = tl.load(part_ptr + sp[:, None, None] * N * M + rn[None, :, None] * M + rm[None, None, :],
                        mask=(sp < SPLIT)[:, None, None] & (rn < N)[None, :, None] & (rm < M)[None, None, :],
                        other=0.0, cache_modifier=".cg")
            acc = tl.sum(p, axis=0)
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
                 mask=m_ok & (rn < N)[:, None])


#: GPU launch parameters of the default configuration by padded M: tile, warps, stages,
#: register prefetch, and the programs per SM that the K split aims for. H200, 2026-12-02
#: (benchmarks/decode_gemm.py sweep): BLOCK_K = 128 won at every shape; BLOCK_K = 256 with
#: BLOCK_N = 64 (16 chained wgmma steps on a register operand) computed wrong values under
#: Triton 3.6 and is not used.
GPU_DECODE = {
    8: dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PREFETCH=False, per_sm=8),
    16: dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PREFETCH=False, per_sm=4),
    32: dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PREFETCH=False, per_sm=4),
    64: dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PREFETCH=False, per_sm=4),
}
#: The strict configuration: no split, the whole K per program, M always padded to 64 (the
#: MMA is m64 n64 k16 for every M: on the H200 a 64x8 MMA rounded differently from the
#: learner's 64x128 one in the last fp32 bits, 64x64 did not).
GPU_STRICT_DECODE = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PREFETCH=False, M_PAD=64, PAD_ROWS=True)
#: The decode kernels' dequantization asm in its element-wise form (``_decode_common``) has not
#: run on a GPU yet (written after the last device call of 2026-12-01, whose results exposed
#: the earlier form's layout dependence). Until ``tests/kernels/triton/test_triton_decode.py``
#: passes on a GPU and this is set True, the triton backend keeps its verified paths on CUDA
#: (the image GEMM; the learner's grouped GEMM on rows sorted on the device). The kernels
#: themselves stay callable (tests, benchmarks).
DECODE_GPU_VERIFIED = False
#: Set once the GPU has shown the strict configuration bitwise equal to the learner's strict
#: GEMM (``gemm.STRICT_CONFIG``) on random and adversarial data for M = 1..64 (see
#: ``benchmarks/decode_gemm.py --sections check``); until then strict mode keeps the image GEMM.
#: Evidence so far (H200, 2026-12-01, m64n64 MMA): rows of M = 16 and 64 bitwise equal in
#: fp32; M = 1, 3, 8, 33 equal in bf16 but not in the last fp32 bits -- the code Triton
#: generates depends on whether M is a multiple of 16, so strict launches now pad the rows to
#: ``M_PAD`` (:func:`launch_decode_gemm`); that padded form has not run on a GPU.
STRICT_DECODE_VERIFIED = False


def _m_pad(m: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(m))


def default_config(m: int, n: int, k: int, sm_count: int, entry: dict) -> dict:
    """A default-mode launch from a :data:`GPU_DECODE`-style entry: K split until the grid has
    ``per_sm`` programs per SM (at most :data:`MAX_SPLIT`, at least one K step per split)."""
    bn, bk = entry["BLOCK_N"], entry["BLOCK_K"]
    split = max(1, min(triton.cdiv(k, bk), MAX_SPLIT, entry["per_sm"] * sm_count // max(triton.cdiv(n, bn), 1)))
    cfg = {key: v for key, v in entry.items() if key not in ("per_sm", "min_m_pad")}
    return dict(cfg, M_PAD=_m_pad(m, entry.get("min_m_pad", 8)), SPLIT=split)


def select_config(m: int, n: int, k: int, sm_count: int, batch_invariant: bool) -> dict:
    """Launch parameters: BLOCK_N, BLOCK_K, M_PAD, SPLIT, num_warps, num_stages, PREFETCH."""
    if interpreting():
        # BLOCK_K = 16 and no split in strict mode: the interpreter's fp32 dot then adds exact
        # block partials in K order, the contract's order (the learner's strict GEMM there)
        if batch_invariant:
            return dict(BLOCK_N=16, BLOCK_K=16, M_PAD=_m_pad(m, 16), SPLIT=1, num_warps=4, num_stages=1)
        return dict(BLOCK_N=16, BLOCK_K=32, M_PAD=_m_pad(m, 16), SPLIT=max(1, min(2, k // 32)), num_warps=4,
                    num_stages=1, PREFETCH=True)
    if batch_invariant:
        return dict(GPU_STRICT_DECODE, SPLIT=1)
    return default_config(m, n, k, sm_count, GPU_DECODE[_m_pad(m, 8)])


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
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT"]
    if cfg.get("PAD_ROWS") and m % 16:
        # strict: run with M a multiple of 16 (zero rows), so the code is the same for every M
        mp = cfg["M_PAD"]
        a_pad = a.new_zeros(mp, k)
        a_pad[:m] = a
        sa = a_scale if a_scale.numel() == 1 else torch.cat([a_scale, a_scale.new_ones(mp - m)])
        out_pad = out.new_empty(mp, n)
        launch_decode_gemm(a_pad, b_codes, b_scales, sa, b_scale, bias, out_pad, dict(cfg, PAD_ROWS=False), asm)
        out.copy_(out_pad[:m])
        return
    k_per_split = triton.cdiv(triton.cdiv(k, bk), split) * bk
    split = triton.cdiv(k, k_per_split)
    num_n = triton.cdiv(n, bn)
    part = torch.empty((split, n, m) if split > 1 else (1,), dtype=torch.float32, device=a.device)
    cnt = split_counters(a.device, num_n) if split > 1 else part
    _decode_gemm_kernel[(num_n, split)](
        a, b_codes, b_scales, out, part, cnt, a_scale, b_scale, bias if bias is not None else b_scale,
        dequant_tables(a.device), m, n, k, k_per_split, a.stride(0), out.stride(0), split,
        SA_ROWS=a_scale.numel() != 1 or m == 1, SB_ROWS=b_scale.numel() != 1 or n == 1,
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0 and k_per_split % bk == 0,
        BLOCK_N=bn, BLOCK_K=bk, M_PAD=cfg["M_PAD"], SPLIT_MAX=triton.next_power_of_2(split),
        ASM=(not interpreting()) if asm is None else asm, DOT_FP32=interpreting(), PREFETCH=cfg.get("PREFETCH", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **exact_launch(),
    )


@torch.library.custom_op("minite::decode_gemm", mutates_args=())
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
