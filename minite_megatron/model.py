"""Post-build settings of a GPT model that the layer specs cannot reach: the LM head.

``GPTModel`` builds its output layer itself (not from the layer spec). With
``recipe.fp32_lm_head`` (always in strict mode) the logits are computed in FP32 from the BF16
hidden states and weight (batch invariant in strict mode), on the learner and the rollout
engine alike, so both see the same logits and log-softmax.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from .recipe import Recipe


class FP32OutputLayer(ColumnParallelLinear):
    """Megatron's vocab-parallel output layer with an FP32 GEMM (batch invariant if ``strict``).

    Same parameters and state dict as ``ColumnParallelLinear``; only ``_forward_impl`` differs.
    """

    minite_strict: bool = False

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **kwargs):
        group = tp_group if tp_group is not None else self.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        if self.minite_strict:
            from .invariant.matmul import linear

            return linear(input, weight, bias, out_dtype=torch.float32)
        out = torch.matmul(input.float(), weight.float().t())
        return out + bias.float() if bias is not None else out


def finalize_gpt_model(model: torch.nn.Module, recipe: Recipe | None = None) -> torch.nn.Module:
    """Apply the recipe's LM-head choice to a built ``GPTModel`` (or a wrapper holding one).

    The output layer keeps its parameters (and any optimizer/DDP references to them); only its
    class changes to :class:`FP32OutputLayer`, which adds no state. Also names every miniTE
    module (:func:`~minite_megatron.modules.naming.name_modules`), so that a non-finite
    activation under ``nonfinite="raise"`` names its layer.
    """
    from .modules.naming import name_modules

    recipe = recipe if recipe is not None else Recipe()
    name_modules(model)
    for module in model.modules():
        head = getattr(module, "output_layer", None)
        if isinstance(head, ColumnParallelLinear) and recipe.fp32_lm_head:
            if not isinstance(head, FP32OutputLayer):
                head.__class__ = FP32OutputLayer
            head.minite_strict = recipe.strict
    return model
