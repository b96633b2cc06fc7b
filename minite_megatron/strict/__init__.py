"""Strict alignment mode: batch-invariant ops whose per-row results do not depend on the batch
size, the batch composition, or prefill vs decode -- so the learner's teacher-forced log-probs
equal the rollout engine's bitwise.

Functional ops (pure torch; the fixed-order ``"torch"`` formulation on any device, the Triton
``bi_*`` kernels on CUDA, see :mod:`.backend`), one module each::

    from minite_megatron.strict.matmul import linear             # GEMM
    from minite_megatron.strict.rmsnorm import rms_norm           # RMSNorm
    from minite_megatron.strict.softmax import log_softmax, softmax, token_log_probs, sigmoid
    from minite_megatron.strict.attention import attention        # prefill == decode, bitwise
    from minite_megatron.strict.topk import stable_topk
    from minite_megatron.strict.activations import silu, gelu_tanh
    from minite_megatron.strict.tree import tree_sum              # the fixed reduction order

Megatron-Core modules and specs (these import megatron): :mod:`.megatron` (all modules),
:mod:`.specs`, :mod:`.config`, :mod:`.parallel_linear`, :mod:`.core_attention`, :mod:`.router`,
:mod:`.moe`, :mod:`.collectives`. See ``docs/strict.md`` for the guarantee, the cost and what is
not covered.

(The package deliberately re-exports nothing: several functions share their module's name.)
"""
