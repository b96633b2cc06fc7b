"""The decode step's q/k RMSNorm + RoPE + KV-cache write, one kernel for all heads of a step.

``qk_norm_rope_cache(mixed, ...)`` takes ``linear_qkv``'s output for ``B`` new tokens, ``mixed``
``[B, NG * (PER + 2) * D]`` (Megatron's layout: per query group ``PER`` query heads, one key, one
value head of ``D``), and for every row of ``D`` values

* query heads: ``q_layernorm`` then RoPE at the token's position, written to ``q`` ``[B, NG*PER, D]``;
* key heads: ``k_layernorm`` then RoPE, written into ``k_cache[pos[b], b, g]``;
* value heads: copied into ``v_cache[pos[b], b, g]``.

Reference (the learner's modules, :func:`minite_megatron.rollout.fused_ops.qk_norm_rope_reference`):
``SelfAttention.get_query_key_value_tensors``' split, the norms (strict / aligned RMSNorm,
:func:`.bi_rmsnorm.bi_rmsnorm` on the GPU), Megatron's ``_apply_rotary_pos_emb_bshd`` with the
tables ``cos = (cos(freqs) * mscale).to(dtype)``, ``sin`` likewise (precomputed by torch, read
per position), and the cache writes. Bit for bit:

1. **The norm is bi_rmsnorm's.** One program per row of ``D``, ``num_warps=4``,
   ``BLOCK = min(next_pow2(D), 4096)``, and phase 1 is bi_rmsnorm's reduction statement for
   statement (:mod:`.norm_quantize`'s phase 1, whose sm_90a PTX is pinned equal to bi_rmsnorm's:
   the same load expression, ``acc += x * x``, one ``tl.sum``, ``/ D``, ``div_rn(1, sqrt_rn(ms +
   eps))``; default compile options). ``tests/kernels/triton/decode/test_qk_norm_rope.py`` compares the
   reduction PTX with bi_rmsnorm's at the same ``D``. Then ``y = round(x * r * w)`` (``w`` the
   q or k weight, ``+ 1`` when zero-centered), element-wise.
2. **RoPE is Megatron's unfused bshd formula with its roundings**: over the first ``ROT``
   dimensions ``out = round(round(y * cos) + round(rotate_half(y) * sin))`` with
   ``rotate_half(y)[d] = -y[d + ROT/2]`` (``d < ROT/2``), ``y[d - ROT/2]`` (else); the partner
   element's ``y`` is computed by the same program from its own load (no shuffle). Products of
   two 16-bit values are exact in fp32, so each rounding is torch's; the roundings between the
   operations also keep FMA contraction from changing anything. Dimensions past ``ROT`` pass
   through. Only 16-bit dtypes (bf16, fp16) are taken: an fp32 model would need the products
   rounded apart from the add without the 16-bit rounding in between.
3. Under the interpreter (CPU tests) bf16 is rounded and loaded on the bits (its fp32 -> bf16
   cast truncates), as :mod:`.norm_quantize` does.

Not handled here (the caller's unfused path runs instead): interleaved rotary, fp32 models, a
norm other than the batch-invariant RMSNorm, ``D > 4096``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.custom_op import custom_op
from minite_kernels.triton.nvfp4._nvfp4_math import interpreting
from minite_kernels.triton.invariant.bi_rmsnorm import MAX_BLOCK
from minite_kernels.triton.nvfp4.norm_quantize import NORM_WARPS, _load_f32, round_half
from minite_kernels.triton._build._host import next_pow2


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
    H, sxm, sxh, eps,
    s_cos, sq_b, sq_h, sk_s, sk_b, sk_g, sv_s, sv_b, sv_g,
    PER: tl.constexpr, NG: tl.constexpr, ROT: tl.constexpr,
    NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr,
    IS_FP16: tl.constexpr, BITWISE_BF16: tl.constexpr,
):
    """One row of D per program (rows of ``mixed`` viewed as [B * NG * (PER + 2), D])."""
    # ---- phase 1: bi_rmsnorm's reduction, statement for statement (norm_quantize's phase 1)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    r = 1.0
    if NORM:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK):
            cols = h0 + lanes
            x = _load_f32(x_ptr + row * sxm + cols.to(tl.int64) * sxh, cols < H, BITWISE_BF16)
            acc += x * x
        ms = tl.sum(acc, axis=0) / H
        r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))

    # ---- phase 2: the row's role, its normalized values, RoPE, the store
    slot = row % (PER + 2)
    bg = row // (PER + 2)
    b = bg // NG
    g = bg % NG
    is_k = slot == PER
    is_v = slot == PER + 1
    cols = lanes
    cmask = cols < H
    x_row = x_ptr + row * sxm
    x = _load_f32(x_row + cols.to(tl.int64) * sxh, cmask, BITWISE_BF16)
    y = x
    if NORM:
        w = tl.where(is_k, tl.load(wk_ptr + cols, mask=cmask, other=0.0).to(tl.float32),
                     tl.load(wq_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
        if ZERO_CENTERED:
            w = w + 1.0
        _yb, yn = round_half(x * r * w, IS_FP16, BITWISE_BF16)
        y = tl.where(is_v, x, yn)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    out = y
    if ROT > 0:
        in_rot = cols < ROT
        pc = tl.where(cols < ROT // 2, cols + ROT // 2, cols - ROT // 2)
        xp = _load_f32(x_row + pc.to(tl.int64) * sxh, in_rot, BITWISE_BF16)
        yp = xp
        if NORM:
            wp = tl.where(is_k, tl.load(wk_ptr + pc, mask=in_rot, other=0.0).to(tl.float32),
                          tl.load(wq_ptr + pc, mask=in_rot, other=0.0).to(tl.float32))
            if ZERO_CENTERED:
                wp = wp + 1.0
            _pb, yp = round_half(xp * r * wp, IS_FP16, BITWISE_BF16)
        rot = tl.where(cols < ROT // 2, -yp, yp)
        c = _load_f32(cos_ptr + pos * s_cos + cols, in_rot, BITWISE_BF16)
        s = _load_f32(sin_ptr + pos * s_cos + cols, in_rot, BITWISE_BF16)
        _ab, a = round_half(y * c, IS_FP16, BITWISE_BF16)
        _bb, bsin = round_half(rot * s, IS_FP16, BITWISE_BF16)
        _ob, o = round_half(a + bsin, IS_FP16, BITWISE_BF16)
        out = tl.where(in_rot & (slot <= PER), o, y)
    bits, _v = round_half(out, IS_FP16, BITWISE_BF16)  # exact: out is a 16-bit value already
    val = bits.to(tl.int16)
    if slot < PER:
        dst = q_ptr.to(tl.pointer_type(tl.int16)) + b * sq_b + (g * PER + slot) * sq_h + cols
    elif is_k:
        dst = kc_ptr.to(tl.pointer_type(tl.int16)) + pos * sk_s + b * sk_b + g * sk_g + cols
    else:
        dst = vc_ptr.to(tl.pointer_type(tl.int16)) + pos * sv_s + b * sv_b + g * sv_g + cols
    tl.store(dst, val, mask=cmask)


@custom_op("minite::qk_norm_rope_cache", mutates_args=("k_cache", "v_cache"))
def qk_norm_rope_cache_op(
    mixed: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    zero_centered_gamma: bool, cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, groups: int, per: int,
) -> torch.Tensor:
    """Kernel launch (see :func:`qk_norm_rope_cache` for the arguments); returns ``q`` [B, NG*PER, D]."""
    b = mixed.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty(b, groups * per, d, dtype=mixed.dtype, device=mixed.device)
    if b == 0:
        return q
    rows = mixed.view(b * groups * (per + 2), d)
    norm = q_weight is not None
    rot = 0 if cos is None else cos.shape[-1]
    dummy = positions
    _qk_norm_rope_kernel[(rows.shape[0],)](
        rows, q_weight if norm else dummy, k_weight if norm else dummy,
        cos if rot else dummy, sin if rot else dummy, positions, q, k_cache, v_cache,
        d, rows.stride(0), rows.stride(1), eps,
        cos.stride(0) if rot else 0, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PER=per, NG=groups, ROT=rot, NORM=norm, ZERO_CENTERED=zero_centered_gamma,
        BLOCK=min(next_pow2(d), MAX_BLOCK), IS_FP16=mixed.dtype == torch.float16,
        BITWISE_BF16=interpreting() and mixed.dtype == torch.bfloat16, num_warps=NORM_WARPS,
    )
    return q


@qk_norm_rope_cache_op.register_fake
def _(mixed, q_weight, k_weight, eps, zero_centered_gamma, cos, sin, positions, k_cache, v_cache, groups, per):
    return mixed.new_empty(mixed.shape[0], groups * per, k_cache.shape[-1])


def qk_norm_rope_cache(
    mixed: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: int,
    per: int,
) -> torch.Tensor:
    """q/k norm + RoPE of the new tokens' heads, keys and values written into the cache.

    Args:
        mixed: ``[B, groups * (per + 2) * D]`` bf16 / fp16, unit stride along the last dim.
        q_weight, k_weight: ``[D]`` norm weights (both or neither: no qk-layernorm).
        eps, zero_centered_gamma: the norms' (bi_rmsnorm's arguments).
        cos, sin: ``[S, ROT]`` tables in ``mixed.dtype`` (``ROT`` even, ``<= D``), or None (no RoPE).
        positions: ``[B]`` int64, each ``< S`` and ``< k_cache.shape[0]``.
        k_cache, v_cache: ``[S, >= B, groups, D]`` in ``mixed.dtype`` (unit last stride); row ``b``'s
            key and value are written at ``[positions[b], b]``.
        groups, per: query groups and query heads per group.
    Returns:
        ``q`` ``[B, groups * per, D]`` (normalized, rotated).
    Raises:
        TypeError / ValueError for dtypes or shapes the kernel does not take (the caller's unfused
        path is the same computation).
    """
    if mixed.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"qk_norm_rope_cache: 16-bit activations only, got {mixed.dtype}")
    d = k_cache.shape[-1]
    if mixed.dim() != 2 or mixed.shape[1] != groups * (per + 2) * d or mixed.stride(1) != 1:
        raise ValueError(f"qk_norm_rope_cache: mixed {tuple(mixed.shape)} is not [B, {groups}*({per}+2)*{d}] "
                         "with unit last stride")
    if d > MAX_BLOCK:
        raise ValueError(f"qk_norm_rope_cache: head dim {d} > {MAX_BLOCK}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope_cache: give both norm weights or neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and tuple(w.shape) != (d,):
            raise ValueError(f"qk_norm_rope_cache: {name} {tuple(w.shape)} != ({d},)")
    if (cos is None) != (sin is None):
        raise ValueError("qk_norm_rope_cache: give both RoPE tables or neither")
    if cos is not None:
        if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] % 2 or cos.shape[1] > d or cos.dtype != mixed.dtype:
            raise ValueError(f"qk_norm_rope_cache: RoPE tables {tuple(cos.shape)} {cos.dtype} must be [S, ROT<= {d}] "
                             f"(ROT even) in {mixed.dtype}")
        cos, sin = cos.contiguous(), sin.contiguous()
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[1] < mixed.shape[0] or c.shape[2] != groups or c.stride(3) != 1 or c.dtype != mixed.dtype:
            raise ValueError(f"qk_norm_rope_cache: {name} {tuple(c.shape)} {c.dtype} must be [S, >= B, {groups}, {d}] "
                             f"{mixed.dtype} with unit last stride")
    return qk_norm_rope_cache_op(mixed, None if q_weight is None else q_weight.contiguous(),
                                 None if k_weight is None else k_weight.contiguous(), float(eps),
                                 bool(zero_centered_gamma), cos, sin, positions, k_cache, v_cache, int(groups), int(per))


def aot_kernel(d: int = 128, dtype: str = "bf16", per: int = 8, groups: int = 4):
    """The kernel as launched for bf16 heads of ``d`` (qk-norm and RoPE over all of ``d``),
    compiled for sm_90a on this machine (needs a process without ``TRITON_INTERPRET``)."""
    from minite_kernels.triton._build._aot import compile_for

    sig = {"x_ptr": f"*{dtype}", "wq_ptr": f"*{dtype}", "wk_ptr": f"*{dtype}", "cos_ptr": f"*{dtype}",
           "sin_ptr": f"*{dtype}", "pos_ptr": "*i64", "q_ptr": f"*{dtype}", "kc_ptr": f"*{dtype}",
           "vc_ptr": f"*{dtype}", "H": "i32", "sxm": "i32", "eps": "fp32", "s_cos": "i32", "sq_b": "i32",
           "sq_h": "i32", "sk_s": "i32", "sk_b": "i32", "sk_g": "i32", "sv_s": "i32", "sv_b": "i32", "sv_g": "i32"}
    ce = dict(PER=per, NG=groups, ROT=d, NORM=True, ZERO_CENTERED=False, BLOCK=min(next_pow2(d), MAX_BLOCK),
              IS_FP16=dtype == "fp16", BITWISE_BF16=False, sxh=1)
    return compile_for(_qk_norm_rope_kernel, sig, ce, num_warps=NORM_WARPS,
                       divisible=("H", "sxm", "s_cos", "sq_b", "sq_h", "sk_s", "sk_b", "sk_g", "sv_s", "sv_b", "sv_g"))
