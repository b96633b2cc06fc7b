"""The quantization chain: hand-computed vectors, hard cases, properties on large tensors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minite_megatron import nvfp4
from minite_megatron.nvfp4.formats import E2M1_MAGNITUDES, FLT_MAX
from minite_megatron.testing import assert_bitwise_equal, assert_nvfp4_equal

F32 = torch.float32


def codes_of(q):
    return nvfp4.unpack_e2m1(q.codes.reshape(q.rows, -1))


# ---- hand-computed vectors ----------------------------------------------------------------
def test_hand_vector_every_tie_with_unit_scales():
    """A row whose amax is 2688 has S_enc = S_dec = 1; a block with amax 6 has
    sf = e4m3(6 * RN(1/6)) = e4m3(1.0000000298) = 1.0, so x * enc = x and every E2M1 tie
    (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) shows its rounding directly."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    block0 = [6.0] + ties + [-t for t in ties] + [0.0]
    block1 = [2688.0] + [0.0] * 15
    x = torch.tensor([block0 + block1], dtype=F32)
    q = nvfp4.quantize(x)
    assert q.global_decode.tolist() == [1.0]
    assert q.block_scales.float().tolist() == [[1.0, 448.0]]
    assert codes_of(q)[0, :16].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    assert codes_of(q)[0, 16].item() == 7  # 2688 / 448 = 6
    assert q.dequantize()[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_hand_vector_global_scale_chain():
    """amax 3: S_enc = 2688/3 = 896, S_dec = fp32(1/896); the amax block gets
    sf = e4m3(3 * (896 * RN(1/6))) = 448 and encodes 3 as 6."""
    x = torch.zeros(1, 32, dtype=F32)
    x[0, 0] = 3.0
    x[0, 16] = 1.5  # block amax 1.5: sf = e4m3(1.5 * 149.33334) = e4m3(224.0) = 224
    q = nvfp4.quantize(x)
    s_enc = torch.tensor(2688.0, dtype=F32) / torch.tensor(3.0, dtype=F32)
    assert q.global_decode.item() == torch.tensor(1.0 / s_enc.double().item(), dtype=F32).item()
    assert q.block_scales.float().tolist() == [[448.0, 224.0]]
    assert codes_of(q)[0, 0].item() == 7 and codes_of(q)[0, 16].item() == 7
    assert q.dequantize()[0, 0].item() == pytest.approx(3.0, rel=1e-6)


def test_saturation_at_six_when_scale_rounds_down():
    """Block amax 6.3 with S_enc = 1: sf = e4m3(1.05) = 1.0, so 6.3 * enc = 6.3 saturates to 6."""
    x = torch.zeros(1, 32, dtype=F32)
    x[0, 16] = 2688.0
    x[0, :3] = torch.tensor([6.3, -6.3, 5.9])
    q = nvfp4.quantize(x)
    assert q.block_scales.float()[0, 0].item() == 1.0
    assert codes_of(q)[0, :3].tolist() == [7, 15, 7]


def test_saturation_at_e4m3_448_with_an_amax_override():
    """A global amax smaller than the data (e.g. a stale or reused amax) pushes block scales
    past 448: they saturate (satfinite), never become NaN, and codes saturate at 6."""
    x = torch.tensor([[100.0] + [1.0] * 15], dtype=F32)
    q = nvfp4.quantize(x, global_scale="row", amax=torch.tensor([10.0]))
    assert q.block_scales.float().item() == 448.0
    assert codes_of(q)[0, 0].item() == 7
    assert torch.isfinite(q.dequantize()).all()


def test_zero_block_and_zero_amax():
    x = torch.zeros(3, 32, dtype=F32)
    x[1, 16:] = torch.linspace(-1, 1, 16)
    q = nvfp4.quantize(x)
    assert q.global_decode[0].item() == 1.0 and q.global_decode[2].item() == 1.0  # amax == 0 -> S_enc = 1
    assert q.block_scales.float()[1, 0].item() == 0.0  # zero block: sf = 0, enc = FLT_MAX
    assert (codes_of(q)[[0, 2]] == 0).all() and (codes_of(q)[1, :16] == 0).all()
    assert (q.dequantize()[[0, 2]] == 0).all()


def test_subnormal_e4m3_block_scales():
    """amax 2688 gives S_enc = 1; a block with amax 0.01 has sf = e4m3(0.01/6) = 2^-9 (the
    smallest subnormal), and one with amax 0.02 gets 2 * 2^-9."""
    x = torch.zeros(1, 48, dtype=F32)
    x[0, 0] = 2688.0
    x[0, 16] = 0.01
    x[0, 32] = 0.02
    q = nvfp4.quantize(x)
    assert q.block_scales.float()[0, 1:].tolist() == [2.0**-9, 2.0**-8]
    enc = 1.0 / 2.0**-9
    assert codes_of(q)[0, 16].item() == nvfp4.e2m1_encode_nearest(torch.tensor([0.01 * enc], dtype=F32)).item()


def test_tiny_amax_overflows_s_enc_to_flt_max():
    x = torch.full((1, 16), 1e-38, dtype=F32)
    q = nvfp4.quantize(x)
    s_enc, s_dec = nvfp4.global_scales(torch.tensor([1e-38]))
    assert s_enc.item() == FLT_MAX
    assert q.global_decode.item() == s_dec.item()
    assert torch.isfinite(q.dequantize()).all()


def test_per_row_versus_per_tensor():
    x = torch.randn(4, 64, dtype=torch.bfloat16) * torch.tensor([[1.0], [10.0], [0.01], [100.0]]).bfloat16()
    qr = nvfp4.quantize(x, global_scale="row")
    qt = nvfp4.quantize(x, global_scale="tensor")
    assert qr.global_decode.shape == (4,) and qt.global_decode.shape == (1,)
    for r in range(4):  # a row quantized alone with a tensor scale == that row of the per-row result
        alone, row = nvfp4.quantize(x[r : r + 1], global_scale="tensor"), qr.row_slice(r, r + 1)
        assert_bitwise_equal(alone.codes, row.codes, "codes")
        assert_bitwise_equal(alone.linear_scales(), row.linear_scales(), "scales")
        assert_bitwise_equal(alone.global_decode, row.global_decode, "global")
    assert qt.global_decode.item() == nvfp4.global_scales(x.float().abs().amax().reshape(1))[1].item()


# ---- non-finite policy ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_propagates_nan_to_its_scale_domain_only(bad):
    x = torch.randn(3, 32, dtype=F32)
    x[1, 5] = bad
    q = nvfp4.quantize(x, global_scale="row")
    deq = q.dequantize()
    assert torch.isnan(deq[1]).all(), "the row holding a non-finite value must dequantize to NaN"
    assert torch.isfinite(deq[[0, 2]]).all(), "other rows are untouched"
    assert (codes_of(q)[1] == 0).all()
    assert torch.isnan(q.block_scales.float()[1]).all()
    qt = nvfp4.quantize(x, global_scale="tensor")
    assert torch.isnan(qt.dequantize()).all()


def test_nonfinite_raise_names_first_element():
    x = torch.randn(3, 32)
    x[2, 7] = float("inf")
    x[2, 9] = float("nan")
    with pytest.raises(ValueError, match=r"2 non-finite.*\(2, 7\)"):
        nvfp4.quantize(x, nonfinite="raise")


def test_negative_zero_input_dequantizes_to_zero():
    x = torch.tensor([[-0.0] * 15 + [1.0]], dtype=F32)
    q = nvfp4.quantize(x)
    assert (q.dequantize()[0, :15] == 0).all()


# ---- layout, shapes, tiles --------------------------------------------------------------------
def test_empty_rows():
    q = nvfp4.quantize(torch.zeros(0, 32, dtype=torch.bfloat16))
    assert q.codes.shape == (0, 16) and q.global_decode.shape == (0,)
    assert q.dequantize().shape == (0, 32)


def test_leading_dims_are_kept():
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    q = nvfp4.quantize(x)
    assert q.codes.shape == (3, 5, 16) and q.block_scales.shape == (3, 5, 2) and q.global_decode.shape == (15,)
    assert_nvfp4_equal(q.matrix(), nvfp4.quantize(x.reshape(15, 32)))


def test_non_contiguous_input_equals_contiguous():
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    assert_nvfp4_equal(nvfp4.quantize(x.t()), nvfp4.quantize(x.t().contiguous()))
    assert_nvfp4_equal(nvfp4.quantize(x[:, ::2]), nvfp4.quantize(x[:, ::2].contiguous()))


def test_2d_tiles_share_one_scale_per_tile_and_transpose_exactly():
    w = torch.randn(64, 96, dtype=torch.bfloat16)
    q = nvfp4.quantize(w, global_scale="tensor", tile=(16, 16))
    s = q.block_scales.float().reshape(4, 16, 6)
    assert (s == s[:, :1, :]).all()
    qt = q.transpose()
    assert_nvfp4_equal(qt, nvfp4.quantize(w.t(), global_scale="tensor", tile=(16, 16)))
    assert_bitwise_equal(qt.dequantize(), q.dequantize().t().contiguous())


def test_group_scales_equal_per_matrix_tensor_scales():
    w = torch.randn(3, 32, 48) * torch.tensor([1.0, 100.0, 0.001]).view(3, 1, 1)
    q = nvfp4.quantize(w, global_scale="group", tile=(16, 16))
    assert q.global_decode.shape == (3,)
    for g in range(3):
        assert_nvfp4_equal(q.group(g), nvfp4.quantize(w[g], global_scale="tensor", tile=(16, 16)))


def test_with_image_is_exact_bf16_of_codes_times_scales():
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    q = nvfp4.quantize(x, with_image=True)
    assert q.image.dtype == torch.bfloat16
    assert_bitwise_equal(q.image.float(), q.image_fp32())  # exact in bf16


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(x=torch.randn(4, 40)), ValueError, "multiple of 16"),
        (dict(x=torch.randint(0, 5, (4, 32))), TypeError, "bfloat16/float32"),
        (dict(x=torch.tensor(1.0)), ValueError, "at least one dimension"),
        (dict(x=torch.randn(32, 32), tile=(16, 16), global_scale="row"), ValueError, "16x16 tiles"),
        (dict(x=torch.randn(24, 32), tile=(16, 16), global_scale="tensor"), ValueError, "second-to-last"),
        (dict(x=torch.randn(4, 32), tile=(8, 8)), ValueError, "tile must be"),
        (dict(x=torch.randn(4, 32), global_scale="block"), ValueError, "global_scale must be"),
        (dict(x=torch.randn(4, 32), global_scale="group"), ValueError, r"\[G, R, K\]"),
        (dict(x=torch.randn(32, 32), tile=(16, 16), global_scale="tensor", rht_seed=1), ValueError, "1x16"),
        (dict(x=torch.randn(4, 32), rounding="up"), ValueError, "rounding"),
    ],
)
def test_bad_input_raises_clearly(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nvfp4.quantize(**kwargs)


def test_unknown_backend_and_unavailable_backend():
    with pytest.raises(ValueError, match="unknown NVFP4 backend"):
        nvfp4.quantize(torch.randn(2, 16), backend="nope")
    if not torch.cuda.is_available():
        with pytest.raises(nvfp4.BackendUnavailable, match="blackwell"):
            nvfp4.quantize(torch.randn(2, 16), backend="blackwell")


# ---- properties on large tensors -----------------------------------------------------------
GRID = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)


