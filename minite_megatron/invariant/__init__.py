"""Batch-invariant math: ops whose per-row results do not depend on the batch size, the batch
composition, or prefill vs decode -- so the learner's teacher-forced log-probs equal the rollout
engine's bitwise (strict mode, and default mode's ``aligned_*`` ops).

Part of the contract layer: pure torch, the fixed-order torch formulation on any device and the
reference of the ``bi_*`` ops of the NVFP4 ``Backend`` (``bi_matmul``, ``bi_rmsnorm``,
``bi_rmsnorm_backward``, ``bi_log_softmax``, ``bi_attention``): each op runs the kernel of
:func:`minite_megatron.nvfp4.backends.invariant_backend` (Triton on a CUDA GPU) where its
``supports`` says yes, else its torch formulation. Functional ops, one module each::

    from minite_megatron.invariant.matmul import linear             # GEMM
    from minite_megatron.invariant.rmsnorm import rms_norm           # RMSNorm
    from minite_megatron.invariant.softmax import log_softmax, softmax, token_log_probs, sigmoid
    from minite_megatron.invariant.attention import attention        # prefill == decode, bitwise
    from minite_megatron.invariant.topk import stable_topk
    from minite_megatron.invariant.activations import silu, gelu_tanh
    from minite_megatron.nvfp4.tree import tree_sum                  # the fixed reduction order
    from minite_megatron.invariant.collectives import invariant_all_reduce, invariant_reduce_scatter

The Megatron-Core modules built on them live in :mod:`minite_megatron.modules` (``linear``,
``norm``, ``core_attention``, ``router``, ``deterministic_moe``); the config rules in
:mod:`minite_megatron.strict_config`. See ``docs/strict.md`` for the guarantee, the cost and what
is not covered.

(The package deliberately re-exports nothing: several functions share their module's name.)
"""
