"""Group-relative advantages (GRPO) with the DAPO options, and the sample filters that go with them.

Layout: ``rewards`` is a float tensor ``[N]`` holding ``N / G`` groups of ``G`` samples each,
contiguous (``rewards[g*G : (g+1)*G]`` are the samples of prompt ``g``; the layout the trainer and
verl's ``compute_grpo_outcome_advantage`` use after ``repeat_interleave``).

Per group with rewards ``r_1..r_G``, mean ``m`` and unbiased standard deviation ``s``
(``torch.std``, Bessel's correction, as verl and TRL compute it):

* GRPO (``normalize_std=True``): ``A_i = (r_i - m) / (s + eps)``;
* Dr. GRPO / DAPO without std scaling (``normalize_std=False``): ``A_i = r_i - m``.

A group of identical rewards gets advantages exactly 0 either way (``(r - m) = 0``, and
``0 / eps = 0``), so it contributes no policy gradient; DAPO's *dynamic sampling* drops such groups
so that they do not dilute the token-mean (:func:`zero_variance_groups` gives the mask).

A group of size 1 has no baseline (its advantage would be ``0`` with ``normalize_std=False`` and
``0 / 0`` under torch's unbiased std): :func:`check_group_size` refuses it with one line.
"""

from __future__ import annotations

import torch


class GroupSizeError(ValueError):
    """Raised for a group size that cannot give group-relative advantages."""


def check_group_size(group_size: int, n_samples: int | None = None) -> int:
    """``group_size`` as an int; raises :class:`GroupSizeError` unless it is >= 2 and (when
    ``n_samples`` is given) divides ``n_samples``."""
    g = int(group_size)
    if g != group_size or g < 2:
        raise GroupSizeError(
            f"--group {group_size}: group-relative advantages (GRPO) need at least 2 samples per prompt "
            "(a group of one has no baseline: its advantage is 0/0)"
        )
    if n_samples is not None and n_samples % g:
        raise GroupSizeError(f"{n_samples} samples do not split into groups of {g}")
    return g


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N], got {getattr(rewards, 'shape', type(rewards))}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    g = check_group_size(group_size, rewards.numel())
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"rewards[{i}] = {rewards[i].item()!r} is not finite")
    return rewards.view(-1, g)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages ``[N]`` (float32) for ``rewards`` ``[N]`` in groups of ``group_size``.

    See the module docstring for the formulas. Raises :class:`GroupSizeError` for a group size
    below 2 or one that does not divide ``N``, ValueError for non-finite rewards or a non-1-D
    tensor.
    """
    r = _grouped(rewards, group_size).to(torch.float32)
    centered = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool ``[N]``: True for every sample of a group whose rewards are all equal (DAPO's dynamic
    sampling drops these groups: all-correct or all-wrong prompts carry no learning signal)."""
    r = _grouped(rewards, group_size)
    same = (r == r[:, :1]).all(dim=1, keepdim=True)
    return same.expand_as(r).reshape(-1)


__all__ = ["GroupSizeError", "check_group_size", "group_advantages", "zero_variance_groups"]
