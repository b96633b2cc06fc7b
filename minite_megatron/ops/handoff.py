"""A producer's quantization handed to the NVFP4 linear that consumes its output.

A fused producer (RMSNorm -> quantize: :mod:`.producers`) writes its bf16 output *and* the
fprop operand of the next linear (per-token NVFP4 codes, scales and image) from one read of its
input. It offers the pair here; the linear's :func:`~.linear.quantize_activation` takes the
quantization instead of reading the activation again, when it is provably the same tensor:

* the same storage, offset, shape (as a 2D ``[M, K]`` matrix), dtype and contiguity, and the
  same version counter (no in-place change since the producer wrote it; tensors made under
  ``torch.inference_mode`` have none, and match on storage alone); the slot holds a
  reference to the producer's output, so its memory cannot be reused for another tensor while
  the offer stands;
* the same quantization: the offer's key (global scale ``"row"``, the non-finite policy, the
  backend) equals the consumer's, and the consumer needs no cross-rank amax (a row-parallel
  linear under tensor parallelism, or a sequence-parallel gather, never matches or is refused).

One slot per thread (the forward pass is sequential): an offer replaces the previous one, and
taking it clears it, so a stale offer never outlives the next producer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..nvfp4.tensor import NVFP4Tensor


@dataclass(frozen=True)
class _Offer:
    tensor: torch.Tensor
    version: int
    quantized: NVFP4Tensor
    key: tuple


_slot = threading.local()


def activation_key(recipe, backend) -> tuple:
    """What a handed-over fprop activation quantization must agree on with its consumer."""
    return ("row", recipe.nonfinite, backend.name)


def _matrix_key(t: torch.Tensor) -> tuple | None:
    if not t.is_contiguous() or t.dim() == 0:
        return None
    k = t.shape[-1]
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel() // max(k, 1), k, t.dtype, t.device)


def _version(t: torch.Tensor) -> int | None:
    # inference-mode tensors keep no version counter (the rollout engine): storage identity only
    return None if t.is_inference() else t._version


def offer(tensor: torch.Tensor, quantized: NVFP4Tensor, key: tuple) -> None:
    """Offer ``quantized`` (the NVFP4 of ``tensor`` as ``[M, K]``) to the next consumer."""
    if _matrix_key(tensor) is None:
        _slot.offer = None
        return
    _slot.offer = _Offer(tensor, _version(tensor), quantized, key)


def take(tensor: torch.Tensor, key: tuple) -> NVFP4Tensor | None:
    """The offered quantization of ``tensor`` (any contiguous view of the offered output with
    the same ``[M, K]`` matrix), or None. Clears the slot either way when it matched the storage."""
    o: _Offer | None = getattr(_slot, "offer", None)
    if o is None:
        return None
    mk = _matrix_key(tensor)
    if mk is None or mk != _matrix_key(o.tensor):
        return None
    _slot.offer = None
    if o.key != key or _version(tensor) != o.version:
        return None
    return o.quantized


def clear() -> None:
    _slot.offer = None
