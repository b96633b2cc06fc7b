"""Deterministic MoE routing for strict mode: FP32 gating, stable top-k, fixed-order scores.

:func:`topk_routing` is Megatron's ``topk_routing_with_score_function`` (softmax before/after
top-k, or sigmoid with optional expert bias, optional scaling) rebuilt from strict parts:
:func:`~minite_megatron.strict.topk.stable_topk` (ties to the lower expert index; NaN raises),
:func:`~minite_megatron.strict.softmax.softmax` / ``sigmoid`` and the tree sum for the sigmoid
normalization. A token's probabilities and experts depend only on its own logits.

:class:`StrictTopKRouter` subclasses Megatron's ``TopKRouter`` (same parameters, aux-loss and
z-loss machinery, expert-bias bookkeeping) and overrides only

- ``gating``: FP32 logits from the batch-invariant GEMM (:func:`~minite_megatron.strict.matmul.linear`),
  whatever ``moe_router_dtype`` says (``fp64`` is refused);
- ``routing``: :func:`topk_routing` instead of the torch top-k.

Refused, with the reason (each makes a token's routing depend on the rest of the batch or is
not implemented here): token dropping (``moe_expert_capacity_factor``), sinkhorn and quantile
balancing, group-limited top-k, router replay, ``sqrtsoftplus`` scores, fused routing.
The aux losses only shape gradients (their forward is the identity on ``probs``) and are kept.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter

from .matmul import linear as batch_invariant_linear
from .softmax import sigmoid, softmax
from .topk import stable_topk
from .tree import tree_sum


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant top-k routing.

    Args:
        logits: ``[tokens, experts]`` (fp32 recommended).
        topk: experts per token.
        score_function: ``"softmax"`` or ``"sigmoid"``.
        use_pre_softmax: softmax over all experts before the top-k (else over the k selected).
        scaling_factor: multiply the probabilities.
        expert_bias: ``[experts]`` added to sigmoid scores for the selection only.
    Returns:
        ``(routing_probs, routing_map)``: ``[tokens, experts]`` in ``logits.dtype`` (zeros off the
        top-k) and bool, as Megatron's ``topk_routing_with_score_function``.
    Raises:
        ValueError for NaN logits, a bad ``topk`` or an unknown score function.
    """
    if logits.dim() != 2:
        raise ValueError(f"topk_routing: logits must be [tokens, experts], got {tuple(logits.shape)}")
    if score_function == "softmax":
        if use_pre_softmax:
            probs, idx = stable_topk(softmax(logits, dim=-1), topk)
        else:
            vals, idx = stable_topk(logits.float(), topk)
            probs = softmax(vals, dim=-1)
    elif score_function == "sigmoid":
        scores = sigmoid(logits)
        if expert_bias is not None:
            _, idx = stable_topk(scores + expert_bias.float(), topk)
            probs = torch.gather(scores, 1, idx)
        else:
            probs, idx = stable_topk(scores, topk)
        if topk > 1:
            probs = probs / (tree_sum(probs, dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"strict routing supports score functions 'softmax' and 'sigmoid', got {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(1, idx, True)
    return routing_probs, routing_map


class StrictTopKRouter(TopKRouter):
    """``TopKRouter`` with FP32 batch-invariant gating and deterministic top-k (module docstring)."""

    minite_strict = True

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        problems = []
        if config.moe_router_dtype == "fp64":
            problems.append("moe_router_dtype='fp64' (strict routing computes fp32 logits)")
        if config.moe_expert_capacity_factor is not None:
            problems.append("moe_expert_capacity_factor (token dropping depends on the whole batch)")
        if config.moe_router_load_balancing_type in ("sinkhorn", "quantile_balancing"):
            problems.append(f"moe_router_load_balancing_type={config.moe_router_load_balancing_type!r}")
        if config.moe_router_group_topk or config.moe_router_num_groups:
            problems.append("group-limited routing (moe_router_num_groups / moe_router_group_topk)")
        if config.moe_router_fusion:
            problems.append("moe_router_fusion (TE's fused top-k)")
        if config.moe_enable_routing_replay:
            problems.append("moe_enable_routing_replay")
        if config.moe_router_score_function not in ("softmax", "sigmoid"):
            problems.append(f"moe_router_score_function={config.moe_router_score_function!r}")
        if problems:
            raise NotImplementedError("StrictTopKRouter does not support: " + "; ".join(problems))
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """FP32 router logits ``[..., experts]`` from the batch-invariant GEMM."""
        return batch_invariant_linear(input, self.weight, self.bias, out_dtype=torch.float32)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's ``TopKRouter.routing`` with :func:`topk_routing` for the selection."""
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, routing_map = topk_routing(
            logits,
            self.topk,
            score_function=self.score_function,
            use_pre_softmax=self.config.moe_router_pre_softmax,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            expert_bias=self.expert_bias,
        )
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            routing_map_for_aux_loss, scores_for_aux_loss = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=False, padding_mask=padding_mask
            )
            with_mask = padding_mask is not None
            probs = self._apply_aux_loss(probs, scores_for_aux_loss, routing_map_for_aux_loss, with_padding_mask=with_mask)
            probs = self._apply_seq_aux_loss(
                probs, scores_for_aux_loss, routing_map_for_aux_loss, seq_length, bsz, with_padding_mask=with_mask
            )
            probs = self._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map_for_aux_loss, with_padding_mask=with_mask)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map
