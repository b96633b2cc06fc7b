"""Batch-invariant RMSNorm, softmax, log-softmax and token log-probs."""

import pytest
import torch

from minite_megatron.invariant.rmsnorm import rms_norm
from minite_megatron.invariant.softmax import log_softmax, softmax, token_log_probs
from minite_megatron.testing import assert_bitwise_equal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_rows_invariant_and_accurate(dtype, zero_centered):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 96, generator=g) * 3).to(dtype)
    w = (torch.randn(96, generator=g) * 0.1 + (0.0 if zero_centered else 1.0)).to(dtype)
    out = rms_norm(x, w, 1e-5, zero_centered)
    for rows in ([0], [36], list(range(4, 30))):
        assert_bitwise_equal(rms_norm(x[rows], w, 1e-5, zero_centered), out[rows])
    assert_bitwise_equal(rms_norm(x.view(37, 1, 96), w, 1e-5, zero_centered).view(37, 96), out)
    xd = x.double()
    wd = w.double() + (1.0 if zero_centered else 0.0)
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    tol = 2.0 ** -(8 if dtype == torch.bfloat16 else 21)
    assert float(((out.double() - exact).abs() / exact.abs().clamp_min(1e-6)).max()) < tol
    assert out.dtype == dtype


def test_rmsnorm_gradients_match_the_formula():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=g, dtype=torch.float64)
    w = torch.randn(32, generator=g, dtype=torch.float64)
    xs, ws = x.float().requires_grad_(), w.float().requires_grad_()
    out = rms_norm(xs, ws, 1e-5)
    go = torch.randn_like(out)
    out.backward(go)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * wr).backward(go.double())
    torch.testing.assert_close(xs.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ws.grad.double(), wr.grad, rtol=1e-4, atol=1e-5)


def test_rmsnorm_errors_and_nonfinite():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(7))
    with pytest.raises(TypeError):
        rms_norm(x.long(), torch.ones(8))
    x[1, 2] = float("nan")
    out = rms_norm(x, torch.ones(8))
    assert bool(torch.isnan(out[1]).all()) and bool(torch.isfinite(out[[0, 2]]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax_rows_invariant_and_accurate(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(21, 1000, generator=g) * 4).to(dtype)
    out = log_softmax(x)
    assert out.dtype == torch.float32
    for rows in ([0], [20], list(range(3, 17))):
        assert_bitwise_equal(log_softmax(x[rows]), out[rows])
    assert_bitwise_equal(log_softmax(x.view(3, 7, 1000)).view(21, 1000), out)
    exact = torch.log_softmax(x.double(), -1)
    assert float((out.double() - exact).abs().max()) < 1e-5
    assert_bitwise_equal(log_softmax(x.t(), dim=0).t().contiguous(), out)


def test_softmax_with_masks_and_fully_masked_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 10, generator=g)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0, 5:] = True
    mask[2] = True  # nothing visible
    p = softmax(x, mask=mask)
    assert bool((p[0, 5:] == 0).all()) and bool((p[2] == 0).all())
    torch.testing.assert_close(p[0, :5], torch.softmax(x[0, :5], -1))
    torch.testing.assert_close(p.sum(-1)[[0, 1, 3]], torch.ones(3))
    # masking == truncating (zero padding invariance), bitwise
    assert_bitwise_equal(softmax(x[0:1, :5]), p[0:1, :5])


def test_token_log_probs_and_gradients():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 50, generator=g, requires_grad=True)
    tokens = torch.randint(0, 50, (2, 3), generator=g)
    lp = token_log_probs(logits, tokens)
    ref = torch.log_softmax(logits.detach(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(lp.detach(), ref)
    lp.sum().backward()
    lr = logits.detach().clone().requires_grad_()
    torch.log_softmax(lr, -1).gather(-1, tokens[..., None]).sum().backward()
    torch.testing.assert_close(logits.grad, lr.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        token_log_probs(logits, torch.full_like(tokens, 50))
    with pytest.raises(ValueError):
        token_log_probs(logits, tokens[:, :2])


def test_log_softmax_nonfinite_policy():
    x = torch.tensor([[0.0, float("-inf"), 1.0], [float("nan"), 0.0, 1.0]])
    out = log_softmax(x)
    assert out[0, 1].item() == float("-inf") and bool(torch.isfinite(out[0, [0, 2]]).all())
    assert bool(torch.isnan(out[1]).all())
