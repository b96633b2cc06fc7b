"""Pieces shared by the Triton image GEMMs (dense, grouped, wgrad): the K loop and the epilogue.

The K loop multiplies bf16 *images* (``e2m1 * e4m3``, exact in bf16) with fp32 accumulation.
Two accumulation modes:

* ``CANONICAL=False``: ``acc = tl.dot(a, b, acc)`` on ``BLOCK_K``-wide tiles, the tensor core
  adds in its own order (held to ``nvfp4.fp32_accumulation_bound``). On the H200 this is wgmma
  (SASS ``HGMMA``); under the interpreter it is fp32 ``np.matmul`` + one rounded add.
* ``CANONICAL=True``: the contract's own order. Each 16-element K block's partial product is
  computed alone (exact in fp32 whatever the instruction, see ``nvfp4.gemm``) and added to the
  accumulator with one round-to-nearest fp32 add (``add.rn.f32`` on the GPU, so the compiler
  can neither fuse it into the MMA nor into an FMA). Bitwise equal to the reference.

Under the interpreter ``tl.dot`` on bf16 is broken (TOOLCHAIN.md), so tiles are cast to fp32
first (``DOT_FP32``; exact for images) and ``input_precision="ieee"`` keeps fp32 exact.

Epilogue (the contract's order): ``out = (acc * fp32(s_a[m] * s_b[n])) (+ bias[n])``, one
rounding to the output dtype; launched with ``enable_fp_fusion=False``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rn(x, y, INLINE_ASM: tl.constexpr):
    """fp32 ``x + y`` rounded to nearest, never fused with a neighbouring multiply or MMA."""
    if INLINE_ASM:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return x + y


@triton.jit
def mma_tile(acc, a, b, DOT_FP32: tl.constexpr, CANONICAL: tl.constexpr):
    """``acc + a @ b`` for one K step of a tile. ``CANONICAL`` (a 16-wide step): the exact block
    partial is added with one round-to-nearest add; else the MMA accumulates in place.
    ``DOT_FP32`` (the interpreter): fp32 operands, IEEE products."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if CANONICAL:
        return add_rn(acc, tl.dot(a, b, input_precision="ieee" if DOT_FP32 else None), not DOT_FP32)
    else:
        return tl.dot(a, b, acc, input_precision="ieee" if DOT_FP32 else None)


@triton.jit
def mma_k_loop(
    a_base, b_base, a_rmask, b_cmask, k_start, k_end, s_ak, s_bk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, CANONICAL: tl.constexpr,
):
    """fp32 [BM, BN] = sum over k in [k_start, k_end) of A[:, k] * B[k, :].

    ``a_base``: [BM, 1] pointers to A's rows at k = 0; ``b_base``: [1, BN] pointers to B's
    columns (rows of the ``[N, K]`` operand) at k = 0; masks for the M / N tails. K tails are
    masked to zero (exact zeros add nothing).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if CANONICAL:
        offs_k = tl.arange(0, 16)
        for k0 in range(k_start, k_end, BLOCK_K):
            for j in tl.static_range(BLOCK_K // 16):
                kk = k0 + j * 16 + offs_k
                kmask = kk < k_end
                a = tl.load(a_base + kk[None, :] * s_ak, mask=a_rmask & kmask[None, :], other=0.0)
                b = tl.load(b_base + kk[:, None] * s_bk, mask=kmask[:, None] & b_cmask, other=0.0)
                if DOT_FP32:
                    p = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                else:
                    p = tl.dot(a, b)
                acc = add_rn(acc, p, not DOT_FP32)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_base + (k_start + offs_k)[None, :] * s_ak
        b_ptrs = b_base + (k_start + offs_k)[:, None] * s_bk
        for k0 in range(k_start, k_end, BLOCK_K):
            kmask = offs_k < k_end - k0
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * s_ak
            b_ptrs += BLOCK_K * s_bk
    return acc


@triton.jit
def epilogue(acc, sa, sb, bias, HAS_BIAS: tl.constexpr):
    """``acc * fp32(sa[:, None] * sb[None, :])`` then ``+ bias[None, :]`` (fp32, no FMA)."""
    out = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        out = out + bias[None, :]
    return out
