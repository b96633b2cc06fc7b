"""Quantized weights, computed once per optimizer step and reused across micro-batches.

A cached entry is keyed by (optimizer generation, the parameter's version counter and storage).
The generation is bumped by a global ``torch.optim`` step post-hook, so every optimizer (a
Megatron optimizer wraps a ``torch.optim`` one) invalidates the caches when it steps; an
in-place write to the parameter (loading a checkpoint) bumps its version counter. Call
:func:`invalidate_weight_caches` after changing weights any other way (e.g. ``param.data = ...``).
"""

from __future__ import annotations

import torch

from torch.optim.optimizer import register_optimizer_step_post_hook

from ..nvfp4.tensor import NVFP4Tensor

_GENERATION = [0]


def invalidate_weight_caches() -> None:
    """Force every cached quantized weight to be recomputed at its next use."""
    _GENERATION[0] += 1


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate_weight_caches()


register_optimizer_step_post_hook(_on_optimizer_step)


class QuantizedWeightCache:
    """Holds one weight's NVFP4 form -- or the stacked form of a list of expert weights -- and,
    lazily, its transpose for dgrad."""

    def __init__(self):
        self._key = None
        self._q: NVFP4Tensor | None = None
        self._qt: NVFP4Tensor | None = None

    @staticmethod
    def _key_of(weights, extra) -> tuple:
        ws = (weights,) if isinstance(weights, torch.Tensor) else tuple(weights)
        return (_GENERATION[0], extra) + tuple((w._version, w.data_ptr(), w.dtype, w.shape) for w in ws)

    def get(self, weights, quantize, extra=None) -> NVFP4Tensor:
        """The quantized weight(s); ``quantize(weights)`` (a detached tensor, or the list as
        given) runs only when the key changed."""
        key = self._key_of(weights, extra)
        if key != self._key:
            with torch.no_grad():
                self._q = quantize(weights.detach() if isinstance(weights, torch.Tensor) else weights)
            self._qt = None
            self._key = key
        return self._q

    def transposed(self, make) -> NVFP4Tensor:
        """The dgrad operand ``W^T`` (``make(q)``: an exact relayout for 16x16 tiles)."""
        if self._qt is None:
            with torch.no_grad():
                self._qt = make(self._q)
        return self._qt

    def clear(self) -> None:
        self._key = self._q = self._qt = None
