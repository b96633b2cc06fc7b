"""MoE layer with a deterministic combine of the top-k expert outputs (strict and default mode).

Megatron un-permutes the expert outputs with ``scatter_add_`` (``index_add_`` in deterministic
mode) into a bf16 buffer: on a GPU the k contributions of a token are added by atomics in
whatever order the threads arrive, each add rounded to bf16, so with ``topk >= 3`` a token's
output changes from run to run and with the batch -- and a rollout engine's one-token decode
steps add in another order than the learner's full-sequence forward. Measured on the H200
(qwen3-moe preset, ``minite-diagnose run``): layer 0's MoE output differed in 111418 elements
between the learner and the sampler while every expert's fc1/fc2 output was bitwise equal.
:func:`deterministic_unpermute` gathers each token's rows and adds them in a fixed order
(increasing permuted position, i.e. increasing expert index, starting from ``+0.0``, one
rounding to the rows' dtype per add), with ordinary gathers and elementwise adds: the same bits
on every device and for every batch (on a CPU it is also exactly what ``scatter_add_`` computes
sequentially). :func:`ordered_sum` is the same sum for rows already laid out ``[T, k, H]`` in
expert order (the rollout engine's decode step).

:class:`DeterministicMoELayer` is Megatron's ``MoELayer`` whose token dispatcher (all-gather or
all-to-all, chosen by ``moe_token_dispatcher_type`` as usual) uses that combine; the minite specs
use it in default mode too (``specs.MiniteSpecProvider.moe_layer``). :class:`StrictMoELayer`
is the same layer flagged strict. With the all-gather dispatcher over several TP x EP ranks,
the cross-rank reduce-scatter of the combined outputs is also replaced by the fixed-order one of
:mod:`.collectives`. Refused: the ``flex`` dispatcher, expert tensor parallelism with the
all-to-all dispatcher (its reduce-scatter), ``inference_optimized`` MoE, fused permutation (TE),
token dropping with padding.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from ..modules.moe import IdentitySortSkip
from .collectives import invariant_reduce_scatter


def deterministic_unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum the permuted rows back into their tokens in a fixed order.

    Args:
        permuted: ``[P, H]`` expert outputs in permuted (expert-major) order.
        sorted_indices: ``[P]`` int: the token each permuted row belongs to.
        num_tokens: number of tokens T.
    Returns:
        ``[T, H]`` in ``permuted.dtype``: ``out[t] = ((+0 + r_0) + r_1) + ...`` over the rows of
        token ``t`` in increasing permuted position; tokens without rows are zeros. Differentiable.
    Raises:
        ValueError for mismatched shapes or indices outside ``[0, T)``.
    """
    if permuted.dim() != 2 or sorted_indices.shape != (permuted.shape[0],):
        raise ValueError(f"deterministic_unpermute: permuted {tuple(permuted.shape)} vs indices {tuple(sorted_indices.shape)}")
    hidden = permuted.shape[1]
    out = permuted.new_zeros(num_tokens, hidden)
    if permuted.shape[0] == 0:
        return out
    idx = sorted_indices.long()
    if int(idx.min()) < 0 or int(idx.max()) >= num_tokens:
        raise ValueError(f"deterministic_unpermute: token indices outside [0, {num_tokens})")
    order = torch.argsort(idx, stable=True)  # rows grouped by token, in permuted order
    counts = torch.bincount(idx, minlength=num_tokens)
    starts = torch.cumsum(counts, 0) - counts
    last = permuted.shape[0] - 1
    for slot in range(int(counts.max())):
        has = counts > slot
        rows = order[torch.clamp(starts + slot, max=last)]
        out = out + torch.where(has[:, None], permuted.index_select(0, rows), 0.0)
    return out


def ordered_sum(rows: torch.Tensor) -> torch.Tensor:
    """``[T, k, H]`` -> ``[T, H]``: ``((+0 + rows[:, 0]) + rows[:, 1]) + ...`` in ``rows.dtype``,
    one rounding per add: :func:`deterministic_unpermute`'s sum for tokens whose k rows are given
    in increasing expert order (every token has all k rows: no token dropping). No host sync."""
    if rows.dim() != 3:
        raise ValueError(f"ordered_sum: rows must be [T, k, H], got {tuple(rows.shape)}")
    out = rows.new_zeros(rows.shape[0], rows.shape[2])
    for j in range(rows.shape[1]):
        out = out + rows[:, j]
    return out


class StrictAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """All-gather dispatcher with :func:`deterministic_unpermute` and a fixed-order reduce-scatter."""

    def combine_preprocess(self, hidden_states):
        return deterministic_unpermute(
            hidden_states, self.reversed_local_input_permutation_mapping, self.hidden_shape_before_permute[0]
        )

    def token_combine(self, hidden_states):
        if self.tp_size > 1 or self.ep_size > 1:
            out = invariant_reduce_scatter(hidden_states.to(self.local_probs.dtype), group=self.tp_ep_group)
            return out.to(hidden_states.dtype)
        return hidden_states


class StrictAlltoAllTokenDispatcher(IdentitySortSkip, MoEAlltoAllTokenDispatcher):
    """All-to-all dispatcher with :func:`deterministic_unpermute` (the all-to-alls only move rows)."""

    def combine_postprocess(self, permutated_local_input_tokens):
        output = deterministic_unpermute(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            self.hidden_shape_before_permute[0],
        ).view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


class DeterministicMoELayer(MoELayer):
    """Megatron's ``MoELayer`` with a deterministic combine (see the module docstring).

    Where the combine cannot be replaced (a dispatcher or option listed in the module
    docstring) it keeps Megatron's and says so once in the log; :class:`StrictMoELayer` raises
    instead. ``deterministic_combine`` tells which one a layer runs.
    """

    require_deterministic = False

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False, name=None):
        problems = []
        if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            problems.append(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}")
        if config.moe_permute_fusion:
            problems.append("moe_permute_fusion (TE's fused unpermute)")
        if config.transformer_impl == "inference_optimized":
            problems.append("transformer_impl='inference_optimized'")
        if config.moe_pad_expert_input_to_capacity:
            problems.append("moe_pad_expert_input_to_capacity")
        if problems and self.require_deterministic:
            raise NotImplementedError(f"{type(self).__name__} does not support: " + "; ".join(problems))
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        self.deterministic_combine = False
        if isinstance(self.token_dispatcher, MoEAlltoAllTokenDispatcher):
            cls = StrictAlltoAllTokenDispatcher
            if self.token_dispatcher.tp_size > 1:
                problems.append("expert tensor parallelism with the all-to-all dispatcher")
        else:
            cls = StrictAllGatherTokenDispatcher
        if problems:
            if self.require_deterministic:
                raise NotImplementedError(f"{type(self).__name__} does not support: " + "; ".join(problems))
            _warn_once(f"MoE layers keep Megatron's (atomic, order-dependent) combine: {'; '.join(problems)}")
            return
        dispatcher = cls(self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection)
        if self.use_shared_expert and self.shared_expert_overlap:
            dispatcher.set_shared_experts(self.shared_experts)
        self.megatron_token_dispatcher = self.token_dispatcher  # Megatron's, for before/after comparisons
        self.token_dispatcher = dispatcher
        self.deterministic_combine = True


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        logging.getLogger(__name__).warning(msg)


class StrictMoELayer(DeterministicMoELayer):
    """:class:`DeterministicMoELayer` in a strict model: refuses what it cannot make
    deterministic, flagged for ``model_is_strict``."""

    minite_strict = True
    require_deterministic = True
