"""Triton quantize kernel == ``nvfp4.quantize_reference``, bit for bit (codes, block scales,
global scales, image): 16x16 tiles, strided input, bad arguments, K = 0. The standard cases
(random, bin edges, saturation, non-finite, SR, RHT, swizzled, empty) are run on every backend
and path by ``tests/kernels/test_quantize_suite.py``.

Runs under TRITON_INTERPRET=1 on CPU-only machines (small shapes) and on the GPU when there
is one. The reference always runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_kernels.triton._build._testing import DEVICE, assert_quantized_equal, kernels_runnable, randn, tie_matrix

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.nvfp4.quantize import quantize_forward  # noqa: E402


def check(x: torch.Tensor, name: str = "q", **kwargs) -> None:
    """Kernel on DEVICE vs reference on CPU, every output bitwise (image included; NaN
    payloads of the image are not compared, see ``assert_same_bits_or_both_nan``)."""
    kwargs.setdefault("with_image", True)
    got = quantize_forward(x.to(DEVICE), **kwargs)
    ref = nvfp4.quantize_reference(x.cpu(), **kwargs)
    assert_quantized_equal(_cpu(got), ref, name)
    assert got.global_decode.shape == ref.global_decode.shape, name


def _cpu(q):
    from dataclasses import replace

    return replace(
        q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
        image=None if q.image is None else q.image.cpu(),
    )


@pytest.mark.parametrize("global_scale", ["tensor", "group"])
def test_2d_tiles(global_scale):
    x = randn(2, 32, 48, seed=8, scale=2.0, dtype=torch.bfloat16)
    if global_scale == "tensor":
        x = x.reshape(64, 48)
    check(x, global_scale=global_scale, tile=(16, 16))
    check(tie_matrix(16), global_scale="tensor", tile=(16, 16))


def test_strided_input_read_in_place():
    """``x.t()`` (the wgrad operands) and a column slice are read through their strides."""
    x = randn(80, 48, seed=11, dtype=torch.bfloat16)
    check(x.t())
    check(x.t(), global_scale="tensor")
    check(randn(20, 128, seed=12)[:, 32:96])


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(tile=(16, 16), global_scale="row"), ValueError, "16x16 tiles"),
        (dict(rounding="stochastic"), ValueError, "needs a seed"),
        (dict(rounding="up"), ValueError, "rounding"),
        (dict(nonfinite="ignore"), ValueError, "nonfinite"),
        (dict(scale_layout="tiled"), ValueError, "scale_layout"),
        (dict(rht_seed=1, tile=(16, 16), global_scale="tensor"), ValueError, "Hadamard"),
    ],
)
def test_bad_arguments_raise_clearly(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        quantize_forward(randn(16, 32).to(DEVICE), **kwargs)


def test_bad_inputs_raise_clearly():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_forward(randn(4, 24).to(DEVICE))
    with pytest.raises(TypeError, match="bfloat16/float32/float16"):
        quantize_forward(torch.ones(4, 16, dtype=torch.int32).to(DEVICE))


def test_k_zero_and_empty_domains_follow_the_contract():
    """Regression: K == 0 (empty scale domains, S_dec = 1) used to fail in ``reshape(-1, 0)``."""
    for shape, gs in (((4, 0), "row"), ((4, 0), "tensor"), ((2, 3, 0), "group"), ((0, 32), "tensor")):
        check(torch.zeros(shape), global_scale=gs)
