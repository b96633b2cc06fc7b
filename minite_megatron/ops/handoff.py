"""A producer's quantization handed to the NVFP4 linear that consumes its output.

A fused producer (RMSNorm -> quantize: :mod:`.producers`) writes its bf16 output *and* the
fprop operand of the next linear (per-token NVFP4 codes, scales and image) from one read of its
input. It offers the pair to a :class:`Handoff`, the slot the spec gives one producer (``offer_to=``)
and its linear (``handoff=``); the linear's :func:`~.linear.quantize_activation` takes the
quantization instead of reading the activation again, when it is provably the same tensor:

* the same storage, offset, shape (as a 2D ``[M, K]`` matrix), dtype and contiguity, and the
  same version counter (no in-place change since the producer wrote it; tensors made under
  ``torch.inference_mode`` have none, and match on storage alone); the slot holds a
  reference to the producer's output, so its memory cannot be reused for another tensor while
  the offer stands;
* the same quantization: the offer's key (global scale ``"row"``, the non-finite policy, the
  backend) equals the consumer's, and the consumer needs no cross-rank amax (a row-parallel
  linear under tensor parallelism, or a sequence-parallel gather, never matches or is refused).

An offer replaces the previous one; the consumer's take (and its backward) clears the slot
whether it matched or not, so a stale offer never outlives the consumer's next call.
"""

from __future__ import annotations

from collections import namedtuple

import torch

from ..nvfp4.tensor import NVFP4Tensor

_Offer = namedtuple("_Offer", "tensor version quantized key")  # the producer's output, its version, its NVFP4


def activation_key(recipe, backend) -> tuple:
    """What a handed-over fprop activation quantization must agree on with its consumer."""
    return ("row", recipe.nonfinite, backend.name)


def _matrix_key(t: torch.Tensor) -> tuple | None:
    if not t.is_contiguous() or t.dim() == 0:
        return None
    k = t.shape[-1]
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel() // max(k, 1), k, t.dtype, t.device)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version  # inference mode (rollout): no version counter, storage only


class Handoff:
    """The slot of one producer -> NVFP4 linear pair; ``recipe`` is the consumer's recipe."""

    def __init__(self, recipe):
        self.recipe = recipe
        self._offer: _Offer | None = None

    def offer(self, tensor: torch.Tensor, quantized: NVFP4Tensor, key: tuple) -> None:
        """Offer ``quantized`` (the NVFP4 of ``tensor`` as ``[M, K]``) to the consumer."""
        self._offer = None if _matrix_key(tensor) is None else _Offer(tensor, _version(tensor), quantized, key)

    def take(self, tensor: torch.Tensor, key: tuple) -> NVFP4Tensor | None:
        """The offered quantization of ``tensor`` (any contiguous view of the offered output with
        the same ``[M, K]`` matrix), or None. Clears the slot either way."""
        o, self._offer = self._offer, None
        same = o is not None and (mk := _matrix_key(tensor)) is not None and mk == _matrix_key(o.tensor)
        return o.quantized if same and o.key == key and _version(tensor) == o.version else None

    def clear(self) -> None:
        self._offer = None


def clear_all(model: torch.nn.Module) -> None:
    """Clear every producer's slot in ``model`` (after a CUDA-graph capture: offers in graph memory)."""
    for m in model.modules():
        if isinstance(slot := getattr(m, "offer_to", None), Handoff):
            slot.clear()
