"""Megatron's grouped experts with their weighted SwiGLU fused (issue 16).

:class:`MiniteGroupedMLP` is Megatron's ``TEGroupedMLP`` whose forward, where it applies, computes
fc1's activation times the routing probabilities in one op
(:func:`minite_megatron.ops.moe_activation.weighted_swiglu`: the same bits as Megatron's
``activation_func(h)``, ``* permuted_probs``, ``.to(dtype)`` -- the minite activation module under
``use_te_activation_func``, else Megatron's inline GLU with its ``up + glu_linear_offset``
(bias-activation fusion off); with an NVFP4 ``linear_fc2`` it
also hands fc2 its per-token quantization through their ``Handoff``, ``offer_to=``) and its
backward in one kernel. Everything else is ``TEGroupedMLP.forward``: whenever a feature the fused
path does not implement is on, it falls back to it (:meth:`MiniteGroupedMLP.why_unfused` names
the reason). Switched off with the recipe field ``fused_moe_activation`` (``Recipe(...,
fused_moe_activation=False)``) or, on a built model, by setting ``fuse_activation = False`` on
the module. Experts in fp32 (or any dtype but bf16 / fp16) run Megatron's forward too.

In the fused path the experts also take their token counts left on the device
(:meth:`MiniteGroupedMLP.why_host_counts`; the MoE layer's dispatcher then neither copies them to
the host nor waits: :mod:`.moe`).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP

from ..nvfp4.group_sizes import DeviceGroupSizes
from ..ops.moe_activation import weighted_swiglu
from ..recipe import Recipe
from ..settings import settings
from .activation import MiniteActivation
from .naming import names_nonfinite


def _inline_glu(x: torch.Tensor) -> torch.Tensor:
    """``TEGroupedMLP``'s inline ``glu`` for SwiGLU without clamp or offset (``use_te_activation_func`` off)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(gate) * (up + 0.0)


#: fc1 output dtypes the fused kernels read (fp32 experts, e.g. CPU tests, keep Megatron's autograd chain)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class MiniteGroupedMLP(TEGroupedMLP):
    """``TEGroupedMLP(num_local_experts, config, submodules, pg_collection, name, *, recipe=,
    offer_to=)``: ``offer_to`` is the ``Handoff`` the spec gave ``linear_fc2`` (None: BF16 fc2)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None, *,
                 recipe: Recipe | None = None, offer_to=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        self.recipe = recipe if recipe is not None else Recipe()
        tp = self.tp_group.size() if self.tp_group is not None else 1
        self.offer_to = offer_to if tp == 1 else None  # row-parallel fc2 under expert TP: amax spans ranks
        self.fuse_activation = self.why_unfused() is None

    def why_unfused(self) -> str | None:
        """None if the fused activation applies to this module's configuration, else the reason."""
        c = self.config
        if not self.recipe.fused_moe_activation:
            return "the recipe's fused_moe_activation is off"
        if c.use_te_activation_func and not isinstance(self.activation_func, MiniteActivation):
            return "the activation submodule is not the minite activation module"
        checks = (
            (not c.use_te_activation_func and c.bias_activation_fusion,
             "Megatron's weighted bias-SwiGLU fusion (bias_activation_fusion) computes another rounding"),
            (not c.gated_linear_unit or c.activation_func is not torch.nn.functional.silu, "the activation is not SwiGLU"),
            (c.activation_func_clamp_value is not None, "activation_func_clamp_value is set"),
            (bool(c.glu_linear_offset), "glu_linear_offset is set"),
            (c.moe_mlp_glu_interleave_size is not None, "moe_mlp_glu_interleave_size is set"),
            (c.add_bias_linear, "the expert linears have biases"),
            (self.activation_recompute, "the MoE activation is recomputed (recompute_modules moe_act)"),
            (bool(c.fine_grained_activation_offloading), "fine-grained activation offloading is on"),
            (self._with_fused_impl, "Transformer Engine's op fuser runs the experts"),
            (bool(c.fp8 or c.fp4), "TE fp8/fp4 padding is on"),
            (c.moe_apply_probs_on_input, "moe_apply_probs_on_input is set"),
            (bool(getattr(c, "moe_paged_stash", False)), "moe_paged_stash is set"),
            ((c.moe_ffn_hidden_size or 0) % 16 != 0, "the per-expert FFN size is not a multiple of 16"),
        )
        return next((why for bad, why in checks if bad), None)

    def why_host_counts(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> str | None:
        """None if :meth:`forward` takes the token counts left on the device (a
        ``DeviceGroupSizes``: no host wait; the token dispatcher asks before it dispatches) for
        tokens of ``dtype`` on ``device`` (defaults: fc1's weights'), else the reason the counts
        must reach the host (Megatron's forward, or a linear that needs host sizes). Asked once
        per dispatch: the answer is kept per (dtype, device, the recipe objects, weight dtype,
        ``MINITE_BACKEND``)."""
        if not self.fuse_activation:
            return f"the experts run Megatron's forward ({self.why_unfused() or 'fuse_activation is off'})"
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        weight = fc1.weight0
        dtype = weight.dtype if dtype is None else dtype
        device = weight.device if device is None else torch.device(device)
        key = (dtype, device, id(self.recipe), id(getattr(fc1, "recipe", None)), id(getattr(fc2, "recipe", None)),
               weight.dtype, settings().backend)  # (recipes are frozen: their ids)
        cache = self.__dict__.setdefault("_host_counts_answers", {})
        if key not in cache:
            cache[key] = self._why_host_counts(dtype, device)
        return cache[key]

    def _why_host_counts(self, dtype, device) -> str | None:
        if dtype not in _KERNEL_DTYPES:
            return f"the experts run Megatron's forward on {dtype} tokens"
        for name in ("linear_fc1", "linear_fc2"):
            linear = getattr(self, name)
            ask = getattr(linear, "why_host_counts", None)
            why = f"{type(linear).__name__} takes host counts" if ask is None else ask(dtype, device)
            if why is not None:
                return f"{name}: {why}"
        return None

    @names_nonfinite
    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, output_buffer=None,
                grad_input_buffer=None):
        """``TEGroupedMLP.forward`` (same arguments and result) with the fused activation;
        ``tokens_per_expert`` may be a ``DeviceGroupSizes`` (where :meth:`why_host_counts` is
        None; Megatron's forward, if it runs after all, brings it to the host: its ``tolist()``)."""
        if (not self.fuse_activation or output_buffer is not None or grad_input_buffer is not None
                or permuted_local_hidden_states.dtype not in _KERNEL_DTYPES):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, output_buffer,
                                   grad_input_buffer)
        # one host list for fc1 and fc2, as Megatron passes it (they share its device index tensors),
        # or the counts left on the device, shared the same way
        if isinstance(tokens_per_expert, DeviceGroupSizes):
            sizes = tokens_per_expert
        else:
            sizes = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        fc1_output, _ = self.linear_fc1(permuted_local_hidden_states, sizes)
        if self.config.use_te_activation_func:
            act = weighted_swiglu(fc1_output, permuted_probs, self.offer_to, self.activation_func.activation)
        else:  # Megatron's inline GLU: silu(gate) * (up + glu_linear_offset), the offset 0
            act = weighted_swiglu(fc1_output, permuted_probs, self.offer_to, _inline_glu, inline_glu=True)
        output, _ = self.linear_fc2(act, sizes)
        return output, None
