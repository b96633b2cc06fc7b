"""The host side of the Blackwell ops end to end, on a CPU: everything up to the launch is real
(validation, scale layouts, global-scale strides, group offsets, expert realignment for
wgrad, output allocation), and the launch is replaced by a torch model of the kernel that
reads the raw launch arguments exactly as the kernel documents them
(``_blockscaled_gemm_impl`` module docstring). The results must equal the contract bit for
bit. This pins the interface between the host code and the kernel (layouts, strides, offsets
units) without a GPU; the kernel itself is checked by test_cute_compile.py / test_cute_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4 import BLOCK, e2m1_decode, unpack_e2m1, unswizzle_scales
from minite_megatron.nvfp4.gemm import block_partials_accumulate, epilogue
from minite_megatron.settings import settings
from minite_megatron.testing import assert_bitwise_equal
from minite_kernels.cute import _host
from minite_kernels.cute.backend import BACKEND

if _host.dsl_import_error() is not None:
    pytest.skip(_host.dsl_import_error(), allow_module_level=True)


def _image(codes: torch.Tensor, swizzled: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """fp32 [rows, k] = e2m1(code) * scale, from packed codes and flat swizzled scales."""
    values = e2m1_decode(unpack_e2m1(codes.reshape(rows, k // 2)))
    scales = unswizzle_scales(swizzled, rows, k // BLOCK).to(torch.float32)
    return (values.view(rows, k // BLOCK, BLOCK) * scales.unsqueeze(-1)).view(rows, k)


def kernel_model(config, a_codes, b_codes, a_scales, b_scales, out, row_scale_a, row_scale_b, bias, offsets,
                 *, m, n, k, groups, sb_strides, arch, schedule=None):
    """What the kernel computes from its launch arguments (see the impl module docstring).
    Grouped rows: CTA p runs the (tile, expert) pair the schedule assigns it (expert g = the
    last with ``schedule[g] <= p``, tile ``offs[g] // 128 + p - schedule[g]``) and stores that
    expert's rows of that tile; no row is written twice."""
    assert arch in ("sm_100a", "sm_103a")
    assert config.mma_k == 64 or (arch == "sm_103a" and not config.k_grouped and k % 32 == 0)
    assert config.mma_k == 96 or k % 64 == 0
    assert a_codes.is_contiguous() and b_codes.is_contiguous() and a_codes.dtype == torch.uint8
    assert a_scales.dim() == 1 and b_scales.dim() == 1 and a_scales.dtype == torch.float8_e4m3fn
    sb_flat = row_scale_b.reshape(-1)

    def sb(g):  # fp32 [n]: element (col, g) at col * stride_n + g * stride_g
        return sb_flat[torch.arange(n) * sb_strides[0] + g * sb_strides[1]]

    ia = _image(a_codes, a_scales, m, k)
    if config.k_grouped:
        ib = _image(b_codes, b_scales, n, k)
        offs = offsets.tolist()
        for g in range(groups):
            lo, hi = offs[g] * 64, offs[g + 1] * 64
            if hi > lo:
                acc = block_partials_accumulate(ia[:, lo:hi], ib[:, lo:hi])
                out[g] = epilogue(acc, row_scale_a, sb(g), None, out.dtype)
            else:
                out[g] = 0
        return
    per_group = b_scales.numel() // groups
    offs = offsets.tolist() if config.grouped else [0, m]
    if config.grouped:
        sched = schedule.tolist()
        assert len(sched) == groups + 1 and sched[-1] <= -(-m // 128) + groups - 1  # fits the grid
        passes = []
        for p in range(sched[-1]):
            g = max(h for h in range(groups) if sched[h] <= p)
            tile = offs[g] // 128 + p - sched[g]
            passes.append((g, max(offs[g], 128 * tile), min(offs[g + 1], 128 * tile + 128)))
    else:
        passes = [(0, 0, m)] if m else []
    written = torch.zeros(m, dtype=torch.int64)
    for g, lo, hi in passes:
        assert lo < hi, "a CTA ran a pass that stores nothing"
        written[lo:hi] += 1
        ib = _image(b_codes.reshape(groups, n, k // 2)[g], b_scales[g * per_group : (g + 1) * per_group], n, k)
        acc = block_partials_accumulate(ia[lo:hi], ib)
        bias_g = None if bias is None else bias.reshape(groups, n)[g]  # fp32 [G, N] (dense: G == 1)
        out[lo:hi] = epilogue(acc, row_scale_a[lo:hi], sb(g), bias_g, out.dtype)
    assert bool((written == 1).all()), "every row is written by exactly one pass"


def _fake_blackwell(monkeypatch, arch):
    from minite_kernels.cute import _blockscaled_gemm_impl as impl
    from minite_kernels.cute import gemm, grouped_gemm, grouped_wgrad_gemm

    for module in (gemm, grouped_gemm, grouped_wgrad_gemm):
        monkeypatch.setattr(module, "device_arch", lambda device: arch)
        if hasattr(module, "blackwell_arch"):
            monkeypatch.setattr(module, "blackwell_arch", lambda device: arch)
    calls = []

    def launch(config, *args, **kwargs):
        calls.append(config)
        kernel_model(config, *args, **kwargs)

    monkeypatch.setattr(impl, "launch", launch)
    return calls


@pytest.fixture
def on_fake_blackwell(monkeypatch):
    """The ops believe they run on sm_100a (B200), and the launch is the model above."""
    return _fake_blackwell(monkeypatch, "sm_100a")


@pytest.fixture
def on_fake_b300(monkeypatch):
    """The ops believe they run on sm_103a (B300), and the launch is the model above."""
    monkeypatch.delenv("MINITE_BLACKWELL_MMA_K", raising=False)
    settings.cache_clear()  # (read once per process: the variable changed)
    return _fake_blackwell(monkeypatch, "sm_103a")


def _q(x, **kw):
    return nvfp4.quantize_reference(x, **kw)


@pytest.mark.parametrize("m,n,k", [(1, 1, 64), (37, 96, 192), (130, 600, 320)])
@pytest.mark.parametrize("b_scale", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype,with_bias", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)])
def test_dense_host_path_equals_the_contract(on_fake_blackwell, m, n, k, b_scale, out_dtype, with_bias):
    g = torch.Generator().manual_seed(m + n + k)
    a = _q(torch.randn(m, k, generator=g))
    b = _q(torch.randn(n, k, generator=g) * 3, global_scale=b_scale)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    got = BACKEND.gemm(a, b, bias, out_dtype)
    assert_bitwise_equal(got, nvfp4.gemm_reference(a, b, bias, out_dtype), "dense")
    assert on_fake_blackwell[-1].tile_n == (256 if n >= 512 else 128)
    assert on_fake_blackwell[-1].has_bias == with_bias and not on_fake_blackwell[-1].grouped


def test_dense_host_path_keeps_leading_dimensions(on_fake_blackwell):
    g = torch.Generator().manual_seed(1)
    a = _q(torch.randn(2, 3, 128, generator=g))
    b = _q(torch.randn(48, 128, generator=g), global_scale="tensor", tile=(16, 16))
    got = BACKEND.gemm(a, b)
    assert got.shape == (2, 3, 48)
    assert_bitwise_equal(got, nvfp4.gemm_reference(a, b), "3D activations")


@pytest.mark.parametrize("sizes", [[5, 0, 130, 1], [0, 0, 7], [64] * 3, [1] * 9, [0, 128, 1, 255, 0]])
@pytest.mark.parametrize("n,with_bias", [(80, True), (256, False)])
def test_grouped_host_path_equals_the_contract(on_fake_blackwell, sizes, n, with_bias):
    """Per-group swizzled weight scales (N = 80 is not a multiple of 128), per-expert global
    scales broadcast along N (stride 0), int32 row offsets, [G, N] bias."""
    g = torch.Generator().manual_seed(n + len(sizes))
    a = _q(torch.randn(sum(sizes), 128, generator=g))
    b = _q(torch.randn(len(sizes), n, 128, generator=g), global_scale="group", tile=(16, 16))
    bias = torch.randn(len(sizes), n, generator=g) if with_bias else None
    got = BACKEND.grouped_gemm(a, b, sizes, bias)
    assert_bitwise_equal(got, nvfp4.grouped_gemm_reference(a, b, sizes, bias), "grouped")
    assert on_fake_blackwell[-1].grouped


@pytest.mark.parametrize("sizes", [[1, 0, 33, 16, 100], [64, 0, 128], [0, 3]])
@pytest.mark.parametrize("global_scale", ["tensor", "row"])
def test_grouped_wgrad_host_path_equals_the_contract(on_fake_blackwell, sizes, global_scale):
    """Contract quantization with stochastic rounding and RHT, experts realigned to 64-token
    columns, k-tile offsets in units of 64, empty experts -> zeros."""
    g = torch.Generator().manual_seed(sum(sizes))
    dy, x = torch.randn(sum(sizes), 48, generator=g), torch.randn(sum(sizes), 72, generator=g)
    kw = dict(global_scale=global_scale, grad_rounding="stochastic", grad_seed=99, rht_seed=3)
    got = BACKEND.grouped_wgrad(dy, x, sizes, **kw)
    assert_bitwise_equal(got, nvfp4.grouped_wgrad_reference(dy, x, sizes, **kw), "grouped wgrad")
    assert on_fake_blackwell[-1].k_grouped


@pytest.mark.parametrize("k", [96, 768, 864, 2048])
def test_b300_runs_the_k96_kernel_on_unpadded_k(on_fake_b300, k):
    """On sm_103a the dense and grouped GEMMs launch the K = 96 kernel (``mma_k=96``) and take
    K that is a multiple of 32 but not of 64 (96, 864) as they are: no padding copy, the scales
    in the unchanged swizzled layout (6 or 54 scale columns, padded to 4 by the swizzle); the
    wgrad keeps the K = 64 kernel. Results equal the contract."""
    g = torch.Generator().manual_seed(k)
    a = _q(torch.randn(130, k, generator=g))
    b = _q(torch.randn(208, k, generator=g), global_scale="tensor", tile=(16, 16))
    assert_bitwise_equal(BACKEND.gemm(a, b), nvfp4.gemm_reference(a, b), "dense K96")
    assert on_fake_b300[-1].mma_k == 96 and on_fake_b300[-1].tile_k == 768
    sizes = [3, 0, 127]
    a = _q(torch.randn(sum(sizes), k, generator=g))
    w = _q(torch.randn(3, 80, k, generator=g), global_scale="group", tile=(16, 16))
    assert_bitwise_equal(BACKEND.grouped_gemm(a, w, sizes), nvfp4.grouped_gemm_reference(a, w, sizes), "grouped K96")
    assert on_fake_b300[-1].mma_k == 96 and on_fake_b300[-1].grouped
    dy, x = torch.randn(40, 48, generator=g), torch.randn(40, 64, generator=g)
    BACKEND.grouped_wgrad(dy, x, [24, 16])
    assert on_fake_b300[-1].k_grouped and on_fake_b300[-1].mma_k == 64


def test_b300_k64_override_and_its_k_rule(on_fake_b300, monkeypatch):
    """``MINITE_BLACKWELL_MMA_K=64`` makes sm_103a run the K = 64 kernel (the fallback), whose
    K rule is a multiple of 64: K = 96 is then refused with one line naming both rules."""
    monkeypatch.setenv("MINITE_BLACKWELL_MMA_K", "64")
    settings.cache_clear()  # (read once per process: the variable changed)
    g = torch.Generator().manual_seed(0)
    a, b = _q(torch.randn(8, 128, generator=g)), _q(torch.randn(16, 128, generator=g))
    assert_bitwise_equal(BACKEND.gemm(a, b), nvfp4.gemm_reference(a, b), "dense K64 on B300")
    assert on_fake_b300[-1].mma_k == 64
    a, b = _q(torch.randn(8, 96, generator=g)), _q(torch.randn(16, 96, generator=g))
    with pytest.raises(ValueError, match=r"K=96 must be a positive multiple of 64 .*K = 96 kernel"):
        BACKEND.gemm(a, b)


def test_b200_refuses_k_that_only_the_b300_kernel_takes(on_fake_blackwell, monkeypatch):
    g = torch.Generator().manual_seed(0)
    a, b = _q(torch.randn(8, 96, generator=g)), _q(torch.randn(16, 96, generator=g))
    with pytest.raises(ValueError, match="K=96 must be a positive multiple of 64"):
        BACKEND.gemm(a, b)
    monkeypatch.setenv("MINITE_BLACKWELL_MMA_K", "96")
    settings.cache_clear()  # (read once per process: the variable changed)
    with pytest.raises(ValueError, match="MINITE_BLACKWELL_MMA_K=96: the K = 96 MMA exists on sm_103a"):
        BACKEND.gemm(a, b)
