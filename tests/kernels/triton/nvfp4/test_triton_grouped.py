"""Triton MoE GEMMs (grouped fprop/dgrad, grouped wgrad) against the contract's references:
bitwise under the interpreter (16-wide K steps), within the fp32 bound on the GPU. Covers
empty experts, experts of one token, very unbalanced routing and device-side group sizes."""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.testing import assert_bitwise_equal, assert_within, gemm_output_bound

from minite_kernels.triton._build._testing import DEVICE, INTERPRETING, kernels_runnable, randn

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.backend import BACKEND  # noqa: E402


def q(x, **kw):
    return nvfp4.quantize_reference(x, **kw)


def dev(t):
    from dataclasses import replace

    return replace(t, codes=t.codes.to(DEVICE), block_scales=t.block_scales.to(DEVICE),
                   global_decode=t.global_decode.to(DEVICE), image=None if t.image is None else t.image.to(DEVICE))


def grouped_bound(qa, qb, sizes, bias):
    """Per-row exact value and bound of the grouped product (each group's dense bound)."""
    am = qa.matrix()
    exacts, bounds, start = [], [], 0
    for g, s in enumerate(sizes):
        e, b = nvfp4.fp32_accumulation_bound(am.row_slice(start, start + s), qb.group(g), None if bias is None else bias[g])
        exacts.append(e)
        bounds.append(b)
        start += s
    return torch.cat(exacts), torch.cat(bounds)


@pytest.mark.parametrize("sizes", [[5, 0, 17, 1], [0, 0, 40, 0], [1, 1, 1, 1]])
def test_grouped_fprop_empty_single_and_unbalanced_experts(sizes):
    m, n, k = sum(sizes), 32, 48
    qa = q(randn(m, k, seed=m, scale=2.0), with_image=True)
    qb = q(randn(len(sizes), n, k, seed=1), global_scale="group", tile=(16, 16), with_image=True)
    bias = randn(len(sizes), n, seed=2)
    out = BACKEND.grouped_gemm(dev(qa), dev(qb), sizes, bias.to(DEVICE))
    exact, bound = grouped_bound(qa, qb, sizes, bias)
    assert_within(out.cpu(), exact, gemm_output_bound(exact, bound, torch.bfloat16), "grouped")
    if INTERPRETING:
        assert_bitwise_equal(out.cpu(), nvfp4.grouped_gemm_reference(qa, qb, sizes, bias), "grouped bits")


def test_grouped_dgrad_on_transposed_expert_weights_and_device_sizes():
    """dgrad ``dY_g @ W_g``: ``qw.transpose()`` of the ``[G, N, K]`` weights is a strided image
    view read in place; group sizes given as a device tensor need no host sync."""
    sizes = [3, 0, 20]
    w = q(randn(3, 32, 48, seed=3), global_scale="group", tile=(16, 16), with_image=True)
    wt = w.transpose()  # [G, 48, 32]
    dy = q(randn(sum(sizes), 32, seed=4), with_image=True)
    out = BACKEND.grouped_gemm(dev(dy), dev(wt), torch.tensor(sizes, device=DEVICE))
    exact, bound = grouped_bound(dy, wt, sizes, None)
    assert_within(out.cpu(), exact, gemm_output_bound(exact, bound, torch.bfloat16), "grouped dgrad")
    if INTERPRETING:
        assert_bitwise_equal(out.cpu(), nvfp4.grouped_gemm_reference(dy, wt, sizes), "grouped dgrad bits")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(global_scale="row"),
        dict(grad_rounding="stochastic", grad_seed=2**32 - 3),
        dict(rht_seed=5, global_scale="row", grad_rounding="stochastic", grad_seed=7),
        dict(rht_seed=9, grad_rounding="stochastic", grad_seed=11),  # tensor amax of padded RHT blocks
        dict(out_dtype=torch.bfloat16),
    ],
)
def test_grouped_wgrad_equals_reference(kwargs):
    sizes = [5, 0, 17, 1, 32]
    t = sum(sizes)
    dy = randn(t, 24, seed=5, dtype=torch.bfloat16)
    x = randn(t, 40, seed=6, dtype=torch.bfloat16)
    out = BACKEND.grouped_wgrad(dy.to(DEVICE), x.to(DEVICE), sizes, **kwargs)
    ref = nvfp4.grouped_wgrad_reference(dy, x, sizes, **kwargs)
    if INTERPRETING:
        assert_bitwise_equal(out.cpu(), ref, "wgrad bits")
    else:
        torch.testing.assert_close(out.cpu(), ref, rtol=2e-2 if kwargs.get("out_dtype") else 1e-4, atol=1e-3)


