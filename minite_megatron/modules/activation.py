"""The MLP activation of the minite specs (Megatron's ``activation_func`` submodule).

Megatron-Core builds it when ``config.use_te_activation_func`` is set (the launcher sets it
under ``--transformer-impl minite --swiglu``; see :mod:`minite_megatron.megatron_args`) and
otherwise computes the activation inline. It computes what Megatron computes: the GLU
``act(gate) * (up + glu_linear_offset)`` (gate and up clamped where
``activation_func_clamp_value`` says) for ``gated_linear_unit``, else ``act(x)``; SwiGLU as
``silu(gate) * up``, Megatron's ``swiglu``.

An activation that feeds an NVFP4 ``linear_fc2`` (``offer_to=``: their ``Handoff``, spec) hands
that linear the per-token quantization of its output (:mod:`minite_megatron.ops.producers`: one
fused SwiGLU -> NVFP4 kernel on the GPU). Not under tensor parallelism: ``linear_fc2`` is row
parallel, its per-token amax spans the ranks, so the quantization waits for the all-reduce.
MoE experts take the module without an offer: Megatron multiplies the router probabilities
between the activation and ``linear_fc2``. The grouped experts of the minite spec
(:class:`~minite_megatron.modules.grouped_mlp.MiniteGroupedMLP`) instead compute activation x
probabilities in one fused op, which makes that offer itself; they call :meth:`MiniteActivation.activation`
only where no kernel runs (CPU tensors).
"""

from __future__ import annotations

import torch

from .naming import names_nonfinite


class MiniteActivation(torch.nn.Module):
    """``MiniteActivation(config=, offer_to=None)``: Megatron's ``TEActivationFunctionBuilder``."""

    def __init__(self, config, offer_to=None, **_):
        super().__init__()
        self.config = config
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        fusable = (
            config.gated_linear_unit
            and config.activation_func is torch.nn.functional.silu
            and getattr(config, "activation_func_clamp_value", None) is None
            and not getattr(config, "glu_linear_offset", 0.0)
        )
        self.offer_to = offer_to if fusable and tp == 1 else None

    @names_nonfinite
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offer_to is not None:
            from ..ops.producers import swiglu_offering

            return swiglu_offering(x, self.offer_to, self.activation)
        return self.activation(x)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's activation of ``x`` (the unfused computation)."""
        cfg = self.config
        if not cfg.gated_linear_unit:
            return cfg.activation_func(x)
        gate, up = torch.chunk(x, 2, dim=-1)
        if (val := getattr(cfg, "activation_func_clamp_value", None)) is not None:
            gate = gate.clamp(min=None, max=val)
            up = up.clamp(min=-val, max=val)
        if cfg.activation_func is torch.nn.functional.silu and not getattr(cfg, "glu_linear_offset", 0.0):
            return torch.nn.functional.silu(gate) * up  # megatron.core.fusions.fused_bias_swiglu.swiglu
        return cfg.activation_func(gate) * (up + cfg.glu_linear_offset)
