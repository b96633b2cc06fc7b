"""Quantized weights, computed once per weight version and reused until the weight changes.

A cached entry is keyed by (optimizer generation, the parameter's version counter and storage).
The generation is bumped by a global ``torch.optim`` step post-hook, so every optimizer (a
Megatron optimizer wraps a ``torch.optim`` one) invalidates the caches when it steps; an
in-place write to the parameter (loading a checkpoint) bumps its version counter. Call
:func:`invalidate_weight_caches` after changing weights any other way (e.g. ``param.data = ...``).

What an entry holds (memory, issue 16): the packed codes and block scales (4.5 bits per weight)
and nothing derived from them in training -- no BF16 image, no transposed copy. A GEMM that needs
the BF16 image of a weight (Hopper's emulation) builds it just in time and drops it after the
call; the dgrad GEMM reads that image transposed (16x16 tiles), never a relayout. Outside autograd
(rollout, evaluation: the forward runs under ``torch.no_grad``) the image is quantized with the
codes and kept, since decode steps reuse it many times. By default a layer's entry
is dropped once its backward has used it, so at the end of a backward -- where a training step's
memory peaks, every gradient allocated -- no layer holds quantized weights (H200, qwen3-moe at
4096 tokens: peak 10.79 GiB against 12.00 GiB keeping them; the BF16 twin 10.34 GiB). With
gradient accumulation the next micro-batch then quantizes again (the same bits, one more
quantize pass per weight and micro-batch); ``keep_codes`` keeps them for the next micro-batch
instead (once per optimizer step). The owner of a cache (the layer) sets both options from its
recipe (``keep_weight_images``, ``keep_weight_codes``).
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from torch.optim.optimizer import register_optimizer_step_post_hook

from ..nvfp4.tensor import NVFP4Tensor

_GENERATION = [0]
_LIVE: "weakref.WeakSet[QuantizedWeightCache]" = weakref.WeakSet()


def invalidate_weight_caches() -> None:
    """Force every cached quantized weight to be recomputed at its next use."""
    _GENERATION[0] += 1


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate_weight_caches()


register_optimizer_step_post_hook(_on_optimizer_step)


def cached_bytes() -> dict[str, int]:
    """Bytes held by every live cache (each storage counted once): ``packed`` (codes, scales,
    global scales), ``images``, ``transposed`` (relayouts kept for backends that need them) and
    the number of ``entries``."""
    out = {"entries": 0, "packed": 0, "images": 0, "transposed": 0}
    seen: set[int] = set()

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out[kind] += st.nbytes()

    for cache in list(_LIVE):
        if cache._q is None:
            continue
        out["entries"] += 1
        for q, packed in ((cache._q, "packed"), (cache._qt, "transposed")):
            if q is not None:
                for t in (q.codes, q.block_scales, q.global_decode):
                    add(packed, t)
                add("images" if packed == "packed" else "transposed", q.image)
    return out


class QuantizedWeightCache:
    """Holds one weight's NVFP4 form -- or the stacked form of a list of expert weights -- and,
    for backends that need it, its transpose for dgrad (see the module docstring).

    ``keep_images``: keep the BF16 image in training too (2 more bytes per weight until the backward);
    ``keep_codes``: keep the entry after the layer's backward (0.56 bytes per weight more there)."""

    def __init__(self, keep_images: bool = False, keep_codes: bool = False):
        self.keep_images_in_training, self.keep_codes = keep_images, keep_codes
        self._key = None
        self._q: NVFP4Tensor | None = None
        self._qt: NVFP4Tensor | None = None
        _LIVE.add(self)

    @staticmethod
    def _key_of(weights, extra) -> tuple:
        ws = (weights,) if isinstance(weights, torch.Tensor) else tuple(weights)
        return (_GENERATION[0], extra) + tuple((w._version, w.data_ptr(), w.dtype, w.shape) for w in ws)

    def get(self, weights, quantize, extra=None, *, with_image: bool | None = None,
            image_once: bool = False) -> NVFP4Tensor:
        """The quantized weight(s); ``quantize(weights, with_image)`` (``weights``: a detached
        tensor, or the list as given) runs only when the key changed. ``with_image``: does the
        entry carry the BF16 image (default :meth:`keep_images`, taken where autograd's grad mode
        is the caller's)? ``image_once`` (the forward GEMM): where it does not, ``quantize`` writes
        the image anyway (from the quantize pass itself instead of a separate image pass over the
        codes); the caller gets it for this one call, the entry keeps codes and scales only (a
        cache hit returns those)."""
        with_image = self.keep_images() if with_image is None else with_image
        once = image_once and not with_image
        key = self._key_of(weights, extra)
        if key != self._key:
            with torch.no_grad():
                q = quantize(weights.detach() if isinstance(weights, torch.Tensor) else weights, with_image or once)
            self._q = replace(q, image=None) if once and q.image is not None else q
            self._qt = None
            self._key = key
            return q
        return self._q

    def transposed(self, make) -> NVFP4Tensor:
        """The dgrad operand ``W^T`` (``make(q)``: an exact relayout for 16x16 tiles), for
        backends without a GEMM that reads ``W`` transposed."""
        if self._qt is None:
            with torch.no_grad():
                self._qt = make(self._q)
        return self._qt

    def keep_images(self) -> bool:
        """Should a weight quantized now carry (and its entry keep) its BF16 image?"""
        return self.keep_images_in_training or not torch.is_grad_enabled()

    def release_after_backward(self) -> None:
        """Called by a layer's backward once it has used the weight (unless ``keep_codes``)."""
        if not self.keep_codes:
            self.clear()

    def clear(self) -> None:
        self._key = self._q = self._qt = None
