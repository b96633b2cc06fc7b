"""The ``blackwell`` NVFP4 backend: native FP4 tensor-core GEMMs (sm_100a / sm_103a).

Protocol of :mod:`minite_megatron.nvfp4.backends`. What runs where:

* ``gemm`` / ``grouped_gemm``: the CuTe DSL kernels (:mod:`.gemm`, :mod:`.grouped_gemm`).
  Operands with linear scales are converted to the swizzled layout first. Both kernels are
  batch invariant (tiles fixed by N, no split-K), so ``batch_invariant`` needs nothing more.
* ``quantize``: delegated to the Triton backend (bitwise equal to the contract) when it is
  importable and available on the device, else to the reference; the result carries
  swizzled scales, the layout the GEMMs read.
* ``grouped_wgrad`` / ``grouped_wgrad_gemm``: delegated the same way (Triton, else the
  reference). The wgrad GEMM groups along K (tokens, 16-aligned per expert), which the
  row-grouped kernel here does not cover.

``available(device)`` is True only on a CUDA device of compute capability 10.0 or 10.3 with
the CUTLASS DSL importable; ``why_not(device)`` says which of those is missing.
"""

from __future__ import annotations

import torch

from minite_megatron.nvfp4 import NVFP4Tensor, ReferenceBackend

from . import _host


def _fallback_backend(device: torch.device | None):
    """The Triton backend if it exists and runs on ``device``, else the reference."""
    try:
        from minite_kernels.triton.backend import BACKEND as triton_backend
    except ImportError:  # not built yet / not installed: the contract itself is exact
        return ReferenceBackend()
    return triton_backend if triton_backend.available(device) else ReferenceBackend()


class BlackwellBackend:
    """NVFP4 on Blackwell FP4 tensor cores (see the module docstring)."""

    name = "blackwell"

    def available(self, device: torch.device | None = None) -> bool:
        return _host.why_not(device) is None

    def why_not(self, device: torch.device | None = None) -> str | None:
        return _host.why_not(device)

    def quantize(self, x: torch.Tensor, **kwargs) -> NVFP4Tensor:
        """Contract quantization (Triton or reference), scales returned swizzled."""
        return _fallback_backend(x.device).quantize(x, **kwargs).swizzled()

    def gemm(self, a, b, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        from .gemm import nvfp4_gemm

        if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
            raise TypeError("nvfp4.gemm takes two NVFP4Tensor operands (quantize them first)")
        return nvfp4_gemm(a.swizzled(), b.swizzled(), bias, out_dtype)

    def grouped_gemm(self, a, b, group_sizes, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        from .grouped_gemm import nvfp4_grouped_gemm

        if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
            raise TypeError("nvfp4.grouped_gemm takes two NVFP4Tensor operands (quantize them first)")
        return nvfp4_grouped_gemm(a.swizzled(), b.swizzled(), group_sizes, bias, out_dtype)

    def grouped_wgrad(self, grad_out, x, group_sizes, **kwargs):
        return _fallback_backend(x.device).grouped_wgrad(grad_out, x, group_sizes, **kwargs)

    def grouped_wgrad_gemm(self, a, b, padded_group_sizes, out_dtype=torch.float32, batch_invariant=False):
        backend = _fallback_backend(a.device)
        if hasattr(backend, "grouped_wgrad_gemm"):
            return backend.grouped_wgrad_gemm(a, b, padded_group_sizes, out_dtype, batch_invariant)
        return ReferenceBackend().grouped_wgrad_gemm(a, b, padded_group_sizes, out_dtype, batch_invariant)


BACKEND = BlackwellBackend()
