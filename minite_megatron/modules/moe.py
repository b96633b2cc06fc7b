"""The MoE layer of the minite specs in default mode: Megatron's, minus an identity permutation.

Megatron's all-to-all token dispatcher sorts the tokens it received "by local expert" after the
all-to-all (``sort_chunks_by_idxs``: split into one chunk per (rank, expert), then a ``cat`` in
the new order) and restores the order before the combine. With one expert-parallel and one
tensor-parallel rank that order is the identity, yet the split + cat still copies every routed
token twice in the forward and twice in the backward (H200, qwen3-moe at 4096 tokens: 16 copies
of 32768 x 2048 bf16, 4.8 ms of a 40 ms step; issue 16). :class:`IdentitySortSkip` returns the
tokens as they are in that case: the same values, so the same bits, without the copies.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class IdentitySortSkip:
    """Mixin for ``MoEAlltoAllTokenDispatcher`` subclasses: skip the sort by local expert (and its
    inverse) when it is the identity permutation (one EP rank, one TP rank, no drop-and-pad)."""

    def _sort_is_identity(self) -> bool:
        known = getattr(self, "_identity_sort", None)
        if known is None:
            order = getattr(self, "sort_input_by_local_experts", None)
            known = bool(
                self.ep_size == 1 and self.tp_size == 1 and not self.drop_and_pad and order is not None
                and torch.equal(torch.as_tensor(order).cpu(), torch.arange(len(order)))
            )
            self._identity_sort = known
        return known

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """Megatron's ``dispatch_postprocess`` (same host synchronization points) without the
        identity sort."""
        if not self._sort_is_identity():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", self.tokens_per_expert)
        tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self._sort_is_identity():
            return super().combine_preprocess(hidden_states)
        return hidden_states


class MiniteAlltoAllTokenDispatcher(IdentitySortSkip, MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher with :class:`IdentitySortSkip`."""


class MiniteMoELayer(MoELayer):
    """Megatron's ``MoELayer``; its all-to-all dispatcher skips the identity sort (module docstring)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False, name=None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            dispatcher = MiniteAlltoAllTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                       config=self.config, pg_collection=pg_collection)
            if self.use_shared_expert and self.shared_expert_overlap:
                dispatcher.set_shared_experts(self.shared_experts)
            self.token_dispatcher = dispatcher
