"""Strict alignment mode: batch-invariant ops whose per-row results do not depend on the batch
size, the batch composition, or prefill vs decode -- so the learner's teacher-forced log-probs
equal the rollout engine's bitwise.

Functional ops (pure torch; ``"torch"`` fixed-order formulation on any device, the Triton
``bi_*`` kernels on CUDA, see :mod:`.backend`)::

    from minite_megatron import strict
    strict.linear(x, w, b, out_dtype=torch.float32)     # GEMM
    strict.rms_norm(x, w, eps)                          # RMSNorm
    strict.log_softmax(logits) / strict.softmax(x, mask=...) / strict.token_log_probs(logits, ids)
    strict.attention(q, k, v, scale=..., causal=True)   # prefill == decode, bitwise
    strict.stable_topk(scores, k); strict.silu(x); strict.tree_sum(x, dim)

Megatron-Core modules and specs (import megatron): :mod:`.megatron`, :mod:`.specs`,
:mod:`.config`. See ``docs/strict.md`` for the guarantee, the cost and what is not covered.
"""

from .activations import gelu_tanh, silu
from .attention import attention
from .backend import resolve as resolve_backend
from .backend import use_backend
from .matmul import linear
from .rmsnorm import rms_norm
from .softmax import log_softmax, sigmoid, softmax, token_log_probs
from .topk import stable_topk
from .tree import tree_sum

__all__ = [
    "attention",
    "gelu_tanh",
    "linear",
    "log_softmax",
    "resolve_backend",
    "rms_norm",
    "sigmoid",
    "silu",
    "softmax",
    "stable_topk",
    "token_log_probs",
    "tree_sum",
    "use_backend",
]
