"""The MoE layer of the minite specs in default mode: Megatron's, minus an identity permutation.

Megatron's all-to-all token dispatcher sorts the tokens it received "by local expert" after the
all-to-all (``sort_chunks_by_idxs``: split into one chunk per (rank, expert), then a ``cat`` in
the new order) and restores the order before the combine. With one expert-parallel and one
tensor-parallel rank that order is the identity, yet the split + cat still copies every routed
token twice in the forward and twice in the backward (H200, qwen3-moe at 4096 tokens: 16 copies
of 32768 x 2048 bf16, 4.8 ms of a 40 ms step; issue 16). :class:`IdentitySortSkip` returns the
tokens as they are in that case: the same values, so the same bits, without the copies.

In that same case Megatron's dispatcher still copies the token counts to the host and waits for
them once per MoE layer (``_maybe_dtoh_and_synchronize``: ``TEGroupedMLP.forward`` takes a host
list), so the host is never more than one layer ahead of the GPU and the GPU idles wherever a
segment's launch work is longer than its kernels (H200, qwen3-moe, 16384 tokens: the NVFP4 step
127.1 ms for 122.1 ms of GPU time; issue 16). :class:`DeviceTokenCounts` leaves them on the device
when the experts take them there (``MiniteGroupedMLP.why_host_counts``): no copy, no wait; the
experts get a :class:`~minite_megatron.nvfp4.group_sizes.DeviceGroupSizes` and compute the same
bits. Everywhere else the wait stays, and :meth:`DeviceTokenCounts.why_host_counts` says why.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ..nvfp4.group_sizes import DeviceGroupSizes


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


class DeviceTokenCounts(IdentitySortSkip):
    """Mixin for ``MoEAlltoAllTokenDispatcher`` subclasses: :class:`IdentitySortSkip`, and where
    :meth:`why_host_counts` is None the token counts stay on the device -- no device-to-host copy,
    no wait -- and reach the experts as a ``DeviceGroupSizes`` (module docstring). The MoE layer
    names its experts with :meth:`set_experts`; ``counts_on_device = False`` on a built dispatcher
    keeps Megatron's wait (an A/B in one process)."""

    counts_on_device = True
    _counts_experts = None  # the experts (set_experts), if they answer why_host_counts
    _why_host: str | None = "no dispatch yet"  # this dispatch's answer of why_host_counts

    def set_experts(self, experts) -> None:
        """The experts this dispatcher feeds: their ``why_host_counts(dtype, device)`` says whether
        they take device counts (modules without one take host counts)."""
        self._counts_experts = experts if callable(getattr(experts, "why_host_counts", None)) else None

    def why_host_counts(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> str | None:
        """None if a dispatch of tokens of ``dtype`` on ``device`` (defaults: the experts') leaves
        the token counts on the device, else why Megatron's copy and wait stay."""
        c = self.config
        checks = (
            (not self.counts_on_device, "counts_on_device is off"),
            (self.ep_size > 1, "expert parallelism: the all-to-all takes its split sizes on the host"),
            (self.tp_size > 1, "expert tensor parallelism: the all-gather takes its split sizes on the host"),
            (self.drop_and_pad, "moe_pad_expert_input_to_capacity (fixed capacity: Megatron neither copies nor waits)"),
            (c.moe_expert_capacity_factor is not None,
             "moe_expert_capacity_factor: the permutation's output size is a host int (a wait before it)"),
            (bool(c.moe_router_padding_for_quantization),
             "moe_router_padding_for_quantization: the permutation's output size is a host int (a wait before it)"),
            (bool(c.moe_permute_fusion), "moe_permute_fusion (Transformer Engine's fused permutation)"),
            (self.cuda_dtoh_point != "before_permutation_1" and c.cuda_graph_impl != "full_iteration",
             "per-layer CUDA graphs of the MoE preprocessing"),
            (not self._sort_is_identity(), "the sort by local expert is not the identity"),
            (self._counts_experts is None, "the experts take host counts (Megatron's TEGroupedMLP / SequentialMLP)"),
        )
        why = next((why for bad, why in checks if bad), None)
        if why is None:
            if device is None:
                device = next(self._counts_experts.parameters()).device
            why = self._counts_experts.why_host_counts(dtype, device)
            why = None if why is None else f"the experts: {why}"
        return why

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Megatron's, after deciding (:meth:`why_host_counts`) whether the counts stay on the device."""
        self._why_host = self.why_host_counts(hidden_states.dtype, hidden_states.device)
        return super().dispatch_preprocess(hidden_states, routing_map, probs)

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if self._why_host is None:  # the counts stay where they are: no copy, no wait
            return tokens_per_expert
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a CUDA graph capture reached the MoE token dispatcher's host copy of its token "
                               f"counts ({point}): {self._why_host}")
        return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        tokens, tokens_per_expert, probs = super().dispatch_postprocess(global_input_tokens, global_probs)
        if self._why_host is None:
            tokens_per_expert = DeviceGroupSizes(tokens_per_expert, tokens.shape[0])
        return tokens, tokens_per_expert, probs


class MiniteAlltoAllTokenDispatcher(DeviceTokenCounts, MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher with :class:`IdentitySortSkip` and :class:`DeviceTokenCounts`."""


class MiniteMoELayer(MoELayer):
    """Megatron's ``MoELayer``; its all-to-all dispatcher skips the identity sort and, where the
    experts take them, leaves the token counts on the device (module docstring)."""

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
            dispatcher.set_experts(self.experts)
            self.token_dispatcher = dispatcher
