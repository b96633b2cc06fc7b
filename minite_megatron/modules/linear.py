"""NVFP4 tensor-parallel linears: Megatron's own linears with only the GEMM replaced.

``NVFP4ColumnParallelLinear`` / ``NVFP4RowParallelLinear`` subclass Megatron-Core's
``ColumnParallelLinear`` / ``RowParallelLinear`` and override ``_forward_impl`` alone, so
parameters, initialisation, sharded state dicts, and the TP/SP communication stay Megatron's:
the sequence-parallel all-gather (backward: reduce-scatter) and the dgrad all-reduce go through
Megatron's own ``gather_from_sequence_parallel_region`` / ``copy_to_tensor_model_parallel_region``
autograd functions, the row-parallel reduction through Megatron's ``forward``.

``precision="bf16"`` keeps Megatron's GEMM (the BF16 first/last layers of a recipe), except in
strict mode, where every high-precision linear (attention projections, dense MLPs, experts of
``SequentialMLP``, BF16 first/last layers) is batch invariant:

- the GEMM is :func:`minite_megatron.invariant.matmul.linear` (a row's result cannot depend on
  how many tokens share the call; fp32 accumulation, one rounding);
- the row-parallel forward reduction (all-reduce, or reduce-scatter with sequence parallelism)
  is :mod:`minite_megatron.invariant.collectives`' fixed-order version instead of NCCL's
  size-dependent one (:func:`strict_row_parallel_forward`).
The column-parallel input all-gather and every backward collective stay Megatron's (they move
data without adding, or only affect gradients). Strict mode does not support (raises
NotImplementedError) deferred embedding wgrad (``grad_output_buffer``) and gradient-tensor-parallel
weight rematerialization (``gtp_remat_size > 1``).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

from ..invariant.collectives import invariant_all_reduce, invariant_reduce_scatter
from ..invariant.matmul import linear as batch_invariant_linear
from ..nvfp4.formats import BLOCK
from ..ops.linear import LinearContext, nvfp4_linear
from ..ops.weight_cache import QuantizedWeightCache
from ..recipe import Recipe
from .naming import names_nonfinite


class MiniteConfigError(ValueError):
    """A model shape the NVFP4 recipe cannot run; the message names the Megatron flag."""


def check_multiple_of_16(value: int, what: str, flag: str) -> None:
    if value % BLOCK:
        raise MiniteConfigError(
            f"NVFP4 needs {what} to be a multiple of {BLOCK}, got {value} (check {flag})"
        )


def _refuse_strict_unsupported(grad_output_buffer=None, gtp_remat_size=1, **_):
    if grad_output_buffer is not None:
        raise NotImplementedError("strict linears do not support defer_embedding_wgrad_compute")
    if gtp_remat_size and gtp_remat_size > 1:
        raise NotImplementedError("strict linears do not support gtp_remat_size > 1")


def strict_row_parallel_forward(linear: RowParallelLinear, input_parallel: torch.Tensor):
    """Megatron's ``RowParallelLinear.forward`` with the strict GEMM (``linear._gemm``) and the
    fixed-order TP reduction: ``input_`` [s, b, h/tp] (or [tokens, h/tp] for experts) ->
    ``(output, bias or None)``."""
    if not linear.input_is_parallel:
        if linear.sequence_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel=True")
        input_parallel = scatter_to_tensor_model_parallel_region(input_parallel, group=linear.tp_group)
    output_parallel = linear._gemm(input_parallel, linear.weight, None)
    if linear.explicit_expert_comm:
        if not linear.skip_bias_add:
            raise ValueError("expert RowParallelLinear must use skip_bias_add=True")
        output_ = output_parallel
    elif linear.sequence_parallel:
        output_ = invariant_reduce_scatter(output_parallel, group=linear.tp_group)
    else:
        output_ = invariant_all_reduce(output_parallel, group=linear.tp_group)
    if not linear.skip_bias_add:
        return ((output_ + linear.bias) if linear.bias is not None else output_), None
    return output_, linear.bias


class _NVFP4LinearMixin:
    """Shared state and the replaced GEMM of the two tensor-parallel linears."""

    def _bind_tp(self, parallel_mode: str) -> None:
        self.minite_ctx.tp_group = self.tp_group
        self.minite_ctx.parallel_mode = parallel_mode

    def _init_minite(self, recipe: Recipe | None, precision: str, handoff=None) -> None:
        if precision not in ("nvfp4", "bf16"):
            raise ValueError(f"precision must be 'nvfp4' or 'bf16', got {precision!r}")
        self.recipe = recipe if recipe is not None else Recipe()
        self.precision = precision
        cache = QuantizedWeightCache(self.recipe.keep_weight_images, self.recipe.keep_weight_codes)
        self.minite_ctx = LinearContext(self.recipe, cache, handoff=handoff)

    @property
    def trace_name(self) -> str | None:
        return self.minite_ctx.trace_name

    @trace_name.setter
    def trace_name(self, name: str | None) -> None:
        self.minite_ctx.trace_name = name

    def quantized_weight(self):
        """The NVFP4 weight the forward uses (what export writes), or None in BF16 precision."""
        if self.precision != "nvfp4":
            return None
        from ..ops.linear import backend_for, weight_operand

        return weight_operand(self.minite_ctx, self.weight, backend_for(self.recipe, self.weight.device))

    @names_nonfinite
    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.precision == "nvfp4":
            return nvfp4_linear(x, weight, bias, self.minite_ctx)
        return batch_invariant_linear(x, weight, bias)


class NVFP4ColumnParallelLinear(_NVFP4LinearMixin, ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` with an NVFP4 GEMM (weights ``[N/tp, K]``)."""

    def __init__(self, input_size, output_size, *, config, init_method, recipe: Recipe | None = None, precision: str = "nvfp4",
                 handoff=None, **kwargs):
        self._init_minite(recipe, precision, handoff)
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        self._bind_tp("column")
        if precision == "nvfp4":
            check_multiple_of_16(input_size, "the input size of a column-parallel linear", "--hidden-size / --ffn-hidden-size")
            if self.recipe.weight_tile == "2d":
                check_multiple_of_16(
                    self.output_size_per_partition,
                    "the per-rank output size of a column-parallel linear (16x16 weight tiles)",
                    "--hidden-size, --num-attention-heads, --kv-channels, --ffn-hidden-size and --tensor-model-parallel-size",
                )

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **kwargs):
        if self.precision == "bf16" and not self.recipe.strict:
            return super()._forward_impl(
                input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel, tp_group=tp_group, **kwargs,
            )
        if self.recipe.strict:
            _refuse_strict_unsupported(**kwargs)
        group = tp_group if tp_group is not None else self.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        return self._gemm(input, weight, bias)


