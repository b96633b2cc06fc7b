"""The Megatron-Core modules of strict mode, in one place (what the minite specs import).

- :class:`StrictDotProductAttention`: core attention (training and the static KV-cache path).
- :class:`StrictTopKRouter`: FP32 batch-invariant gating, stable top-k.
- :class:`StrictMoELayer`: deterministic combine of the expert outputs.
- :class:`StrictColumnParallelLinear` / :class:`StrictRowParallelLinear`: batch-invariant GEMM
  and TP reductions for the high-precision linears.
- :data:`StrictRMSNorm`: batch-invariant RMSNorm builder (layer norm, qk-layernorm, final norm).
"""

from .core_attention import StrictDotProductAttention
from .parallel_linear import StrictColumnParallelLinear, StrictRowParallelLinear
from .moe import StrictMoELayer, deterministic_unpermute
from .router import StrictTopKRouter, topk_routing
from .specs import StrictRMSNorm, StrictSpecProvider

__all__ = [
    "StrictColumnParallelLinear",
    "StrictDotProductAttention",
    "StrictMoELayer",
    "StrictRMSNorm",
    "StrictRowParallelLinear",
    "StrictSpecProvider",
    "StrictTopKRouter",
    "deterministic_unpermute",
    "topk_routing",
]
