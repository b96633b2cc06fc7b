"""Backends that implement the contract, and the dispatcher that picks one.

A backend exposes ``available(device) -> bool``, ``why_not(device) -> str | None`` (the reason
it cannot run there) and the ops ``quantize``, ``gemm``, ``grouped_gemm``, ``grouped_wgrad`` with the reference's
signatures, and ``decode_grouped_gemm`` (MoE decode on unsorted rows routed to experts).
``get_backend(None, device)`` picks the best available one for the device:
``blackwell`` (sm_100a/sm_103a FP4 tensor cores) > ``triton`` (any CUDA GPU) > ``reference``
(pure torch, always available). ``MINITE_BACKEND=<name>`` overrides the choice.

Kernel backends live in the ``minite_kernels`` package and are imported lazily, so this
package imports only torch.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from .gemm import gemm_reference
from .grouped import decode_grouped_gemm_reference, grouped_gemm_reference, grouped_wgrad_gemm_reference, grouped_wgrad_reference
from .quantize import quantize_reference
from .tensor import NVFP4Tensor


def triton_interpreting() -> bool:
    """Does Triton run kernels in its interpreter (CPU tensors; ``TRITON_INTERPRET`` read with
    Triton's own rule: 1/true/on/yes)? Read without importing Triton."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class BackendUnavailable(RuntimeError):
    """A backend was asked for where it cannot run; the message says why."""


class Backend(Protocol):
    name: str

    def available(self, device: torch.device | None = None) -> bool: ...

    def why_not(self, device: torch.device | None = None) -> str | None: ...

    def quantize(self, x: torch.Tensor, **kwargs) -> NVFP4Tensor: ...

    def gemm(
        self,
        a: NVFP4Tensor,
        b: NVFP4Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        batch_invariant: bool = False,
    ) -> torch.Tensor: ...

    def grouped_gemm(
        self,
        a: NVFP4Tensor,
        b: NVFP4Tensor,
        group_sizes: Sequence[int],
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        batch_invariant: bool = False,
    ) -> torch.Tensor: ...

    def grouped_wgrad(
        self,
        grad_out: torch.Tensor,
        x: torch.Tensor,
        group_sizes: Sequence[int],
        **kwargs,
    ) -> torch.Tensor: ...

    def decode_grouped_gemm(
        self,
        a: NVFP4Tensor,
        w_stacked: NVFP4Tensor,
        expert_ids: torch.Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
        batch_invariant: bool = False,
        *,
        num_experts: int | None = None,
        group_offsets: torch.Tensor | None = None,  # rows already sorted by expert: [E + 1] prefix offsets
    ) -> torch.Tensor: ...

    # optional: the GEMM half of grouped_wgrad on pre-quantized operands (the reference's is
    # used on the backend's device when a backend does not provide it)
    # def grouped_wgrad_gemm(self, a, b, padded_group_sizes, out_dtype, batch_invariant) -> Tensor
    # optional: row-wise + column-wise quantization of one [T, N] matrix in one read, and its
    # amax pass (:mod:`.row_col`; callers fall back to two ``quantize`` calls without them)
    # def quantize_row_col(self, x, **kwargs) -> tuple[NVFP4Tensor, NVFP4Tensor]
    # def amax_row_col(self, x, **kwargs) -> tuple[Tensor, Tensor]


class ReferenceBackend:
    """The contract itself: pure torch, any device, exact and batch invariant (slow)."""

    name = "reference"

    def available(self, device: torch.device | None = None) -> bool:
        return True

    def why_not(self, device: torch.device | None = None) -> str | None:
        return None

    def quantize(self, x: torch.Tensor, **kwargs) -> NVFP4Tensor:
        return quantize_reference(x, **kwargs)

    def gemm(self, a, b, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        return gemm_reference(a, b, bias, out_dtype)

    def grouped_gemm(self, a, b, group_sizes, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        return grouped_gemm_reference(a, b, group_sizes, bias, out_dtype)

    def grouped_wgrad(self, grad_out, x, group_sizes, **kwargs):
        return grouped_wgrad_reference(grad_out, x, group_sizes, **kwargs)

    def decode_grouped_gemm(self, a, w_stacked, expert_ids, out_dtype=torch.bfloat16, batch_invariant=False, *,
                            num_experts=None, group_offsets=None):
        # group_offsets (rows already sorted by expert) changes nothing here: every row is its own GEMM
        return decode_grouped_gemm_reference(a, w_stacked, expert_ids, out_dtype, batch_invariant,
                                             num_experts=num_experts)

    def grouped_wgrad_gemm(self, a, b, padded_group_sizes, out_dtype=torch.float32, batch_invariant=False):
        return grouped_wgrad_gemm_reference(a, b, padded_group_sizes, out_dtype)


# name -> "module:attribute" of a lazily imported backend object
_LAZY = {
    "triton": "minite_kernels.triton.backend:BACKEND",
    "blackwell": "minite_kernels.cute.backend:BACKEND",
}
_REGISTRY: dict[str, Backend] = {"reference": ReferenceBackend()}
_PREFERENCE = ("blackwell", "triton", "reference")


class _Missing:
    """Stand-in for a backend whose module cannot be imported here."""

    def __init__(self, name: str, error: Exception):
        self.name = name
        self._error = error

    def available(self, device=None) -> bool:
        return False

    def why_not(self, device=None) -> str:
        return f"backend {self.name!r} cannot be imported: {type(self._error).__name__}: {self._error}"


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY) + tuple(n for n in _LAZY if n not in _REGISTRY)


def _load(name: str) -> Backend:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name not in _LAZY:
        raise ValueError(f"unknown NVFP4 backend {name!r}; known: {', '.join(backend_names())}")
    module, attr = _LAZY[name].split(":")
    try:
        backend = getattr(importlib.import_module(module), attr)
    except Exception as e:  # an optional dependency is missing or broken: say so, don't hide it
        backend = _Missing(name, e)
    _REGISTRY[name] = backend
    return backend


def register_backend(backend: Backend) -> None:
    """Add or replace a backend (e.g. a user's own kernels)."""
    _REGISTRY[backend.name] = backend


def get_backend(name: str | None = None, device: torch.device | str | None = None) -> Backend:
    """The backend ``name`` (raising :class:`BackendUnavailable` with its reason if it cannot
    run on ``device``), or the best available one for ``device`` when ``name`` is None."""
    device = torch.device(device) if device is not None else None
    name = name or os.environ.get("MINITE_BACKEND") or None
    if name is not None:
        backend = _load(name)
        if not backend.available(device):
            raise BackendUnavailable(f"NVFP4 backend {name!r} unavailable on {device}: {backend.why_not(device)}")
        return backend
    if device is None or device.type == "cpu":
        return _REGISTRY["reference"]
    for candidate in _PREFERENCE:
        backend = _load(candidate)
        if backend.available(device):
            return backend
    return _REGISTRY["reference"]


def available_backends(device: torch.device | str | None = None) -> dict[str, str | None]:
    """name -> None if it runs on ``device``, else the reason it does not."""
    device = torch.device(device) if device is not None else None
    return {n: (None if _load(n).available(device) else _load(n).why_not(device)) for n in backend_names()}
