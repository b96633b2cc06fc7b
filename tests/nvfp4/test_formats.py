"""E2M1 and UE4M3 as data: every code, every bin edge and tie, the e4m3 cast, packing."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minite_megatron import nvfp4
from minite_megatron.nvfp4.formats import E2M1_BIN_EDGES, E2M1_MAGNITUDES
from minite_megatron.testing import assert_bitwise_equal

GRID = np.array(E2M1_MAGNITUDES)


def nearest_even_code(a: float) -> int:
    """Independent oracle: nearest E2M1 magnitude code of a >= 0, ties to the even code, sat 6."""
    if a >= 6.0:
        return 7
    d = np.abs(GRID - a)
    best = np.flatnonzero(d == d.min())
    if len(best) == 2:  # a tie: the even code
        return int(best[0] if best[0] % 2 == 0 else best[1])
    return int(best[0])


def test_every_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = nvfp4.e2m1_decode(codes)
    expected = list(E2M1_MAGNITUDES) + [-v for v in E2M1_MAGNITUDES]
    assert vals.tolist() == expected
    assert math.copysign(1.0, vals[8].item()) == -1.0  # code 8 is -0


def test_every_code_round_trips():
    vals = nvfp4.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert nvfp4.e2m1_encode_nearest(vals).tolist() == list(range(16))


def test_every_midpoint_is_a_tie_to_even_code():
    """The table's ties are the midpoints of neighbours, and each goes to the even code."""
    mids = [(lo + hi) / 2 for lo, hi in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:])]
    assert [e for e, _ in E2M1_BIN_EDGES] == mids  # 0.25 0.75 1.25 1.75 2.5 3.5 5
    v = torch.tensor(mids, dtype=torch.float32)
    codes = nvfp4.e2m1_encode_nearest(v)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert nvfp4.e2m1_encode_nearest(-v).tolist() == [8, 10, 10, 12, 12, 14, 14]
    assert all(c % 2 == 0 for c in codes.tolist())


@pytest.mark.parametrize("edge", [e for e, _ in E2M1_BIN_EDGES])
def test_each_bin_edge_plus_minus_one_ulp(edge):
    e = torch.tensor([edge], dtype=torch.float32)
    below = torch.nextafter(e, torch.tensor([0.0]))
    above = torch.nextafter(e, torch.tensor([100.0]))
    lo_code = E2M1_MAGNITUDES.index(max(g for g in E2M1_MAGNITUDES if g < edge))
    assert nvfp4.e2m1_encode_nearest(below).item() == lo_code
    assert nvfp4.e2m1_encode_nearest(above).item() == lo_code + 1
    assert nvfp4.e2m1_encode_nearest(-below).item() == lo_code + 8
    assert nvfp4.e2m1_encode_nearest(-above).item() == lo_code + 9


def test_saturation_zero_sign_and_nan():
    v = torch.tensor([6.0, 6.0001, 1e30, float("inf"), -7.0, -float("inf"), 0.0, -0.0, -0.1, float("nan")])
    assert nvfp4.e2m1_encode_nearest(v).tolist() == [7, 7, 7, 7, 15, 15, 0, 8, 8, 0]


def test_nearest_matches_independent_oracle_on_dense_grid():
    a = torch.linspace(0, 8, 200_001, dtype=torch.float32)
    got = nvfp4.e2m1_encode_nearest(a).numpy()
    want = np.array([nearest_even_code(float(x)) for x in a[::97]])
    assert (got[::97] == want).all()
    # vectorised check on every element: decoded value is a nearest grid point
    dec = np.abs(nvfp4.e2m1_decode(torch.from_numpy(got)).numpy())
    d = np.abs(GRID[None, :] - np.minimum(a.numpy(), 6.0)[:, None]).min(axis=1)
    assert (np.abs(dec - np.minimum(a.numpy(), 6.0)) == d).all()


def e4m3_oracle(v: np.ndarray) -> np.ndarray:
    """Independent fp64 oracle: RNE to e4m3fn (subnormal step 2^-9), satfinite at 448."""
    a = np.abs(v.astype(np.float64))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    quantum = np.where(a >= 2.0**-6, 2.0 ** (e - 3), 2.0**-9)
    r = np.rint(a / quantum) * quantum  # np.rint: half to even
    r = np.minimum(r, 448.0)
    return np.copysign(r, v)


def test_e4m3_cast_is_rne_satfinite_everywhere():
    """torch's float8_e4m3fn cast (after the clamp) equals an independent RNE oracle on every
    e4m3 value, every midpoint and +-1 ulp around each, subnormals and the saturation range."""
    pos = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # all finite >= 0
    mids = (pos[1:] + pos[:-1]) / 2
    pts = torch.cat([pos, mids, torch.tensor([448.0, 456.0, 464.0, 479.9, 480.0, 1e6, 3e38])])
    pts = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, float("inf"))), torch.nextafter(pts, torch.zeros_like(pts))])
    pts = torch.cat([pts, -pts, torch.rand(100_000) * 500, torch.rand(100_000) * 2.0**-6])
    got = nvfp4.e4m3_rne_satfinite(pts).float().numpy()
    want = e4m3_oracle(pts.numpy())
    np.testing.assert_array_equal(np.abs(got), np.abs(want))


def test_e4m3_nan_and_inf():
    out = nvfp4.e4m3_rne_satfinite(torch.tensor([float("nan"), float("inf"), -float("inf")]))
    assert torch.isnan(out[0].float())
    assert out[1:].float().tolist() == [448.0, -448.0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda x: len(x) % 2 == 0))
def test_pack_unpack_round_trip(codes):
    c = torch.tensor(codes, dtype=torch.uint8)
    packed = nvfp4.pack_e2m1(c)
    assert packed.shape == (len(codes) // 2,)
    assert (packed & 0xF).tolist() == codes[0::2]  # even element in the low nibble
    assert (packed >> 4).tolist() == codes[1::2]
    assert_bitwise_equal(nvfp4.unpack_e2m1(packed), c)


def test_pack_errors():
    with pytest.raises(ValueError, match="even"):
        nvfp4.pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError):
        nvfp4.unpack_e2m1(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError):
        nvfp4.e2m1_encode_nearest(torch.zeros(2, dtype=torch.bfloat16))


def test_decode_packed_equals_unpack_then_decode():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    from minite_megatron.nvfp4.formats import decode_packed

    assert_bitwise_equal(decode_packed(packed), nvfp4.e2m1_decode(nvfp4.unpack_e2m1(packed)))
