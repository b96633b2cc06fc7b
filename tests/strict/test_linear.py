"""Batch-invariant linear (torch formulation): row results independent of M, bitwise; accurate;
differentiable; clear errors."""

import pytest
import torch

from minite_megatron.invariant import matmul
from minite_megatron.invariant.matmul import linear
from minite_megatron.testing import assert_bitwise_equal


def _data(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_rows_do_not_depend_on_the_batch(dtype, out_dtype):
    x, w, b = _data(45, 96, 72, dtype)
    full = linear(x, w, b, out_dtype=out_dtype)
    for rows in [[0], [44], [3, 17], list(range(5, 38)), list(range(44, -1, -1))]:
        assert_bitwise_equal(linear(x[rows], w, b, out_dtype=out_dtype), full[rows], f"rows {rows[:3]}")
    # 3-D input [s, b, h] as Megatron passes it
    assert_bitwise_equal(linear(x[:44].view(11, 4, 96), w, b, out_dtype=out_dtype).view(44, 72), full[:44])


def test_blas_is_not_batch_invariant_here_but_strict_is():
    """Why strict mode needs its own GEMM: fp32 matmul of one row differs from the same row in a
    batch on this CPU (skipped where the BLAS happens to be invariant for these shapes)."""
    x, w, _ = _data(64, 128, 256, torch.float32, seed=3)
    blas_diff = int((x[:1] @ w.t() != (x @ w.t())[:1]).sum())
    assert_bitwise_equal(linear(x[:1], w), linear(x, w)[:1])
    if blas_diff == 0:
        pytest.skip("this BLAS gives the same bits for M=1 and M=64 on these shapes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accuracy_against_fp64(dtype):
    """Error bound: pairwise fp32 accumulation (ceil(log2 K) + 2 roundings of |x||w|) plus one
    output rounding."""
    x, w, b = _data(33, 200, 40, dtype, seed=4)
    got = linear(x, w, b, out_dtype=torch.float32).double()
    xd, wd, bd = x.double(), w.double(), b.double()
    exact = xd @ wd.t() + bd
    mag = xd.abs() @ wd.abs().t() + bd.abs()
    u = 2.0**-24
    bound = (8 + 2) * u * mag + u * exact.abs()
    assert bool(((got - exact).abs() <= bound).all())
    out = linear(x, w, b)
    assert out.dtype == dtype
    assert_bitwise_equal(out, linear(x, w, b, out_dtype=torch.float32).to(dtype))


def test_chunking_does_not_change_bits(monkeypatch):
    x, w, b = _data(30, 64, 50, torch.float32, seed=5)
    ref = linear(x, w, b)
    monkeypatch.setattr(matmul, "_CHUNK_ELEMENTS", 64 * 7)  # forces column and row chunks
    assert_bitwise_equal(linear(x, w, b), ref)


def test_mixed_dtypes_and_strided_inputs():
    x, w, b = _data(12, 32, 20, torch.bfloat16, seed=6)
    wf = w.float()
    assert_bitwise_equal(linear(x, wf, out_dtype=torch.float32), linear(x.float(), wf, out_dtype=torch.float32))
    xt = x.t().contiguous().t()
    assert_bitwise_equal(linear(xt, w[::1]), linear(x, w))


def test_gradients_match_torch_linear():
    x, w, b = _data(9, 24, 7, torch.float64, seed=7)
    x32, w32, b32 = (t.float().requires_grad_() for t in (x, w, b))
    out = linear(x32, w32, b32)
    g = torch.randn_like(out)
    out.backward(g)
    xr, wr, br = (t.float().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(xr, wr, br).backward(g)
    for a, r in ((x32, xr), (w32, wr), (b32, br)):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_empty_and_nonfinite():
    x, w, b = _data(0, 16, 8, torch.float32)
    assert linear(x, w, b).shape == (0, 8)
    x, w, _ = _data(3, 16, 8, torch.float32)
    x[1, 5] = float("inf")
    out = linear(x, w)
    assert bool(torch.isfinite(out[[0, 2]]).all()) and not bool(torch.isfinite(out[1]).all())
    assert_bitwise_equal(out[[0, 2]], linear(x[[0, 2]], w))


def test_bad_inputs_raise():
    x, w, b = _data(3, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="K="):
        linear(x[:, :15], w)
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, b[:7])
    with pytest.raises(TypeError):
        linear(x.long(), w)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        linear(x, w[None])
