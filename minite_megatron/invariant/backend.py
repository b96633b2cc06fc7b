"""Which implementation the strict (batch-invariant) ops use.

Two implementations, each batch invariant and prefill/decode invariant on its own:

- ``"torch"``: the fixed-order formulation of :mod:`minite_megatron.nvfp4.tree` built from elementwise torch ops.
  Runs on any device (the CPU path; on a GPU it is exact but slow and memory hungry).
- ``"triton"``: the batch-invariant Triton kernels ``minite_kernels.triton.bi_*`` (fixed tiles,
  fixed K / KV-block order, no split-K, no autotuning by shape). Needs a CUDA device, or a CPU
  tensor under ``TRITON_INTERPRET=1`` (tests).

The two are *not* bitwise equal to each other (different reduction trees): learner and rollout
must use the same one, which the default choice guarantees on one device. The default is
``"triton"`` on CUDA tensors and ``"torch"`` elsewhere; ``MINITE_STRICT_BACKEND`` or
:func:`use_backend` override it.

The kernels are found by name (:func:`kernel`), like the NVFP4 backends of
:mod:`minite_megatron.nvfp4.backends`, so this package imports only torch.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import torch

from ..nvfp4.backends import triton_interpreting

BACKENDS = ("torch", "triton")
_forced: list[str | None] = [None]  # process-wide (autograd may run on other threads)


def _override() -> str | None:
    if _forced[0] is not None:
        return _forced[0]
    env = os.environ.get("MINITE_STRICT_BACKEND") or None
    if env is not None and env not in BACKENDS:
        raise ValueError(f"MINITE_STRICT_BACKEND={env!r}; expected one of {BACKENDS}")
    return env


KERNELS = "minite_kernels.triton.invariant"
"""The package of the ``"triton"`` kernels: ``<KERNELS>.<name>.<name>`` is kernel ``name``."""


def kernel(name: str):
    """The Triton kernel ``name`` (``"bi_matmul"``, ``"bi_rmsnorm"``, ...), imported on first use."""
    return getattr(importlib.import_module(f"{KERNELS}.{name}"), name)


def triton_why_not(device: torch.device) -> str | None:
    """None if the Triton kernels can run on ``device``, else the reason."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except Exception as e:  # pragma: no cover - triton ships with torch's CUDA builds
            return f"triton cannot be imported: {e}"
        return None
    if device.type == "cpu" and triton_interpreting():
        return None
    return f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for CPU tensors), got {device}"


def resolve(device: torch.device | str) -> str:
    """The backend the strict ops use for tensors on ``device``.

    Raises ValueError if an override asks for ``"triton"`` where it cannot run.
    """
    device = torch.device(device)
    name = _override()
    if name is None:
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        why = triton_why_not(device)
        if why is not None:
            raise ValueError(f"strict backend 'triton' requested but unavailable: {why}")
    return name


@contextlib.contextmanager
def use_backend(name: str | None):
    """Force the strict backend inside the block (``None``: back to the default choice)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown strict backend {name!r}; expected one of {BACKENDS}")
    previous = _forced[0]
    _forced[0] = name
    try:
        yield
    finally:
        _forced[0] = previous
