"""Batch- and prefill/decode-invariant causal attention (GQA), fp32 inside.

Layout: ``q`` ``[B, Hq, Sq, D]``, ``k`` ``[B, Hkv, Sk, D]``, ``v`` ``[B, Hkv, Sk, Dv]`` with
``Hq % Hkv == 0`` (query head ``h`` reads kv head ``h // (Hq // Hkv)``). The queries are the
*last* ``Sq`` positions of the ``Sk`` keys: query ``i`` sits at position ``Sk - Sq + i``. That one
rule covers a training/teacher-forced forward (``Sq == Sk``), a prefill and every decode step
over a KV cache (``Sq`` new tokens after ``Sk - Sq`` cached ones). With ``causal`` a query at
position ``t`` sees the keys ``0..t``; ``mask`` (bool, broadcastable to ``[B, Hq, Sq, Sk]``, True =
hidden, Megatron's convention) hides more.

The torch formulation (``"torch"`` backend), per (batch, head, query):

    s_j = tree_d(q_d * k_jd) * scale                   (fp32 products, aligned pairwise tree)
    m   = max over visible j of s_j                    (exact in any order)
    e_j = exp(s_j - m) if j visible else +0.0
    l   = tree_j(e_j);   p_j = e_j / l
    o_d = tree_j(p_j * v_jd)  (+0.0 where j is hidden)

The key-axis trees are anchored at key 0 and hidden keys are exact ``+0.0``, so by the zero
padding invariance of :mod:`minite_megatron.nvfp4.tree` a query's output is the same bits whether its key axis is
``t + 1`` long (decode) or ``T`` long with the rest masked (prefill/learner), and whatever the
batch size, the other sequences or the other queries in the call. Hidden keys cannot leak
non-finite values (they are selected away, not multiplied by zero). A query with no visible
key returns zeros. Visible non-finite values propagate (NaN).

A backend's ``bi_attention`` kernel where :func:`minite_megatron.nvfp4.backends.invariant_backend` has
one (Triton: one fixed KV-block order for prefill and decode; invariant by its own construction, not
bitwise equal to the torch one). Backward: the gradients of ordinary attention with the same
visibility (only forward values must agree between engines; O(S) memory, no ``[Sq, Sk]`` fp32
matrices). With the kernel's forward and no mask (the learner: causal, ``Sq == Sk``), bf16/fp16,
one head dim: torch's fused backward --
the cuDNN or flash op that SDPA picks for these inputs -- called directly on (q, k, v, O, LSE),
with the forward's own output and its log-sum-exp (:func:`fused_attention_backward`; issue 16:
the recompute cost a whole cuDNN forward per layer). Elsewhere (CPU, masks, fp32, causal with
``1 < Sq < Sk``, an op that refuses) and with ``MINITE_ATTENTION_BACKWARD=recompute``
(``settings().attention_backward``, :mod:`minite_megatron.settings`): the gradients of
:func:`sdpa_attention`, recomputing its forward for autograd's saved state. The two differ by
the bf16 rounding of the two forwards' outputs (:func:`minite_megatron.testing.attention_grad_gap_bound`).
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F

from ..nvfp4.backends import Backend, invariant_backend
from ..nvfp4.tree import tree_sum
from ..settings import settings

_CHUNK_ELEMENTS = 1 << 22


def _check(q, k, v, mask):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"strict attention: {name} must be 4-D [B, H, S, D], got {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"strict attention: {name} must be floating, got {t.dtype}")
    b, hq, sq, d = q.shape
    bk, hkv, sk, dk = k.shape
    if (bk, hkv, sk) != tuple(v.shape[:3]) or bk != b or dk != d:
        raise ValueError(f"strict attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"strict attention: {hq} query heads are not a multiple of {hkv} kv heads")
    if sq > sk:
        raise ValueError(f"strict attention: {sq} queries but only {sk} keys (queries are the last Sq positions)")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"strict attention: mask must be bool (True = hidden), got {mask.dtype}")
        try:
            torch.broadcast_shapes(tuple(mask.shape), (b, hq, sq, sk))
        except RuntimeError as e:
            raise ValueError(f"strict attention: mask {tuple(mask.shape)} does not broadcast to {(b, hq, sq, sk)}") from e


def visible_keys(b: int, hq: int, sq: int, sk: int, causal: bool, mask: torch.Tensor | None, device) -> torch.Tensor:
    """bool ``[B|1, Hq|1, Sq, Sk]``: which keys each query sees (True = visible)."""
    vis = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=device)
    if causal:
        qpos = torch.arange(sk - sq, sk, device=device)[:, None]
        vis = vis & (torch.arange(sk, device=device)[None, :] <= qpos)
    if mask is not None:
        vis = vis & ~mask
    return vis


def attention_torch(q, k, v, scale: float, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """The torch formulation (module docstring); returns fp32 ``[B, Hq, Sq, Dv]``."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    out = torch.zeros(b, hq, sq, dv, dtype=torch.float32, device=q.device)
    if min(b, hq, sq, sk) == 0:
        return out
    vis = visible_keys(b, hq, sq, sk, causal, mask, q.device).expand(b, hq, sq, sk).reshape(b * hq, sq, sk)
    qf = q.to(torch.float32).reshape(b * hq, sq, d)
    kf = k.to(torch.float32).repeat_interleave(group, dim=1).reshape(b * hq, sk, d)
    vf = v.to(torch.float32).repeat_interleave(group, dim=1).reshape(b * hq, sk, dv)
    out = out.view(b * hq, sq, dv)
    per_query = sk * max(d, dv, 1)
    if per_query * sq <= _CHUNK_ELEMENTS:
        heads, rows = max(1, _CHUNK_ELEMENTS // (per_query * sq)), sq
    else:
        heads, rows = 1, max(1, _CHUNK_ELEMENTS // per_query)
    for h0 in range(0, b * hq, heads):
        kk, vv = kf[h0 : h0 + heads], vf[h0 : h0 + heads]  # [n, Sk, D], [n, Sk, Dv]
        for q0 in range(0, sq, rows):
            qq = qf[h0 : h0 + heads, q0 : q0 + rows]  # [n, r, D]
            vs = vis[h0 : h0 + heads, q0 : q0 + rows]  # [n, r, Sk]
            s = tree_sum(qq[:, :, None, :] * kk[:, None, :, :], dim=-1) * scale  # [n, r, Sk]
            s = torch.where(vs, s, float("-inf"))
            m = torch.amax(s, dim=-1, keepdim=True)
            m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            e = torch.where(vs, torch.exp(s - m), 0.0)
            denom = tree_sum(e, dim=-1, keepdim=True)
            p = torch.where(denom > 0, e / denom, 0.0)
            pv = torch.where(vs[..., None], p[..., None] * vv[:, None, :, :], 0.0)  # [n, r, Sk, Dv]
            out[h0 : h0 + heads, q0 : q0 + rows] = tree_sum(pv, dim=2)
    return out.view(b, hq, sq, dv)


# [(weak reference to the mask, (version, sq, sk, shape), whether it hides a causally visible key)]: the last mask
_MASK_MEMO: list = [None]


def effective_mask(mask: torch.Tensor | None, sq: int, sk: int, causal: bool) -> torch.Tensor | None:
    """``mask`` (bool, True = hidden), or None when it hides no key that ``causal`` shows.

    The check is one reduction and a host read; it is remembered for the mask object (and its
    version), so the layers of one forward, which share the mask, pay it once. Under CUDA-graph
    capture (no host reads) the mask is kept as given.

    Raises:
        TypeError if ``mask`` is not bool.
    """
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be bool (True = hidden), got {mask.dtype}")
    if not causal:
        return mask
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return mask
    memo = _MASK_MEMO[0]
    key = (mask._version, sq, sk, tuple(mask.shape))
    if memo is not None and memo[0]() is mask and memo[1] == key:
        hides_visible = memo[2]
    else:
        hides_visible = bool((mask & visible_keys(1, 1, sq, sk, True, None, mask.device)).any())
        _MASK_MEMO[0] = (weakref.ref(mask), key, hides_visible)  # no strong reference to the mask
    return mask if hides_visible else None


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Ordinary (not batch-invariant) attention with this module's visibility rule, through torch's
    SDPA (flash / cuDNN / memory-efficient kernels on a GPU, the math backend on a CPU): the
    default-mode core attention (:mod:`minite_megatron.modules.attention`) and the backward of
    :func:`attention`.

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Sk, D]``; v: ``[B, Hkv, Sk, Dv]``; ``Hq % Hkv == 0``
            (GQA), ``Sq <= Sk``; any strides with a unit last stride.
        scale: the softmax scale.
        causal: queries see keys up to their own position (queries = the last Sq positions).
        mask: optional bool, True = hidden, broadcastable to ``[B, Hq, Sq, Sk]``.
        dropout_p: attention dropout probability (training).
    Returns:
        ``[B, Hq, Sq, Dv]`` in ``q.dtype``; rows with no visible key are zeros. Differentiable.
    Raises:
        ValueError for mismatched shapes; TypeError for a non-bool mask.
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if k.shape[0] != b or tuple(v.shape[:3]) != tuple(k.shape[:3]) or k.shape[3] != d:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} kv heads")
    if sq > sk:
        raise ValueError(f"attention: {sq} queries but {sk} keys (queries are the last Sq positions)")
    mask = effective_mask(mask, sq, sk, causal)
    if mask is None and (not causal or sq == 1):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=hkv != hq)
    if mask is None and sq == sk:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=hkv != hq)
    visible = ~mask if mask is not None else None
    if causal:
        cv = visible_keys(1, 1, sq, sk, True, None, q.device)
        visible = cv if visible is None else visible & cv
    if hkv != hq:  # the masked kernels take no GQA: repeat the kv heads
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout_p, scale=scale)
    none_visible = ~visible.any(-1, keepdim=True)
    return out.masked_fill(none_visible, 0.0)



