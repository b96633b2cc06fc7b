"""Stochastic rounding: reproducible bits, exact fractions, unbiased means."""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.stochastic import (
    e2m1_encode_stochastic,
    fmix32,
    random_bits,
    uniform_from_bits,
)
from minite_megatron.testing import assert_nvfp4_equal


def test_fmix32_matches_a_python_big_int_implementation():
    def py_fmix32(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    vals = [0, 1, 2, 0xDEADBEEF, 0xFFFFFFFF, 123456789] + list(range(1000, 1100))
    got = fmix32(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [py_fmix32(v) for v in vals]


def test_bits_are_uniform_and_seed_dependent():
    r = torch.arange(256).unsqueeze(1)
    c = torch.arange(1024).unsqueeze(0)
    u = uniform_from_bits(random_bits(7, r, c))
    assert 0.0 <= u.min() and u.max() < 1.0
    hist = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = ((hist - expected) ** 2 / expected).sum().item()
    assert chi2 < 50.0  # 15 dof: p < 1e-5 above ~44
    assert (random_bits(8, r, c) != random_bits(7, r, c)).float().mean() > 0.99


def test_same_seed_same_codes_different_seed_different_codes():
    x = torch.randn(64, 256)
    a = nvfp4.quantize(x, rounding="stochastic", seed=11)
    assert_nvfp4_equal(a, nvfp4.quantize(x, rounding="stochastic", seed=11))
    b = nvfp4.quantize(x, rounding="stochastic", seed=12)
    assert not torch.equal(a.codes, b.codes)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert_nvfp4_equal(
        nvfp4.quantize(x, rounding="stochastic", generator=g1), nvfp4.quantize(x, rounding="stochastic", generator=g2)
    )


def test_values_on_the_grid_never_move_and_saturation_holds():
    v = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, -6.5, float("nan")])
    for u in (0.0, 0.5, 0.999999):
        codes = e2m1_encode_stochastic(v, torch.full_like(v, u))
        assert codes.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 15, 0]


def test_round_up_iff_uniform_below_exact_fraction():
    """2.25 lies 1/4 of the way from 2 to 3: up iff u < 0.25 (exactly)."""
    v = torch.full((4,), 2.25)
    u = torch.tensor([0.0, 0.2499999, 0.25, 0.9])
    assert e2m1_encode_stochastic(v, u).tolist() == [5, 5, 4, 4]


@pytest.mark.parametrize("scale", [1.0, 1e-3, 50.0])
def test_mean_of_many_draws_converges_to_the_input(scale):
    torch.manual_seed(0)
    x = (torch.randn(4, 64) * scale).float()
    n = 512
    acc = torch.zeros_like(x, dtype=torch.float64)
    acc2 = torch.zeros_like(acc)
    for s in range(n):
        d = nvfp4.quantize(x, rounding="stochastic", seed=1000 + s).dequantize().double()
        acc += d
        acc2 += d * d
    mean = acc / n
    # theoretical spread of one draw: p(1-p) * gap^2 in value units (gap of the E2M1 grid
    # around v = x * enc, times the block's decode unit); 6 sigma of the mean plus one
    # draw's discreteness (gap / n)
    q = nvfp4.quantize(x)
    unit = (q.linear_scales().double() * q.row_global_decode().double().unsqueeze(1)).repeat_interleave(16, 1)
    v = (x.double() / unit).abs()
    grid = torch.tensor(nvfp4.E2M1_MAGNITUDES, dtype=torch.float64)
    lo_idx = (v.unsqueeze(-1) >= grid[1:]).sum(-1).clamp(max=6)
    gap = (grid[lo_idx + 1] - grid[lo_idx]) * unit
    p = ((v - grid[lo_idx]) * unit / gap).clamp(0, 1)
    tol = 6 * (p * (1 - p)).sqrt() * gap / n**0.5 + gap / n + 1e-12
    # block scales round to nearest, so a block's amax element can land above 6 and
    # saturate (biased by design); everything else is unbiased
    inside = v <= 6.0
    assert inside.float().mean() > 0.9
    assert ((mean - x.double()).abs() <= tol)[inside].all()
    # and nearest rounding is biased where SR is not: the SR mean is much closer on average
    nearest = nvfp4.quantize(x).dequantize().double()
    assert (mean - x.double()).abs().mean() < 0.5 * (nearest - x.double()).abs().mean()


def test_stochastic_needs_a_seed_in_the_reference():
    with pytest.raises(ValueError, match="seed"):
        nvfp4.quantize_reference(torch.randn(2, 16), rounding="stochastic")


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 1, 2**31 + 7, 2**32 - 1, 2**40 + 3])
def test_a_device_seed_is_its_int_seeds_key_and_bits(seed):
    """``DeviceSeed.of(seed)`` holds ``sr_key(seed)`` (fmix32 of the seed mod 2^32, as a signed
    int32) and the reference draws the int seed's bits from it, on fresh data and ties."""
    ds = nvfp4.DeviceSeed.of(seed, "cpu")
    key = int(fmix32(seed & 0xFFFFFFFF))
    assert int(ds.key) == nvfp4.sr_key(seed) == (key - (1 << 32) if key >= (1 << 31) else key)
    r, c = torch.arange(40).unsqueeze(1), torch.arange(96).unsqueeze(0)
    assert torch.equal(random_bits(ds, r, c), random_bits(seed, r, c))
    x = torch.randn(40, 96) * 3
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # E2M1 bin edges (ties)
    for gs in ("row", "tensor"):
        assert_nvfp4_equal(nvfp4.quantize(x, gs, rounding="stochastic", seed=ds),
                           nvfp4.quantize(x, gs, rounding="stochastic", seed=seed))


def test_a_bad_device_seed_is_refused_in_one_line():
    with pytest.raises(TypeError, match="int32 tensor of one element"):
        nvfp4.DeviceSeed(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32 tensor of one element"):
        nvfp4.DeviceSeed(torch.zeros(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="seed must be an int or a DeviceSeed"):
        nvfp4.quantize_reference(torch.randn(2, 16), rounding="stochastic", seed="7")
