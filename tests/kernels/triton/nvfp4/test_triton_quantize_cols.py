"""The column (token-wise) quantize kernel (:mod:`minite_kernels.triton.nvfp4.quantize_cols`) ==
``nvfp4.quantize_reference`` on ``S.t()``, bit for bit: the wgrad operands ``x.t()`` /
``dy.t()`` with per-row or per-tensor scales, stochastic rounding, the fused random Hadamard
transform (and its amax pass), the MoE gather of padded expert token ranges, strided sources.
The standard cases (random, bin edges, saturation, non-finite, SR, swizzled) run on this kernel
through ``tests/kernels/test_quantize_suite.py`` (path ``cols``).

Runs under TRITON_INTERPRET=1 on CPU-only machines and on the GPU when there is one.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.grouped import pad_groups
from minite_megatron.testing import assert_bitwise_equal

from minite_kernels.triton._build._testing import DEVICE, assert_quantized_equal, heavy_tailed, kernels_runnable, randn

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.nvfp4 import quantize_cols  # noqa: E402
from minite_kernels.triton.nvfp4.quantize import quantize_forward, quantize_op, rht_mask_of, sr_key  # noqa: E402


def _cpu(q):
    from dataclasses import replace

    return replace(
        q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
        image=None if q.image is None else q.image.cpu(),
    )


def check_t(s: torch.Tensor, name: str = "q", **kwargs) -> None:
    """Quantize ``s.t()`` (``s`` [T, R] token-major, read in place) on DEVICE vs the reference."""
    kwargs.setdefault("with_image", True)
    st = s.to(DEVICE).t()
    assert quantize_cols.supported(st, False), name
    got = quantize_forward(st, **kwargs)
    ref = nvfp4.quantize_reference(s.cpu().t(), **kwargs)
    assert_quantized_equal(_cpu(got), ref, name)


def test_zeros_subnormals_and_strided_source():
    check_t(torch.zeros(32, 5, dtype=torch.bfloat16))
    sub = torch.full((32, 5), 9.2e-41).to(torch.bfloat16)  # bf16 subnormals (a feature's whole amax)
    sub[:, 1] = randn(32, seed=12, dtype=torch.bfloat16)
    check_t(sub)
    check_t(torch.zeros(32, 5, dtype=torch.bfloat16), global_scale="tensor")
    wide = randn(64, 48, seed=3, dtype=torch.bfloat16)
    check_t(wide[:, :40])  # row stride 48 > 40 features
    check_t(wide[16:, 8:24], global_scale="tensor")


@pytest.mark.parametrize("rht_seed", [-1, 0, 3])
def test_fused_random_hadamard_transform(rht_seed):
    """The transform inside the kernel (and inside its amax pass for tensor scales) equals
    the contract's ``rht16`` butterfly order bit for bit, also with stochastic rounding."""
    s = heavy_tailed(64, 24, seed=7, dtype=torch.bfloat16)
    check_t(s, rht_seed=rht_seed)
    check_t(s, rht_seed=rht_seed, global_scale="tensor")
    check_t(s, rht_seed=rht_seed, global_scale="tensor", rounding="stochastic", seed=11)
    check_t(s.float(), rht_seed=rht_seed)


def test_rht_mask_bits_are_the_sign_vector():
    for seed in (0, 1, 12345):
        signs = nvfp4.rht_signs(seed)
        mask = rht_mask_of(seed)
        assert [(mask >> j) & 1 for j in range(16)] == [int(v < 0) for v in signs.tolist()]
    assert rht_mask_of(-1) == 0 and rht_mask_of(None) == -1


@pytest.mark.parametrize("rht_seed", [None, 2])
def test_amax_pass_equals_the_reference_amax(rht_seed):
    """``amax_launch`` (the tensor / per-row amax of the transformed operand) == the contract's
    amax, NaN winning. NaN payloads are not part of the contract (regression, H200 2026-11-30:
    the GPU's add of a NaN gives 0x7FFFFFFF where torch writes 0x7FC00000)."""
    s = heavy_tailed(80, 33, seed=8, dtype=torch.bfloat16)
    s[3, 30] = float("nan")
    st = s.t()
    ref = st.float()
    if rht_seed is not None:
        ref = nvfp4.rht16(st, nvfp4.rht_signs(rht_seed))
    per_row = torch.where(ref.isnan().any(1), float("nan"), ref.abs().amax(1))
    got = quantize_cols.amax_launch(st.to(DEVICE), None, 1, rht_mask_of(rht_seed)).cpu()
    assert_bitwise_equal(got, per_row, "per-row amax", nan_equal=True)
    got = quantize_cols.amax_launch(st.to(DEVICE), None, 33, rht_mask_of(rht_seed)).cpu()
    assert torch.isnan(got).all() and got.shape == (1,)
    s[3, 30] = 1.0
    ref = s.t().float() if rht_seed is None else nvfp4.rht16(s.t(), nvfp4.rht_signs(rht_seed))
    got = quantize_cols.amax_launch(s.t().to(DEVICE), None, 33, rht_mask_of(rht_seed)).cpu()
    assert_bitwise_equal(got, ref.abs().amax().reshape(1), "tensor amax")