# torch.nn.attention.SDPBackend values (torch._fused_sdp_choice returns them as ints) -> direct op
_SDPA_FLASH, _SDPA_CUDNN = 1, 3
_FAILED: set = set()  # (op, shape key) that raised once: the recompute path from then on


def direct_backward_op(q, k, v, mask, causal: bool, kernels: Backend | None):
    """``(op, is_causal)`` for the fused backward that can take (q, k, v, O, LSE) directly, or None.

    The switch (issue 16): ``settings().attention_backward`` (``MINITE_ATTENTION_BACKWARD``, read at
    each forward; :func:`minite_megatron.settings.overridden` for a block) ``"direct"`` (default) = this
    op where it can run; ``"recompute"`` = the previous path everywhere, a recompute of the forward
    through :func:`sdpa_attention` for autograd's saved state and then its backward.

    ``op`` is ``"cudnn"`` / ``"flash"`` (the op torch's SDPA itself picks for these inputs, so the
    backward kernel is the one the recompute path ran) or ``"flash_cpu"`` (CPU tensors with the
    Triton kernel interpreted: the tests). None -- the recompute path -- where a direct op cannot run
    or would compute something else; each condition says why. (No dropout here: the strict module
    refuses it and the aligned one runs SDPA itself when training with dropout.)
    """
    if settings().attention_backward != "direct":
        return None
    if kernels is None:  # only bi_attention returns the LSE (the torch formulation is the CPU reference)
        return None
    if mask is not None:  # the fused backwards take an additive bias at best, not our bool visibility
        return None
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if min(b, hq, sq, sk, d) == 0 or dv != d:  # empty calls; flash needs one head dim for q, k and v
        return None
    if causal and sq not in (1, sk):  # flash / cuDNN causal is the top-left diagonal: ours only when Sq == Sk
        return None                   # (a single query is the last position: it sees every key, non-causal)
    is_causal = causal and sq > 1
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float16):
        return None  # flash / cuDNN run bf16 / fp16 only
    if any(t.stride(-1) != 1 for t in (q, k, v)):  # their kernels need a unit head-dim stride
        return None
    if q.device.type == "cpu":
        op = "flash_cpu"
    else:
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=None, enable_gqa=hkv != hq)
        op = {_SDPA_CUDNN: "cudnn", _SDPA_FLASH: "flash"}.get(int(choice))
        if op is None:  # SDPA would run memory-efficient / math here (head dim, GPU): their LSE layouts differ
            return None
    if (op, _shape_key(q, k, v)) in _FAILED:
        return None
    return op, is_causal


