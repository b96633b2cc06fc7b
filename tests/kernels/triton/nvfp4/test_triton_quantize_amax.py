"""The amax pass of per-tensor / per-group quantization (:mod:`minite_kernels.triton.nvfp4.amax`)
equals the contract's amax bit for bit: contiguous inputs (flat kernel; one domain, groups,
a partial last group) and strided inputs (row-tile kernel), bf16 / fp16 / fp32, with NaN
winning over +-inf and everything else.

Runs under TRITON_INTERPRET=1 on CPU-only machines and on the GPU when there is one.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron.testing import assert_bitwise_equal

from minite_kernels.triton._build._testing import DEVICE, heavy_tailed, kernels_runnable

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.nvfp4.amax import amax_forward  # noqa: E402


def reference(x2d: torch.Tensor, rows_per_group: int) -> torch.Tensor:
    a = x2d.float().abs()
    out = []
    for r0 in range(0, max(x2d.shape[0], 1), rows_per_group):
        part = a[r0:r0 + rows_per_group]
        m = part.max() if part.numel() else torch.tensor(0.0)
        out.append(torch.where(part.isnan().any(), float("nan"), m))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows_per_group", [1000, 7, 1])
def test_contiguous_and_strided(dtype, rows_per_group):
    x = heavy_tailed(37, 96, seed=rows_per_group, dtype=dtype)
    got = amax_forward(x.to(DEVICE), rows_per_group).cpu()
    assert_bitwise_equal(got, reference(x, rows_per_group), "contiguous")
    base = heavy_tailed(96, 37, seed=3, dtype=dtype)
    got = amax_forward(base.to(DEVICE).t(), rows_per_group).cpu()  # a strided view
    assert_bitwise_equal(got, reference(base.t(), rows_per_group), "strided")


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_nan_wins_over_infinities(bad):
    x = heavy_tailed(40, 64, seed=5, dtype=torch.bfloat16)
    x[3, 7] = bad
    x[30, 60] = float("nan")
    got = amax_forward(x.to(DEVICE), 20).cpu()
    assert got[0].item() == float("inf") and torch.isnan(got[1])
    assert torch.isnan(amax_forward(x.to(DEVICE), 40).cpu()).all()


def test_zeros_subnormals_and_empty():
    """Regression: the amax must not flush subnormal inputs to zero (no float op on |x|)."""
    assert amax_forward(torch.zeros(16, 32, device=DEVICE), 16).cpu().tolist() == [0.0]
    tiny = torch.full((16, 32), 9.2e-41).to(torch.bfloat16)
    tiny[3, 5] = -tiny[3, 5] * 2
    assert_bitwise_equal(amax_forward(tiny.to(DEVICE), 16).cpu(), tiny.float().abs().amax().reshape(1), "subnormal")
    assert amax_forward(torch.zeros(0, 32, device=DEVICE), 1).cpu().tolist() == [0.0]
