"""The NVFP4 autograd ops (``minite_megatron.ops``) on the ``triton`` backend equal the same ops
on the ``reference`` backend: forward output and every gradient, for the dense Linear and
the MoE grouped linear (full update: SR and RHT on). Bitwise under the interpreter, where the
Triton GEMMs accumulate in the contract's canonical order; within the fp32 bound on a GPU."""

from __future__ import annotations

import pytest
import torch

from minite_megatron.testing import assert_bitwise_equal

from minite_kernels.triton._build._testing import DEVICE, INTERPRETING, kernels_runnable

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")


def _compare(got, want, name):
    if INTERPRETING:
        assert_bitwise_equal(got.cpu(), want.cpu(), name)
    else:
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=2e-2, atol=1e-2)


def _linear(backend, x, w, b, dy):
    from minite_megatron.ops.linear import LinearContext, nvfp4_linear
    from minite_megatron.ops.weight_cache import QuantizedWeightCache
    from minite_megatron.recipe import Recipe

    x, w, b = (t.detach().clone().to(DEVICE).requires_grad_() for t in (x, w, b))
    torch.manual_seed(5)
    y = nvfp4_linear(x, w, b, LinearContext(Recipe(backend=backend, rht_seed=3), QuantizedWeightCache()))
    y.backward(dy.to(DEVICE))
    return y, x.grad, w.grad, b.grad


def test_dense_linear_ops_on_triton_equal_reference():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    dy = torch.randn(32, 48, generator=g)
    for name, got, want in zip(("y", "dx", "dw", "db"), _linear("triton", x, w, b, dy), _linear("reference", x, w, b, dy)):
        _compare(got, want, name)


def _grouped(backend, x, ws, sizes, dy):
    from minite_megatron.ops.grouped_linear import nvfp4_grouped_linear
    from minite_megatron.ops.weight_cache import QuantizedWeightCache
    from minite_megatron.ops.linear import LinearContext
    from minite_megatron.ops.weight_cache import QuantizedWeightCache
    from minite_megatron.recipe import Recipe

    x = x.detach().clone().to(DEVICE).requires_grad_()
    ws = [w.detach().clone().to(DEVICE).requires_grad_() for w in ws]
    torch.manual_seed(9)
    lctx = LinearContext(Recipe(backend=backend, rht_seed=3), QuantizedWeightCache())
    y = nvfp4_grouped_linear(x, sizes, ws, None, lctx, QuantizedWeightCache())
    y.backward(dy.to(DEVICE))
    return [y, x.grad] + [w.grad for w in ws]


def test_grouped_linear_ops_on_triton_equal_reference():
    g = torch.Generator().manual_seed(1)
    sizes = [5, 0, 20, 1]
    x = torch.randn(sum(sizes), 32, generator=g)
    ws = [torch.randn(16, 32, generator=g) for _ in sizes]
    dy = torch.randn(sum(sizes), 16, generator=g)
    got, want = _grouped("triton", x, ws, sizes, dy), _grouped("reference", x, ws, sizes, dy)
    for i, (a, b) in enumerate(zip(got, want)):
        _compare(a, b, f"output {i}")
