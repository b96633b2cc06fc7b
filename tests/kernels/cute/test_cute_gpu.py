"""Execution tests of the Blackwell kernels against the contract. They need a Blackwell GPU
(compute capability 10.0 / 10.3) and the CUTLASS DSL, and skip elsewhere with the reason.

Two kinds of checks:
* exact data (block scales in {0.5, 1, 2}, K <= 1024): every partial sum of the products is
  a multiple of 2^-4 below 2^18, exact in fp32 in *any* order, so the tensor-core result must
  equal the reference bit for bit -- this pins the epilogue (one fp32 alpha product, scale,
  bias add, one rounding) and the tile / group / tail bookkeeping;
* realistic data (quantized heavy-tailed values): within the fp32 accumulation bound of
  ``nvfp4.fp32_accumulation_bound`` plus one output rounding.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.settings import settings
from minite_megatron.testing import assert_bitwise_equal, assert_within, gemm_output_bound
from minite_kernels.cute.backend import BACKEND

_REASON = BACKEND.why_not(torch.device("cuda")) if torch.cuda.is_available() else "needs a CUDA GPU"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs a Blackwell GPU (sm_100a/sm_103a): {_REASON}"),
]

DEV = "cuda"


@pytest.mark.parametrize("m", [1, 127, 128, 300])
@pytest.mark.parametrize("n,k", [(1, 64), (96, 192), (200, 320), (512, 256), (640, 1024)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_bitwise_on_exact_data(exact_operand, m, n, k, out_dtype, with_bias):
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    a, b = exact_operand(m, k, gen, device=DEV), exact_operand(n, k, gen, device=DEV)
    bias = (torch.randn(n, generator=gen) * 0.1).to(DEV) if with_bias else None
    got = nvfp4.gemm(a, b, bias, out_dtype=out_dtype, backend="blackwell")
    ref = nvfp4.gemm_reference(a, b, bias, out_dtype)
    assert_bitwise_equal(got, ref, f"blackwell gemm m={m} n={n} k={k}")


@pytest.mark.parametrize("sizes", [[300], [0, 1, 127, 0, 129, 5, 300, 0], [1] * 40, [0, 0, 64, 0]])
@pytest.mark.parametrize("n,k", [(96, 128), (512, 320)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_bitwise_on_exact_data(exact_operand, sizes, n, k, with_bias):
    """Groups of size 0 and 1, groups straddling 128-row tiles, many groups in one tile."""
    gen = torch.Generator().manual_seed(len(sizes) * 101 + n + k)
    a = exact_operand(sum(sizes), k, gen, device=DEV)
    b = exact_operand(n, k, gen, lead=(len(sizes),), device=DEV)
    bias = (torch.randn(len(sizes), n, generator=gen) * 0.1).to(DEV) if with_bias else None
    got = nvfp4.grouped_gemm(a, b, sizes, bias, backend="blackwell")
    ref = nvfp4.grouped_gemm_reference(a, b, sizes, bias)
    assert_bitwise_equal(got, ref, f"blackwell grouped gemm sizes={sizes}")


_ON_B300 = torch.cuda.is_available() and _REASON is None and torch.cuda.get_device_capability() == (10, 3)
_b300_only = pytest.mark.skipif(not _ON_B300, reason="the K = 96 kernel runs on sm_103a (B300) only")


@_b300_only
@pytest.mark.parametrize("k", [96, 864, 2048, 2304])
@pytest.mark.parametrize("m,n", [(300, 200), (128, 512)])
def test_sm103_k96_kernel_bitwise_on_exact_data(exact_operand, monkeypatch, m, n, k):
    """sm_103a's K = 96 kernel (selected there) on exact data, K not a multiple of 64 (96, 864)
    or of 768 (864, 2048: skipped tail MMAs): bitwise equal to the reference (partial sums are
    multiples of 2^-4 below 144 K < 2^20, exact for K <= 7281). Also the grouped GEMM at K = 864."""
    monkeypatch.delenv("MINITE_BLACKWELL_MMA_K", raising=False)
    settings.cache_clear()  # (read once per process: the variable changed)
    gen = torch.Generator().manual_seed(m + n + k)
    a, b = exact_operand(m, k, gen, device=DEV), exact_operand(n, k, gen, device=DEV)
    bias = (torch.randn(n, generator=gen) * 0.1).to(DEV)
    assert_bitwise_equal(nvfp4.gemm(a, b, bias, backend="blackwell"), nvfp4.gemm_reference(a, b, bias), f"k96 k={k}")
    if k == 864:
        sizes = [0, 1, 127, 0, 129, 5, 300, 0]
        a = exact_operand(sum(sizes), k, gen, device=DEV)
        w = exact_operand(n, k, gen, lead=(len(sizes),), device=DEV)
        got = nvfp4.grouped_gemm(a, w, sizes, backend="blackwell")
        assert_bitwise_equal(got, nvfp4.grouped_gemm_reference(a, w, sizes), "k96 grouped")


@_b300_only
def test_sm103_k64_fallback_and_k96_both_within_the_bound(monkeypatch):
    """MINITE_BLACKWELL_MMA_K=64 runs the K = 64 kernel on a B300; both it and the K = 96 kernel
    stay within the fp32 accumulation bound on realistic data (their accumulation orders
    differ, so they need not be bitwise equal to each other)."""
    gen = torch.Generator().manual_seed(96)
    a = nvfp4.quantize(_heavy_tailed(256, 2048, gen=gen), global_scale="row", backend="blackwell")
    b = nvfp4.quantize(_heavy_tailed(384, 2048, gen=gen), global_scale="tensor", tile=(16, 16), backend="blackwell")
    exact, bound = nvfp4.fp32_accumulation_bound(a, b, None)
    for forced in ("", "64"):
        monkeypatch.setenv("MINITE_BLACKWELL_MMA_K", forced)
        settings.cache_clear()  # (read once per process: the variable changed)
        got = nvfp4.gemm(a, b, backend="blackwell")
        assert_within(got, exact, gemm_output_bound(exact, bound, torch.bfloat16), f"MMA_K={forced or 'auto'}")


def _heavy_tailed(*shape, gen):
    x = torch.randn(*shape, generator=gen)
    return (x * torch.exp(torch.randn(*shape, generator=gen) * 1.5)).to(DEV)


@pytest.mark.parametrize("m,n,k", [(256, 384, 2048), (77, 4096, 512), (1000, 200, 1024)])
def test_dense_within_the_fp32_accumulation_bound(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    a = nvfp4.quantize(_heavy_tailed(m, k, gen=gen), global_scale="row", backend="blackwell")
    b = nvfp4.quantize(_heavy_tailed(n, k, gen=gen), global_scale="tensor", tile=(16, 16), backend="blackwell")
    bias = torch.randn(n, generator=gen).to(DEV)
    got = nvfp4.gemm(a, b, bias, backend="blackwell")
    exact, bound = nvfp4.fp32_accumulation_bound(a, b, bias)
    assert_within(got, exact, gemm_output_bound(exact, bound, torch.bfloat16), "blackwell gemm")


def test_grouped_within_the_fp32_accumulation_bound():
    gen = torch.Generator().manual_seed(5)
    sizes, n, k = [33, 0, 200, 1, 90], 256, 1536
    a = nvfp4.quantize(_heavy_tailed(sum(sizes), k, gen=gen), global_scale="row", backend="blackwell")
    b = nvfp4.quantize(_heavy_tailed(len(sizes), n, k, gen=gen), global_scale="group", tile=(16, 16), backend="blackwell")
    got = nvfp4.grouped_gemm(a, b, sizes, backend="blackwell")
    start = 0
    for g, size in enumerate(sizes):
        if size:
            rows = a.row_slice(start, start + size)
            exact, bound = nvfp4.fp32_accumulation_bound(rows, b.group(g))
            assert_within(got[start : start + size], exact, gemm_output_bound(exact, bound, torch.bfloat16), f"group {g}")
        start += size


def test_rows_do_not_depend_on_the_batch():
    """Strict mode: a row's output is the same whether it is computed alone or in a batch."""
    gen = torch.Generator().manual_seed(11)
    a = nvfp4.quantize(_heavy_tailed(333, 768, gen=gen), backend="blackwell")
    b = nvfp4.quantize(_heavy_tailed(640, 768, gen=gen), global_scale="tensor", backend="blackwell")
    full = nvfp4.gemm(a, b, backend="blackwell", batch_invariant=True)
    for start, end in [(0, 1), (5, 42), (128, 333)]:
        part = nvfp4.gemm(a.row_slice(start, end).swizzled(), b, backend="blackwell", batch_invariant=True)
        assert_bitwise_equal(part, full[start:end], f"rows {start}:{end}")


