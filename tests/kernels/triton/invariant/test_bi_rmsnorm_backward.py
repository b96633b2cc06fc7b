"""The one-pass RMSNorm backward kernel (``bi_rmsnorm_backward``) against the torch formulation
(``invariant.rmsnorm.rms_norm_backward_torch``): the same gradients to fp32 rounding (the sums run in
another fixed order), for the shapes the learner runs (the hidden norms, q/k norms over heads), row
counts that are not a multiple of the tile, zero-centered gamma, no weight gradient; the same bits
run to run; and the autograd function takes it where the Triton kernels run."""

from __future__ import annotations

import pytest
import torch

from minite_kernels.triton._build._testing import DEVICE, kernels_runnable, randn
from minite_kernels.triton.invariant.bi_rmsnorm_backward import bi_rmsnorm_backward, launch_config
from minite_megatron.invariant.rmsnorm import rms_norm_backward_torch

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")


def _case(m, h, seed, dtype=torch.bfloat16):
    x = (randn(m, h, seed=seed) * 3).to(dtype)
    g = randn(m, h, seed=seed + 1).to(dtype)
    w = (1 + 0.1 * randn(h, seed=seed + 2)).to(dtype)
    return x, g, w


@pytest.mark.parametrize("m, h, zc, wg", [(37, 128, False, True), (5, 2048, True, True), (130, 64, False, False),
                                          (1, 96, True, True)])
def test_matches_the_torch_formulation(m, h, zc, wg):
    x, g, w = _case(m, h, seed=m + h)
    gx, gw = bi_rmsnorm_backward(g.to(DEVICE), x.to(DEVICE), w.to(DEVICE), 1e-6, zc, wg)
    rx, rw = rms_norm_backward_torch(g, x, w, 1e-6, zc, wg)
    assert gx.dtype == x.dtype and gx.shape == x.shape
    # bf16 outputs of fp32 values that agree to ~1e-6: at most one bf16 rounding step apart
    torch.testing.assert_close(gx.cpu().float(), rx.float(), rtol=2 ** -7, atol=1e-5)
    if wg:
        torch.testing.assert_close(gw.cpu().float(), rw.float(), rtol=2 ** -7, atol=1e-4)
    else:
        assert gw is None and rw is None


def test_fp32_gradients_agree_to_fp32_rounding_and_repeat_bit_for_bit():
    x, g, w = _case(200, 256, seed=9, dtype=torch.float32)
    gx, gw = bi_rmsnorm_backward(g.to(DEVICE), x.to(DEVICE), w.to(DEVICE), 1e-5)
    rx, rw = rms_norm_backward_torch(g, x, w, 1e-5, False)
    torch.testing.assert_close(gx.cpu(), rx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw.cpu(), rw, rtol=1e-5, atol=1e-5)
    gx2, gw2 = bi_rmsnorm_backward(g.to(DEVICE), x.to(DEVICE), w.to(DEVICE), 1e-5)
    assert torch.equal(gx2, gx) and torch.equal(gw2, gw)


def test_programs_do_not_depend_on_the_device():
    assert launch_config(16384 * 32, 128) == (32, 128, 1024, 4)
    assert launch_config(16384, 2048) == (2, 2048, 1024, 8)
    assert launch_config(3, 2048)[2] == 2


def test_autograd_takes_the_kernel_where_triton_runs(monkeypatch):
    from minite_megatron.invariant import rmsnorm
    from minite_megatron.nvfp4.backends import get_backend
    from minite_megatron.settings import overridden

    calls = []
    triton = type(get_backend("triton", DEVICE))
    real = triton.bi_rmsnorm_backward
    monkeypatch.setattr(triton, "bi_rmsnorm_backward", lambda self, *a: (calls.append("bi_rmsnorm_backward"), real(self, *a))[1])
    x, g, w = _case(8, 64, seed=3)
    x = x.to(DEVICE).requires_grad_()
    w = w.to(DEVICE).requires_grad_()
    with overridden(strict_backend="triton"):
        rmsnorm.rms_norm(x, w, 1e-6).backward(g.to(DEVICE))
    assert "bi_rmsnorm_backward" in calls
    rx, rw = rms_norm_backward_torch(g, x.detach().cpu(), w.detach().cpu(), 1e-6, False)
    torch.testing.assert_close(x.grad.cpu().float(), rx.float(), rtol=2 ** -7, atol=1e-5)
