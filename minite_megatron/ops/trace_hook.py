"""The trace hook: how ops and the rollout engine hand named tensors to a diagnostics tracer.

Ops and the rollout engine sit below :mod:`minite_megatron.diagnostics` and never import it; a
:class:`~minite_megatron.diagnostics.capture.Tracer` pushes itself onto :data:`ACTIVE` while it
records and pops itself after. With no tracer active a call is one list-truthiness test.
"""

from __future__ import annotations

import torch

ACTIVE: list = []
"""The active tracers, innermost last (filled by ``diagnostics.capture.Tracer``)."""


def active_tracer():
    """The innermost active tracer, or None."""
    return ACTIVE[-1] if ACTIVE else None


def capture(name: str, tensor: torch.Tensor) -> None:
    """Record a per-token tensor under ``name`` if a tracer is active (else do nothing)."""
    if ACTIVE:
        ACTIVE[-1].record(name, tensor, keys=None)
