"""The reference GEMM: exact block partials, canonical order, epilogue, grouped variants."""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.gemm import block_partials_accumulate
from minite_megatron.testing import assert_bitwise_equal, assert_within, gemm_output_bound


def q_act(m, k, scale=1.0, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize((torch.randn(m, k, generator=g) * scale).to(dtype))


def q_weight(n, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize(torch.randn(n, k, generator=g).bfloat16(), global_scale="tensor", tile=(16, 16))


def test_block_partials_are_exact_in_fp32():
    a, b = q_act(64, 256), q_weight(48, 256)
    ia, ib = a.image_fp32(), b.image_fp32()
    for j in range(0, 256, 16):
        p32 = ia[:, j : j + 16] @ ib[:, j : j + 16].t()
        p64 = ia[:, j : j + 16].double() @ ib[:, j : j + 16].double().t()
        assert torch.equal(p32.double(), p64), f"block {j // 16} partial is not exact"


def test_canonical_order_is_sequential_over_blocks():
    a, b = q_act(16, 128), q_weight(32, 128)
    ia, ib = a.image_fp32().double(), b.image_fp32().double()
    acc = torch.zeros(16, 32, dtype=torch.float32)
    for j in range(0, 128, 16):
        acc = (acc.double() + ia[:, j : j + 16] @ ib[:, j : j + 16].t()).float()  # one fp32 rounding per block
    assert_bitwise_equal(block_partials_accumulate(a.image_fp32(), b.image_fp32()), acc)


def test_epilogue_order_scale_then_bias_then_one_rounding():
    a, b = q_act(8, 64), q_weight(16, 64)
    bias = torch.randn(16).bfloat16()
    acc = block_partials_accumulate(a.image_fp32(), b.image_fp32())
    alpha = a.row_global_decode().unsqueeze(1) * b.row_global_decode().unsqueeze(0)
    want = ((acc * alpha) + bias.float()).bfloat16()
    assert_bitwise_equal(nvfp4.gemm(a, b, bias=bias), want)
    assert_bitwise_equal(nvfp4.gemm(a, b, out_dtype=torch.float32), acc * alpha)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e3])
def test_reference_within_the_fp32_accumulation_bound(out_dtype, scale):
    a, b = q_act(64, 512, scale=scale), q_weight(96, 512)
    bias = torch.randn(96)
    exact, acc_bound = nvfp4.fp32_accumulation_bound(a, b, bias)
    out = nvfp4.gemm(a, b, bias=bias, out_dtype=out_dtype)
    assert_within(out, exact, gemm_output_bound(exact, acc_bound, out_dtype), "gemm")


def test_batch_invariance_bitwise():
    x = torch.randn(128, 256).bfloat16()
    b = q_weight(64, 256)
    full = nvfp4.gemm(nvfp4.quantize(x), b)
    for m in (1, 7, 128):
        for start in (0, 3, 128 - m):
            part = nvfp4.gemm(nvfp4.quantize(x[start : start + m]), b)
            assert_bitwise_equal(part, full[start : start + m], f"rows {start}:{start + m}")


def test_dgrad_with_the_transposed_2d_weight_equals_requantizing():
    w = torch.randn(64, 96).bfloat16()
    qw = nvfp4.quantize(w, global_scale="tensor", tile=(16, 16))
    dy = nvfp4.quantize(torch.randn(32, 64).bfloat16())
    assert_bitwise_equal(
        nvfp4.gemm(dy, qw.transpose()),
        nvfp4.gemm(dy, nvfp4.quantize(w.t(), global_scale="tensor", tile=(16, 16))),
    )


def test_nan_row_stays_in_its_row():
    x = torch.randn(4, 64)
    x[2, 3] = float("nan")
    out = nvfp4.gemm(nvfp4.quantize(x), q_weight(16, 64))
    assert torch.isnan(out[2]).all() and torch.isfinite(out[[0, 1, 3]]).all()


