"""Per-step RL metrics under the names verl / slime users read.

:class:`MetricSums` accumulates (sum, count) pairs over micro-batches, mini-batches and ranks
(one all-reduce per step) so that every ``actor/*`` value is a token-weighted mean over the step's
updates, whatever the micro-batching. :func:`rollout_metrics` summarizes a rollout batch. The
learner/rollout gap metrics (``rollout_corr/*``) come from :func:`minite_megatron.diagnostics.
gap_metrics` (through ``GapMonitor``); they are not recomputed here.

=====================================  =========================================================
``actor/pg_loss``                      policy loss of an update (aggregated as trained), mean over updates
``actor/kl_loss``                      token mean of the k3 KL to the reference policy
``actor/entropy``                      token mean of the learner's entropy at the sampling temperature
``actor/pg_clipfrac``                  fraction of tokens whose clipped branch is active (zero gradient)
``actor/pg_clipfrac_lower``            fraction of tokens capped by the dual clip (A < 0)
``actor/ppo_kl``                       token mean of ``old_logp - logp`` (k1 KL(pi_old || pi))
``actor/grad_norm``                    gradient norm before clipping, mean over updates
``actor/lr``                           learning rate of the last update
``rollout_corr/rollout_is_mean``       mean TIS weight ``min(exp(old - rollout), C)``
``rollout_corr/rollout_is_clip_frac``  fraction of tokens whose TIS weight hit the cap
``critic/rewards/{mean,max,min}``      rollout rewards
``critic/advantages/{mean,max,min}``   advantages over the samples that enter the loss
``response_length/{mean,max,min}``     response tokens per sample (EOD included)
``response_length/clip_ratio``         fraction of samples cut at ``max_new_tokens`` (no EOD)
=====================================  =========================================================
"""

from __future__ import annotations

import torch


class MetricSums:
    """Named (sum, count) pairs; :meth:`all_reduce` sums them over a process group, :meth:`means`
    divides. Values are float64 on the CPU."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._count: dict[str, float] = {}

    def add(self, key: str, total, count) -> None:
        """Add ``total`` (a sum over ``count`` items) to ``key``; tensors are detached."""
        t = float(total.detach().double().item()) if isinstance(total, torch.Tensor) else float(total)
        c = float(count.detach().double().item()) if isinstance(count, torch.Tensor) else float(count)
        self._sum[key] = self._sum.get(key, 0.0) + t
        self._count[key] = self._count.get(key, 0.0) + c

    def total(self, key: str, default: float = 0.0) -> float:
        """The accumulated sum of ``key``."""
        return self._sum.get(key, default)

    def merge(self, other: "MetricSums", skip: tuple[str, ...] = ()) -> None:
        """Add every pair of ``other`` (except the keys in ``skip``)."""
        for key in other._sum:
            if key not in skip:
                self.add(key, other._sum[key], other._count[key])

    def all_reduce(self, group=None) -> None:
        """Sum every pair over ``group`` (all ranks must hold the same keys; no-op without
        torch.distributed or on a group of one)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return
        keys = sorted(self._sum)
        buf = torch.tensor([[self._sum[k], self._count[k]] for k in keys], dtype=torch.float64)
        if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
            buf = buf.cuda()
        dist.all_reduce(buf, group=group)
        buf = buf.cpu()
        for i, k in enumerate(keys):
            self._sum[k], self._count[k] = float(buf[i, 0]), float(buf[i, 1])

    def means(self) -> dict[str, float]:
        """``{key: sum / count}`` (NaN where the count is 0)."""
        return {k: (self._sum[k] / self._count[k] if self._count[k] else float("nan")) for k in sorted(self._sum)}


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.double()
    if x.numel() == 0:
        return {f"{prefix}/mean": float("nan"), f"{prefix}/max": float("nan"), f"{prefix}/min": float("nan")}
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()), f"{prefix}/min": float(x.min())}


def rollout_metrics(
    rewards: torch.Tensor, advantages: torch.Tensor, response_lengths: torch.Tensor, truncated: torch.Tensor,
    kept: torch.Tensor | None = None,
) -> dict[str, float]:
    """``critic/*`` and ``response_length/*`` for one (gathered) rollout batch: ``rewards``,
    ``advantages``, ``response_lengths`` ``[N]``, ``truncated`` bool ``[N]`` (cut without EOD),
    ``kept`` bool ``[N]`` (samples that enter the loss; advantages are summarized over them)."""
    kept = torch.ones_like(truncated, dtype=torch.bool) if kept is None else kept.bool()
    out = {}
    out.update(_stats("critic/rewards", rewards))
    out.update(_stats("critic/advantages", advantages[kept]))
    out.update(_stats("response_length", response_lengths.double()))
    out["response_length/clip_ratio"] = float(truncated.double().mean())
    return out


__all__ = ["MetricSums", "rollout_metrics"]
