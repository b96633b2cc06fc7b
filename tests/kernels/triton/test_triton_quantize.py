"""Triton quantize kernel == ``nvfp4.quantize_reference``, bit for bit (codes, block scales,
global scales, image), on fresh random data and on the contract's hard cases.

Runs under TRITON_INTERPRET=1 on CPU-only machines (small shapes) and on the GPU when there
is one. The reference always runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.testing import assert_bitwise_equal

from minite_kernels.triton._testing import DEVICE, assert_quantized_equal, heavy_tailed, kernels_runnable, randn, tie_matrix

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.quantize import quantize_forward  # noqa: E402


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


@pytest.mark.parametrize("global_scale", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_random_normal_and_heavy_tailed(global_scale, dtype):
    check(randn(37, 96, seed=1, scale=3.0, dtype=dtype), global_scale=global_scale)
    check(heavy_tailed(19, 160, seed=2, dtype=dtype), global_scale=global_scale)


def test_every_bin_edge_tie_neighbour_and_saturation():
    """Ties to the even code at every E2M1 bin edge, fp32 neighbours of the edges, 6.5 -> 6,
    an exact -0.0 (code 8 like the reference), subnormal E4M3 scales, a scale of zero."""
    x = tie_matrix(8)
    check(x)
    check(x, global_scale="tensor")
    check(x.to(torch.bfloat16))


def test_zeros_and_zero_rows():
    x = torch.zeros(5, 32)
    x[2, 3] = 1.0
    check(x)
    check(torch.zeros(3, 48), global_scale="tensor")


def test_extrema_saturation_and_amax_override():
    """Finite extremes (bf16 max, fp32 tiny) and an amax override below the data: E4M3 scales
    saturate at 448 and codes at 6."""
    x = randn(16, 64, seed=3)
    x[0, 0] = 3.3895e38
    x[1, 5] = 1e-38
    check(x)
    check(x, amax=torch.full((16,), 0.5))
    check(x, global_scale="tensor", amax=torch.tensor([0.25]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_propagates_to_its_scale_domain(bad):
    x = randn(6, 48, seed=4)
    x[2, 17] = bad
    check(x)  # row scale: only row 2 is NaN
    check(x, global_scale="tensor")  # the whole tensor is NaN
    g = randn(2, 16, 32, seed=5)
    g[1, 3, 4] = bad
    check(g, global_scale="group", tile=(16, 16))


def test_nonfinite_with_amax_override_marks_blocks():
    """A finite amax override with a NaN / inf inside: NaN blocks get NaN scales, inf saturates."""
    x = randn(4, 64, seed=6)
    x[1, 20] = float("nan")
    x[3, 40] = float("inf")
    check(x, amax=torch.full((4,), 3.0))


def test_nonfinite_raise_names_the_element():
    x = randn(4, 32, seed=7)
    x[2, 9] = float("nan")
    with pytest.raises(ValueError, match=r"first at index \(2, 9\)"):
        quantize_forward(x.to(DEVICE), nonfinite="raise")


@pytest.mark.parametrize("global_scale", ["tensor", "group"])
def test_2d_tiles(global_scale):
    x = randn(2, 32, 48, seed=8, scale=2.0, dtype=torch.bfloat16)
    if global_scale == "tensor":
        x = x.reshape(64, 48)
    check(x, global_scale=global_scale, tile=(16, 16))
    check(tie_matrix(16), global_scale="tensor", tile=(16, 16))


@pytest.mark.parametrize("seed", [0, 12345, 2**31 + 7, 2**32 - 1])
def test_stochastic_rounding_draws_the_reference_bits(seed):
    x = randn(9, 64, seed=9, scale=4.0, dtype=torch.bfloat16)
    check(x, rounding="stochastic", seed=seed)
    check(x, rounding="stochastic", seed=seed, global_scale="tensor")


@pytest.mark.parametrize("rht_seed", [-1, 3])
def test_random_hadamard_transform(rht_seed):
    x = randn(12, 64, seed=10, dtype=torch.bfloat16)
    check(x, rht_seed=rht_seed)
    check(x, rht_seed=rht_seed, rounding="stochastic", seed=99, global_scale="tensor")


def test_strided_input_read_in_place():
    """``x.t()`` (the wgrad operands) and a column slice are read through their strides."""
    x = randn(80, 48, seed=11, dtype=torch.bfloat16)
    check(x.t())
    check(x.t(), global_scale="tensor")
    check(randn(20, 128, seed=12)[:, 32:96])


def test_leading_dims_empty_rows_and_without_image():
    check(randn(2, 3, 32, seed=13))
    check(torch.zeros(0, 32), global_scale="row")
    check(torch.zeros(0, 32), global_scale="tensor")
    check(randn(5, 32, seed=14), with_image=False)


def test_swizzled_scale_output():
    x = randn(130, 80, seed=15)
    got = quantize_forward(x.to(DEVICE), scale_layout="swizzled")
    ref = nvfp4.quantize_reference(x)
    assert got.layout == "swizzled"
    assert_bitwise_equal(got.block_scales.cpu(), nvfp4.swizzle_scales(ref.block_scales.reshape(130, 5)), "swizzled")
    assert_bitwise_equal(got.codes.cpu(), ref.codes, "codes")


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
