"""Tensor-parallel linears for strict mode: Megatron's own modules, batch-invariant GEMM and
TP reductions.

``StrictColumnParallelLinear`` / ``StrictRowParallelLinear`` subclass Megatron's
``ColumnParallelLinear`` / ``RowParallelLinear``: same constructor, parameters, initialization,
sharded state dict and TP/SP communication, only

- the GEMM is :func:`minite_megatron.strict.matmul.linear` (a row's result cannot depend on how
  many tokens share the call; fp32 accumulation, one rounding);
- the row-parallel forward reduction (all-reduce, or reduce-scatter with sequence parallelism)
  is :mod:`.collectives`' fixed-order version instead of NCCL's size-dependent one.
The column-parallel input all-gather and every backward collective are Megatron's (they move
data without adding, or only affect gradients). Use them for every high-precision linear in
strict mode (attention projections, dense MLPs, experts of ``SequentialMLP``, BF16 first/last
layers); the NVFP4 linears of :mod:`minite_megatron.modules` are batch invariant by the NVFP4
contract and call the same GEMM in their BF16 precision.

Not supported (raise NotImplementedError): deferred embedding wgrad (``grad_output_buffer``)
and gradient-tensor-parallel weight rematerialization (``gtp_remat_size > 1``).
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

from .collectives import invariant_all_reduce, invariant_reduce_scatter
from .matmul import linear as batch_invariant_linear


def _unsupported(grad_output_buffer=None, gtp_remat_size=1, **_):
    if grad_output_buffer is not None:
        raise NotImplementedError("strict linears do not support defer_embedding_wgrad_compute")
    if gtp_remat_size and gtp_remat_size > 1:
        raise NotImplementedError("strict linears do not support gtp_remat_size > 1")


class StrictColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` whose GEMM is batch invariant (see the module docstring)."""

    minite_strict = True

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **kwargs):
        _unsupported(**kwargs)
        group = tp_group if tp_group is not None else self.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        return batch_invariant_linear(input, weight, bias)


class StrictRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` with a batch-invariant GEMM and fixed-order TP reduction."""

    minite_strict = True

    def _strict_gemm(self, input_parallel):
        """The local GEMM (a subclass with another batch-invariant GEMM overrides only this)."""
        return batch_invariant_linear(input_parallel, self.weight, None)

    def forward(self, input_):
        """``input_`` [s, b, h/tp] (or [tokens, h/tp] for experts) -> ``(output, bias or None)``."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            if self.sequence_parallel:
                raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel=True")
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output_parallel = self._strict_gemm(input_parallel)
        if self.explicit_expert_comm:
            if not self.skip_bias_add:
                raise ValueError("expert RowParallelLinear must use skip_bias_add=True")
            output_ = output_parallel
        elif self.sequence_parallel:
            output_ = invariant_reduce_scatter(output_parallel, group=self.tp_group)
        else:
            output_ = invariant_all_reduce(output_parallel, group=self.tp_group)
        if not self.skip_bias_add:
            output = (output_ + self.bias) if self.bias is not None else output_
            return output, None
        return output_, self.bias
