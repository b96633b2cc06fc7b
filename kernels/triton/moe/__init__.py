"""MoE fusions without quantization: routing, the deterministic combine, the weighted SwiGLU.

Ops: :mod:`.moe_route` (logits -> top-k -> probabilities -> expert counts),
:mod:`.moe_combine` (``deterministic_unpermute``, ``ordered_sum``),
:mod:`.weighted_swiglu` (forward and fused backward).
"""
