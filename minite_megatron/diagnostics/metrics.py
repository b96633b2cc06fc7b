"""Learner/rollout gap metrics on the same token sequences, under the names RL users know.

Inputs are the per-token log-probs that two engines assign to the *same* sampled tokens:
``learner_logp`` (the trainer, teacher-forced; verl's ``old_log_prob``, NeMo-RL's
``prev_logprobs``) and ``rollout_logp`` (the sampler; verl's ``rollout_log_prob``, NeMo-RL's
``generation_logprobs``), both ``[B, T]`` (or ``[T]``: one sequence), with an optional response
mask ``[B, T]`` (bool or 0/1) selecting the valid tokens. Everything is computed in float64.

Notation, per valid token: ``l`` = learner log-prob, ``r`` = rollout log-prob,
``d = r - l`` (rollout minus learner). The tokens were sampled by the rollout engine, so
expectations over tokens are expectations under ``pi_rollout``.

Keys returned by :func:`gap_metrics` (formulas in ``docs/diagnostics.md``):

=============================================  ====================================================
``rollout_corr/kl``                            token mean of ``d`` (verl k1: KL(pi_rollout||pi_learner))
``rollout_corr/k3_kl``                         token mean of ``exp(-d) + d - 1`` (verl k3, same direction)
``rollout_corr/k3_kl_reverse``                 token mean of ``exp(d) - d - 1`` (k3 with ``d`` = rollout-learner)
``rollout_corr/training_ppl``                  batch mean of per-sequence ``exp(-mean_t l)`` (verl)
``rollout_corr/training_log_ppl``              batch mean of ``-mean_t l``
``rollout_corr/rollout_ppl`` / ``rollout_log_ppl``   the same for ``r``
``rollout_corr/log_ppl_diff``                  batch mean of ``mean_t r - mean_t l`` (also ``_abs``, ``_max``, ``_min``)
``rollout_corr/ppl_ratio``                     batch mean of ``exp(mean_t r - mean_t l)`` = training_ppl/rollout_ppl per seq
``rollout_corr/chi2_token``                    token mean of ``exp(-d)^2`` minus 1 (``-d`` clamped to +-20)
``rollout_corr/chi2_seq``                      batch mean of ``exp(2 * clamp(sum_t -d))`` minus 1
``rollout_corr/logprob_abs_diff_mean``         token mean of ``|d|``
``rollout_corr/logprob_abs_diff_max``          max of ``|d|``
``rollout_corr/train_rollout_logprob_abs_diff`` slime: batch mean of per-sequence token mean of ``|d|``
``rollout_corr/token_mult_prob_error``         NeMo-RL: token mean of ``exp(|d|)``
``rollout_corr/logprob_mismatch_frac``         fraction of tokens whose two log-probs are not equal
``rollout_corr/logprob_abs_diff_frac_gt_{t}``  fraction of tokens with ``|d| > t`` for each threshold
``training/rollout_probs_diff_{mean,max,std}`` verl debug metrics: ``|exp(l) - exp(r)|`` over tokens
``training/rollout_actor_probs_pearson_corr``  Pearson correlation of ``exp(l)`` and ``exp(r)``
``rollout_corr/num_tokens`` / ``num_seqs``     how many valid tokens / sequences entered
=============================================  ====================================================

Router agreement (:func:`router_flip_rates`, also merged into :func:`gap_metrics` when both
engines' top-k expert indices are given): ``rollout_corr/router_topk_flip_rate/layer_{i}``
(fraction of tokens whose *set* of top-k experts differs), ``.../router_topk_expert_miss/layer_{i}``
(mean fraction of a token's k experts absent from the other engine's set) and their means over
layers without the ``/layer_{i}`` suffix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

DEFAULT_THRESHOLDS: tuple[float, ...] = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
"""|dlogp| thresholds whose exceedance fractions are reported."""

CHI2_LOG_CLAMP = 20.0
"""verl clamps log-ratios to +-20 before exponentiating in the chi-squared metrics."""

PREFIX = "rollout_corr/"


# ---- input handling -----------------------------------------------------------------------
def pad_sequences(seqs: Sequence[torch.Tensor | Sequence[float]], pad: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-sequence log-probs -> (``[B, T_max]`` float64, bool mask ``[B, T_max]``)."""
    if len(seqs) == 0:
        raise ValueError("pad_sequences: no sequences given")
    rows = [torch.as_tensor(s, dtype=torch.float64).reshape(-1) for s in seqs]
    t = max(r.numel() for r in rows)
    out = torch.full((len(rows), t), pad, dtype=torch.float64)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
        mask[i, : r.numel()] = True
    return out, mask


