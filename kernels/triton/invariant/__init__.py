"""Batch-invariant (``bi_*``) kernels of the strict path: one fixed reduction order per row.

Ops (each equal to its reference in :mod:`minite_megatron.invariant`): :mod:`.bi_matmul`,
:mod:`.bi_rmsnorm`, :mod:`.bi_rmsnorm_backward`, :mod:`.bi_log_softmax`, :mod:`.bi_attention`.
Shared pieces: :mod:`.bi_common`.
"""
