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
expert order (the rollout engine's decode step). On a GPU both run as one Triton kernel each way
(``minite_kernels.triton.moe.moe_combine``: the forward gathers and adds a token's rows in that
order, the backward is a gather), bitwise equal to the torch formulations here
(:func:`deterministic_unpermute_reference`, :func:`ordered_sum_reference`), which CPU tensors use.
Measured on the H200 before the kernel (qwen3-moe preset, 16384 tokens, issue 16): the torch
formulation and its backward took ~40 ms of a 216 ms strict step.

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

from .moe import DeviceTokenCounts
from ..nvfp4.backends import kernel_backend
from ..nvfp4.moe_reference import deterministic_unpermute_reference, ordered_sum_reference  # noqa: F401  (the contract)
from ..invariant.collectives import invariant_reduce_scatter


def deterministic_unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int, *,
                            kernels_on_cpu: bool = False) -> torch.Tensor:
    """Sum the permuted rows back into their tokens in a fixed order: the backend's
    ``deterministic_unpermute`` for the rows' device (:func:`~minite_megatron.nvfp4.backends.kernel_backend`:
    the Triton kernel on a GPU, the contract's :func:`deterministic_unpermute_reference` elsewhere;
    ``kernels_on_cpu``: the kernel on CPU tensors too, under ``TRITON_INTERPRET=1``): the same bits
    either way. Arguments, result and errors as there, except that on a GPU out-of-range indices
    trigger a device-side assertion (no host synchronization).
    """
    return kernel_backend(permuted.device, kernels_on_cpu).deterministic_unpermute(permuted, sorted_indices, num_tokens)


def ordered_sum(rows: torch.Tensor, *, kernels_on_cpu: bool = False) -> torch.Tensor:
    """``[T, k, H]`` -> ``[T, H]``: :func:`ordered_sum_reference`'s bits, through the backend's
    ``ordered_sum`` (one kernel on a GPU; ``kernels_on_cpu`` as :func:`deterministic_unpermute`).
    No host sync; CUDA-graph capturable."""
    return kernel_backend(rows.device, kernels_on_cpu).ordered_sum(rows)


