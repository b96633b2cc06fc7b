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


@pytest.fixture
def on_fake_blackwell(monkeypatch):
    """The ops believe they run on sm_100a, and the launch is the model above."""
    from minite_kernels.cute import _blockscaled_gemm_impl as impl
    from minite_kernels.cute import gemm, grouped_gemm, grouped_wgrad_gemm

    for module in (gemm, grouped_gemm, grouped_wgrad_gemm):
        monkeypatch.setattr(module, "device_arch", lambda device: "sm_100a")
    calls = []

    def launch(config, *args, **kwargs):
        calls.append(config)
        kernel_model(config, *args, **kwargs)

    monkeypatch.setattr(impl, "launch", launch)
    return calls


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
