"""Autograd contexts hold NVFP4 operands only through ``save_for_backward`` (issue 11: the
linears kept the wgrad operand's codes and scales as a plain ``ctx`` attribute, which
``torch.autograd.graph.saved_tensors_hooks`` -- activation offloading, checkpointing tools --
never saw). Every saved NVFP4 tensor passes through the hooks, and the gradients computed from
the hooks' copies are bitwise the ones without hooks."""

from __future__ import annotations

import contextlib

import torch

from minite_megatron.nvfp4.tensor import NVFP4Tensor
from minite_megatron.ops.grouped_linear import nvfp4_grouped_linear
from minite_megatron.ops.linear import LinearContext, nvfp4_linear
from minite_megatron.ops.weight_cache import QuantizedWeightCache
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal


def _no_tensor_data_on(ctx) -> None:
    for name, value in vars(ctx).items():
        if isinstance(value, NVFP4Tensor):
            held = [t for t in (value.codes, value.block_scales, value.global_decode, value.image) if t is not None]
            assert all(t.numel() == 0 for t in held), f"ctx.{name} holds NVFP4 data outside save_for_backward"


def _run(fn, hooked: bool):
    """``fn()`` -> (output, inputs); backward of sum(output); with hooks that replace every saved
    tensor by a copy (as an offloader would). Returns the gradients and the packed dtypes."""
    packed = []

    def pack(t):
        packed.append(t.dtype)
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hooked else contextlib.nullcontext():
        y, inputs = fn()
    _no_tensor_data_on(y.grad_fn)
    y.float().pow(2).sum().backward()
    return [t.grad for t in inputs], packed


def test_dense_linear_saves_the_wgrad_operand_through_the_hooks():
    def fn():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(40, 64, generator=g).requires_grad_()
        w = torch.randn(32, 64, generator=g).requires_grad_()
        torch.manual_seed(1)
        return nvfp4_linear(x, w, None, LinearContext(Recipe(), QuantizedWeightCache())), (x, w)

    want, _ = _run(fn, hooked=False)
    got, packed = _run(fn, hooked=True)
    assert torch.uint8 in packed and torch.float8_e4m3fn in packed, packed  # Q_col(x): codes, scales
    for a, b, name in zip(got, want, ("dx", "dw")):
        assert_bitwise_equal(a, b, name)


def test_grouped_linear_saves_the_wgrad_operand_through_the_hooks():
    sizes = [5, 0, 20, 1]

    def fn():
        g = torch.Generator().manual_seed(2)
        x = torch.randn(sum(sizes), 32, generator=g).requires_grad_()
        ws = [torch.randn(16, 32, generator=g).requires_grad_() for _ in sizes]
        torch.manual_seed(3)
        lctx = LinearContext(Recipe(), QuantizedWeightCache())
        return nvfp4_grouped_linear(x, sizes, ws, None, lctx, QuantizedWeightCache()), (x, *ws)

    want, _ = _run(fn, hooked=False)
    got, packed = _run(fn, hooked=True)
    assert torch.uint8 in packed and torch.float8_e4m3fn in packed, packed
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"grad {i}")


def test_prepare_for_saving_round_trips():
    from minite_megatron import nvfp4

    q = nvfp4.quantize_reference(torch.randn(32, 48), global_scale="tensor", tile=(16, 16), with_image=True)
    tensors, meta = q.prepare_for_saving()
    assert len(tensors) == 4 and all(t.numel() == 0 for t in (meta.codes, meta.block_scales, meta.image))
    back = meta.restore_from_saved(tensors)
    assert (back.shape, back.tile, back.global_scale) == (q.shape, q.tile, q.global_scale)
    for name in ("codes", "block_scales", "global_decode", "image"):
        assert getattr(back, name) is getattr(q, name), name