def test_nonfinite_rows_give_nan_rows():
    """The non-finite policy: a NaN row (NaN global and block scales) yields a NaN output row,
    and no other row is touched."""
    gen = torch.Generator().manual_seed(2)
    x = _heavy_tailed(130, 256, gen=gen)
    x[3, 7] = float("nan")
    a = nvfp4.quantize(x, backend="blackwell")
    b = nvfp4.quantize(_heavy_tailed(64, 256, gen=gen), global_scale="tensor", backend="blackwell")
    got = nvfp4.gemm(a, b, backend="blackwell").float()
    assert torch.isnan(got[3]).all()
    assert torch.isfinite(torch.cat([got[:3], got[4:]])).all()


def test_empty_inputs(exact_operand):
    gen = torch.Generator().manual_seed(0)
    b = exact_operand(32, 64, gen, device=DEV)
    a = exact_operand(0, 64, gen, device=DEV)
    assert nvfp4.gemm(a, b, backend="blackwell").shape == (0, 32)


# ---- MoE wgrad (groups along K) ----------------------------------------------------------------
@pytest.mark.parametrize("padded", [[16, 0, 48, 64, 112], [0, 64, 0], [1024], [16] * 9])
@pytest.mark.parametrize("n,k", [(96, 200), (300, 640)])
def test_wgrad_gemm_bitwise_on_exact_data(exact_operand, padded, n, k):
    """Experts of 0, 16 (unaligned: moved to 64-aligned columns), 64 and 1024 tokens; experts
    without tokens get exact zeros."""
    gen = torch.Generator().manual_seed(sum(padded) + n + k)
    a, b = exact_operand(n, sum(padded), gen, device=DEV), exact_operand(k, sum(padded), gen, device=DEV)
    got = BACKEND.grouped_wgrad_gemm(a, b, padded)
    ref = nvfp4.grouped_wgrad_gemm_reference(a, b, padded)
    assert_bitwise_equal(got, ref, f"blackwell wgrad gemm {padded}")


