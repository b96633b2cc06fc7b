"""Weight refit for the RL loop: the learner's NVFP4 bytes into a running vLLM model, in place.

The ``minite_nvfp4`` methods keep the parameters in the export's layout (:mod:`.vllm.methods`), so
a refit is vLLM's own weight loading again: each tensor is copied (``param.data.copy_``) into the
storage the model already has, no re-quantization, no new allocation, and the NVFP4 views the
forward uses see the new bytes. Per refit the learner sends, per quantized weight element, half a
byte of codes plus one e4m3 scale per 16 elements (0.5625 bytes) instead of BF16's 2 bytes:
:class:`RefitStats` reports the bytes moved and the BF16 equivalent.

Learner side: :func:`minite_megatron.export.modelopt.export_tensors` turns the Megatron-named
``NVFP4Tensor`` weights (unsharded, TP = EP = 1 view) into the HF-named tensors; gather TP/EP
shards of the quantized bytes first (one global scale per full tensor: the learner's amaxes are
max-reduced across TP ranks, so each rank's shard already carries it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RefitStats:
    """What one refit moved: ``bytes_moved`` (the tensors sent), ``bf16_bytes`` (the same weights
    as BF16: 2 bytes per logical weight element, scales not counted), ``tensors`` (count)."""

    bytes_moved: int
    bf16_bytes: int
    tensors: int

    @property
    def ratio_vs_bf16(self) -> float:
        return self.bytes_moved / self.bf16_bytes if self.bf16_bytes else float("nan")


def refit_stats(tensors: Mapping[str, torch.Tensor]) -> RefitStats:
    """Bytes moved vs BF16 for HF-named export tensors (quantized ``weight`` = uint8 codes, 2 per byte)."""
    moved = bf16 = 0
    for name, t in tensors.items():
        moved += t.numel() * t.element_size()
        if name.endswith(".weight"):
            bf16 += 2 * t.numel() * (2 if t.dtype == torch.uint8 else 1)
    return RefitStats(moved, bf16, len(tensors))


def refit_vllm_model(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     *, load_weights: Callable | None = None) -> RefitStats:
    """Update a running vLLM model's parameters in place with the learner's new weights.

    Args:
        model: the vLLM model (``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``
            or the worker's ``model``), built with ``quantization="minite_nvfp4"``.
        tensors: HF name -> tensor, as :func:`~minite_megatron.export.modelopt.export_tensors` returns
            (or the export directory's tensors).
        load_weights: the loader to run (default ``model.load_weights``, vLLM's own name mapping).
    Returns:
        :class:`RefitStats`.
    Raises:
        ValueError if a tensor would change a parameter's shape or dtype (the refit never allocates),
        RuntimeError if a parameter moved to new storage (a loader that replaced instead of copying).
    """
    items = dict(tensors)
    before = {n: (p.data_ptr(), p.dtype, tuple(p.shape)) for n, p in model.named_parameters()}
    (load_weights or model.load_weights)(iter(items.items()))
    for n, p in model.named_parameters():
        if n in before and before[n] != (p.data_ptr(), p.dtype, tuple(p.shape)):
            raise RuntimeError(f"refit: parameter {n} was replaced, not updated in place ({before[n]} -> "
                               f"{(p.data_ptr(), p.dtype, tuple(p.shape))})")
    for module in model.modules():  # scales may have changed: rebuild the NVFP4 views and checks
        method = getattr(module, "quant_method", None)
        if hasattr(method, "refresh"):
            method.refresh(module)
    return refit_stats(items)


__all__ = ["RefitStats", "refit_stats", "refit_vllm_model"]
