"""The weights a captured decode step reads, at fixed addresses, refreshed per weight version.

A CUDA graph replays the device pointers it was captured with, while the learner's weight
caches (:class:`~minite_megatron.ops.weight_cache.QuantizedWeightCache`) hand out a *new*
quantized tensor after every optimizer step. :class:`StaticWeight` therefore holds its own
copy of the bytes the learner's forward uses -- a module's ``quantized_weight()`` (the very
codes, block scales, global scale of the learner's cache, never re-quantized, and for dense
linears the exact bf16 image an image GEMM reads), or a stack of expert weights -- and :meth:`StaticWeight.refresh`
copies a new version into the same memory. Parameters the decode step reads directly (norms,
router, embeddings, LM head, BF16 linears) are updated in place by the optimizer and need
nothing.

A refresh is keyed on the source object: the learner's cache returns the same tensor until its
key (optimizer generation, the parameters' version counters and storages) changes, so
``refresh()`` is one identity test per weight when nothing changed, and one device copy of
the new bytes when something did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..nvfp4.grouped import stack_expert_weights
from ..nvfp4.tensor import NVFP4Tensor
from ..ops.weight_cache import QuantizedWeightCache

_FIELDS = ("codes", "block_scales", "global_decode", "image")


def _image(q: NVFP4Tensor) -> torch.Tensor:
    """The bf16 image of a quantized weight: the attached one, or built from its codes (exact;
    the learner's training forward keeps none, :mod:`~minite_megatron.ops.weight_cache`)."""
    return q.image if q.image is not None else q.bf16_image().reshape(q.shape)


def _copy_nvfp4(dst: NVFP4Tensor, src: NVFP4Tensor) -> None:
    for f in _FIELDS:
        d = getattr(dst, f)
        if d is None:
            continue
        s = _image(src) if f == "image" else getattr(src, f)
        if s is None or tuple(s.shape) != tuple(d.shape) or s.dtype != d.dtype:
            raise RuntimeError(f"decode weights: the new {f} ({None if s is None else tuple(s.shape)}) does not "
                               f"fit the captured buffer {tuple(d.shape)}; re-create the engine")
        d.copy_(s)


def _clone_nvfp4(q: NVFP4Tensor, keep_image: bool) -> NVFP4Tensor:
    image = _image(q).clone() if keep_image else None
    return replace(q, codes=q.codes.clone(), block_scales=q.block_scales.clone(),
                   global_decode=q.global_decode.clone(), image=image)


class DecodeWeights(list):
    """The :class:`StaticWeight` list of a decode model; ``alias``: the model's quantized weights
    are frozen at fixed addresses (:mod:`.resident`), so the NVFP4 ones are read in place
    (no second copy of 17 GB at Qwen3-30B-A3B's size) instead of cloned."""

    def __init__(self, alias: bool = False):
        super().__init__()
        self.alias = alias

    def nvfp4(self, source: Callable[[], object], *, keep_image: bool = True) -> "StaticWeight":
        """A :class:`StaticWeight` of a quantized-weight source (not yet listed: append it)."""
        return StaticWeight(source, keep_image=keep_image, alias=self.alias)


class StaticWeight:
    """One decode weight at a fixed address: ``source()`` gives the current version (an
    ``NVFP4Tensor``, or a list of dense expert weights to stack ``[E, N, K]``); :attr:`value` is
    the fixed-address copy the step reads."""

    def __init__(self, source: Callable[[], object], *, keep_image: bool = True, alias: bool = False):
        self.source = source
        self.keep_image = keep_image
        self.alias = alias
        self._seen = None
        self.value = None
        self.refresh()

    def refresh(self) -> bool:
        """Copy the source's current version in if it changed; returns whether it did."""
        src = self.source()
        if isinstance(src, (list, tuple)):  # dense experts: keyed like the learner's weight caches
            seen = QuantizedWeightCache._key_of(src, "stack")
        else:
            seen = src
        if self._seen is not None and (seen is self._seen or (isinstance(seen, tuple) and seen == self._seen)):
            return False
        with torch.no_grad():
            if isinstance(src, (list, tuple)):
                if self.value is None:
                    self.value = torch.stack([w.detach() for w in src])
                else:
                    for e, w in enumerate(src):
                        self.value[e].copy_(w.detach())
            elif self.alias:  # frozen weights (a resident model): the source's own tensors, as they are
                self.value = src
            elif self.value is None:
                self.value = _clone_nvfp4(src, self.keep_image)
            else:
                _copy_nvfp4(self.value, src)
        self._seen = seen
        return True


def stacked_nvfp4(linears: Sequence[torch.nn.Module]) -> Callable[[], NVFP4Tensor]:
    """Source of ``[E, N, K]`` stacked NVFP4 expert weights from per-expert NVFP4 linears
    (``stack_expert_weights`` of their ``quantized_weight()``), re-stacked when any changes."""
    memo: dict = {"key": None, "value": None, "refs": None}

    def source():
        qs = [m.quantized_weight() for m in linears]
        key = tuple(id(q) for q in qs)
        if key != memo["key"]:
            memo["value"] = stack_expert_weights(qs)
            memo["key"] = key
            memo["refs"] = qs  # keeps the ids of the key alive (and so meaningful)
        return memo["value"]

    return source
