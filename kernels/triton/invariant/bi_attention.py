"""Batch- and prefill/decode-invariant causal attention (GQA), one fixed KV-block order.

Reference: :func:`minite_megatron.invariant.attention.attention_torch` (same semantics: the queries
are the last ``Sq`` of the ``Sk`` positions, causal visibility, optional bool mask with True =
hidden, fp32 softmax, zeros for a query with no visible key; a different fixed reduction order,
so not bitwise equal to it).

Layout: ``q`` [B, Hq, Sq, D], ``k`` [B, Hkv, Sk, D], ``v`` [B, Hkv, Sk, Dv] (any strides);
``mask`` None or bool broadcastable to [B, Hq, Sq, Sk]. Returns fp32 [B, Hq, Sq, Dv] and, with
``return_lse`` (the learner's forward, issue 16), the fp32 log-sum-exp [B, Hq, Sq] that torch's
fused attention backward takes instead of recomputing the forward: ``(m + log2 l) * ln 2`` from
the final online-softmax state, written after the output by the same program (a ``WITH_LSE``
constexpr), so the output is the same bits with or without it -- a rollout decode step without
the LSE still equals the learner's row.

Why a query's result is the same in prefill, decode and the learner (and whatever the batch):
- one program per (query block of ``BLOCK_M`` rows, batch x head); ``BLOCK_M``, ``BLOCK_N`` and
  the warp count are fixed for every call on a device (:data:`GPU_CONFIG`), so a query runs the same instructions whether it
  shares its tile with other queries (prefill/learner) or sits alone in it (decode);
- the KV blocks ``[0, BLOCK_N), [BLOCK_N, 2 BLOCK_N), ...`` are visited in that order from key 0,
  with the online-softmax update in log2 units (``c = scale * log2(e)``, ``s = qk * c``):
  ``m' = max(m, rowmax s)``, ``p = exp2(fma(qk, c, -m'))``, ``l' = l * exp2(m - m') + sum p``,
  ``acc' = acc * exp2(m - m') + p @ v``. A block whose keys are all hidden for a query leaves its
  state bitwise unchanged (``m' = m``, factor ``exp2(0) = 1``, ``p = 0``), so a prefill that walks
  further (for the tile's later queries) or a decode that stops at the query's own block give
  the same state; hidden keys inside the last block get ``p = 0`` in both;
- the blocks every row of a tile sees entirely (below the tile's first query, inside ``Sk``, no
  mask) run a loop without the visibility masks, the others the masked loop; both apply the
  same arithmetic to a visible score (the explicit ``fma`` leaves the compiler no contraction
  that could differ between them), so a block gives a query the same bits in either loop -- in
  decode a block may fall in the unmasked loop that the same query's prefill tile visits masked;
- no split-KV, no reduction across programs, no atomics.
Keys past ``Sk`` are masked loads of zeros. Values of keys that are hidden only causally (later
tokens in a prefill) enter ``p @ v`` with ``p = 0``: they must be finite (they are real tokens).
Under ``TRITON_INTERPRET=1`` tiles are cast to fp32 and multiplied with an explicit
product-and-sum (see :mod:`.bi_common`); on the GPU bf16/fp16
inputs use the tensor cores (``p`` rounded to the value dtype, as in flash attention) and fp32
inputs ``input_precision="ieee"``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.invariant.bi_common import interpreting, tile_dot
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2

#: (BLOCK_M, BLOCK_N, num_warps, num_stages): one config for every call on a GPU (the learner,
#: prefill and decode alike) -- flash-attention-sized tiles for the wgmma tensor cores; the
#: Triton interpreter (CPU tests) uses small tiles, invariant by the same argument. Issue 16
#: round 2 kept the tiles and moved from ``exp`` with the visibility masks on every block (9.0 ms
#: of the strict 16384-token step on the H200, cuDNN's forward 3.5 ms) to ``exp2`` of one ``fma``
#: and an unmasked loop for fully visible blocks: other bits than before (the learner and the
#: rollout engine share this kernel, so they still agree), the same invariance. Compiled for
#: sm_90a on a CPU: 175 registers (before: 161), no spills, 128 KB of shared memory (128-key
#: blocks: 243 registers and 160-224 KB, not taken).
GPU_CONFIG = (128, 64, 8, 3)
INTERPRETER_CONFIG = (32, 32, 4, 1)
LOG2E = 1.4426950408889634


def block_config() -> tuple[int, int, int, int]:
    """The (BLOCK_M, BLOCK_N, num_warps, num_stages) every call here uses."""
    return INTERPRETER_CONFIG if interpreting() else GPU_CONFIG


@triton.jit
def _attend_block(
    q, k_ptr, v_ptr, m_ptr, n0, offs_m, offs_d, offs_dv, qmask, qpos, m_i, l_i, acc, qk_scale,
    kbase, vbase, mbase, Sk, D, Dv, sks, skd, svs, svd, sms, smk,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CAST_FP32: tl.constexpr,
    PRECISION: tl.constexpr, AS_SUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """One KV block's online-softmax update. ``MASKED=False`` only for blocks every query row of
    the tile sees entirely (no key past ``Sk``, no causally hidden key, no mask): the same
    arithmetic on every visible score as the masked version, which is what keeps a query's state
    the same bits whichever of the two loops visits a block (decode == prefill)."""
    offs_n = n0 + tl.arange(0, BN)
    if MASKED:
        nmask = offs_n < Sk
        k = tl.load(k_ptr + kbase + offs_n[None, :].to(tl.int64) * sks + offs_d[:, None] * skd,
                    mask=nmask[None, :] & (offs_d < D)[:, None], other=0.0)  # [BD, BN]
        v = tl.load(v_ptr + vbase + offs_n[:, None].to(tl.int64) * svs + offs_dv[None, :] * svd,
                    mask=nmask[:, None] & (offs_dv < Dv)[None, :], other=0.0)  # [BN, BDV]
    else:
        k = tl.load(k_ptr + kbase + offs_n[None, :].to(tl.int64) * sks + offs_d[:, None] * skd,
                    mask=(offs_d < D)[:, None], other=0.0)
        v = tl.load(v_ptr + vbase + offs_n[:, None].to(tl.int64) * svs + offs_dv[None, :] * svd,
                    mask=(offs_dv < Dv)[None, :], other=0.0)
    if CAST_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tile_dot(q, k, tl.zeros((BM, BN), dtype=tl.float32), PRECISION, AS_SUM)
    s = qk * qk_scale  # log2 units
    if MASKED:
        vis = qmask[:, None] & nmask[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= qpos[:, None])
        if HAS_MASK:
            hidden = tl.load(m_ptr + mbase + offs_m[:, None].to(tl.int64) * sms + offs_n[None, :].to(tl.int64) * smk,
                             mask=qmask[:, None] & nmask[None, :], other=1)
            vis = vis & (hidden == 0)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(tl.fma(qk, qk_scale, -m_safe[:, None]))
    if MASKED:
        p = tl.where(vis, p, 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tile_dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, AS_SUM)
    return m_new, l_i, acc


@triton.jit
def _bi_attention_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, out_ptr, lse_ptr,
    Hq, Sq, Sk, D, Dv, GROUP, qk_scale,
    sqb, sqh, sqs, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    smb, smh, sms, smk,
    sob, soh, sos, sod,
    slb, slh, sls,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CAST_FP32: tl.constexpr, PRECISION: tl.constexpr, AS_SUM: tl.constexpr,
    WITH_LSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    qmask = offs_m < Sq
    qpos = Sk - Sq + offs_m
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
                + offs_m[:, None].to(tl.int64) * sqs + offs_d[None, :] * sqd,
                mask=qmask[:, None] & (offs_d < D)[None, :], other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)
    kbase = b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    vbase = b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    mbase = b.to(tl.int64) * smb + h.to(tl.int64) * smh
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BDV), dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(Sk, Sk - Sq + (pid_m + 1) * BM)
        lo = (Sk - Sq + pid_m * BM + 1) // BN * BN  # keys every row of the tile sees
    else:
        hi = Sk
        lo = Sk // BN * BN
    if HAS_MASK:
        lo = 0
    for n0 in range(0, lo, BN):
        m_i, l_i, acc = _attend_block(
            q, k_ptr, v_ptr, m_ptr, n0, offs_m, offs_d, offs_dv, qmask, qpos, m_i, l_i, acc, qk_scale,
            kbase, vbase, mbase, Sk, D, Dv, sks, skd, svs, svd, sms, smk,
            False, CAUSAL, HAS_MASK, CAST_FP32, PRECISION, AS_SUM, BM, BN,
        )
    for n0 in range(lo, hi, BN):
        m_i, l_i, acc = _attend_block(
            q, k_ptr, v_ptr, m_ptr, n0, offs_m, offs_d, offs_dv, qmask, qpos, m_i, l_i, acc, qk_scale,
            kbase, vbase, mbase, Sk, D, Dv, sks, skd, svs, svd, sms, smk,
            True, CAUSAL, HAS_MASK, CAST_FP32, PRECISION, AS_SUM, BM, BN,
        )
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0)
    tl.store(out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh
             + offs_m[:, None].to(tl.int64) * sos + offs_dv[None, :] * sod,
             out, mask=qmask[:, None] & (offs_dv < Dv)[None, :])
    if WITH_LSE:  # after the output, from the same final state: the output's arithmetic is untouched
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))
        tl.store(lse_ptr + b.to(tl.int64) * slb + h.to(tl.int64) * slh + offs_m.to(tl.int64) * sls, lse, mask=qmask)


def _launch(q, k, v, mask, scale, causal, out, lse):
    """Run the kernel into ``out`` (fp32 [B, Hq, Sq, Dv]) and, if not None, ``lse`` (fp32 [B, Hq, Sq])."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if min(b, hq, sq) == 0:
        return
    if sk == 0:  # no key at all: zeros, and the log of an empty sum (see bi_attention)
        out.zero_()
        if lse is not None:
            lse.fill_(float("inf"))
        return
    if dv == 0 and lse is None:
        return
    if mask is not None:
        mask = mask.expand(b, hq, sq, sk).view(torch.uint8)
        ms = mask.stride()
    else:
        ms = (0, 0, 0, 0)
    cast = interpreting() or q.dtype == torch.float32 or not (q.dtype == k.dtype == v.dtype)
    block_m, block_n, warps, stages = block_config()
    grid = (cdiv(sq, block_m), b * hq)
    _bi_attention_kernel[grid](
        q, k, v, mask if mask is not None else out, out, lse if lse is not None else out,
        hq, sq, sk, d, dv, hq // hkv, scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *ms, *out.stride(), *(lse.stride() if lse is not None else (0, 0, 0)),
        CAUSAL=causal, HAS_MASK=mask is not None, CAST_FP32=cast, PRECISION="ieee" if cast else "tf32", AS_SUM=interpreting(),
        WITH_LSE=lse is not None, BM=block_m, BN=block_n, BD=max(16, next_pow2(d)),
        BDV=max(16, next_pow2(dv)), num_warps=warps, num_stages=stages,
    )


