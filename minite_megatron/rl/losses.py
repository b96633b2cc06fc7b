"""Policy-gradient loss pieces: the PPO clipped surrogate with token-level aggregation, truncated
importance sampling (TIS), the k3 KL to a reference policy and the entropy from logits.

Shapes: per-token tensors are ``[B, T]`` (``B`` sequences, ``T`` response positions, right
padded); ``mask`` is bool ``[B, T]`` (True on the response tokens that enter the loss);
``advantages`` is ``[B]`` (one per sequence, broadcast over its tokens) or ``[B, T]``.
Log-probs are fp32 log-probabilities of the sampled tokens. Padding may hold anything (NaN,
-inf): every reduction selects with ``torch.where``, so padding never reaches a sum or a gradient.

Per token, with ``logp`` the learner's log-prob (with gradients), ``old`` the learner's log-prob
before this rollout batch's updates (verl's ``old_log_prob``), ``A`` the advantage:

* ratio ``rho = exp(logp - old)``;
* PPO clipped loss with clip-higher (DAPO): ``max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))``;
  the token is *clipped* (``actor/pg_clipfrac``) where the clipped branch is the larger one, i.e.
  where its gradient is zero; with ``dual_clip = c`` (> 1) the loss of ``A < 0`` tokens is also
  capped at ``-A * c`` (verl's ``clip_ratio_c``);
* TIS (:func:`tis_weights`): the token loss is multiplied by ``w = min(exp(old - rollout), C)``
  (a constant: no gradient), which corrects for the sampler's distribution differing from the
  learner's (``rollout`` = the rollout engine's log-prob of the same token);
* k3 KL to the frozen reference (:func:`k3_kl`): ``exp(r) - r - 1`` with ``r = ref - logp``, an
  unbiased, non-negative estimator of ``KL(pi || pi_ref)`` under samples of ``pi``;
* ``ppo_kl`` (the k1 estimate of ``KL(pi_old || pi)``, reported as ``actor/ppo_kl``): ``old - logp``.

Aggregation (:func:`aggregate`): ``"token-mean"`` sums over every valid token of the mini-batch and
divides by the number of valid tokens of the *whole* mini-batch (DAPO, verl's ``token-mean``; pass
``denominator=`` the global count when the mini-batch is split into micro-batches or ranks, so the
micro-batch losses add up to the mini-batch's token mean); ``"seq-mean-token-mean"`` averages each
sequence's token mean over the sequences (the original GRPO; ``denominator`` = global sequence
count).

Entropy (:func:`entropy_from_logits`): ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` with
``z = fp32(logits) / temperature``, computed on the full vocabulary. Under tensor parallelism the
trainer asks Megatron for gathered logits (``runtime_gather_output=True``), so every TP rank holds
the full ``[.., V]`` row and computes the same entropy; no vocab-parallel reduction is involved.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def _check_mask(mask: torch.Tensor, like: torch.Tensor, name: str = "mask") -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"{name} {tuple(mask.shape)} must match the per-token tensors {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(f"advantages [{advantages.shape[0]}] vs {like.shape[0]} sequences")
        return advantages.to(like.dtype).unsqueeze(1).expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or {tuple(like.shape)}")
    return advantages.to(like.dtype)


def ppo_clip_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped loss ``[B, T]``, the bool ``clipped`` mask (clipped branch active:
    zero gradient) and the dual-clip mask (``A < 0`` tokens capped at ``-A * dual_clip``; all False
    without ``dual_clip``). Formulas in the module docstring; not yet masked or aggregated.

    Raises ValueError for negative clip ranges, ``dual_clip <= 1`` or mismatched shapes.
    """
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ")
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if eps_low >= 1:
        raise ValueError(f"eps_low must be < 1 (the ratio's lower bound is 1 - eps_low), got {eps_low}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = _per_token(advantages, logp)
    ratio = torch.exp(logp - old_logp.detach())
    unclipped = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    lower = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        lower = (adv < 0) & (loss > cap)
        loss = torch.where(lower, cap, loss)
    return loss, clipped, lower


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(old_logp - rollout_logp), cap)`` ``[B, T]``
    (detached: a weight, never a gradient path). Raises ValueError unless ``cap > 0``."""
    if not cap > 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    if old_logp.shape != rollout_logp.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} differ")
    return torch.exp(old_logp.detach() - rollout_logp.detach()).clamp(max=cap)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)``: ``exp(r) - r - 1``, ``r = ref_logp - logp``
    (gradients flow through ``logp``; ``ref_logp`` is detached)."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    r = ref_logp.detach() - logp
    return torch.exp(r) - r - 1.0


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``[...]`` (fp32) of ``softmax(fp32(logits) / temperature)`` for ``logits`` ``[..., V]``
    holding the full vocabulary (see the module docstring for TP). Differentiable."""
    if not (temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.to(torch.float32)
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    return lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over ``mask`` (padding excluded with ``where``: NaN there is harmless)."""
    mask = _check_mask(mask, values)
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", denominator: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Aggregate per-token ``values`` ``[B, T]`` into a scalar (see the module docstring).

    ``denominator``: the mini-batch's valid-token count (``token-mean``) or sequence count
    (``seq-mean-token-mean``) over all its micro-batches and ranks; default: this batch's own.
    Raises ValueError for an unknown mode or a batch with no valid token and no denominator.
    """
    mask = _check_mask(mask, values)
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if mode == "token-mean":
        total = torch.where(mask, values, zero).sum()
        count = mask.sum()
    else:
        n = mask.sum(dim=1)
        per_seq = torch.where(mask, values, zero).sum(dim=1) / n.clamp_min(1)
        total = torch.where(n > 0, per_seq, zero).sum()
        count = (n > 0).sum()
    if denominator is None:
        if int(count) == 0:
            raise ValueError("aggregate: the mask selects no token and no denominator was given")
        denominator = count
    return total / denominator


__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "entropy_from_logits",
    "k3_kl",
    "masked_sum",
    "ppo_clip_token_loss",
    "tis_weights",
]
