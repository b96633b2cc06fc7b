"""The decode step's fused ops: one Triton kernel each on the GPU, a torch reference elsewhere.

Each op computes what the learner's modules compute for the same tokens, bit for bit (the
kernels' tests compare them with these references on fresh data and on the hard cases):

* :func:`moe_route`: router logits -> stable top-k -> softmax probabilities -> Megatron's
  expert-major rows (``minite_kernels.triton.moe.moe_route``; reference :func:`moe_route_reference`:
  :func:`minite_megatron.modules.router.topk_routing`, the strict / aligned router's function,
  and the permutation in torch);
* :func:`combine_rows`: the deterministic MoE combine of expert-major rows
  (:func:`minite_megatron.modules.deterministic_moe.ordered_sum`'s order; ``minite_kernels.triton.moe.moe_combine``);
* :func:`rope_tables`: the ``cos`` / ``sin`` tables of Megatron's unfused RoPE, computed once by
  torch (``(cos(freqs) * mscale).to(dtype)``, what ``_apply_rotary_pos_emb_bshd`` computes per call),
  read per position by ``minite_kernels.triton.decode.qk_norm_rope``.

Which backend runs them is the caller's choice, made once (:func:`fused_backend`: the decode step
holds it and hands it to each op here): :func:`~minite_megatron.nvfp4.backends.kernel_backend`'s
for the model's device -- CUDA tensors; CPU tensors only with ``kernels_on_cpu=True`` under
``TRITON_INTERPRET=1`` (tests, ``benchmarks.kernels._decode_count``) -- or None
(``fused_kernels=False``: no fused kernel; each op runs the learner's modules or its torch
reference). The CPU path of the engine otherwise runs the references: on a CPU the learner's own
torch ops are the oracle (the interpreter's ``exp`` is numpy's, not torch's).
"""

from __future__ import annotations

import torch

from ..nvfp4.backends import Backend, invariant_backend, kernel_backend
from ..nvfp4.moe_reference import Route, ordered_sum_reference


def fused_backend(device: torch.device | str, *, fused_kernels: bool = True,
                  kernels_on_cpu: bool = False) -> Backend | None:
    """The backend whose fused decode kernels run on ``device`` (its ``supports(op)`` then says
    which): :func:`kernel_backend` ``(device, kernels_on_cpu)``; None with ``fused_kernels=False``
    (the learner's modules and the ops' torch references only: tests compare the two)."""
    return kernel_backend(device, kernels_on_cpu) if fused_kernels else None


def use_kernels(backend: Backend | None, op: str, **shape) -> bool:
    """Does ``op`` run on a fused kernel of ``backend`` (:func:`fused_backend`'s choice; ``shape``:
    its operand facts)?"""
    return backend is not None and backend.supports(op, **shape) is None


def norm_fuses(backend: Backend | None, device: torch.device | str) -> bool:
    """Is the learner's batch-invariant RMSNorm on ``device`` the ``bi_rmsnorm`` of ``backend``
    (:func:`fused_backend`'s choice; the arithmetic its fused norms reproduce: q/k norm + RoPE, the
    residual add + RMSNorm -> NVFP4)? ``invariant_backend`` runs the learner's norm."""
    if backend is None:
        return False
    learner = invariant_backend(device)
    return backend.name == learner.name and learner.supports("bi_rmsnorm") is None


