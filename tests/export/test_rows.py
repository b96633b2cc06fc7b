"""Exact split / merge of fused NVFP4 weights (qkv, gate+up, experts): bytes move, nothing is re-quantized."""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.export.rows import (
    concat_rows,
    fc1_row_ranges,
    interleave_qkv_order,
    qkv_row_ranges,
    split_groups,
    stack_groups,
    take_rows,
)
from minite_megatron.testing import assert_bitwise_equal, assert_nvfp4_equal


def _hard_weight(n=128, k=64, seed=0):
    """Random rows plus the hard cases: an all-zero tile (zero scale), one huge outlier (the
    tensor amax, saturating its block at scale 448), tiles whose e4m3 block scales are
    subnormal, tiles whose scales underflow to zero, and negative values that round to -0."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0:16, 0:16] = 0.0
    w[16, 3] = 3.0e4  # S_enc = 2688 / 3e4: block scales = block_amax * 0.0149
    w[32:48, 16:32] = torch.randn(16, 16, generator=g) * 0.1  # scales in (2^-9, 2^-6): e4m3 subnormals
    w[48:64, 0:16] = torch.randn(16, 16, generator=g) * 1e-6  # scales underflow to 0
    w[64, 32:48] = -1e-3  # tiny negatives next to larger values: code 8 (-0)
    return w


def _q(w):
    return nvfp4.quantize(w, "tensor", (16, 16), backend="reference")


def test_qkv_ranges_by_hand():
    """Megatron's fused qkv: per query group, np/ng q heads then k then v (head_dim rows each)."""
    r = qkv_row_ranges(num_heads=4, num_groups=2, head_dim=16)
    assert r == {"q": [(0, 32), (64, 96)], "k": [(32, 48), (96, 112)], "v": [(48, 64), (112, 128)]}
    assert interleave_qkv_order(4, 2, 16) == [("q", 0, 32), ("k", 0, 16), ("v", 0, 16), ("q", 32, 64), ("k", 16, 32), ("v", 16, 32)]
    assert fc1_row_ranges(32) == {"gate": [(0, 32)], "up": [(32, 64)]}
    with pytest.raises(ValueError, match="multiple of num_query_groups"):
        qkv_row_ranges(5, 2, 16)


@pytest.mark.parametrize("tile", [(16, 16), (1, 16)])
def test_split_then_merge_is_bitwise_identity(tile):
    w = _hard_weight()
    q = nvfp4.quantize(w, "tensor", tile, backend="reference")
    r = qkv_row_ranges(4, 2, 16)
    parts = {p: take_rows(q, r[p]) for p in "qkv"}
    dense = q.dequantize()
    for p in "qkv":
        # each piece decodes to exactly the rows it came from, and keeps the shared global scale
        rows = torch.cat([dense[a:b] for a, b in r[p]])
        assert_bitwise_equal(parts[p].dequantize(), rows, p)
        assert_bitwise_equal(parts[p].global_decode, q.global_decode, p)
        assert parts[p].tile == tile
    pieces = [take_rows(parts[part], [(a, b)]) for part, a, b in interleave_qkv_order(4, 2, 16)]
    assert_nvfp4_equal(concat_rows(pieces), q, "qkv")


def test_pieces_equal_quantizing_the_rows_alone_only_with_the_shared_scale():
    """Documents why the split needs no re-quantization: quantizing a piece's rows on its own
    with the fused tensor's amax gives the same bytes (16x16 tiles are never cut)."""
    w = _hard_weight()
    q = _q(w)
    r = qkv_row_ranges(4, 2, 16)
    rows = torch.cat([w[a:b] for a, b in r["k"]])
    alone = nvfp4.quantize(rows, "tensor", (16, 16), backend="reference", amax=w.abs().amax().reshape(1))
    assert_nvfp4_equal(take_rows(q, r["k"]), alone, "k")


def test_groups_roundtrip():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 32, 48, generator=g)
    w[2] *= 1e3  # per-expert global scales differ
    q = nvfp4.quantize(w, "group", (16, 16), backend="reference")
    experts = split_groups(q)
    for e, qe in enumerate(experts):
        assert_bitwise_equal(qe.dequantize(), q.dequantize()[e], f"expert {e}")
    assert_nvfp4_equal(stack_groups(experts), q, "experts")


def test_errors_are_clear():
    q = _q(_hard_weight())
    with pytest.raises(ValueError, match="cuts a 16x16 tile"):
        take_rows(q, [(0, 8)])
    with pytest.raises(ValueError, match="outside"):
        take_rows(q, [(0, 256)])
    other = _q(_hard_weight(seed=1) * 2)
    with pytest.raises(ValueError, match="re-quantization"):
        concat_rows([take_rows(q, [(0, 16)]), take_rows(other, [(0, 16)])])
    with pytest.raises(ValueError, match="one global scale per weight"):
        take_rows(nvfp4.quantize(torch.randn(16, 32), "row", (1, 16), backend="reference"), [(0, 16)])
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        take_rows(torch.zeros(16, 16), [(0, 16)])
    with pytest.raises(ValueError, match="group"):
        split_groups(q)