def _prepare(
    learner_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and return (learner, rollout, mask) as float64/float64/bool ``[B, T]``."""
    for nm, t in (("learner_logp", learner_logp), ("rollout_logp", rollout_logp)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{nm} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{nm} must be a floating-point tensor of log-probs, got {t.dtype}")
    if learner_logp.shape != rollout_logp.shape:
        raise ValueError(
            f"learner_logp {tuple(learner_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} "
            "must have the same shape (the same tokens)"
        )
    if learner_logp.dim() == 1:
        learner_logp, rollout_logp = learner_logp.unsqueeze(0), rollout_logp.unsqueeze(0)
        mask = None if mask is None else mask.reshape(1, -1)
    if learner_logp.dim() != 2:
        raise ValueError(f"log-probs must be [B, T] or [T], got {tuple(learner_logp.shape)}")
    if mask is None:
        mask = torch.ones(learner_logp.shape, dtype=torch.bool, device=learner_logp.device)
    else:
        if mask.shape != learner_logp.shape:
            raise ValueError(f"mask {tuple(mask.shape)} must match the log-probs {tuple(learner_logp.shape)}")
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("mask must be boolean or hold only 0 and 1")
            mask = mask != 0
    if not bool(mask.any()):
        raise ValueError("mask selects no token: the metrics are undefined")
    l = learner_logp.detach().to(torch.float64)
    r = rollout_logp.detach().to(torch.float64)
    for nm, t in (("learner_logp", l), ("rollout_logp", r)):
        bad = mask & ~torch.isfinite(t)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{nm} has {int(bad.sum())} non-finite value(s) on valid tokens; first at "
                f"[seq, pos] = {list(idx)}: {t[idx].item()!r}"
            )
    # Padding may hold anything (NaN, -inf): zero it so no arithmetic touches it.
    l = torch.where(mask, l, torch.zeros_like(l))
    r = torch.where(mask, r, torch.zeros_like(r))
    return l, r, mask


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(x[mask].mean())


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence token mean ``[B]`` over sequences with at least one valid token."""
    n = mask.sum(dim=1)
    keep = n > 0
    s = torch.where(mask, x, torch.zeros_like(x)).sum(dim=1)
    return (s[keep] / n[keep])


def threshold_key(t: float) -> str:
    """``1e-06`` -> ``rollout_corr/logprob_abs_diff_frac_gt_1e-06``, ``0.1`` -> ``..._gt_0.1`` (``%g``)."""
    return f"{PREFIX}logprob_abs_diff_frac_gt_{t:g}"


# ---- the metrics --------------------------------------------------------------------------
def gap_metrics(
    learner_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    learner_topk: Mapping[int, torch.Tensor] | None = None,
    rollout_topk: Mapping[int, torch.Tensor] | None = None,
    topk_mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """The learner/rollout gap on the same tokens, as a flat ``{name: float}`` dict.

    Args:
        learner_logp, rollout_logp: float ``[B, T]`` (or ``[T]``) log-probs of the same tokens.
        mask: bool or 0/1 ``[B, T]`` response mask (None: every token counts).
        thresholds: |dlogp| thresholds for the exceedance fractions.
        learner_topk, rollout_topk: optional ``{layer: int [tokens, k]}`` top-k expert indices
            of the two engines on the same tokens (see :func:`router_flip_rates`).
        topk_mask: optional bool ``[tokens]`` selecting the tokens the router metrics count.

    Returns:
        The keys listed in the module docstring, all Python floats.

    Raises:
        TypeError / ValueError for mismatched shapes, a non-float input, a mask selecting
        nothing, or a non-finite log-prob on a valid token (a ``-inf`` log-prob means a
        probability of zero: the ratio metrics are undefined there, so it is never averaged
        silently).
    """
    l, r, m = _prepare(learner_logp, rollout_logp, mask)
    d = r - l  # rollout minus learner
    ad = d.abs()
    out: dict[str, float] = {}

    # verl off-policy diagnostics (verl/trainer/ppo/rollout_corr_helper.py names).
    out[f"{PREFIX}kl"] = _token_mean(d, m)
    log_ratio = -d  # log(pi_learner / pi_rollout), verl's `old_log_prob - rollout_log_prob`
    out[f"{PREFIX}k3_kl"] = _token_mean(torch.exp(log_ratio) - log_ratio - 1.0, m)
    out[f"{PREFIX}k3_kl_reverse"] = _token_mean(torch.exp(d) - d - 1.0, m)
    mean_l, mean_r = _seq_mean(l, m), _seq_mean(r, m)
    out[f"{PREFIX}training_ppl"] = float(torch.exp(-mean_l).mean())
    out[f"{PREFIX}training_log_ppl"] = float((-mean_l).mean())
    out[f"{PREFIX}rollout_ppl"] = float(torch.exp(-mean_r).mean())
    out[f"{PREFIX}rollout_log_ppl"] = float((-mean_r).mean())
    log_ppl_diff = mean_r - mean_l
    out[f"{PREFIX}log_ppl_diff"] = float(log_ppl_diff.mean())
    out[f"{PREFIX}log_ppl_abs_diff"] = float(log_ppl_diff.abs().mean())
    out[f"{PREFIX}log_ppl_diff_max"] = float(log_ppl_diff.max())
    out[f"{PREFIX}log_ppl_diff_min"] = float(log_ppl_diff.min())
    out[f"{PREFIX}ppl_ratio"] = float(torch.exp(log_ppl_diff).mean())
    rho = torch.exp(log_ratio.clamp(-CHI2_LOG_CLAMP, CHI2_LOG_CLAMP))
    out[f"{PREFIX}chi2_token"] = _token_mean(rho.square(), m) - 1.0
    seq_log_ratio = torch.where(m, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1)[m.any(dim=1)]
    out[f"{PREFIX}chi2_seq"] = float(torch.exp(2.0 * seq_log_ratio.clamp(-CHI2_LOG_CLAMP, CHI2_LOG_CLAMP)).mean()) - 1.0

    # |dlogp| family (slime, NeMo-RL, and the strict-alignment view).
    out[f"{PREFIX}logprob_abs_diff_mean"] = _token_mean(ad, m)
    out[f"{PREFIX}logprob_abs_diff_max"] = float(ad[m].max())
    out[f"{PREFIX}train_rollout_logprob_abs_diff"] = float(_seq_mean(ad, m).mean())
    out[f"{PREFIX}token_mult_prob_error"] = _token_mean(torch.exp(ad), m)
    same = learner_logp.detach().reshape(m.shape) == rollout_logp.detach().reshape(m.shape)
    out[f"{PREFIX}logprob_mismatch_frac"] = float((~same)[m].double().mean())
    for t in thresholds:
        out[threshold_key(float(t))] = float((ad[m] > t).double().mean())

    # verl debug metrics (verl/utils/debug/metrics.py names): probability space.
    pl, pr = torch.exp(l[m]), torch.exp(r[m])
    pdiff = (pl - pr).abs()
    out["training/rollout_probs_diff_mean"] = float(pdiff.mean())
    out["training/rollout_probs_diff_max"] = float(pdiff.max())
    out["training/rollout_probs_diff_std"] = float(pdiff.std()) if pdiff.numel() > 1 else 0.0
    out["training/rollout_actor_probs_pearson_corr"] = _pearson(pl, pr)

    out[f"{PREFIX}num_tokens"] = float(m.sum())
    out[f"{PREFIX}num_seqs"] = float(m.any(dim=1).sum())

    if (learner_topk is None) != (rollout_topk is None):
        raise ValueError("give both learner_topk and rollout_topk, or neither")
    if learner_topk is not None:
        out.update(router_flip_rates(learner_topk, rollout_topk, topk_mask))
    return out


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation; NaN when either side is constant (undefined, never a made-up 1)."""
    if a.numel() < 2:
        return float("nan")
    a0, b0 = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a0 * a0).sum()) * float((b0 * b0).sum()))
    return float((a0 * b0).sum()) / den if den > 0 else float("nan")


def per_sequence_metrics(
    learner_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Per-sequence gap, float64 ``[B]`` each (NaN for a sequence with no valid token).

    Keys: ``num_tokens``, ``logprob_abs_diff_mean``, ``logprob_abs_diff_max``, ``log_ppl_diff``
    (``mean_t r - mean_t l``), ``k3_kl`` (verl direction), ``seq_log_ratio`` (``sum_t (l - r)``).
    """
    l, r, m = _prepare(learner_logp, rollout_logp, mask)
    d = r - l
    n = m.sum(dim=1).to(torch.float64)
    nan = torch.full_like(n, float("nan"))

    def smean(x: torch.Tensor) -> torch.Tensor:
        s = torch.where(m, x, torch.zeros_like(x)).sum(dim=1)
        return torch.where(n > 0, s / n.clamp_min(1), nan)

    ad = d.abs()
    amax = torch.where(m, ad, torch.full_like(ad, -1.0)).amax(dim=1)
    return {
        "num_tokens": n,
        "logprob_abs_diff_mean": smean(ad),
        "logprob_abs_diff_max": torch.where(n > 0, amax, nan),
        "log_ppl_diff": smean(r) - smean(l),
        "k3_kl": smean(torch.exp(-d) + d - 1.0),
        "seq_log_ratio": torch.where(n > 0, torch.where(m, -d, torch.zeros_like(d)).sum(dim=1), nan),
    }


def position_curves(
    learner_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Per-position gap curves over the batch, float64 ``[T]`` each (NaN where no token).

    Position ``t`` is the column of the ``[B, T]`` layout (align responses left so that it is
    the position in the response). Keys: ``count``, ``logprob_abs_diff_mean``,
    ``logprob_abs_diff_max``, ``k3_kl`` (verl direction), ``mismatch_frac``.
    """
    l, r, m = _prepare(learner_logp, rollout_logp, mask)
    d = r - l
    ad = d.abs()
    mf = m.to(torch.float64)
    cnt = mf.sum(dim=0)
    nan = torch.full_like(cnt, float("nan"))

    def cmean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(cnt > 0, (x * mf).sum(dim=0) / cnt.clamp_min(1), nan)

    same = learner_logp.detach().reshape(m.shape) == rollout_logp.detach().reshape(m.shape)
    amax = torch.where(m, ad, torch.full_like(ad, -1.0)).amax(dim=0)
    return {
        "count": cnt,
        "logprob_abs_diff_mean": cmean(ad),
        "logprob_abs_diff_max": torch.where(cnt > 0, amax, nan),
        "k3_kl": cmean(torch.exp(-d) + d - 1.0),
        "mismatch_frac": cmean((~same).to(torch.float64)),
    }


def router_flip_rates(
    learner_topk: Mapping[int, torch.Tensor],
    rollout_topk: Mapping[int, torch.Tensor],
    token_mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-layer router top-k agreement of two engines on the same tokens.

    Args:
        learner_topk, rollout_topk: ``{layer: int [tokens, k]}`` (or ``[B, T, k]``) expert
            indices; the order inside a row does not matter (sets are compared). Both must hold
            the same layers and, per layer, the same shape.
        token_mask: optional bool ``[tokens]`` (or ``[B, T]``) of the tokens to count.

    Returns:
        ``rollout_corr/router_topk_flip_rate/layer_{i}``: fraction of tokens whose expert *set*
        differs; ``rollout_corr/router_topk_expert_miss/layer_{i}``: mean over tokens of
        ``(k - |A & B|) / k``; and both averaged over layers (keys without ``/layer_{i}``).

    Raises:
        ValueError for different layer sets, shapes, a non-integer index tensor, or a row with
        a repeated expert.
    """
    if set(learner_topk) != set(rollout_topk):
        raise ValueError(
            f"router top-k layers differ: learner {sorted(learner_topk)} vs rollout {sorted(rollout_topk)}"
        )
    if not learner_topk:
        raise ValueError("router_flip_rates: no layer given")
    out: dict[str, float] = {}
    flips, misses = [], []
    for layer in sorted(learner_topk):
        a, b = learner_topk[layer], rollout_topk[layer]
        if a.shape != b.shape:
            raise ValueError(f"layer {layer}: top-k shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
        if a.is_floating_point() or b.is_floating_point() or a.dtype == torch.bool:
            raise ValueError(f"layer {layer}: top-k expert indices must be integers, got {a.dtype}/{b.dtype}")
        k = a.shape[-1]
        a2, b2 = a.reshape(-1, k).long(), b.reshape(-1, k).long()
        if token_mask is not None:
            tm = token_mask.reshape(-1).bool()
            if tm.numel() != a2.shape[0]:
                raise ValueError(f"layer {layer}: token_mask has {tm.numel()} tokens, top-k has {a2.shape[0]}")
            a2, b2 = a2[tm], b2[tm]
        if a2.shape[0] == 0:
            raise ValueError(f"layer {layer}: no token to compare")
        sa, sb = a2.sort(dim=1).values, b2.sort(dim=1).values
        for nm, s in (("learner", sa), ("rollout", sb)):
            if k > 1 and bool((s[:, 1:] == s[:, :-1]).any()):
                raise ValueError(f"layer {layer}: {nm} top-k has a repeated expert in a row")
        flip = (sa != sb).any(dim=1).double().mean()
        common = (a2.unsqueeze(2) == b2.unsqueeze(1)).any(dim=2).sum(dim=1)
        miss = ((k - common).double() / k).mean()
        out[f"{PREFIX}router_topk_flip_rate/layer_{layer}"] = float(flip)
        out[f"{PREFIX}router_topk_expert_miss/layer_{layer}"] = float(miss)
        flips.append(float(flip))
        misses.append(float(miss))
    out[f"{PREFIX}router_topk_flip_rate"] = sum(flips) / len(flips)
    out[f"{PREFIX}router_topk_expert_miss"] = sum(misses) / len(misses)
    return out


def topk_from_routing_map(routing_map: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Megatron's bool routing map ``[tokens, E]`` -> int64 expert indices ``[tokens, k]`` (ascending).

    Raises ValueError if the rows do not all select the same number of experts (``k``).
    """
    rm = routing_map.bool()
    counts = rm.sum(dim=1)
    kk = int(counts[0]) if k is None and counts.numel() else k
    if counts.numel() and not bool((counts == kk).all()):
        raise ValueError(f"routing map rows select {sorted(set(counts.tolist()))} experts, expected {kk} each")
    idx = torch.arange(rm.shape[1], device=rm.device).expand_as(rm)
    return idx[rm].reshape(rm.shape[0], kk or 0)


__all__ = [
    "DEFAULT_THRESHOLDS",
    "gap_metrics",
    "pad_sequences",
    "per_sequence_metrics",
    "position_curves",
    "router_flip_rates",
    "threshold_key",
    "topk_from_routing_map",
]
