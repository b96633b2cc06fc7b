"""Triton kernels on the GPU at real shapes (skipped without CUDA).

* quantize: bitwise equal to the CPU reference at Qwen3-30B-A3B activation and weight shapes,
  every option;
* GEMMs: within the derived fp32 bound of the contract; ``canonical=True`` bitwise;
* strict mode: row r bitwise identical whether computed with M = 1, 7, 128 or 4096 rows, and
  across repeated runs (dense and grouped);
* grouped GEMM with empty experts and very unbalanced routing.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.testing import assert_bitwise_equal, assert_within, gemm_output_bound

from minite_kernels.triton._build._testing import assert_quantized_equal, heavy_tailed, randn, tie_matrix

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _backend():
    from minite_kernels.triton.backend import BACKEND

    return BACKEND


def _cpu(q):
    from dataclasses import replace

    return replace(q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
                   image=None if q.image is None else q.image.cpu())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(global_scale="tensor"),
        dict(rounding="stochastic", seed=2**31 + 11),
        dict(global_scale="tensor", rht_seed=4),
    ],
)
def test_quantize_bitwise_at_real_shapes(kwargs):
    x = torch.cat([randn(2048, 2048, seed=1, scale=3.0), heavy_tailed(1024, 2048, seed=2),
                   tie_matrix(64).repeat(1, 32)]).to(torch.bfloat16)
    if not kwargs:
        x[5, 7] = float("nan")  # row scales: only row 5 becomes NaN
    got = _backend().quantize(x.to(CUDA), with_image=True, **kwargs)
    ref = nvfp4.quantize_reference(x, with_image=True, **kwargs)
    assert_quantized_equal(_cpu(got), ref)
    xt_dev = x[:, :1024].to(CUDA).t()  # a strided view, read in place
    assert xt_dev.stride(0) == 1
    got = _backend().quantize(xt_dev, with_image=True, **kwargs)
    assert_quantized_equal(_cpu(got), nvfp4.quantize_reference(x[:, :1024].t(), with_image=True, **kwargs), "x.t()")


def test_quantize_weights_16x16_at_real_shape():
    w = randn(128, 1536, 256, seed=3, scale=0.02)  # [G, N, K] expert weights (smaller K)
    got = _backend().quantize(w.to(CUDA), global_scale="group", tile=(16, 16), with_image=True)
    assert_quantized_equal(_cpu(got), nvfp4.quantize_reference(w, global_scale="group", tile=(16, 16), with_image=True))


def _operands(m, n, k, seed=0):
    qa = nvfp4.quantize_reference(randn(m, k, seed=seed, scale=2.0), with_image=True)
    qb = nvfp4.quantize_reference(heavy_tailed(n, k, seed=seed + 1), global_scale="tensor", tile=(16, 16),
                                  with_image=True)
    return qa, qb


def _dev(q):
    from dataclasses import replace

    return replace(q, codes=q.codes.to(CUDA), block_scales=q.block_scales.to(CUDA),
                   global_decode=q.global_decode.to(CUDA), image=None if q.image is None else q.image.to(CUDA))


@pytest.mark.parametrize("strict", [False, True])
def test_gemm_within_fp32_bound_at_real_shape(strict):
    qa, qb = _operands(1024, 1536, 2048)
    out = _backend().gemm(_dev(qa), _dev(qb), batch_invariant=strict).cpu()
    exact, bound = nvfp4.fp32_accumulation_bound(qa, qb)
    assert_within(out, exact, gemm_output_bound(exact, bound, torch.bfloat16))


def test_canonical_gemm_is_bitwise_equal_to_the_reference_on_the_gpu():
    from minite_kernels.triton.nvfp4.gemm import gemm_forward

    qa, qb = _operands(512, 768, 2048, seed=5)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = gemm_forward(qa.image.to(CUDA), qb.image.to(CUDA), qa.global_decode.to(CUDA),
                           qb.global_decode.to(CUDA), None, out_dtype, True, canonical=True)
        assert_bitwise_equal(out.cpu(), nvfp4.gemm_reference(qa, qb, None, out_dtype), "canonical")


def test_strict_rows_do_not_depend_on_the_batch():
    """Row r of a strict GEMM is bitwise the same computed with M = 1, 7, 128, 4096 rows and
    across repeated runs (fixed tiles and K order, nothing keyed on M)."""
    qa, qb = _operands(4096, 2048, 2048, seed=7)
    a, b = _dev(qa), _dev(qb)
    full = _backend().gemm(a, b, batch_invariant=True)
    assert_bitwise_equal(_backend().gemm(a, b, batch_invariant=True), full, "repeat")
    for m in (1, 7, 128):
        part = _backend().gemm(a.row_slice(0, m), b, batch_invariant=True)
        assert_bitwise_equal(part, full[:m], f"M={m}")
        tail = _backend().gemm(a.row_slice(4096 - m, 4096), b, batch_invariant=True)
        assert_bitwise_equal(tail, full[4096 - m:], f"last {m} rows")


def test_strict_grouped_rows_do_not_depend_on_other_tokens():
    qb = nvfp4.quantize_reference(randn(16, 256, 512, seed=8, scale=0.02), global_scale="group", tile=(16, 16),
                                  with_image=True)
    qa = nvfp4.quantize_reference(randn(600, 512, seed=9), with_image=True)
    sizes = [0, 300, 1, 0, 150, 0, 0, 100, 49, 0, 0, 0, 0, 0, 0, 0]
    full = _backend().grouped_gemm(_dev(qa), _dev(qb), sizes, batch_invariant=True)
    assert_bitwise_equal(_backend().grouped_gemm(_dev(qa), _dev(qb), sizes, batch_invariant=True), full, "repeat")
    # expert 1's first 7 tokens alone, everything else empty
    one = [0, 7] + [0] * 14
    part = _backend().grouped_gemm(_dev(qa).row_slice(0, 7), _dev(qb), one, batch_invariant=True)
    assert_bitwise_equal(part, full[:7], "expert 1 alone")


def test_grouped_empty_experts_and_very_unbalanced_routing_at_real_shape():
    g, n, k = 128, 1536, 2048
    sizes = [0] * g
    sizes[3], sizes[64], sizes[127], sizes[10] = 5000, 1, 17, 600  # 124 empty experts
    qb = nvfp4.quantize_reference(randn(g, n, k, seed=10, scale=0.02), global_scale="group", tile=(16, 16),
                                  with_image=True)
    qa = nvfp4.quantize_reference(randn(sum(sizes), k, seed=11), with_image=True)
    out = _backend().grouped_gemm(_dev(qa), _dev(qb), torch.tensor(sizes, device=CUDA)).cpu()
    am, start = qa.matrix(), 0
    for e, s in enumerate(sizes):
        if s:
            exact, bound = nvfp4.fp32_accumulation_bound(am.row_slice(start, start + s), qb.group(e))
            assert_within(out[start:start + s], exact, gemm_output_bound(exact, bound, torch.bfloat16), f"expert {e}")
        start += s


def test_decode_gemm_within_bound_at_real_shape():
    from minite_kernels.triton.decode.decode_gemm import decode_gemm_forward

    for m, n, k in ((1, 2048, 4096), (7, 5120, 2048), (64, 2048, 6144)):
        qa, qb = _operands(m, n, k, seed=m)
        out = decode_gemm_forward(qa.image.to(CUDA), qb.codes.to(CUDA), qb.block_scales.to(CUDA),
                                  qa.global_decode.to(CUDA), qb.global_decode.to(CUDA)).cpu()
        exact, bound = nvfp4.fp32_accumulation_bound(qa, qb)
        assert_within(out, exact, gemm_output_bound(exact, bound, torch.bfloat16), f"decode M={m}")
        out = _backend().gemm(_dev(qa), _dev(qb), batch_invariant=False).cpu()  # dispatcher's choice
        assert_within(out, exact, gemm_output_bound(exact, bound, torch.bfloat16), f"backend M={m}")


@pytest.mark.parametrize("rht_seed", [None, 11])
def test_grouped_wgrad_at_real_shape(rht_seed):
    sizes = [0, 700, 13, 300] + [0] * 4
    t = sum(sizes)
    dy = randn(t, 512, seed=12, dtype=torch.bfloat16)
    x = randn(t, 256, seed=13, dtype=torch.bfloat16)
    out = _backend().grouped_wgrad(dy.to(CUDA), x.to(CUDA), sizes, grad_rounding="stochastic", grad_seed=5,
                                   rht_seed=rht_seed).cpu()
    qa = nvfp4.quantize_wgrad_operand(dy, sizes, rounding="stochastic", seed=5, rht_seed=rht_seed)
    qb = nvfp4.quantize_wgrad_operand(x, sizes, rht_seed=rht_seed)
    padded, col = nvfp4.padded_group_sizes(sizes), 0
    for e, p in enumerate(padded):
        if p:
            exact, bound = nvfp4.fp32_accumulation_bound(_cols(qa.matrix(), col, col + p), _cols(qb.matrix(), col, col + p))
            assert_within(out[e], exact, gemm_output_bound(exact, bound, torch.float32), f"expert {e}")
        else:
            assert torch.count_nonzero(out[e]) == 0
        col += p


def _cols(q, c0, c1):
    """Columns [c0, c1) (multiples of 16) of a 2D NVFP4 matrix as its own tensor."""
    from dataclasses import replace

    img = None if q.image is None else q.image[:, c0:c1]
    return replace(q, codes=q.codes[:, c0 // 2:c1 // 2].contiguous(), block_scales=q.block_scales[:, c0 // 16:c1 // 16].contiguous(),
                   shape=torch.Size([q.rows, c1 - c0]), image=img)