class _OrderedPermuteBackward(torch.autograd.Function):
    """Megatron's permuted tokens (``tokens.index_select(0, sorted_indices)``, computed by its
    dispatcher) with the backward :func:`deterministic_unpermute`: each token's gradient is the
    sum of its rows' gradients in increasing row order, instead of ``index_add_``'s atomics (a
    different order per run on a GPU; on a CPU ``index_add_`` adds in this same order, so the
    bits there are Megatron's). On the H200 that ``index_add_`` took ~2.2 ms per MoE layer at
    16384 tokens (qwen3-moe, issue 16)."""

    @staticmethod
    def forward(ctx, tokens, permuted, sorted_indices, kernels_on_cpu):
        ctx.save_for_backward(sorted_indices)
        ctx.shape = tokens.shape
        ctx.kernels_on_cpu = kernels_on_cpu
        return permuted.view_as(permuted)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        shape = ctx.shape
        out = deterministic_unpermute(grad, sorted_indices, shape.numel() // shape[-1], kernels_on_cpu=ctx.kernels_on_cpu)
        return out.view(shape), None, None, None


def ordered_permute_backward(tokens: torch.Tensor, permuted: torch.Tensor, sorted_indices: torch.Tensor, *,
                             kernels_on_cpu: bool = False) -> torch.Tensor:
    """``permuted`` (= ``tokens.view(-1, H).index_select(0, sorted_indices)``, already computed)
    re-attached to ``tokens`` with the deterministic backward of :class:`_OrderedPermuteBackward`;
    unchanged when no gradient flows to ``tokens``."""
    if not (torch.is_grad_enabled() and tokens.requires_grad):
        return permuted
    return _OrderedPermuteBackward.apply(tokens, permuted.detach(), sorted_indices, bool(kernels_on_cpu))


class _KernelsOnCPU:
    """A deterministic dispatcher's ``kernels_on_cpu``: its combine runs the Triton kernels on CPU
    tensors too (under ``TRITON_INTERPRET=1``); set by :class:`DeterministicMoELayer`'s argument."""

    kernels_on_cpu = False


class StrictAllGatherTokenDispatcher(_KernelsOnCPU, MoEAllGatherTokenDispatcher):
    """All-gather dispatcher with :func:`deterministic_unpermute`, the deterministic permutation
    backward (:func:`ordered_permute_backward`) and a fixed-order reduce-scatter."""

    def dispatch_postprocess(self, hidden_states, probs):
        permuted, tokens_per_expert, local_probs = super().dispatch_postprocess(hidden_states, probs)
        permuted = ordered_permute_backward(hidden_states, permuted, self.reversed_local_input_permutation_mapping,
                                            kernels_on_cpu=self.kernels_on_cpu)
        return permuted, tokens_per_expert, local_probs

    def combine_preprocess(self, hidden_states):
        return deterministic_unpermute(
            hidden_states, self.reversed_local_input_permutation_mapping, self.hidden_shape_before_permute[0],
            kernels_on_cpu=self.kernels_on_cpu,
        )

    def token_combine(self, hidden_states):
        if self.tp_size > 1 or self.ep_size > 1:
            out = invariant_reduce_scatter(hidden_states.to(self.local_probs.dtype), group=self.tp_ep_group)
            return out.to(hidden_states.dtype)
        return hidden_states


class StrictAlltoAllTokenDispatcher(_KernelsOnCPU, DeviceTokenCounts, MoEAlltoAllTokenDispatcher):
    """All-to-all dispatcher with :func:`deterministic_unpermute` and the deterministic
    permutation backward (:func:`ordered_permute_backward`; the all-to-alls only move rows); the
    identity sort skipped and the counts left on the device where they can be (:mod:`.moe`)."""

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        permuted, permuted_probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
        permuted = ordered_permute_backward(hidden_states, permuted, self.reversed_local_input_permutation_mapping,
                                            kernels_on_cpu=self.kernels_on_cpu)
        return permuted, permuted_probs

    def combine_postprocess(self, permutated_local_input_tokens):
        output = deterministic_unpermute(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            self.hidden_shape_before_permute[0],
            kernels_on_cpu=self.kernels_on_cpu,
        ).view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


class DeterministicMoELayer(MoELayer):
    """Megatron's ``MoELayer`` with a deterministic combine (see the module docstring).

    Where the combine cannot be replaced (a dispatcher or option listed in the module
    docstring) it keeps Megatron's and says so once in the log; :class:`StrictMoELayer` raises
    instead. ``deterministic_combine`` tells which one a layer runs. ``kernels_on_cpu`` (tests, CPU
    smoke runs): the combine's Triton kernels run on CPU tensors too, under ``TRITON_INTERPRET=1``
    (elsewhere CPU tensors take the contract's torch formulation: the same bits).
    """

    require_deterministic = False

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False, name=None,
                 kernels_on_cpu: bool = False):
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
        dispatcher.kernels_on_cpu = bool(kernels_on_cpu)
        if self.use_shared_expert and self.shared_expert_overlap:
            dispatcher.set_shared_experts(self.shared_experts)
        if isinstance(dispatcher, DeviceTokenCounts):
            dispatcher.set_experts(self.experts)
        self.megatron_token_dispatcher = self.token_dispatcher  # Megatron's, for before/after comparisons
        self.token_dispatcher = dispatcher
        self.deterministic_combine = True


def use_kernels_on_cpu(model: torch.nn.Module, on: bool = True) -> None:
    """``kernels_on_cpu`` for every deterministic MoE layer of a built ``model`` (a CPU smoke run that
    exercises the GPU's combine kernels, interpreted)."""
    for m in model.modules():
        if isinstance(m, DeterministicMoELayer) and isinstance(m.token_dispatcher, _KernelsOnCPU):
            m.token_dispatcher.kernels_on_cpu = bool(on)


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
