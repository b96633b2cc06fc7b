"""The 128x4 swizzled block-scale layout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minite_megatron import nvfp4
from minite_megatron.testing import assert_bitwise_equal


def swizzle_by_formula(scales: torch.Tensor) -> torch.Tensor:
    """Independent scalar oracle: tile (r // 128, c // 4) in row-major tile order, byte
    (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4) inside the 512-byte tile."""
    rows, cols = scales.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(pr * pc, dtype=torch.uint8)
    raw = scales.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * (pc // 4) + c // 4
            out[tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = raw[r, c]
    return out


@pytest.mark.parametrize("rows, cols", [(1, 1), (128, 4), (130, 5), (256, 12), (37, 64)])
def test_swizzle_matches_the_formula(rows, cols):
    s = (torch.rand(rows, cols) * 400).to(torch.float8_e4m3fn)
    sw = nvfp4.swizzle_scales(s)
    assert sw.dtype == torch.float8_e4m3fn
    assert sw.numel() == nvfp4.swizzled_numel(rows, cols)
    assert_bitwise_equal(sw.view(torch.uint8), swizzle_by_formula(s))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 20))
def test_swizzle_round_trip(rows, cols):
    s = torch.randint(0, 126, (rows, cols), dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert_bitwise_equal(nvfp4.unswizzle_scales(nvfp4.swizzle_scales(s), rows, cols), s)


def test_tensor_layout_round_trip():
    q = nvfp4.quantize(torch.randn(200, 96, dtype=torch.bfloat16))
    sq = q.swizzled()
    assert sq.layout == "swizzled" and sq.block_scales.dim() == 1
    assert_bitwise_equal(sq.linear().block_scales, q.block_scales)
    assert torch.equal(sq.dequantize(), q.dequantize())


def test_unswizzle_checks_size():
    with pytest.raises(ValueError, match="expected"):
        nvfp4.unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 128, 4)
