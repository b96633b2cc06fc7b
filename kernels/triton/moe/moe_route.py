"""MoE routing of a decode step in one kernel: router logits -> top-k -> probabilities -> the
expert-major row layout the grouped expert GEMMs and the combine read.

``moe_route(logits, k)`` for fp32 logits ``[T, E]`` (``T`` tokens of a decode step) returns
:class:`Route`:

* the selection and probabilities of :func:`minite_megatron.modules.router.topk_routing` (softmax
  over the top-k logits, no pre-softmax; the strict and the aligned router's function), bit for
  bit: the top-k is stable (the larger logit first, ties to the lower expert index; the
  padding experts never win), then ``m = max``, ``e_j = exp(v_j - m)`` in the selection order,
  ``l`` = the aligned pairwise tree over ``e_0 .. e_{k-1}`` (zero padded to a power of two:
  :mod:`minite_megatron.nvfp4.tree`'s order; a sum of two values does not depend on how the
  reduction is laid out), ``p_j = e_j / l`` (IEEE division, ``0`` where ``l == 0``), times the
  scaling factor if one is given. ``exp`` is libdevice's ``expf`` on the GPU (the function torch's
  CUDA ``exp`` calls; no flush to zero), numpy's under the interpreter (then the probabilities
  may differ from torch's CPU ``exp`` by an ulp: the CPU path of the rollout engine runs the torch
  reference instead);
* the rows of Megatron's expert-major permutation (experts in increasing index, tokens in
  increasing index within an expert): ``ids`` (expert of each row), ``tokens``, ``probs``
  ``[T * k]``; ``sizes`` ``[E]`` int32 (rows per expert) and ``offsets`` ``[E + 1]`` int32 (their
  prefix sums: what the grouped GEMM reads); and ``combine`` ``[T * k]`` int32, the
  row of token ``t``'s ``j``-th expert in increasing expert order at ``t * k + j`` -- the order in
  which the deterministic combine (:func:`minite_megatron.modules.deterministic_moe.ordered_sum`) adds them.

One program holds all ``T x E`` logits (``T * E <= MAX_ELEMENTS``); the layout is a counting
sort (column sums of the routing map, their exclusive prefix, the ranks within a column). No
host synchronization: CUDA-graph capturable. NaN logits route somewhere in range (never out of
bounds); their probabilities are NaN.

Reference: :func:`minite_megatron.rollout.fused_ops.moe_route_reference` (the learner's
``topk_routing`` and the permutation in torch).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from minite_kernels.custom_op import custom_op
from minite_megatron.nvfp4.moe_reference import Route
from minite_kernels.triton.nvfp4._nvfp4_math import interpreting
from minite_kernels.triton._build._host import next_pow2

#: Largest T * E (padded to powers of two) one program routes.
MAX_ELEMENTS = 16384
#: Largest k.
MAX_TOPK = 32
#: libdevice without flush-to-zero (nvcc's default for torch's kernels).
LAUNCH = {"enable_reflect_ftz": False}


@triton.jit
def _pair_level(s, T_P: tl.constexpr, W: tl.constexpr):
    """One level of the aligned pairwise tree: [T_P, W] -> [T_P, W // 2], adjacent pairs."""
    return tl.sum(tl.reshape(s, [T_P, W // 2, 2]), axis=2)


@triton.jit
def _moe_route_kernel(
    logits_ptr, ids_ptr, tok_ptr, probs_ptr, comb_ptr, sizes_ptr, offs_ptr,
    T, E, s_t, s_e, scaling,
    K: tl.constexpr, T_P: tl.constexpr, E_P: tl.constexpr, K_P: tl.constexpr,
    HAS_SCALING: tl.constexpr, ACCURATE_EXP: tl.constexpr,
):
    t = tl.arange(0, T_P)[:, None]
    e = tl.arange(0, E_P)[None, :]
    real = (t < T) & (e < E)
    x = tl.load(logits_ptr + t.to(tl.int64) * s_t + e * s_e, mask=real, other=float("-inf"))
    taken = (e >= E) | (t < 0)  # [T_P, E_P]; padding experts are never selected
    jj = tl.arange(0, K_P)[None, :]
    vals = tl.zeros((T_P, K_P), tl.float32)
    idxs = tl.zeros((T_P, K_P), tl.int32)
    # ---- the stable top-k: the largest remaining logit, ties to the lowest index
    for j in tl.static_range(K):
        cand = tl.where(taken, float("-inf"), x)
        m = tl.max(cand, axis=1)
        idx = tl.min(tl.where((cand == m[:, None]) & ~taken, e, E_P), axis=1)
        first_free = tl.min(tl.where(taken, E_P, e), axis=1)
        idx = tl.where(idx >= E_P, first_free, idx)  # NaN rows: any free expert, never out of range
        v = tl.max(tl.where(e == idx[:, None], x, float("-inf")), axis=1)
        v = tl.where(m != m, m, v)
        taken = taken | (e == idx[:, None])
        vals = tl.where(jj == j, v[:, None], vals)
        idxs = tl.where(jj == j, idx[:, None], idxs)
    # ---- softmax over the k selected logits (invariant.softmax.softmax: max, exp, tree sum, divide)
    sel = jj < K
    mx = tl.max(tl.where(sel, vals, float("-inf")), axis=1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    z = vals - mx[:, None]
    if ACCURATE_EXP:
        ex = libdevice.exp(z)
    else:
        ex = tl.exp(z)
    ex = tl.where(sel, ex, 0.0)
    s = ex
    if K_P >= 32:
        s = _pair_level(s, T_P, 32)
    if K_P >= 16:
        s = _pair_level(s, T_P, 16)
    if K_P >= 8:
        s = _pair_level(s, T_P, 8)
    if K_P >= 4:
        s = _pair_level(s, T_P, 4)
    if K_P >= 2:
        s = _pair_level(s, T_P, 2)
    s = tl.sum(s, axis=1) + 0.0  # [T_P, 1] -> [T_P] (one element)
    p = tl.div_rn(ex, s[:, None])
    p = tl.where(s[:, None] > 0, p, 0.0)
    if HAS_SCALING:
        p = p * scaling
    # ---- the probability of each (token, expert), the routing map
    pgrid = tl.zeros((T_P, E_P), tl.float32)
    for j in tl.static_range(K):
        pj = tl.sum(tl.where(jj == j, p, 0.0), axis=1)
        ij = tl.sum(tl.where(jj == j, idxs, 0), axis=1)
        pgrid = tl.where(e == ij[:, None], pj[:, None], pgrid)
    routed = taken & real
    r = routed.to(tl.int32)
    # ---- expert-major rows: a counting sort by expert, tokens in order within an expert
    sizes = tl.sum(r, axis=0)  # [E_P]
    start = tl.cumsum(sizes, axis=0) - sizes
    row = start[None, :] + (tl.cumsum(r, axis=0) - r)  # [T_P, E_P]
    tl.store(ids_ptr + row, (e + t * 0).to(tl.int32), mask=routed)
    tl.store(tok_ptr + row, (t + e * 0).to(tl.int32), mask=routed)
    tl.store(probs_ptr + row, pgrid, mask=routed)
    slot = tl.cumsum(r, axis=1) - r  # a token's experts in increasing index
    tl.store(comb_ptr + t * K + slot, row, mask=routed)
    tl.store(sizes_ptr + tl.arange(0, E_P), sizes, mask=tl.arange(0, E_P) < E)
    tl.store(offs_ptr + 1 + tl.arange(0, E_P), start + sizes, mask=tl.arange(0, E_P) < E)
    tl.store(offs_ptr + tl.arange(0, 1), tl.zeros((1,), tl.int32))


def fits(tokens: int, experts: int, topk: int) -> bool:
    """Can one program route ``tokens`` x ``experts`` with this ``topk``?"""
    return (0 < topk <= min(experts, MAX_TOPK)
            and next_pow2(max(tokens, 1)) * next_pow2(experts) <= MAX_ELEMENTS)


@custom_op("minite::moe_route", mutates_args=())
def moe_route_op(logits: torch.Tensor, k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                           torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel launch (:func:`moe_route`); ``scaling == 0`` means none."""
    t, e = logits.shape
    dev = logits.device
    ids = torch.empty(t * k, dtype=torch.int32, device=dev)
    tok = torch.empty(t * k, dtype=torch.int32, device=dev)
    probs = torch.empty(t * k, dtype=torch.float32, device=dev)
    comb = torch.empty(t * k, dtype=torch.int32, device=dev)
    sizes = torch.empty(e, dtype=torch.int32, device=dev)
    offsets = torch.empty(e + 1, dtype=torch.int32, device=dev)
    if t == 0:
        return ids, tok, probs, comb, sizes.zero_(), offsets.zero_()
    interp = interpreting()
    t_p, e_p = next_pow2(t), next_pow2(e)
    _moe_route_kernel[(1,)](
        logits, ids, tok, probs, comb, sizes, offsets, t, e, logits.stride(0), logits.stride(1), float(scaling),
        K=k, T_P=t_p, E_P=e_p, K_P=next_pow2(k), HAS_SCALING=bool(scaling),
        ACCURATE_EXP=not interp, num_warps=8 if t_p * e_p >= 4096 else 4, **({} if interp else LAUNCH),
    )
    return ids, tok, probs, comb, sizes, offsets


@moe_route_op.register_fake
def _(logits, k, scaling):
    t, e = logits.shape
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty(t * k, **i32), logits.new_empty(t * k, **i32), logits.new_empty(t * k),
            logits.new_empty(t * k, **i32), logits.new_empty(e, **i32), logits.new_empty(e + 1, **i32))


def moe_route(logits: torch.Tensor, k: int, scaling_factor: float | None = None) -> Route:
    """Route ``logits`` ``[T, E]`` fp32 to their top-``k`` experts (see the module docstring).

    Raises:
        TypeError for non-fp32 logits; ValueError for a shape one program cannot route
        (:func:`fits`) or a bad ``k``.
    """
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise TypeError(f"moe_route: logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    t, e = logits.shape
    if not fits(t, e, k):
        raise ValueError(f"moe_route: {t} tokens x {e} experts, top-{k} does not fit one program "
                         f"(T*E <= {MAX_ELEMENTS} padded, k <= {MAX_TOPK})")
    if scaling_factor is not None and not scaling_factor:
        raise ValueError("moe_route: a scaling factor of 0")
    return Route(*moe_route_op(logits, int(k), float(scaling_factor or 0.0)))
