"""NVFP4 tensor-parallel linears: Megatron's own linears with only the GEMM replaced.

``NVFP4ColumnParallelLinear`` / ``NVFP4RowParallelLinear`` subclass Megatron-Core's
``ColumnParallelLinear`` / ``RowParallelLinear`` and override ``_forward_impl`` alone, so
parameters, initialisation, sharded state dicts, and the TP/SP communication stay Megatron's:
the sequence-parallel all-gather (backward: reduce-scatter) and the dgrad all-reduce go through
Megatron's own ``gather_from_sequence_parallel_region`` / ``copy_to_tensor_model_parallel_region``
autograd functions, the row-parallel reduction through Megatron's ``forward``.

``precision="bf16"`` keeps Megatron's GEMM (the BF16 first/last layers of a recipe), except in
strict mode, where a batch-invariant high-precision GEMM is used so that row results do not
depend on the batch.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from ..nvfp4.formats import BLOCK
from ..ops.linear import LinearContext, nvfp4_linear
from ..ops.weight_cache import QuantizedWeightCache
from ..recipe import Recipe


class MiniteConfigError(ValueError):
    """A model shape the NVFP4 recipe cannot run; the message names the Megatron flag."""


def check_multiple_of_16(value: int, what: str, flag: str) -> None:
    if value % BLOCK:
        raise MiniteConfigError(
            f"NVFP4 needs {what} to be a multiple of {BLOCK}, got {value} (check {flag})"
        )


class _NVFP4LinearMixin:
    """Shared state and the replaced GEMM of the two tensor-parallel linears."""

    def _bind_tp(self, parallel_mode: str) -> None:
        self.minite_ctx.tp_group = self.tp_group
        self.minite_ctx.parallel_mode = parallel_mode

    def _init_minite(self, recipe: Recipe | None, precision: str) -> None:
        if precision not in ("nvfp4", "bf16"):
            raise ValueError(f"precision must be 'nvfp4' or 'bf16', got {precision!r}")
        self.recipe = recipe if recipe is not None else Recipe()
        self.precision = precision
        self.minite_ctx = LinearContext(self.recipe, QuantizedWeightCache())

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

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.precision == "nvfp4":
            return nvfp4_linear(x, weight, bias, self.minite_ctx)
        from ..strict.matmul import linear as batch_invariant_linear

        return batch_invariant_linear(x, weight, bias)


class NVFP4ColumnParallelLinear(_NVFP4LinearMixin, ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` with an NVFP4 GEMM (weights ``[N/tp, K]``)."""

    def __init__(self, input_size, output_size, *, config, init_method, recipe: Recipe | None = None, precision: str = "nvfp4", **kwargs):
        self._init_minite(recipe, precision)
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
        group = tp_group if tp_group is not None else self.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        return self._gemm(input, weight, bias)


class NVFP4RowParallelLinear(_NVFP4LinearMixin, RowParallelLinear):
    """Megatron's ``RowParallelLinear`` with an NVFP4 GEMM (weights ``[N, K/tp]``)."""

    def __init__(self, input_size, output_size, *, config, init_method, recipe: Recipe | None = None, precision: str = "nvfp4", **kwargs):
        self._init_minite(recipe, precision)
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

    def _strict_gemm(self, input_parallel):
        return self._gemm(input_parallel, self.weight, None)

    def forward(self, input_):
        """Megatron's forward; in strict mode its TP reduction is the fixed-order one (NCCL's
        all-reduce / reduce-scatter order depends on the message size, i.e. on the batch)."""
        if self.recipe.strict:
            from ..strict.parallel_linear import StrictRowParallelLinear

            return StrictRowParallelLinear.forward(self, input_)
        return super().forward(input_)