def _shape_key(q, k, v):
    return tuple(q.shape), tuple(k.shape), q.dtype, q.device.type


_CUDNN_LSE_RANK: list = []  # the rank of the LSE torch's cuDNN forward returns (its backward expects the same)


def _cudnn_lse(lse: torch.Tensor) -> torch.Tensor:
    if not _CUDNN_LSE_RANK:  # [B, H, Sq, 1] in torch 2.11, [B, H, Sq] in later ones: ask the op's meta kernel
        t = torch.empty(1, 1, 2, 8, dtype=torch.bfloat16, device="meta")
        _CUDNN_LSE_RANK.append(torch.ops.aten._scaled_dot_product_cudnn_attention(t, t, t, None, True)[1].dim())
    return lse.unsqueeze(-1) if _CUDNN_LSE_RANK[0] == 4 else lse


def fused_attention_backward(op: str, grad_out, q, k, v, out, lse, scale: float, is_causal: bool):
    """``(dq, dk, dv)`` of attention at (q, k, v) from torch's fused backward ``op`` (see
    :func:`direct_backward_op`), given the forward's output ``out`` ([B, Hq, Sq, D], q's dtype) and
    log-sum-exp ``lse`` (fp32 [B, Hq, Sq], natural log); GQA: dk, dv have k's Hkv heads.

    The call is the one SDPA's own autograd makes: ``out`` allocated like q (``empty_like(q)``, as
    cuDNN's forward allocates O) and ``grad_out`` as it comes -- cuDNN keys its cached backward
    graphs on the q, k, v layouts only, so O and dO must not look different from SDPA's calls."""
    if grad_out.dtype != out.dtype:
        grad_out = grad_out.to(out.dtype)
    sq, sk = q.shape[2], k.shape[2]
    aten = torch.ops.aten
    if op == "cudnn":
        unused = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed / offset: no dropout
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, _cudnn_lse(lse), unused, unused, None, None, None, sq, sk, 0.0, is_causal,
            scale=scale)
    if op == "flash":
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, sq, sk, 0.0, is_causal, unused, unused, scale=scale)
    if op == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, is_causal,
                                                                         scale=scale)
    raise ValueError(f"fused_attention_backward: unknown op {op!r}")


