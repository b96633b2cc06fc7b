"""Training-time monitor: the learner/rollout gap logged next to loss and reward every step.

One line in a Megatron (or any) RL training loop::

    monitor = GapMonitor(threshold=1e-3, writer=tensorboard_writer)   # once
    monitor.update(iteration, learner_logp, rollout_logp, response_mask, loss=loss, reward=reward)

Each update computes :func:`~.metrics.gap_metrics`, prints one console line (via ``logging``
and, with ``print_fn``, any callable such as Megatron's ``print_rank_0``), writes every metric
and the extra scalars to tensorboard (``add_scalar(key, value, step)``; extra scalars under
``train/<name>``) and checks the thresholds. A crossed threshold logs a warning, increments
``alerts`` (and ``alerts_by_key``), writes ``rollout_corr/alerts`` to tensorboard and, with
``raise_on_alert=True``, raises :class:`GapAlert`.

Metrics are computed on the tokens this process sees; under data parallelism call it on the
gathered batch or read it per rank (max-type metrics are per rank).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import torch

from .metrics import gap_metrics

logger = logging.getLogger("minite_megatron.diagnostics.monitor")

DEFAULT_METRIC = "rollout_corr/logprob_abs_diff_mean"
CONSOLE_KEYS = (
    ("rollout_corr/logprob_abs_diff_mean", "|dlogp| mean"),
    ("rollout_corr/logprob_abs_diff_max", "max"),
    ("rollout_corr/k3_kl", "k3_kl"),
    ("rollout_corr/token_mult_prob_error", "tmpe"),
    ("rollout_corr/logprob_mismatch_frac", "mismatch"),
    ("rollout_corr/router_topk_flip_rate", "router flips"),
)


class GapAlert(RuntimeError):
    """Raised by :meth:`GapMonitor.update` (``raise_on_alert=True``) when a threshold is crossed."""


def _scalar(v) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"scalars must be single numbers, got a tensor of shape {tuple(v.shape)}")
        return float(v.detach().float().item())
    return float(v)


class GapMonitor:
    """Logs the gap metrics each step and alerts above thresholds.

    Args:
        threshold: a float for ``metric``, or ``{metric_name: threshold}``; an alert fires when a
            metric is above its threshold (or is NaN). None: no alerts.
        metric: the metric a float ``threshold`` applies to.
        writer: a tensorboard ``SummaryWriter`` (anything with ``add_scalar``), or None.
        raise_on_alert: raise :class:`GapAlert` instead of only warning.
        log_every: console line every N updates (tensorboard and alerts every update).
        print_fn: extra sink for the console line (e.g. Megatron's ``print_rank_0``).
        metrics_kwargs: passed to :func:`gap_metrics` (e.g. ``thresholds=``).
    """

    def __init__(
        self,
        threshold: float | Mapping[str, float] | None = None,
        *,
        metric: str = DEFAULT_METRIC,
        writer=None,
        raise_on_alert: bool = False,
        log_every: int = 1,
        print_fn: Callable[[str], None] | None = None,
        metrics_kwargs: dict | None = None,
    ) -> None:
        if threshold is None:
            self.thresholds: dict[str, float] = {}
        elif isinstance(threshold, Mapping):
            self.thresholds = {str(k): float(v) for k, v in threshold.items()}
        else:
            self.thresholds = {metric: float(threshold)}
        for k, v in self.thresholds.items():
            if not v >= 0:
                raise ValueError(f"threshold for {k!r} must be >= 0, got {v}")
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        if writer is not None and not hasattr(writer, "add_scalar"):
            raise TypeError("writer must have add_scalar(tag, value, step) (a tensorboard SummaryWriter)")
        self.writer = writer
        self.raise_on_alert = raise_on_alert
        self.log_every = log_every
        self.print_fn = print_fn
        self.metrics_kwargs = dict(metrics_kwargs or {})
        self.alerts = 0
        self.alerts_by_key: dict[str, int] = {}
        self.updates = 0
        self.last: dict[str, float] = {}

    def check(self, metrics: Mapping[str, float]) -> list[tuple[str, float, float]]:
        """(key, value, threshold) of every crossed threshold; raises KeyError for a threshold
        naming a metric that was not computed."""
        crossed = []
        for key, thr in self.thresholds.items():
            if key not in metrics:
                raise KeyError(f"GapMonitor threshold names {key!r}, which is not a computed metric")
            v = metrics[key]
            if math.isnan(v) or v > thr:
                crossed.append((key, v, thr))
        return crossed

    def update(
        self,
        step: int,
        learner_logp: torch.Tensor,
        rollout_logp: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        learner_topk: Mapping[int, torch.Tensor] | None = None,
        rollout_topk: Mapping[int, torch.Tensor] | None = None,
        **scalars,
    ) -> dict[str, float]:
        """Compute, log and check the gap for one step; returns the metrics (plus ``train/<name>``
        for each extra scalar such as ``loss=`` or ``reward=``).

        Raises :class:`GapAlert` on a crossed threshold when ``raise_on_alert``; the input
        errors of :func:`gap_metrics` otherwise.
        """
        metrics = gap_metrics(
            learner_logp, rollout_logp, mask, learner_topk=learner_topk, rollout_topk=rollout_topk, **self.metrics_kwargs
        )
        extra = {f"train/{k}": _scalar(v) for k, v in scalars.items()}
        crossed = self.check(metrics)
        self.updates += 1
        out = {**extra, **metrics}
        if self.writer is not None:
            for k, v in out.items():
                self.writer.add_scalar(k, v, step)
        if crossed:
            self.alerts += 1
            for key, _, _ in crossed:
                self.alerts_by_key[key] = self.alerts_by_key.get(key, 0) + 1
            if self.writer is not None:
                self.writer.add_scalar("rollout_corr/alerts", float(self.alerts), step)
        line = self.format_line(step, out)
        if (self.updates - 1) % self.log_every == 0:
            logger.info(line)
            if self.print_fn is not None:
                self.print_fn(line)
        self.last = out
        if crossed:
            msg = f"step {step}: learner/rollout gap above threshold: " + ", ".join(
                f"{k} = {v:.4g} > {t:.4g}" for k, v, t in crossed
            )
            logger.warning(msg)
            if self.print_fn is not None:
                self.print_fn("WARNING: " + msg)
            if self.raise_on_alert:
                raise GapAlert(msg)
        return out

    @staticmethod
    def format_line(step: int, values: Mapping[str, float]) -> str:
        """``step 12 | loss 0.231 | reward 0.5 | |dlogp| mean 1.2e-08 max 3e-07 | k3_kl ...``."""
        parts = [f"step {step}"]
        parts += [f"{k.removeprefix('train/')} {v:.4g}" for k, v in values.items() if k.startswith("train/")]
        parts += [f"{label} {values[k]:.3g}" for k, label in CONSOLE_KEYS if k in values]
        return " | ".join(parts)


__all__ = ["GapAlert", "GapMonitor"]
