"""The one-pass row-wise + column-wise quantize (:mod:`minite_kernels.triton.quantize_dual`) ==
``nvfp4.row_col.quantize_row_col`` (i.e. ``quantize_reference(x)`` and
``quantize_reference(x.t())``), bit for bit: codes, E4M3 block scales, fp32 global decode
scales, bf16 image and the NVFP4Tensor metadata of both results, for both scale kinds on
each side, stochastic rounding on / off (independent streams), the fused RHT on / off, the
amax pass (``amax_row_col``) and given amaxes, and the hard cases: zeros, E2M1 ties and bin
edges, saturation, subnormal block scales, bf16 subnormal inputs, NaN / inf (propagate:
NaN scale domains; raise: ValueError), strided and misaligned rows, fp16.

CPU tests run under TRITON_INTERPRET=1 (one kernel program per call: ~1-2 s each; the file
takes about a minute on 2 cores); the ``gpu`` tests compare with the two separate
``quantize_forward`` calls at the H200 benchmark shapes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minite_megatron.nvfp4 import row_col
from minite_megatron.nvfp4.backends import ReferenceBackend
from minite_megatron.testing import assert_bitwise_equal

from minite_kernels.triton._testing import (
    DEVICE,
    assert_quantized_equal,
    heavy_tailed,
    kernels_runnable,
    randn,
    tie_matrix,
)

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.quantize_dual import amax_row_col_forward, quantize_row_col_forward  # noqa: E402

BF16 = torch.bfloat16
DY = dict(row_rounding="stochastic", row_seed=11, col_rounding="stochastic", col_seed=12, col_rht_seed=0)
X = dict(row_scale="row", col_rht_seed=0)


def _cpu(q):
    return replace(q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
                   image=None if q.image is None else q.image.cpu())


def _same_metadata(a, b, name):
    for field in ("shape", "global_scale", "tile", "layout", "rht_seed"):
        assert getattr(a, field) == getattr(b, field), (name, field, getattr(a, field), getattr(b, field))
    assert (a.image is None) == (b.image is None), name
    assert a.codes.dtype == b.codes.dtype and a.block_scales.dtype == b.block_scales.dtype, name
    assert tuple(a.codes.shape) == tuple(b.codes.shape) and tuple(a.block_scales.shape) == tuple(b.block_scales.shape)


def check(x: torch.Tensor, name: str = "x", **kwargs):
    """Dual pass on DEVICE vs the reference on the CPU: both results, bit for bit."""
    got_row, got_col = quantize_row_col_forward(x.to(DEVICE) if x.device != DEVICE else x, **kwargs)
    ref_row, ref_col = row_col.quantize_row_col(x.cpu(), **kwargs)
    for got, ref, side in ((got_row, ref_row, "row"), (got_col, ref_col, "col")):
        got = _cpu(got)
        _same_metadata(got, ref, f"{name}.{side}")
        assert_quantized_equal(got, ref, f"{name}.{side}")
    return got_row, got_col


def check_amax(x: torch.Tensor, **kwargs):
    got = amax_row_col_forward(x.to(DEVICE), **kwargs)
    ref = row_col.amax_row_col(x.cpu(), **kwargs)
    assert_bitwise_equal(got[0].cpu(), ref[0], "row amax")
    assert_bitwise_equal(got[1].cpu(), ref[1], "col amax")
    return ref


# ---- fresh random data, every option ------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, kwargs",
    [
        ((16, 16), {}),
        ((48, 64), X),
        ((128, 256), DY),
        ((128, 16), dict(row_scale="row", col_scale="row", col_rht_seed=3)),
        ((16, 256), dict(col_scale="row", col_rounding="stochastic", col_seed=2**32 - 1)),
    ],
)
def test_random_shapes_and_recipes(shape, kwargs):
    """T in {16, 48, 128} x N in {16, 64, 256}, the dy (SR both sides, RHT) and x (per-token
    row scale, RHT) recipes among them."""
    check(randn(*shape, seed=shape[0] + shape[1], scale=3.0, dtype=BF16), **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(row_scale="row", col_scale="tensor"),
        dict(row_scale="tensor", col_scale="row", col_rht_seed=-1),
        dict(row_scale="row", col_scale="row", row_rounding="stochastic", row_seed=0, col_rht_seed=5),
        dict(row_scale="tensor", col_scale="tensor", col_rounding="stochastic", col_seed=7),
        dict(row_scale="row", col_scale="row", row_rounding="stochastic", row_seed=1, col_rounding="stochastic",
             col_seed=1),
    ],
)
def test_heavy_tailed_every_scale_kind_rounding_and_transform(kwargs):
    """Outliers (a block amax far below the domain's): both scale kinds on each side, SR on one
    side, the other, both (same seed: the two streams still differ, row/col of *their* matrix)."""
    check(heavy_tailed(64, 48, seed=3, dtype=BF16), **kwargs)


def test_fp16_input():
    check(randn(32, 48, seed=4, scale=100.0, dtype=torch.float16), **DY)


# ---- hard cases --------------------------------------------------------------------------
def _ties() -> torch.Tensor:
    """[64 tokens, 80 features]: features 0-63 are ``tie_matrix`` rows (every E2M1 bin edge and
    tie, 6.5 -> 6 saturation, -0.0, a subnormal E4M3 scale, a scale that rounds to zero) for
    the row side; features 64-79 the same along tokens for the column side. Every token and
    feature has amax 2688 (S_enc = 1), so the rounding shows directly."""
    return torch.cat([tie_matrix(64), tie_matrix(16).t()], dim=1).to(BF16)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(row_scale="row", col_scale="row"),
        dict(),
        dict(row_scale="row", col_scale="row", row_rounding="stochastic", row_seed=5, col_rounding="stochastic",
             col_seed=6),
    ],
)
def test_every_bin_edge_tie_saturation_and_subnormal_scale(kwargs):
    check(_ties(), **kwargs)


def test_zeros_and_bf16_subnormal_inputs():
    """All zeros (amax 0: S_enc = 1, every scale 0), and bf16 subnormals, alone in a token /
    feature domain (subnormal amax) and next to normal values (the interpreter flushes them in
    bf16 -> fp32 casts: the kernel converts on the bits)."""
    check(torch.zeros(32, 32, dtype=BF16), row_scale="row", col_scale="row", col_rht_seed=1)
    check(torch.zeros(16, 16, dtype=BF16))
    sub = torch.full((48, 32), 9.2e-41).to(BF16)
    sub[:, 5] = randn(48, seed=12, dtype=BF16)
    sub[7, :] = -2.0e-39
    check(sub, row_scale="row", col_scale="row")
    check(sub, col_rht_seed=2, row_rounding="stochastic", row_seed=3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_propagates_to_its_scale_domains(bad):
    """A NaN / inf marks its token (row side, per-token scale) and its feature (column side,
    per-feature scale; the RHT spreads it over the block) NaN; with tensor scales everything."""
    x = randn(48, 64, seed=5, dtype=BF16)
    x[17, 21] = bad
    check(x, row_scale="row", col_scale="row", col_rht_seed=4)
    check(x, row_rounding="stochastic", row_seed=2)
    ra, ca = check_amax(x, row_scale="row", col_scale="row", col_rht_seed=4)
    assert ra[17] == float("inf") and ca[21] == float("inf") and torch.isfinite(ra[:17]).all()


def test_nonfinite_raise():
    x = randn(32, 32, seed=6, dtype=BF16)
    x[3, 4] = float("nan")
    for fn in (quantize_row_col_forward, row_col.quantize_row_col):
        with pytest.raises(ValueError, match="non-finite"):
            fn(x.to(DEVICE) if fn is quantize_row_col_forward else x, nonfinite="raise")


# ---- amaxes ------------------------------------------------------------------------------
@pytest.mark.parametrize("row_scale, col_scale, rht", [("tensor", "tensor", 0), ("row", "tensor", 3),
                                                       ("tensor", "row", None), ("row", "row", -1)])
def test_amax_pass_equals_the_reference(row_scale, col_scale, rht):
    x = heavy_tailed(80, 48, seed=7, dtype=BF16)
    x[5, 9] = 2.0e-39  # a subnormal (exact on the bits)
    check_amax(x, row_scale=row_scale, col_scale=col_scale, col_rht_seed=rht)


def test_amax_given_equals_computed_and_overrides():
    """Given amaxes (as a tensor-parallel caller passes them after an all-reduce): the same bits
    as computing them; smaller overrides saturate scales and codes; an override keeps a NaN
    block marked in an otherwise finite domain."""
    x = randn(64, 32, seed=8, scale=5.0, dtype=BF16)
    kw = dict(row_scale="row", col_scale="tensor", col_rht_seed=6)
    ra, ca = row_col.amax_row_col(x, **kw)
    a = check(x, row_amax=ra, col_amax=ca, **kw)
    b = check(x, **kw)
    for p, q in zip(a, b):
        assert torch.equal(p.codes, q.codes) and torch.equal(p.block_scales.view(torch.uint8), q.block_scales.view(torch.uint8))
    x[3, 30] = float("nan")
    check(x, row_amax=torch.full((64,), 0.5), col_amax=torch.tensor([0.25]), col_scale="tensor", row_scale="row")
    check(x, row_amax=torch.tensor([1e-3]), col_amax=torch.full((32,), 7.0), col_scale="row", col_rht_seed=6,
          col_rounding="stochastic", col_seed=9)


# ---- layouts, options, errors --------------------------------------------------------------
def test_strided_misaligned_and_without_image():
    base = randn(48, 80, seed=9, dtype=BF16).to(DEVICE)
    check(base[:, 16:80], row_scale="row")  # row stride 80 > 64 features
    odd = base.reshape(-1)[1:1 + 32 * 32].view(32, 32)  # rows start 2 bytes off 4-byte words: copied
    check(odd, **DY)
    q_row, q_col = check(randn(32, 16, seed=10, dtype=BF16), with_image=False)
    assert q_row.image is None and q_col.image is None


def test_backends_expose_the_dual_op():
    from minite_kernels.triton.backend import BACKEND

    x = randn(32, 32, seed=13, dtype=BF16)
    ref = ReferenceBackend().quantize_row_col(x, **DY)
    got = BACKEND.quantize_row_col(x.to(DEVICE), **DY)
    for g, r in zip(got, ref):
        assert_quantized_equal(_cpu(g), r)
    ra = BACKEND.amax_row_col(x.to(DEVICE), row_scale="row", col_scale="tensor", col_rht_seed=0)
    rb = ReferenceBackend().amax_row_col(x, row_scale="row", col_scale="tensor", col_rht_seed=0)
    assert_bitwise_equal(ra[0].cpu(), rb[0], "row amax")
    assert_bitwise_equal(ra[1].cpu(), rb[1], "col amax")


def test_empty_tokens():
    q_row, q_col = quantize_row_col_forward(torch.zeros(0, 32, dtype=BF16, device=DEVICE))
    r_row, r_col = row_col.quantize_row_col(torch.zeros(0, 32, dtype=BF16))
    assert q_row.codes.shape == r_row.codes.shape == (0, 16) and q_col.codes.shape == r_col.codes.shape == (32, 0)
    assert q_col.global_decode.tolist() == r_col.global_decode.tolist() == [1.0]


@pytest.mark.parametrize(
    "x, kwargs, match",
    [
        (torch.zeros(24, 32, dtype=BF16), {}, "multiples of 16"),
        (torch.zeros(32, 24, dtype=BF16), {}, "multiples of 16"),
        (torch.zeros(32, 32), {}, "bfloat16 or float16"),
        (torch.zeros(2, 16, 16, dtype=BF16), {}, "2D"),
        (torch.zeros(32, 32, dtype=BF16).t(), {}, "unit stride"),
        (torch.zeros(32, 32, dtype=BF16), dict(row_scale="group"), "'row' or 'tensor'"),
        (torch.zeros(32, 32, dtype=BF16), dict(row_rounding="stochastic"), "seed"),
        (torch.zeros(32, 32, dtype=BF16), dict(col_rounding="stochastic"), "seed"),
        (torch.zeros(32, 32, dtype=BF16), dict(row_scale="row", row_amax=torch.ones(1)), "row_amax"),
    ],
)
def test_rejects_what_it_does_not_take(x, kwargs, match):
    """ValueError with a clear message (the caller falls back to two quantize calls)."""
    with pytest.raises(ValueError, match=match):
        quantize_row_col_forward(x.to(DEVICE), **kwargs)


# ---- GPU: real shapes against the two separate kernels --------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("t, n", [(16384, 2048), (16384, 5120), (16384, 6144), (4096 + 16, 1040)])
@pytest.mark.parametrize("recipe", ["dy", "x"])
def test_gpu_equals_two_quantize_forward_calls(t, n, recipe):
    """The H200 benchmark shapes (and one with tails of every tile): the dual path's bits ==
    ``quantize_forward(dy)`` + ``quantize_forward(dy.t())`` (each with its own amax pass)."""
    from minite_kernels.triton.quantize import quantize_forward

    g = torch.Generator(device="cuda").manual_seed(t + n)
    x = (torch.randn(t, n, device="cuda", generator=g) * 3.0).to(BF16)
    x[::97, ::13] *= 1000.0  # outliers
    kw = DY if recipe == "dy" else X
    q_row, q_col = quantize_row_col_forward(x, with_image=True, **kw)
    r_row = quantize_forward(x, global_scale=kw.get("row_scale", "tensor"), rounding=kw.get("row_rounding", "nearest"),
                             seed=kw.get("row_seed"), with_image=True)
    r_col = quantize_forward(x.t(), global_scale="tensor", rounding=kw.get("col_rounding", "nearest"),
                             seed=kw.get("col_seed"), rht_seed=kw["col_rht_seed"], with_image=True)
    for a, b, side in ((q_row, r_row, "row"), (q_col, r_col, "col")):
        _same_metadata(a, b, side)
        assert_bitwise_equal(a.codes, b.codes, f"{side}.codes")
        assert_bitwise_equal(a.block_scales, b.block_scales, f"{side}.scales")
        assert_bitwise_equal(a.global_decode, b.global_decode, f"{side}.global_decode")
        assert_bitwise_equal(a.image, b.image, f"{side}.image")


@pytest.mark.gpu
def test_gpu_hard_cases_against_the_reference():
    x = torch.cat([_ties().repeat(8, 4), randn(512, 320, seed=14, scale=4.0, dtype=BF16)])
    x[100, 7] = float("nan")
    x[600, 300] = float("inf")
    for kw in (dict(row_scale="row", col_scale="row", col_rht_seed=0), DY, dict(X, col_scale="row")):
        check(x.cuda(), **kw)
        check_amax(x, row_scale=kw.get("row_scale", "tensor"), col_scale=kw.get("col_scale", "tensor"),
                   col_rht_seed=kw.get("col_rht_seed"))


@pytest.mark.gpu
def test_gpu_amax_given_and_cuda_graph_capture():
    """Given amaxes (the TP path) and a CUDA-graph capture of the whole op (no host sync, no
    host-to-device copy inside) give the same bits as the eager call."""
    x = randn(2048, 1024, seed=15, scale=2.0, dtype=BF16).cuda()
    eager = quantize_row_col_forward(x, **DY)
    ra, ca = amax_row_col_forward(x, col_rht_seed=0)
    given = quantize_row_col_forward(x, row_amax=ra, col_amax=ca, **DY)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = quantize_row_col_forward(x, **DY)
    graph.replay()
    torch.cuda.synchronize()
    for q in (given, captured):
        for a, b in zip(q, eager):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.image.view(torch.int16), b.image.view(torch.int16))
            assert torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))
            assert torch.equal(a.global_decode, b.global_decode)