def _recompute_grads(grad_out, q, k, v, mask, scale, causal):
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = sdpa_attention(qq, kk, vv, scale=scale, causal=causal, mask=mask)
        return torch.autograd.grad(out, (qq, kk, vv), grad_out.to(out.dtype))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, causal, kernels):
        direct = direct_backward_op(q, k, v, mask, causal, kernels) if any(ctx.needs_input_grad[:3]) else None
        ctx.direct, ctx.scale, ctx.causal = direct, scale, causal
        if direct is not None:
            out32, lse = kernels.bi_attention(q, k, v, mask, scale, causal, return_lse=True)
            out = torch.empty_like(q)  # the O layout cuDNN's own forward returns (see fused_attention_backward)
            out.copy_(out32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        if kernels is not None:
            out = kernels.bi_attention(q, k, v, mask, scale, causal)
        else:
            out = attention_torch(q, k, v, scale, causal, mask)
        ctx.save_for_backward(q, k, v, mask if mask is not None else torch.empty(0))
        ctx.has_mask = mask is not None
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.direct is not None:
            q, k, v, out, lse = ctx.saved_tensors
            op, is_causal = ctx.direct
            try:
                dq, dk, dv = fused_attention_backward(op, grad_out, q, k, v, out, lse, ctx.scale, is_causal)
            except torch.cuda.OutOfMemoryError:
                raise  # not a refusal (and the recompute needs more memory)
            except RuntimeError as e:  # an op that refuses these inputs after all: say so once, then recompute
                _FAILED.add((op, _shape_key(q, k, v)))
                warnings.warn(f"attention backward: torch's {op} backward refused q {tuple(q.shape)}, k {tuple(k.shape)}"
                              f" {q.dtype} ({str(e).splitlines()[0][:200]}); recomputing through SDPA for these shapes")
                dq, dk, dv = _recompute_grads(grad_out, q, k, v, None, ctx.scale, ctx.causal)
            return dq, dk, dv, None, None, None, None
        q, k, v, mask = ctx.saved_tensors
        mask = mask if ctx.has_mask else None
        dq, dk, dv = _recompute_grads(grad_out, q, k, v, mask, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batch- and prefill/decode-invariant attention (see the module docstring).

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Sk, D]``; v: ``[B, Hkv, Sk, Dv]``; bf16/fp16/fp32.
        scale: softmax scale (default ``1 / sqrt(D)``).
        causal: query ``i`` (position ``Sk - Sq + i``) sees keys ``<=`` its position.
        mask: optional bool, broadcastable to ``[B, Hq, Sq, Sk]``, True = hidden.
    Returns:
        ``[B, Hq, Sq, Dv]`` in ``q.dtype`` (computed in fp32, rounded once). Differentiable.
    Raises:
        ValueError / TypeError for bad shapes, dtypes or a mask that does not broadcast.
    """
    _check(q, k, v, mask)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    mask = effective_mask(mask, q.shape[2], k.shape[2], causal)  # same visibility, so the same bits
    backend = invariant_backend(q.device)
    kernels = backend if backend.supports("bi_attention") is None else None  # None: the torch formulation
    return _Attention.apply(q, k, v, mask, float(scale), bool(causal), kernels)