def rope_tables(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[S, ROT]`` in ``dtype`` from Megatron's RoPE frequencies ``[S, 1, 1, ROT]``:
    ``(torch.cos(freqs) * mscale).to(dtype)`` as ``_apply_rotary_pos_emb_bshd`` computes them
    (element-wise, so a row is the same whatever the length of the table)."""
    f = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    return (torch.cos(f) * mscale).to(dtype).contiguous(), (torch.sin(f) * mscale).to(dtype).contiguous()


# ---- MoE routing ---------------------------------------------------------------------------------
def route_supported(router, tokens: int, routing: Backend) -> bool:
    """Can :func:`moe_route` stand in for ``router``'s forward on ``tokens`` tokens? The strict or
    aligned router (batch-invariant fp32 gating, :func:`topk_routing`) with a softmax after the
    top-k, no expert bias, not training (no aux losses, no jitter), and a shape ``routing`` (the
    :func:`kernel_backend` of the model's device, whether or not its fused kernels run) routes
    (:func:`_route_shape_ok`)."""
    from ..modules.router import StrictTopKRouter

    if not isinstance(router, StrictTopKRouter) or not getattr(router, "aligned", True):
        return False  # Megatron's TopKRouter (or an aligned one that kept it): call the module
    c = router.config
    return (not router.training and router.score_function == "softmax" and not c.moe_router_pre_softmax
            and router.expert_bias is None and not c.moe_input_jitter_eps
            and _route_shape_ok(routing, tokens, c.num_moe_experts, router.topk))


def _route_shape_ok(backend: Backend, tokens: int, experts: int, topk: int) -> bool:
    """The shape is routed: by ``backend``'s ``moe_route`` kernel where it has one (its limits),
    else by :func:`moe_route_reference` (any shape)."""
    if type(backend).moe_route is Backend.moe_route:
        return True
    return backend.supports("moe_route", tokens=tokens, experts=experts, topk=topk) is None


def moe_route_reference(logits: torch.Tensor, k: int, scaling_factor: float | None = None):
    """:func:`moe_route` in torch: the learner's :func:`~minite_megatron.modules.router.topk_routing`
    (softmax after the top-k), then the rows of Megatron's expert-major permutation."""
    from ..modules.router import topk_routing

    t, e = logits.shape
    probs, routing_map = topk_routing(logits, k, score_function="softmax", use_pre_softmax=False,
                                      scaling_factor=scaling_factor, check_finite=False)
    return route_from_map(probs, routing_map, k)


def route_from_map(probs: torch.Tensor, routing_map: torch.Tensor, k: int, route_cls=Route):
    """The expert-major rows of a router's output (``probs`` ``[T, E]``, ``routing_map`` bool ``[T, E]``
    with exactly ``k`` experts per token): a :class:`~minite_megatron.nvfp4.moe_reference.Route`. No host sync."""
    t, e = routing_map.shape
    dev = routing_map.device
    # the experts of each token in increasing index (distinct keys: the lowest expert first)
    rank = routing_map.to(torch.int32) * (e - torch.arange(e, device=dev, dtype=torch.int32))
    experts = torch.topk(rank, k, dim=1, sorted=True).indices  # [T, k]
    weights = torch.gather(probs, 1, experts)
    tok = torch.arange(t, device=dev).repeat_interleave(k)
    ids = experts.reshape(-1)
    order = torch.argsort(ids * t + tok)  # expert-major, tokens in order within an expert
    combine = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=dev))
    sizes = torch.zeros(e, dtype=torch.int32, device=dev).scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    offsets = torch.nn.functional.pad(torch.cumsum(sizes, 0, dtype=torch.int32), (1, 0))
    return route_cls(ids[order].to(torch.int32), tok[order].to(torch.int32), weights.reshape(-1)[order].float(),
                     combine.to(torch.int32), sizes, offsets)


def moe_route(logits: torch.Tensor, k: int, scaling_factor: float | None = None, *, backend: Backend | None):
    """The routing of fp32 ``logits`` ``[T, E]`` (:mod:`minite_kernels.triton.moe.moe_route`'s
    :class:`Route`): ``backend``'s kernel (:func:`fused_backend`'s choice) where it supports the
    shape, else :func:`moe_route_reference`."""
    if backend is not None and backend.supports("moe_route", tokens=logits.shape[0], experts=logits.shape[1], topk=k) is None:
        return backend.moe_route(logits, k, scaling_factor)
    return moe_route_reference(logits, k, scaling_factor)


# ---- the combine -----------------------------------------------------------------------------------
def combine_rows(rows: torch.Tensor, combine: torch.Tensor, k: int, *, backend: Backend | None) -> torch.Tensor:
    """``[T * k, H]`` expert-major rows -> ``[T, H]``: each token's rows added in increasing expert
    order from ``+0.0`` (:func:`~minite_megatron.modules.deterministic_moe.ordered_sum`'s bits), ``combine`` the
    rows of token ``t`` at ``t * k .. t * k + k - 1``. ``backend``'s ``moe_sum_rows`` (:func:`fused_backend`'s
    choice; one kernel on the GPU), else the reference."""
    if backend is not None:
        return backend.moe_sum_rows(rows, combine, k)
    t = combine.numel() // k
    return ordered_sum_reference(rows.index_select(0, combine.long()).view(t, k, rows.shape[-1]))