def test_grouped_wgrad_gemm_on_prequantized_operands_and_device_sizes():
    """The GEMM half (what ``ops.grouped_linear`` calls) on operands without images, and the
    whole wgrad with device-side group sizes (padded width bounded, no host sync)."""
    sizes = [4, 0, 16, 9]
    t = sum(sizes)
    dy = randn(t, 16, seed=7)
    x = randn(t, 32, seed=8)
    qa = nvfp4.quantize_wgrad_operand(dy, sizes)
    qb = nvfp4.quantize_wgrad_operand(x, sizes)
    padded = nvfp4.padded_group_sizes(sizes)
    out = BACKEND.grouped_wgrad_gemm(dev(qa), dev(qb), padded)
    ref = nvfp4.grouped_wgrad_gemm_reference(qa, qb, padded)
    if INTERPRETING:
        assert_bitwise_equal(out.cpu(), ref, "wgrad gemm bits")
        assert_bitwise_equal(
            BACKEND.grouped_wgrad(dy, x, torch.tensor(sizes)).cpu(), nvfp4.grouped_wgrad_reference(dy, x, sizes),
            "wgrad device sizes",
        )
    else:
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_grouped_errors():
    qa = q(randn(8, 32), with_image=True)
    qb = q(randn(2, 16, 32), global_scale="group", tile=(16, 16), with_image=True)
    with pytest.raises(ValueError, match="sum to"):
        BACKEND.grouped_gemm(dev(qa), dev(qb), [3, 4])
    with pytest.raises(ValueError, match="group sizes for"):
        BACKEND.grouped_gemm(dev(qa), dev(qb), [8])
    with pytest.raises(ValueError, match="global_scale='group'"):
        BACKEND.grouped_gemm(dev(qa), dev(qa), [8])
    with pytest.raises(ValueError, match="needs a seed"):
        BACKEND.grouped_wgrad(randn(4, 16).to(DEVICE), randn(4, 16).to(DEVICE), [4], grad_rounding="stochastic")
    with pytest.raises(ValueError, match="multiples of 16"):
        BACKEND.grouped_wgrad_gemm(dev(qa), dev(qa), [8, 24])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(global_scale="row", rounding="stochastic", seed=4),
        dict(rht_seed=5, rounding="stochastic", seed=6),
        dict(rht_seed=-1, global_scale="row"),
    ],
)
def test_wgrad_operand_padded_through_the_gather_equals_the_padded_copy(kwargs):
    """``quantize_wgrad_operand`` on the Triton backend (groups padded to 16 tokens by the column
    kernel's gather, no copy) is bitwise the contract's (``pad_groups`` then quantize)."""
    from minite_megatron.testing import assert_nvfp4_equal

    sizes = [5, 0, 17, 1, 32, 3]
    t = randn(sum(sizes), 48, seed=31, dtype=torch.bfloat16)
    got = BACKEND.quantize_wgrad_operand(t.to(DEVICE), sizes, **kwargs)
    want = nvfp4.quantize_wgrad_operand(t, sizes, **kwargs)
    assert got.shape == want.shape
    assert_nvfp4_equal(_to_cpu(got), want)
    empty = BACKEND.quantize_wgrad_operand(t[:0].to(DEVICE), [0, 0], **kwargs)
    assert_nvfp4_equal(_to_cpu(empty), nvfp4.quantize_wgrad_operand(t[:0], [0, 0], **kwargs))


def _to_cpu(q):
    from dataclasses import replace

    return replace(q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu())
