"""Deterministic MoE routing for strict mode: FP32 gating, stable top-k, fixed-order scores.

:func:`topk_routing` is Megatron's ``topk_routing_with_score_function`` (softmax before/after
top-k, or sigmoid with optional expert bias, optional scaling) rebuilt from strict parts:
:func:`~minite_megatron.invariant.topk.stable_topk` (ties to the lower expert index; NaN raises),
:func:`~minite_megatron.invariant.softmax.softmax` / ``sigmoid`` and the tree sum for the sigmoid
normalization. A token's probabilities and experts depend only on its own logits.

:class:`StrictTopKRouter` subclasses Megatron's ``TopKRouter`` (same parameters, aux-loss and
z-loss machinery, expert-bias bookkeeping) and overrides only

- ``gating``: FP32 logits from the batch-invariant GEMM (:func:`~minite_megatron.invariant.matmul.linear`),
  whatever ``moe_router_dtype`` says (``fp64`` is refused);
- ``routing``: :func:`topk_routing` instead of the torch top-k.

Refused, with the reason (each makes a token's routing depend on the rest of the batch or is
not implemented here): token dropping (``moe_expert_capacity_factor``), sinkhorn and quantile
balancing, group-limited top-k, router replay, ``sqrtsoftplus`` scores, fused routing.
The aux losses only shape gradients (their forward is the identity on ``probs``) and are kept.

:class:`AlignedTopKRouter` is the same router for default mode (``recipe.aligned_ops``): a
token's experts and probabilities get the same bits in the learner's forward and in the rollout
engine's decode step. It is not flagged strict, does not check the logits for NaN (no host
sync; Megatron's router does not either), and where the config asks for something listed above
it is Megatron's ``TopKRouter`` unchanged (one log line says so).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter

from ..invariant.matmul import linear as batch_invariant_linear
from ..invariant.softmax import sigmoid, softmax
from ..invariant.topk import stable_topk
from ..nvfp4.tree import tree_sum


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant top-k routing.

    Args:
        logits: ``[tokens, experts]`` (fp32 recommended).
        topk: experts per token.
        score_function: ``"softmax"`` or ``"sigmoid"``.
        use_pre_softmax: softmax over all experts before the top-k (else over the k selected).
        scaling_factor: multiply the probabilities.
        expert_bias: ``[experts]`` added to sigmoid scores for the selection only.
        check_finite: raise on NaN scores (one host sync; :func:`.topk.stable_topk`).
    Returns:
        ``(routing_probs, routing_map)``: ``[tokens, experts]`` in ``logits.dtype`` (zeros off the
        top-k) and bool, as Megatron's ``topk_routing_with_score_function``.
    Raises:
        ValueError for NaN logits (with ``check_finite``), a bad ``topk`` or an unknown score function.
    """
    if logits.dim() != 2:
        raise ValueError(f"topk_routing: logits must be [tokens, experts], got {tuple(logits.shape)}")
    if score_function == "softmax":
        if use_pre_softmax:
            probs, idx = stable_topk(softmax(logits, dim=-1), topk, check_finite=check_finite)
        else:
            vals, idx = stable_topk(logits.float(), topk, check_finite=check_finite)
            probs = softmax(vals, dim=-1)
    elif score_function == "sigmoid":
        scores = sigmoid(logits)
        if expert_bias is not None:
            _, idx = stable_topk(scores + expert_bias.float(), topk, check_finite=check_finite)
            probs = torch.gather(scores, 1, idx)
        else:
            probs, idx = stable_topk(scores, topk, check_finite=check_finite)
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


def router_problems(config) -> list[str]:
    """What in ``config`` the batch-invariant routing cannot do (empty: it can do all of it)."""
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
    return problems


class StrictTopKRouter(TopKRouter):
    """``TopKRouter`` with FP32 batch-invariant gating and deterministic top-k (module docstring)."""

    minite_strict = True

    check_finite = True

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        problems = router_problems(config)
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
            check_finite=self.check_finite,
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


class AlignedTopKRouter(StrictTopKRouter):
    """Default mode's router with strict routing's bits where the config allows (module docstring):
    ``aligned`` tells which one a layer runs."""

    minite_strict = False
    check_finite = False

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        problems = router_problems(config)
        if config.moe_router_dtype != "fp32":
            problems.append(f"moe_router_dtype={config.moe_router_dtype!r} (aligned routing computes fp32 logits: "
                            "--minite-fp32-router)")
        self.aligned = not problems
        if problems:
            _log_once(f"MoE routers keep Megatron's TopKRouter (not batch invariant): {'; '.join(problems)}")
        TopKRouter.__init__(self, config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return super().gating(input) if self.aligned else TopKRouter.gating(self, input)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if self.aligned:
            return super().routing(logits, padding_mask)
        return TopKRouter.routing(self, logits, padding_mask=padding_mask)


_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        import logging

        logging.getLogger(__name__).warning(msg)
