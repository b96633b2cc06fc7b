"""Reusable RL pieces for a GRPO / DAPO trainer on Megatron: group-relative advantages
(:mod:`.advantages`), the PPO clipped loss with token-level aggregation, TIS, k3 KL and entropy
(:mod:`.losses`), the learner's log-probs of a rollout batch (:mod:`.policy`) and the per-step
metrics (:mod:`.metrics`). The trainer that puts them together is ``examples/rl/train_grpo.py``.
"""

from .advantages import GroupSizeError, check_group_size, group_advantages, zero_variance_groups
from .losses import AGGREGATIONS, aggregate, entropy_from_logits, k3_kl, masked_sum, ppo_clip_token_loss, tis_weights
from .metrics import MetricSums, rollout_metrics

__all__ = [
    "AGGREGATIONS",
    "GroupSizeError",
    "MetricSums",
    "aggregate",
    "check_group_size",
    "entropy_from_logits",
    "group_advantages",
    "k3_kl",
    "masked_sum",
    "ppo_clip_token_loss",
    "rollout_metrics",
    "tis_weights",
    "zero_variance_groups",
]
