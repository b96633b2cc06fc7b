"""The NVFP4 grouped linear for MoE experts, behind Megatron's grouped-MLP module.

Built by ``TEGroupedMLP`` (which runs without Transformer Engine when TE's fp8/fp4 flags are
off) through its fc1/fc2 builders::

    NVFP4GroupedLinear(num_local_experts, input_size, output_size, *, config, init_method, bias,
                       skip_bias_add, is_expert, tp_comm_buffer_name, pg_collection, name,
                       recipe=..., parallel_mode="column" | "row", precision=..., handoff=None)
    forward(x [T, K], tokens_per_expert: list[int] | DeviceGroupSizes) -> (y [T, N], bias or None)
    why_host_counts(dtype=None, device=None) -> None, or why the counts must reach the host

One call runs all local experts: in NVFP4, or with ``precision="bf16"`` (the BF16 twin and the
recipe's BF16 layers) through ``torch._grouped_mm`` (:func:`~minite_megatron.ops.grouped_linear.
bf16_grouped_linear`; strict mode: the batch-invariant GEMM per expert). Parameters are
``weight{i}`` / ``bias{i}`` as TE's grouped linear names them, so Megatron's expert sharded state
dict (and its SwiGLU fc1 factory) apply unchanged and checkpoints are interchangeable with TE's
and the sequential experts'. They are allocated as consecutive slices of one ``[G, N, K]``
buffer (:meth:`NVFP4GroupedLinear.stacked_weights`), so the grouped kernels read all experts
without a stacked copy and the weight cache keys on one version counter. Expert
linears do no communication (the token dispatcher does); with expert tensor parallelism the
column output / row input is divided by the expert-TP size.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from ..ops.grouped_linear import (
    bf16_grouped_linear,
    bf16_why_host_sizes,
    expert_weights,
    nvfp4_grouped_linear,
    nvfp4_why_host_sizes,
)
from ..ops.weight_cache import QuantizedWeightCache
from ..ops.linear import LinearContext
from ..recipe import Recipe
from .linear import check_multiple_of_16
from .naming import names_nonfinite


def _pg_size(group) -> int:
    return group.size() if group is not None else 1


def _pg_rank(group) -> int:
    return group.rank() if group is not None else 0


class NVFP4GroupedLinear(MegatronModule):
    """All local experts' ``y_g = x_g @ W_g^T (+ b_g)`` in one NVFP4 op."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = True,
        tp_comm_buffer_name: str | None = None,
        pg_collection=None,
        name: str | None = None,
        recipe: Recipe | None = None,
        parallel_mode: str = "column",
        precision: str = "nvfp4",
        handoff=None,
    ):
        super().__init__(config=config)
        if parallel_mode not in ("column", "row"):
            raise ValueError(f"parallel_mode must be 'column' or 'row', got {parallel_mode!r}")
        if precision not in ("nvfp4", "bf16"):
            raise ValueError(f"precision must be 'nvfp4' or 'bf16', got {precision!r}")
        self.precision = precision
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "expt_dp"])
        self.recipe = recipe if recipe is not None else Recipe()
        self.num_gemms = num_gemms
        self.parallel_mode = parallel_mode
        self.skip_bias_add = skip_bias_add
        self.use_bias = bias
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        tp = _pg_size(self._tp_group)
        self.in_features = divide(input_size, tp) if parallel_mode == "row" else input_size
        self.out_features = divide(output_size, tp) if parallel_mode == "column" else output_size
        if precision == "nvfp4":
            flags = "--hidden-size, --moe-ffn-hidden-size and --expert-tensor-parallel-size"
            check_multiple_of_16(self.in_features, "the per-rank input size of an expert linear", flags)
            check_multiple_of_16(self.out_features, "the per-rank output size of an expert linear (16x16 tiles)", flags)
        # Megatron's rule (ColumnParallelLinear): expert params reduce over the expert-DP group
        # when experts are sharded differently from dense layers
        use_expert_pgs = _pg_size(pg_collection.ep) > 1 or config.expert_tensor_parallel_size != config.tensor_model_parallel_size

        device = torch.cuda.current_device() if torch.cuda.is_available() and not config.use_cpu_initialization else "cpu"
        partition_dim = 0 if parallel_mode == "column" else 1
        # one buffer, one slice per expert: the grouped GEMMs read [G, N, K] as a view
        buffer = torch.empty(num_gemms, self.out_features, self.in_features, dtype=config.params_dtype, device=device)
        for i in range(num_gemms):
            w = torch.nn.Parameter(buffer[i])
            if config.perform_initialization and config.use_cpu_initialization:
                _initialize_affine_weight_cpu(
                    w, output_size, input_size, self.out_features if parallel_mode == "column" else self.in_features,
                    partition_dim, init_method, params_dtype=config.params_dtype,
                    rank=_pg_rank(self._tp_group), world_size=tp,
                )
            elif config.perform_initialization:
                _initialize_affine_weight_gpu(w, init_method, partition_dim=partition_dim, is_expert=True)
            else:
                set_tensor_model_parallel_attributes(w, is_parallel=True, dim=partition_dim, stride=1)
            setattr(w, "allreduce", not use_expert_pgs)
            self.register_parameter(f"weight{i}", w)
            if bias:
                b = torch.nn.Parameter(torch.zeros(self.out_features, dtype=config.params_dtype, device=device))
                if parallel_mode == "column":
                    set_tensor_model_parallel_attributes(b, is_parallel=True, dim=0, stride=1)
                setattr(b, "allreduce", not use_expert_pgs)
                self.register_parameter(f"bias{i}", b)
        # handoff: the slot the experts' fused activation offers this (fc2) linear its input's
        # quantization in (spec; ops.moe_activation)
        self.minite_ctx = LinearContext(self.recipe, None, tp_group=self._tp_group, parallel_mode=parallel_mode,
                                        handoff=handoff if precision == "nvfp4" else None)
        self._weights_cache = QuantizedWeightCache(self.recipe.keep_weight_images, self.recipe.keep_weight_codes)
        # the [G, N, K] buffer the weight{i} are slices of, while they still are (not a
        # registered buffer: the parameters are the state)
        self._weight_buffer = buffer.detach()
        self._buffer_ptrs = [getattr(self, f"weight{i}").data_ptr() for i in range(num_gemms)]

    # ---- forward ------------------------------------------------------------------------------
    @property
    def weights(self) -> list[torch.Tensor]:
        params = self._parameters  # direct lookups: this runs several times per step (host-bound at 4096 tokens)
        return [params[f"weight{i}"] for i in range(self.num_gemms)]

    def stacked_weights(self) -> torch.Tensor | None:
        """The experts' weights as one ``[G, N, K]`` tensor without a copy (the buffer they were
        allocated in), or None once a parameter was moved or rebound (``param.data = ...``, a
        device move): the ops then stack them (a copy per use)."""
        buf = self._weight_buffer
        if buf is None:
            return None
        ws = self.weights
        if ws[0].dtype != buf.dtype or [w.data_ptr() for w in ws] != self._buffer_ptrs:
            self._weight_buffer = None  # for good: let the old buffer go
            return None
        return buf

    @property
    def biases(self) -> list[torch.Tensor] | None:
        return [self._parameters[f"bias{i}"] for i in range(self.num_gemms)] if self.use_bias else None

    @property
    def trace_name(self) -> str | None:
        return self.minite_ctx.trace_name

    @trace_name.setter
    def trace_name(self, name: str | None) -> None:
        self.minite_ctx.trace_name = name

    def why_host_counts(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> str | None:
        """None if :meth:`forward` takes ``tokens_per_expert`` as a ``DeviceGroupSizes`` (counts
        left on the device: no host wait) for inputs of ``dtype`` (default: the weights') on
        ``device`` (default: the weights'), else the reason it needs them on the host."""
        w = self.weight0
        dtype = w.dtype if dtype is None else dtype
        device = w.device if device is None else torch.device(device)
        if self.use_bias:
            return "the expert linears have biases"
        if _pg_size(self._tp_group) > 1:
            return "expert tensor parallelism"
        if self.precision == "nvfp4":
            return nvfp4_why_host_sizes(self.recipe, device)
        return bf16_why_host_sizes(dtype, device, w.dtype)

    @names_nonfinite
    def forward(self, x: torch.Tensor, tokens_per_expert):
        # Megatron's grouped MLP passes one host list to fc1 and fc2: kept as it is, so that the
        # two linears share its device index tensors (ops.grouped_linear.shared_group_sizes); a
        # DeviceGroupSizes (the MoE layer without its routing wait) is passed on the same way
        sizes = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else tokens_per_expert
        fused_bias = self.biases if (self.use_bias and not self.skip_bias_add) else None
        if self.precision == "nvfp4":
            y = nvfp4_grouped_linear(x, sizes, self.weights, fused_bias, self.minite_ctx, self._weights_cache,
                                     self.stacked_weights())
        else:
            y = self._bf16_forward(x, sizes, fused_bias)
        if self.use_bias and self.skip_bias_add:
            return y, self.biases
        return y, None

    def _bf16_forward(self, x, sizes, biases):
        """High-precision experts (the BF16 twin, BF16 layers): ``torch._grouped_mm``; in strict
        mode the batch-invariant GEMM, one per expert."""
        if not self.recipe.strict:
            return bf16_grouped_linear(x, sizes, self.weights, biases, self.stacked_weights())
        from ..invariant.matmul import linear

        outs = [
            linear(xe, w, None if biases is None else biases[g])
            for g, (xe, w) in enumerate(zip(torch.split(x, [int(s) for s in sizes]), self.weights))
        ]
        return torch.cat(outs) if outs else x.new_zeros(0, self.out_features)

    def quantized_weight(self):
        """The ``[G, N, K]`` NVFP4 expert weights the forward uses (what export writes), or None
        in BF16 precision."""
        from ..ops.linear import backend_for

        if self.precision != "nvfp4":
            return None
        return expert_weights(self._weights_cache, self.weights, self.recipe, backend_for(self.recipe, self.weight0.device),
                              self.minite_ctx, stacked=self.stacked_weights())

    def backward_dw(self) -> None:
        """Delayed wgrad is not used: weight gradients are computed in backward."""

    # ---- checkpointing --------------------------------------------------------------------------
    def get_extra_state(self):
        """None: miniTE keeps no per-module state beyond the weights (quantized weights are derived
        from them). Written, like the sequential experts' linears and TE's grouped linear do, so
        checkpoints interchange with theirs."""
        return None

    def set_extra_state(self, state) -> None:
        """Accept (and ignore) what a sequential-expert or TE checkpoint holds here: miniTE
        derives its scales from the weights, so FP8-style metadata has nothing to restore."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for i in range(1, self.num_gemms):  # the other experts' extra states (distributed checkpoints)
            state_dict.pop(f"{prefix}_extra_state{i}", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Per expert: ``weight{i}`` sharded over expert TP (axis 0 column / 1 row) and placed at
        its global expert index along the expert axis, and its ``_extra_state`` object, with keys
        identical to the sequential experts' (``SequentialMLP``) and TE's grouped linear's, so
        checkpoints load in both directions. Dict keys as TE's: ``_extra_state`` (expert 0),
        ``_extra_state{i}`` (the others)."""
        singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
        ep = self._pg_collection.ep
        num_global = _pg_size(ep) * self.num_gemms
        offset = _pg_rank(ep) * self.num_gemms
        ep_axis = len(sharded_offsets)
        tp_axis = 0 if self.parallel_mode == "column" else 1
        out = {}
        for i in range(self.num_gemms):
            gidx = offset + i
            state = {f"{i}.weight": getattr(self, f"weight{i}"), f"{i}._extra_state": self.get_extra_state()}
            axis_map = {f"{i}.weight": tp_axis}
            if self.use_bias:
                state[f"{i}.bias"] = getattr(self, f"bias{i}")
                if self.parallel_mode == "column":
                    axis_map[f"{i}.bias"] = 0
            if singleton_local_shards:
                expert_prefix, offsets = f"{gidx}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (ep_axis, gidx, num_global))
            sub = make_sharded_tensors_for_checkpoint(
                state, "", axis_map, offsets, tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"]
            )
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            if self.use_bias:
                out[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        expt_dp_rank = _pg_rank(getattr(self._pg_collection, "expt_dp", None))
        for sh in out.values():
            sh.replica_id = (*sh.replica_id[:2], expt_dp_rank)
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(per expert [in={self.in_features}, out={self.out_features}] x "
            f"{self.num_gemms}, bias={self.use_bias}, mode={self.parallel_mode}, recipe.strict={self.recipe.strict})"
        )