def check_codes_are_nearest_even(x: torch.Tensor, q) -> None:
    """Recompute v = x * enc from the stored scales and check every code is a nearest E2M1
    value of v (saturated at 6) with ties to the even code."""
    k = x.shape[-1]
    sf = q.linear_scales().float()
    s_dec = q.row_global_decode().unsqueeze(1)
    enc = (1.0 / (sf * s_dec)).clamp(max=FLT_MAX)
    v = (x.reshape(-1, k).float().view(-1, k // 16, 16) * enc.unsqueeze(2)).reshape(-1, k)
    a = v.abs().double().clamp(max=6.0).reshape(-1)
    code = codes_of(q).reshape(-1).long()
    got = GRID[code & 7]
    dmin = (a.unsqueeze(1) - GRID.unsqueeze(0)).abs().min(dim=1).values
    assert torch.equal((got - a).abs(), dmin), "a code is not a nearest E2M1 value"
    tie = ((a.unsqueeze(1) - GRID.unsqueeze(0)).abs() == dmin.unsqueeze(1)).sum(1) == 2
    assert ((code[tie] & 1) == 0).all(), "a tie did not go to the even code"
    neg = torch.signbit(v.reshape(-1)) & (code != 0)
    assert ((code[neg] & 8) == 8).all(), "negative values keep the sign bit"


@pytest.mark.parametrize("dist", ["normal", "student_t", "lognormal_outliers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, F32])
def test_large_random_tensors_nearest_even_and_error_bound(dist, dtype):
    g = torch.Generator().manual_seed(hash((dist, str(dtype))) % 2**31)
    shape = (1024, 1024)  # >= 10^6 elements
    if dist == "normal":
        x = torch.randn(shape, generator=g)
    elif dist == "student_t":
        x = torch.distributions.StudentT(2.0).sample(shape)
    else:
        x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)
    x = x.to(dtype)
    for gs in ("row", "tensor"):
        q = nvfp4.quantize(x, global_scale=gs)
        check_codes_are_nearest_even(x, q)
        # error bound: half the local E2M1 gap (<= 1 at |v| <= 6) in units of the block's
        # decode scale, or the saturation distance
        deq = q.dequantize().double()
        unit = (q.linear_scales().double() * q.row_global_decode().double().unsqueeze(1)).repeat_interleave(16, dim=1)
        err = (deq - x.double()).abs()
        bound = torch.maximum(unit * 1.0, x.double().abs() - 6 * unit) * (1 + 2**-20) + 1e-45
        assert (err <= bound).all()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 8),
    blocks=st.integers(1, 4),
    scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]),
    seed=st.integers(0, 2**31 - 1),
    gs=st.sampled_from(["row", "tensor"]),
)
def test_property_nearest_even(rows, blocks, scale, seed, gs):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 16 * blocks, generator=g) * scale).to(F32)
    check_codes_are_nearest_even(x, nvfp4.quantize(x, global_scale=gs))


def test_empty_k_and_expert_without_tokens():
    """Pins: with expert parallelism a rank may receive no tokens: quantizing [H, 0] (K == 0)
    used to raise 'cannot reshape tensor of 0 elements'; the wgrad of such experts is zero."""
    q = nvfp4.quantize(torch.zeros(8, 0), global_scale="tensor")
    assert q.codes.shape == (8, 0) and q.block_scales.shape == (8, 0) and q.global_decode.tolist() == [1.0]
    dw = nvfp4.grouped_wgrad_reference(torch.zeros(0, 32), torch.zeros(0, 64), [0, 0, 0])
    assert dw.shape == (3, 32, 64) and (dw == 0).all()