@custom_op("minite::bi_attention", mutates_args=())
def _bi_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     causal: bool) -> torch.Tensor:
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3], dtype=torch.float32, device=q.device)
    _launch(q, k, v, mask, scale, causal, out, None)
    return out


@_bi_attention_op.register_fake
def _(q, k, v, mask, scale, causal):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=torch.float32)


@custom_op("minite::bi_attention_lse", mutates_args=())
def _bi_attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
    _launch(q, k, v, mask, scale, causal, out, lse)
    return out, lse


@_bi_attention_lse_op.register_fake
def _(q, k, v, mask, scale, causal):
    return (q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=torch.float32),
            q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32))


def bi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 scale: float | None = None, causal: bool = True, return_lse: bool = False):
    """Batch- and prefill/decode-invariant attention -> fp32 [B, Hq, Sq, Dv] (module docstring).

    With ``return_lse`` also the fp32 log-sum-exp [B, Hq, Sq] (contiguous): the natural log of
    ``sum_j exp(scale * q.k_j)`` over the visible keys, the softmax statistic torch's SDPA
    backends save for their backward; ``+inf`` for a query with no visible key (as flash
    attention stores it: a backward then recomputes probabilities ``exp(s - inf) = 0``, the
    gradient of that query's constant zero output). The output is the same bits with or without it.

    Raises ValueError for mismatched shapes, ``Sq > Sk`` or ``Hq % Hkv != 0``; TypeError for a
    non-bool mask.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("bi_attention: q, k, v must be 4-D [B, H, S, D]")
    b, hq, sq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"bi_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"bi_attention: {hq} query heads not a multiple of {k.shape[1]} kv heads")
    if sq > k.shape[2]:
        raise ValueError(f"bi_attention: {sq} queries but {k.shape[2]} keys")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"bi_attention: mask must be bool (True = hidden), got {mask.dtype}")
    scale = float(d ** -0.5 if scale is None else scale)
    if return_lse:
        return _bi_attention_lse_op(q, k, v, mask, scale, bool(causal))
    return _bi_attention_op(q, k, v, mask, scale, bool(causal))