class NVFP4RowParallelLinear(_NVFP4LinearMixin, RowParallelLinear):
    """Megatron's ``RowParallelLinear`` with an NVFP4 GEMM (weights ``[N, K/tp]``)."""

    def __init__(self, input_size, output_size, *, config, init_method, recipe: Recipe | None = None, precision: str = "nvfp4",
                 handoff=None, **kwargs):
        self._init_minite(recipe, precision, handoff)
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        self._bind_tp("row")
        if precision == "nvfp4":
            check_multiple_of_16(
                self.input_size_per_partition,
                "the per-rank input size of a row-parallel linear",
                "--hidden-size, --ffn-hidden-size and --tensor-model-parallel-size",
            )
            if self.recipe.weight_tile == "2d":
                check_multiple_of_16(output_size, "the output size of a row-parallel linear (16x16 weight tiles)", "--hidden-size")

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **kwargs):
        if self.precision == "bf16" and not self.recipe.strict:
            return super()._forward_impl(
                input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel, tp_group=tp_group, **kwargs,
            )
        return self._gemm(input, weight, bias)

    def forward(self, input_):
        """Megatron's forward; in strict mode its TP reduction is the fixed-order one (NCCL's
        all-reduce / reduce-scatter order depends on the message size, i.e. on the batch)."""
        if self.recipe.strict:
            return strict_row_parallel_forward(self, input_)
        return super().forward(input_)