def test_leading_dims():
    x = torch.randn(3, 5, 64).bfloat16()
    b = q_weight(16, 64)
    out = nvfp4.gemm(nvfp4.quantize(x), b)
    assert out.shape == (3, 5, 16)
    assert_bitwise_equal(out.reshape(15, 16), nvfp4.gemm(nvfp4.quantize(x.reshape(15, 64)), b))


def test_gemm_errors():
    with pytest.raises(ValueError, match="K mismatch"):
        nvfp4.gemm(q_act(4, 64), q_weight(16, 32))
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        nvfp4.gemm(torch.randn(4, 64), q_weight(16, 64))


# ---- grouped (MoE) --------------------------------------------------------------------------
def test_grouped_gemm_with_empty_and_single_row_groups():
    sizes = [0, 1, 5, 0, 10]
    x = torch.randn(sum(sizes), 64).bfloat16()
    w = torch.randn(len(sizes), 32, 64).bfloat16()
    qa = nvfp4.quantize(x)
    qb = nvfp4.quantize(w, global_scale="group", tile=(16, 16))
    bias = torch.randn(len(sizes), 32)
    out = nvfp4.grouped_gemm(qa, qb, sizes, bias=bias)
    start = 0
    for g, s in enumerate(sizes):
        if s:
            want = nvfp4.gemm(qa.row_slice(start, start + s), qb.group(g), bias=bias[g])
            assert_bitwise_equal(out[start : start + s], want, f"group {g}")
        start += s


def test_grouped_gemm_errors():
    qa = nvfp4.quantize(torch.randn(6, 64))
    qb = nvfp4.quantize(torch.randn(2, 16, 64), global_scale="group", tile=(16, 16))
    with pytest.raises(ValueError, match="sum to"):
        nvfp4.grouped_gemm(qa, qb, [3, 2])
    with pytest.raises(ValueError, match="group sizes for"):
        nvfp4.grouped_gemm(qa, qb, [6])
    with pytest.raises(ValueError, match="global_scale='group'"):
        nvfp4.grouped_gemm(qa, nvfp4.quantize(torch.randn(16, 64)), [6])


def test_grouped_wgrad_single_group_is_the_dense_wgrad():
    dy, x = torch.randn(64, 32).bfloat16(), torch.randn(64, 48).bfloat16()
    dense = nvfp4.gemm(
        nvfp4.quantize(dy.t(), global_scale="tensor"),
        nvfp4.quantize(x.t(), global_scale="tensor"),
        out_dtype=torch.float32,
    )
    assert_bitwise_equal(nvfp4.grouped_wgrad(dy, x, [64])[0], dense)


def test_grouped_wgrad_pads_each_expert_and_zeroes_empty_ones():
    sizes = [5, 0, 17, 1]
    dy, x = torch.randn(23, 32).bfloat16(), torch.randn(23, 16).bfloat16()
    dw = nvfp4.grouped_wgrad(dy, x, sizes, grad_rounding="stochastic", grad_seed=3, rht_seed=7)
    assert dw.shape == (4, 32, 16) and dw.dtype == torch.float32
    assert (dw[1] == 0).all()
    # each expert's product is its own (padding never mixes experts): close to the exact one
    exact = torch.stack([dy[:5].float().t() @ x[:5].float(), dy[5:22].float().t() @ x[5:22].float()])
    rel = (dw[[0, 2]] - exact).norm() / exact.norm()
    assert rel < 0.25, f"NVFP4 wgrad far from the exact product: rel {rel:.3f}"
    assert torch.equal(dw, nvfp4.grouped_wgrad(dy, x, sizes, grad_rounding="stochastic", grad_seed=3, rht_seed=7))


def test_pad_groups():
    x = torch.arange(6.0).unsqueeze(1)
    out = nvfp4.pad_groups(x, [2, 0, 4], multiple=4)
    assert out.squeeze(1).tolist() == [0, 1, 0, 0, 2, 3, 4, 5]
    assert nvfp4.padded_group_sizes([2, 0, 4], 4) == [4, 0, 4]