def test_grouped_wgrad_within_the_fp32_accumulation_bound():
    """End to end: contract quantization (stochastic rounding, RHT) then the tensor cores."""
    gen = torch.Generator().manual_seed(9)
    sizes, n, k = [40, 0, 300, 7, 1500], 256, 384
    dy, x = _heavy_tailed(sum(sizes), n, gen=gen), _heavy_tailed(sum(sizes), k, gen=gen)
    kw = dict(grad_rounding="stochastic", grad_seed=123, rht_seed=7)
    got = BACKEND.grouped_wgrad(dy, x, sizes, **kw)
    qa = nvfp4.quantize_wgrad_operand(dy, sizes, rounding="stochastic", seed=123, rht_seed=7)
    qb = nvfp4.quantize_wgrad_operand(x, sizes, rht_seed=7)
    ia, ib = qa.image_fp32().double(), qb.image_fp32().double()
    alpha = qa.row_global_decode().double().unsqueeze(1) * qb.row_global_decode().double().unsqueeze(0)
    col = 0
    for g, p in enumerate(nvfp4.padded_group_sizes(sizes)):
        exact = (ia[:, col : col + p] @ ib[:, col : col + p].t()) * alpha
        mag = (ia[:, col : col + p].abs() @ ib[:, col : col + p].abs().t()) * alpha.abs()
        u = 2.0**-24
        bound = p * u / (1 - p * u) * mag + 2 * u * (mag + exact.abs())
        assert_within(got[g], exact, gemm_output_bound(exact, bound, torch.float32), f"expert {g}")
        col += p


@pytest.mark.xfail(
    raises=RuntimeError,
    strict=False,
    reason="contract: quantize_reference cannot quantize K == 0 (reported to the lead); the kernel op "
    "itself returns zeros for T == 0",
)
def test_wgrad_without_tokens():
    """All local experts without tokens (possible with expert parallelism): zero gradients."""
    dy, x = torch.zeros(0, 32, device=DEV), torch.zeros(0, 64, device=DEV)
    got = BACKEND.grouped_wgrad(dy, x, [0, 0, 0])
    assert got.shape == (3, 32, 64) and not got.any()
