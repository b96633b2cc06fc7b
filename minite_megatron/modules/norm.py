"""LayerNorm / RMSNorm for the minite specs: sequence-parallel capable, batch invariant in strict mode.

Megatron's torch fallback norm refuses sequence parallelism (its SP gradient all-reduce relies
on the ``sequence_parallel`` attribute that apex's fused norm sets on its parameters); this norm
sets it, so Megatron's ``finalize_model_grads`` all-reduces the norm weights across TP ranks as
it does for apex/TE norms. In strict mode RMSNorm uses the batch-invariant formulation of
:mod:`minite_megatron.invariant.rmsnorm`; so does default mode with ``aligned`` (the recipe's
``aligned_ops``, on by default), so that the rollout engine's decode steps normalize a token
with the learner's bits (the cost is the same: one kernel per norm forward on the GPU, the
ordinary gradient formulas backward). A norm that feeds an NVFP4 linear (``offer_to=``: the
:class:`~minite_megatron.ops.handoff.Handoff` the spec gives both) hands that linear its quantized
output (:mod:`minite_megatron.ops.producers`: one fused kernel on the GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .naming import names_nonfinite


class MiniteNorm(torch.nn.Module):
    """Megatron's ``LayerNormBuilder`` interface: ``MiniteNorm(config=, hidden_size=, eps=)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, batch_invariant: bool = False,
                 offer_to=None, aligned: bool = False, **_):
        super().__init__()
        self.normalization = getattr(config, "normalization", "LayerNorm")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"MiniteNorm supports LayerNorm and RMSNorm, got {self.normalization!r} (--normalization)")
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        self.eps = eps
        self.batch_invariant = batch_invariant
        # RMSNorm in the batch-invariant formulation (strict mode, or default mode aligned with decode)
        self.invariant_rms = bool(batch_invariant or aligned)
        self.hidden_size = hidden_size
        device = "cpu" if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available() else torch.cuda.current_device()
        init = 0.0 if self.zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init, dtype=config.params_dtype, device=device))
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
        sp = bool(getattr(config, "sequence_parallel", False))
        for p in self.parameters():
            setattr(p, "sequence_parallel", sp)
        # The slot shared with the NVFP4 linear this norm feeds (spec): offer it the quantized output
        # (ops.producers). Not under sequence parallelism, where the linear gathers its input first.
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        self.offer_to = offer_to if self.normalization == "RMSNorm" and not (sp and tp > 1) else None

    @names_nonfinite
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offer_to is not None:
            from ..ops.producers import rms_norm_offering

            return rms_norm_offering(x, self.weight, self.eps, self.zero_centered_gamma, self.offer_to, self._norm)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "RMSNorm":
            if self.invariant_rms:
                from ..invariant.rmsnorm import rms_norm

                return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)
            w = self.weight + 1 if self.zero_centered_gamma else self.weight
            if x.dtype == w.dtype:  # torch's fused kernel (fp32 inside): no dtype round trip
                return F.rms_norm(x, (self.hidden_size,), w, self.eps)
            return F.rms_norm(x.float(), (self.hidden_size,), w.float(), self.eps).to(x.dtype)
        if self.batch_invariant:
            raise NotImplementedError("strict mode supports RMSNorm only (--normalization RMSNorm)")
        w = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.layer_norm(x.float(), (self.hidden_size,), w.float(), self.bias.float(), self.eps).to(x.dtype)
