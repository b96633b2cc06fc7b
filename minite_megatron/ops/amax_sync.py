"""Global amaxes across tensor-parallel ranks: quantization independent of the TP layout.

A rank holds a shard of a weight, and a row-parallel linear sees only a slice of each token's
features. Quantizing a shard with its own amax would make the bytes depend on the TP size: the
learner at TP=2 and a sampler at TP=1 would not run the same policy, and the shards could not be
exported as one tensor. So wherever a scale domain (a row, a tensor, an expert's matrix) is
split across ranks, the amax is max-reduced over the group first (a tiny all-reduce: one value
per row, tensor or expert) and passed to the quantizer. With 16-element blocks that never straddle
a shard boundary (shard sizes are multiples of 16), every rank then writes exactly the bytes of
the unsharded quantization.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..nvfp4.hadamard import rht16, rht_signs


def group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def needs_sync(global_scale: str, group, *, rows_sharded: bool, k_sharded: bool) -> bool:
    """Is this scale domain split across the ranks of ``group``?"""
    if group_size(group) == 1:
        return False
    if global_scale == "row":
        return k_sharded
    return rows_sharded or k_sharded


def local_amax(t: torch.Tensor, global_scale: str, rht_seed: int | None = None) -> torch.Tensor:
    """fp32 amax per row ``[rows]``, per tensor ``[1]`` or per leading matrix ``[G]``; a NaN in
    a domain makes its amax +inf (so it wins the max on every rank: the quantizer then marks the
    domain NaN, as it would unsharded)."""
    k = t.shape[-1]
    if rht_seed is not None:
        t = rht16(t, rht_signs(None if rht_seed < 0 else rht_seed, device=t.device))
    a = t.reshape(-1, k).abs().float()
    nan = torch.isnan(a)
    if global_scale == "row":
        amax, bad = a.amax(dim=1), nan.any(dim=1)
    elif global_scale == "group":
        g = t.shape[0]
        amax, bad = a.reshape(g, -1).amax(dim=1), nan.reshape(g, -1).any(dim=1)
    else:
        amax, bad = a.amax().reshape(1), nan.any().reshape(1)
    return torch.where(bad, torch.full_like(amax, float("inf")), amax)


def synced_amax(
    t: torch.Tensor,
    global_scale: str,
    group,
    *,
    rows_sharded: bool,
    k_sharded: bool,
    rht_seed: int | None = None,
) -> torch.Tensor | None:
    """The amax of the whole (unsharded) scale domain, or None when the local one is it."""
    if not needs_sync(global_scale, group, rows_sharded=rows_sharded, k_sharded=k_sharded):
        return None
    amax = local_amax(t, global_scale, rht_seed)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax
