"""The 16x16 random Hadamard transform: orthogonal, invertible, product preserving."""

import pytest
import torch

from minite_megatron import nvfp4


def test_hadamard_is_orthogonal_after_scaling():
    h = nvfp4.hadamard_matrix(16) / 4
    assert torch.equal(h @ h.t(), torch.eye(16))
    assert set(h.unique().tolist()) == {-0.25, 0.25}


def test_rht_equals_the_matrix_form():
    x = torch.randn(8, 64, dtype=torch.float64).float()
    d = nvfp4.rht_signs(3)
    y = nvfp4.rht16(x, d)
    h = nvfp4.hadamard_matrix(16).double() / 4
    ref = ((x.double().view(8, 4, 16) * d.double()) @ h.t()).view(8, 64)
    assert (y.double() - ref).abs().max() < 1e-5 * x.abs().max()


def test_rht_inverse_and_product_preservation():
    a, b = torch.randn(32, 128, dtype=torch.float64), torch.randn(16, 128, dtype=torch.float64)
    d = nvfp4.rht_signs(9)
    ya, yb = nvfp4.rht16(a, d).double(), nvfp4.rht16(b, d).double()
    assert torch.allclose(ya @ yb.t(), a @ b.t(), atol=1e-4)
    # inverse: x = D (H/4) y, block-wise
    h = nvfp4.hadamard_matrix(16).double() / 4
    back = ((ya.view(32, 8, 16) @ h.t()) * d.double()).view(32, 128)
    assert torch.allclose(back, a, atol=1e-5)


def test_signs_fixed_and_seeded():
    assert torch.equal(nvfp4.rht_signs(None), torch.ones(16))
    assert torch.equal(nvfp4.rht_signs(4), nvfp4.rht_signs(4))
    assert not torch.equal(nvfp4.rht_signs(4), nvfp4.rht_signs(5))


def test_quantize_with_rht_quantizes_the_transformed_values():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    q = nvfp4.quantize(x, global_scale="tensor", rht_seed=2)
    assert q.rht_seed == 2
    ref = nvfp4.quantize(nvfp4.rht16(x, nvfp4.rht_signs(2)), global_scale="tensor")
    assert torch.equal(q.codes, ref.codes)


def test_rht_spreads_an_outlier():
    x = torch.zeros(1, 16)
    x[0, 3] = 100.0
    y = nvfp4.rht16(x, nvfp4.rht_signs(1))
    assert torch.equal(y.abs(), torch.full((1, 16), 25.0))


def test_rht_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.rht16(torch.randn(2, 20), nvfp4.rht_signs(1))
    with pytest.raises(ValueError, match="signs"):
        nvfp4.rht16(torch.randn(2, 16), torch.ones(8))
