"""Batch-invariant tensor-parallel reductions (all-reduce, reduce-scatter) for strict mode.

NCCL's all-reduce picks its algorithm and chunking by message size (ring / tree, protocol), so
the order in which the TP partial sums of a row-parallel linear are added can change with the
number of tokens in the call: the learner (many tokens) and the rollout engine (a few tokens
per decode step) would round a token's output differently. Strict mode replaces the two
reductions Megatron does in the forward pass:

- :func:`invariant_all_reduce`: all-gather the partials, then the aligned pairwise tree over
  ranks in rank order (:mod:`minite_megatron.nvfp4.tree`), in fp32, one rounding to the input dtype;
- :func:`invariant_reduce_scatter` (sequence parallel, along dim 0): an all-to-all that hands
  every rank the partials of its own slice from every rank, then the same tree.

Both give every rank the same bits, and a token's result depends only on its own partials.
Cost: ``world_size`` times the memory of one partial and all-gather traffic instead of a
reduce; acceptable for strict mode's TP sizes. Backward is the ordinary adjoint (identity for
the all-reduce, all-gather for the reduce-scatter), as in Megatron's mappings.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..nvfp4.tree import tree_sum


def _world(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def _tree_over_ranks(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tree_sum(parts.to(torch.float32), dim=0).to(dtype)


class _InvariantAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        world = _world(group)
        if world == 1:
            return x
        x = x.contiguous()
        flat = x.reshape(-1)
        gathered = torch.empty(world * flat.numel(), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, flat, group=group)
        return _tree_over_ranks(gathered.view(world, *x.shape), x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _InvariantReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        world = _world(group)
        ctx.group, ctx.world = group, world
        if world == 1:
            return x
        if x.shape[0] % world:
            raise ValueError(f"invariant_reduce_scatter: dim 0 ({x.shape[0]}) is not divisible by {world} ranks")
        x = x.contiguous()
        received = torch.empty_like(x)
        dist.all_to_all_single(received, x, group=group)  # chunk r of every rank -> rank r
        parts = received.view(world, x.shape[0] // world, *x.shape[1:])
        return _tree_over_ranks(parts, x.dtype)

    @staticmethod
    def backward(ctx, g):
        if ctx.world == 1:
            return g, None
        g = g.contiguous()
        out = torch.empty((ctx.world * g.shape[0], *g.shape[1:]), dtype=g.dtype, device=g.device)
        dist.all_gather_into_tensor(out, g, group=ctx.group)
        return out, None


def invariant_all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group`` (None: the default group) in a fixed order (rank
    0, 1, ... as a pairwise tree, fp32). Returns ``x`` itself for one rank or no initialized
    process group."""
    return _InvariantAllReduce.apply(x, group)


def invariant_reduce_scatter(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks, then this rank's slice of dim 0 (sequence parallel), in a fixed order.

    Raises ValueError if dim 0 is not divisible by the group size."""
    return _InvariantReduceScatter.apply(x, group)
