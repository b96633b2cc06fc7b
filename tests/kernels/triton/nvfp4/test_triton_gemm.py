"""Triton dense GEMMs (image GEMM, decode GEMM) against the contract's GEMM.

Rule: every output lies within ``fp32_accumulation_bound`` + one output rounding
(``gemm_output_bound``, derived, not tuned) of the exact product; where a kernel is canonical
(the interpreter's 16-wide K steps; ``canonical=True``) it is also bitwise equal to
``gemm_reference``.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.testing import assert_bitwise_equal, assert_within, gemm_output_bound

from minite_kernels.triton._build._testing import DEVICE, INTERPRETING, heavy_tailed, kernels_runnable, randn

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.backend import BACKEND  # noqa: E402
from minite_kernels.triton.decode.decode_gemm import decode_gemm_forward  # noqa: E402
from minite_kernels.triton.nvfp4.gemm import gemm_forward  # noqa: E402
from minite_kernels.triton.nvfp4.image import image_2d  # noqa: E402


def q(x, **kw):
    return nvfp4.quantize_reference(x, **kw)


def on_device(t):
    from dataclasses import replace

    return replace(t, codes=t.codes.to(DEVICE), block_scales=t.block_scales.to(DEVICE),
                   global_decode=t.global_decode.to(DEVICE), image=None if t.image is None else t.image.to(DEVICE))


def check_bound_and_maybe_bits(out, qa, qb, bias, out_dtype, bitwise):
    exact, bound = nvfp4.fp32_accumulation_bound(qa, qb, bias)
    assert_within(out.cpu(), exact, gemm_output_bound(exact, bound, out_dtype), "gemm")
    if bitwise:
        assert_bitwise_equal(out.cpu(), nvfp4.gemm_reference(qa, qb, bias, out_dtype), "gemm bits")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1, 32, 64), (45, 40, 96), (96, 64, 32)])
def test_image_gemm_equals_reference(m, n, k, out_dtype):
    qa = q(randn(m, k, seed=m, scale=2.0), with_image=True)
    qb = q(heavy_tailed(n, k, seed=n), global_scale="tensor", with_image=True)
    bias = randn(n, seed=7)
    out = gemm_forward(qa.image.to(DEVICE), qb.image.to(DEVICE), qa.global_decode.to(DEVICE),
                       qb.global_decode.to(DEVICE), bias.to(DEVICE), out_dtype)
    check_bound_and_maybe_bits(out, qa, qb, bias, out_dtype, bitwise=INTERPRETING)


@pytest.mark.parametrize("strict", [False, True])
def test_canonical_mode_is_bitwise_equal_to_the_reference(strict):
    """``canonical=True`` adds exact 16-element block partials in K order: the contract."""
    qa = q(randn(33, 160, seed=1), with_image=True)
    qb = q(randn(48, 160, seed=2), global_scale="tensor", tile=(16, 16), with_image=True)
    out = gemm_forward(qa.image.to(DEVICE), qb.image.to(DEVICE), qa.global_decode.to(DEVICE),
                       qb.global_decode.to(DEVICE), None, torch.bfloat16, batch_invariant=strict, canonical=True)
    check_bound_and_maybe_bits(out, qa, qb, None, torch.bfloat16, bitwise=True)


def test_dgrad_layout_reads_the_transposed_weight_in_place():
    """dgrad ``dY @ W``: ``W.transpose()``'s image is a strided view; no copy, same result."""
    w = q(randn(64, 48, seed=3), global_scale="tensor", tile=(16, 16), with_image=True)
    wt = w.transpose()
    assert wt.image.stride(0) == 1
    dy = q(randn(20, 64, seed=4), with_image=True)
    out = BACKEND.gemm(on_device(dy), on_device(wt))
    check_bound_and_maybe_bits(out, dy, wt, None, torch.bfloat16, bitwise=INTERPRETING)


def test_pointer_path_for_operands_tma_cannot_describe():
    """A transposed ``a`` image (unit stride along M) takes the pointer-load kernel."""
    qa = q(randn(32, 48, seed=5), with_image=True)
    a_t = qa.image.t().contiguous().t()  # same values, column-major
    qb = q(randn(16, 48, seed=6), with_image=True)
    out = gemm_forward(a_t.to(DEVICE), qb.image.to(DEVICE), qa.global_decode.to(DEVICE), qb.global_decode.to(DEVICE))
    check_bound_and_maybe_bits(out, qa, qb, None, torch.bfloat16, bitwise=INTERPRETING)


@pytest.mark.parametrize("m", [1, 7, 64])
def test_decode_gemm_on_packed_weights(m):
    qa = q(randn(m, 128, seed=m), with_image=True)
    qb = q(randn(48, 128, seed=8), global_scale="tensor", tile=(16, 16))
    bias = randn(48, seed=9)
    out = decode_gemm_forward(qa.image.to(DEVICE), qb.codes.to(DEVICE), qb.block_scales.to(DEVICE),
                              qa.global_decode.to(DEVICE), qb.global_decode.to(DEVICE), bias.to(DEVICE))
    check_bound_and_maybe_bits(out, qa, qb, bias, torch.bfloat16, bitwise=False)


def test_backend_gemm_without_images_and_with_swizzled_scales():
    """Operands without an image get one from the image kernel; swizzled scales are relaid."""
    qa = q(randn(70, 64, seed=10))
    qb = q(randn(32, 64, seed=11), global_scale="tensor").swizzled()
    assert_bitwise_equal(image_2d(on_device(qa)).cpu(), qa.image_fp32().to(torch.bfloat16), "image kernel")
    out = BACKEND.gemm(on_device(qa), on_device(qb))
    check_bound_and_maybe_bits(out, qa, qb.linear(), None, torch.bfloat16, bitwise=INTERPRETING)


def test_backend_dispatch_and_leading_dims():
    qa = q(randn(2, 5, 32, seed=12), with_image=True)
    qb = q(randn(16, 32, seed=13), global_scale="tensor", with_image=True)
    for strict in (False, True):
        out = nvfp4.gemm(on_device(qa), on_device(qb), backend="triton", batch_invariant=strict)
        assert out.shape == (2, 5, 16)
        exact, bound = nvfp4.fp32_accumulation_bound(qa, qb)
        assert_within(out.cpu(), exact, gemm_output_bound(exact, bound, torch.bfloat16))


def test_zero_k_rows_and_errors():
    qa = q(randn(0, 32, seed=14), with_image=True)
    qb = q(randn(16, 32, seed=15), global_scale="tensor", with_image=True)
    assert BACKEND.gemm(on_device(qa), on_device(qb)).shape == (0, 16)
    with pytest.raises(ValueError, match="K mismatch"):
        BACKEND.gemm(on_device(q(randn(4, 48), with_image=True)), on_device(qb))
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        BACKEND.gemm(randn(4, 32).to(DEVICE), on_device(qb))
    with pytest.raises(TypeError, match="out_dtype"):
        BACKEND.gemm(on_device(q(randn(4, 32), with_image=True)), on_device(qb), out_dtype=torch.int8)
    with pytest.raises(ValueError, match="bias"):
        BACKEND.gemm(on_device(q(randn(4, 32), with_image=True)), on_device(qb), bias=torch.zeros(3).to(DEVICE))
    with pytest.raises(ValueError, match="M <= 64"):
        decode_gemm_forward(torch.zeros(65, 32, dtype=torch.bfloat16), qb.codes, qb.block_scales,
                            torch.ones(1), torch.ones(1))
