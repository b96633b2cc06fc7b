"""The ``blackwell`` NVFP4 backend: native FP4 tensor-core GEMMs (sm_100a / sm_103a).

Protocol of :mod:`minite_megatron.nvfp4.backends`. What runs where:

* ``gemm`` / ``grouped_gemm``: the CuTe DSL kernels (:mod:`.gemm`, :mod:`.grouped_gemm`).
  Operands with linear scales are converted to the swizzled layout first. Both kernels are
  batch invariant (tiles fixed by N, no split-K), so ``batch_invariant`` needs nothing more.
  On sm_103a (B300) they run B300's K = 96 MMA (``MINITE_BLACKWELL_MMA_K=64`` forces K = 64).
* ``quantize``: delegated to the Triton backend (bitwise equal to the contract) when it is
  importable and available on the device, else to the reference; the result carries
  swizzled scales, the layout the GEMMs read.
* ``grouped_wgrad_gemm``: the K-grouped CuTe DSL kernel (:mod:`.grouped_wgrad_gemm`; experts
  moved to 64-aligned token columns first when needed, which changes no value).
* ``grouped_wgrad``: the two quantizations of the contract (:func:`nvfp4.quantize_wgrad_operand`
  with the quantizer above, so stochastic rounding draws the contract's bits), then
  ``grouped_wgrad_gemm``.

``available(device)`` is True only on a CUDA device of compute capability 10.0 or 10.3 with
the CUTLASS DSL importable; ``why_not(device)`` says which of those is missing.
"""

from __future__ import annotations

import torch

from minite_megatron.nvfp4 import NVFP4Tensor, ReferenceBackend, padded_group_sizes, quantize_wgrad_operand
from minite_megatron.nvfp4.backends import INVARIANT_OPS, Backend

from . import _host


def _fallback_backend(device: torch.device | None):
    """The Triton backend if it exists and runs on ``device``, else the reference."""
    try:
        from minite_kernels.triton.backend import BACKEND as triton_backend
    except ImportError:  # not built yet / not installed: the contract itself is exact
        return ReferenceBackend()
    return triton_backend if triton_backend.available(device) else ReferenceBackend()


class BlackwellBackend(Backend):
    """NVFP4 on Blackwell FP4 tensor cores (see the module docstring); the ops it does not list
    (decode, fused producers, ``*_nt``) raise :class:`~minite_megatron.nvfp4.OpNotSupported`."""

    name = "blackwell"

    def __init__(self, output_fill: float | None = None):
        #: A bring-up aid (``benchmarks.blackwell_bringup``: NaN): the GEMMs' outputs are allocated
        #: filled with it instead of uninitialised, so a cell a kernel fails to write shows up.
        self.output_fill = output_fill

    def why_not(self, device: torch.device | None = None) -> str | None:
        return _host.why_not(device)

    # ---- the batch-invariant ops: no CuTe DSL formulation yet; the Triton kernels (they compile for
    # sm_100 too) where Triton runs, so strict mode keeps its kernels on Blackwell ----
    def supports(self, op: str, **shape) -> str | None:
        if op in INVARIANT_OPS:
            return _fallback_backend(shape.get("device")).supports(op, **shape)
        return super().supports(op, **shape)

    def bi_matmul(self, x2d, weight, bias, out_dtype):
        return _fallback_backend(x2d.device).bi_matmul(x2d, weight, bias, out_dtype)

    def bi_rmsnorm(self, x2d, weight, eps, zero_centered_gamma):
        return _fallback_backend(x2d.device).bi_rmsnorm(x2d, weight, eps, zero_centered_gamma)

    def bi_rmsnorm_backward(self, gy, x2d, weight, eps, zero_centered_gamma, weight_grad=True):
        return _fallback_backend(x2d.device).bi_rmsnorm_backward(gy, x2d, weight, eps, zero_centered_gamma,
                                                                 weight_grad=weight_grad)

    def bi_log_softmax(self, x2d):
        return _fallback_backend(x2d.device).bi_log_softmax(x2d)

    def bi_attention(self, q, k, v, mask, scale, causal, return_lse=False):
        return _fallback_backend(q.device).bi_attention(q, k, v, mask, scale, causal, return_lse=return_lse)

    def quantize(self, x: torch.Tensor, **kwargs) -> NVFP4Tensor:
        """Contract quantization (Triton or reference), scales returned swizzled."""
        return _fallback_backend(x.device).quantize(x, **kwargs).swizzled()

    def gemm(self, a, b, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        from .gemm import nvfp4_gemm

        if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
            raise TypeError("nvfp4.gemm takes two NVFP4Tensor operands (quantize them first)")
        return nvfp4_gemm(a.swizzled(), b.swizzled(), bias, out_dtype, fill=self.output_fill)

    def grouped_gemm(self, a, b, group_sizes, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        from .grouped_gemm import nvfp4_grouped_gemm

        if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
            raise TypeError("nvfp4.grouped_gemm takes two NVFP4Tensor operands (quantize them first)")
        return nvfp4_grouped_gemm(a.swizzled(), b.swizzled(), group_sizes, bias, out_dtype, fill=self.output_fill)

    def grouped_wgrad(
        self,
        grad_out,
        x,
        group_sizes,
        *,
        global_scale="tensor",
        grad_rounding="nearest",
        grad_seed=None,
        rht_seed=None,
        out_dtype=torch.float32,
    ):
        """``dW[g] = dY_g^T @ X_g`` (see :func:`nvfp4.grouped_wgrad_reference`) -> ``[G, N, K]``."""
        if grad_out.shape[0] != x.shape[0] or sum(group_sizes) != x.shape[0]:
            raise ValueError(
                f"grouped_wgrad: grad_out {tuple(grad_out.shape)}, x {tuple(x.shape)} and group sizes "
                f"summing to {sum(group_sizes)} disagree"
            )
        quantize = _fallback_backend(x.device).quantize
        qa = quantize_wgrad_operand(
            grad_out, group_sizes, global_scale=global_scale, rounding=grad_rounding, seed=grad_seed,
            rht_seed=rht_seed, quantize=quantize,
        )
        qb = quantize_wgrad_operand(x, group_sizes, global_scale=global_scale, rht_seed=rht_seed, quantize=quantize)
        return self.grouped_wgrad_gemm(qa, qb, padded_group_sizes(group_sizes), out_dtype)

    def grouped_wgrad_gemm(self, a, b, padded_group_sizes, out_dtype=torch.float32, batch_invariant=False):
        """The GEMM half of the MoE wgrad on pre-quantized token-major operands -> ``[G, N, K]``."""
        from .grouped_wgrad_gemm import nvfp4_grouped_wgrad_gemm

        return nvfp4_grouped_wgrad_gemm(a, b, padded_group_sizes, out_dtype, fill=self.output_fill)


BACKEND = BlackwellBackend()
