"""Deterministic top-k with stable ties (MoE routing in strict mode).

``torch.topk`` does not document which index wins a tie, and its algorithm may change with the
shape. :func:`stable_topk` sorts each row with a *stable* descending sort: the k largest values,
ties broken by the lower index, the same for a row whatever else shares the call. ``-0.0`` and
``+0.0`` compare equal (a tie). NaN scores raise instead of being routed somewhere arbitrary.

While a CUDA graph is captured the NaN check cannot wait for the GPU: inside
:func:`nan_checks_on_device` (a learner step captured by ``training.cuda_graphs.GraphedStep``)
each check becomes a device flag that the graph's owner reads after the replay; outside it (the
rollout engine's captured decode step) the engine checks its logits itself.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_FLAGS: list | None = None  # while recording: one bool device tensor per NaN check


@contextmanager
def nan_checks_on_device():
    """Within: a NaN check of :func:`stable_topk` under CUDA-graph capture appends ``isnan(scores).any()``
    (a bool device tensor, recomputed by every replay) to the list this yields, instead of being skipped."""
    global _FLAGS
    if _FLAGS is not None:
        raise RuntimeError("nan_checks_on_device: already recording")
    _FLAGS = flags = []
    try:
        yield flags
    finally:
        _FLAGS = None


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of ``scores`` along ``dim``, in descending order, ties to the lower
    index.

    Args:
        scores: floating tensor; ``+-inf`` allowed.
        k: ``1 <= k <= scores.shape[dim]``.
        check_finite: raise on NaN (costs one host sync; while a CUDA graph is being captured, a
            device flag inside :func:`nan_checks_on_device`, else skipped: the module docstring).
    Returns:
        ``(values, indices)``, each ``scores.shape`` with ``dim`` of length ``k``; indices int64.
    Raises:
        ValueError for a bad ``k`` or (``check_finite``) NaN scores.
    """
    n = scores.shape[dim]
    if not 1 <= k <= n:
        raise ValueError(f"stable_topk: k={k} must lie in [1, {n}]")
    capturing = scores.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_finite and capturing:
        if _FLAGS is not None:
            _FLAGS.append(torch.isnan(scores).any())
    elif check_finite and bool(torch.isnan(scores).any()):
        raise ValueError("stable_topk: NaN in the routing scores (strict mode refuses to route them)")
    values, indices = torch.sort(scores, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)