@pytest.mark.parametrize("rht_seed", [None, 4])
def test_gather_of_padded_expert_ranges(rht_seed):
    """``col_index`` (MoE wgrad: experts' token ranges padded to 16 without a padded copy),
    groups of size 0, 1 and 16+: equal to quantizing ``pad_groups(x).t()``, also with the
    fused transform (the padding zeros enter the transform as the contract's do)."""
    from minite_kernels.triton.nvfp4.grouped_wgrad import pad_index

    sizes = [0, 17, 1, 0, 30, 16]
    x = randn(sum(sizes), 24, seed=9, dtype=torch.bfloat16)
    col, _, t_pad = pad_index(sizes, x.shape[0], DEVICE)
    padded = pad_groups(x, sizes)
    assert padded.shape[0] == t_pad
    kw = dict(global_scale="tensor", with_image=True, rounding="stochastic", seed=21, rht_seed=rht_seed)
    ref = nvfp4.quantize_reference(padded.t(), **kw)
    amax = quantize_cols.amax_launch(x.to(DEVICE).t(), col, 24, rht_mask_of(rht_seed))
    assert_bitwise_equal(amax.cpu(), nvfp4.global_scales(ref.global_decode)[0].new_tensor(
        [(padded.float() if rht_seed is None else nvfp4.rht16(padded.t(), nvfp4.rht_signs(rht_seed)).t()).abs().max()]),
        "gathered amax")
    codes, scales, sdec, image = quantize_op(x.to(DEVICE).t(), amax, col, 24, False, True, sr_key(21), True, False,
                                             rht_mask_of(rht_seed))
    assert_bitwise_equal(codes.cpu(), ref.codes, "codes")
    assert_bitwise_equal(scales.cpu().view(torch.float8_e4m3fn), ref.block_scales, "scales")
    assert_bitwise_equal(sdec.cpu(), ref.global_decode, "global decode")
    assert_bitwise_equal(image.cpu(), ref.image, "image")


def test_empty_and_without_image():
    check_t(randn(32, 5, seed=11, dtype=torch.bfloat16), with_image=False)
    got = quantize_forward(torch.zeros(0, 8, dtype=torch.bfloat16, device=DEVICE).t(), global_scale="tensor")
    assert got.codes.shape == (8, 0) and got.global_decode.tolist() == [1.0]


def test_rht_and_gather_on_layouts_the_column_kernel_does_not_take():
    """``quantize_op`` with an RHT mask and a gather on a row-major ``[R, K_src]`` operand
    (not a transposed source): gathered and transformed first, then the generic kernel; the
    same bits as the contract on the padded, transformed operand."""
    from minite_kernels.triton.nvfp4.grouped_wgrad import pad_index

    sizes = [5, 0, 16, 3]
    xt = randn(24, sum(sizes), seed=13, dtype=torch.bfloat16)  # [R, tokens], row-major
    col, _, t_pad = pad_index(sizes, sum(sizes), DEVICE)
    padded = pad_groups(xt.t().contiguous(), sizes).t()  # [R, T_pad]
    ref = nvfp4.quantize_reference(padded, with_image=True, rht_seed=6)
    xd = xt.to(DEVICE)
    assert not quantize_cols.supported(xd, False)
    codes, scales, sdec, image = quantize_op(xd, None, col, 1, False, False, 0, True, False, rht_mask_of(6))
    assert_bitwise_equal(codes.cpu(), ref.codes, "codes")
    assert_bitwise_equal(scales.cpu().view(torch.float8_e4m3fn), ref.block_scales, "scales")
    assert_bitwise_equal(sdec.cpu(), ref.global_decode, "global decode")
    assert_bitwise_equal(image.cpu(), ref.image, "image")


@pytest.mark.parametrize("rht_seed", [None, 4])
def test_amax_pass_also_gives_the_untransformed_tensor_amax(rht_seed):
    """``amax_launch(plain=True)``: one read of ``dy`` gives the wgrad operand's (transformed,
    padded) amax and the dgrad operand's plain tensor amax, each bitwise the separate pass's
    (``amax_forward``); NaN wins in both; the transformed amax is unchanged by the flag."""
    from minite_kernels.triton.nvfp4.amax import amax_forward
    from minite_kernels.triton.nvfp4.grouped_wgrad import pad_index

    sizes = [0, 17, 1, 30, 16]
    x = heavy_tailed(sum(sizes), 40, seed=12, dtype=torch.bfloat16)
    col, _, _ = pad_index(sizes, x.shape[0], DEVICE)
    for case in ("finite", "nan", "inf"):
        xd = x.clone()
        if case != "finite":
            xd[20, 7] = float(case)
        xd = xd.to(DEVICE)
        alone = quantize_cols.amax_launch(xd.t(), col, 40, rht_mask_of(rht_seed))
        both, plain = quantize_cols.amax_launch(xd.t(), col, 40, rht_mask_of(rht_seed), plain=True)
        assert_bitwise_equal(both.cpu(), alone.cpu(), f"transformed amax ({case})", nan_equal=True)
        ref = amax_forward(xd, xd.shape[0]).cpu()
        assert plain.shape == (1,)
        if case == "nan":
            assert torch.isnan(plain).all() and torch.isnan(ref).all()
        else:
            assert_bitwise_equal(plain.cpu(), ref, f"plain amax ({case})")
            assert_bitwise_equal(plain.cpu(), x.to(torch.float32).abs().amax().reshape(1) if case == "finite"
                                 else torch.tensor([float("inf")]), f"plain amax vs torch ({case})")
