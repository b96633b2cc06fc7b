"""The fast row-major quantize kernel (:mod:`minite_kernels.triton.nvfp4.quantize_rows`) ==
``nvfp4.quantize_reference``, bit for bit, on bf16 / fp16 rows: strided rows, rows that take one
chunk or many (the amax pass + quantize pass), 16x16 weight tiles, and the fallback for inputs
it does not take. The standard cases (random, bin edges, saturation, non-finite, SR, swizzled,
empty) run on this kernel through ``tests/kernels/test_quantize_suite.py`` (path ``rows``).

Runs under TRITON_INTERPRET=1 on CPU-only machines and on the GPU when there is one.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_kernels.triton._build._testing import DEVICE, assert_quantized_equal, heavy_tailed, kernels_runnable, randn, tie_matrix

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.nvfp4 import quantize_rows  # noqa: E402
from minite_kernels.triton.nvfp4.quantize import quantize_forward  # noqa: E402

HALF = [torch.bfloat16, torch.float16]


def _cpu(q):
    from dataclasses import replace

    return replace(
        q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
        image=None if q.image is None else q.image.cpu(),
    )


def check(x: torch.Tensor, name: str = "q", fast: bool = True, **kwargs) -> None:
    """Kernel on DEVICE vs reference on CPU (every output, image included); ``fast``: assert
    the input takes the row kernel (else the generic one)."""
    kwargs.setdefault("with_image", True)
    xd = x.to(DEVICE) if x.device != DEVICE else x
    x2d = xd.reshape(-1, xd.shape[-1]) if xd.dim() != 2 else xd
    has_amax = kwargs.get("global_scale", "row") != "row" or kwargs.get("amax") is not None
    assert quantize_rows.supported(x2d, tuple(kwargs.get("tile", (1, 16))) == (16, 16), False, has_amax) == fast, name
    got = quantize_forward(xd, **kwargs)
    ref = nvfp4.quantize_reference(x.cpu(), **kwargs)
    assert_quantized_equal(_cpu(got), ref, name)
    assert got.global_decode.shape == ref.global_decode.shape, name


def half_tie_matrix(dtype: torch.dtype, rows: int = 8) -> torch.Tensor:
    """``tie_matrix`` in a 16-bit type, plus a block per row of each E2M1 bin edge's 16-bit
    neighbours (one ulp of ``dtype`` above and below, exactly on the other side of the edge)."""
    base = tie_matrix(rows).to(dtype)
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=dtype)
    bits = edges.view(torch.int16)
    up, dn = (bits + 1).view(dtype), (bits - 1).view(dtype)
    block = torch.cat([torch.tensor([6.0], dtype=dtype), up, -dn, torch.tensor([-6.5], dtype=dtype)])
    big = torch.tensor([2688.0] + [0.0] * 15, dtype=dtype)  # keeps S_enc = 1 if the row had none
    extra = torch.stack([torch.cat([block, big]) for _ in range(rows)])
    return torch.cat([base, extra], dim=1)


@pytest.mark.parametrize("k", [16, 48, 128, 256, 320])
def test_row_lengths_one_chunk_and_many(k):
    """K = 16 (one block per row), 48 (odd block count: chunks of one block), 128 / 256 (2 / 4
    chunks held in registers), 320 (more chunks than registers hold: the amax pass + quantize
    pass), with a row count that leaves a tail."""
    block_nb, block_r, _, chunks = quantize_rows.config(21, k)
    assert (k // 16) % block_nb == 0 and chunks in (0, k // 16 // block_nb)
    x = randn(21, k, seed=k, scale=2.0, dtype=torch.bfloat16)
    check(x)
    check(x, global_scale="tensor")


def test_strided_rows_and_leading_dims():
    """Rows with a larger stride (a column slice) are read in place; leading dims are flattened."""
    x = randn(20, 128, seed=10, dtype=torch.bfloat16)
    check(x[:, 32:96])
    check(x[::2, 16:80])
    check(randn(2, 3, 32, seed=11, dtype=torch.bfloat16))


def test_inputs_the_row_kernel_does_not_take_fall_back():
    """Rows starting off a 4-byte boundary, fp32 input, and 16x16 tiles of fp32 go to the generic kernel.

    Regression (H200, 2026-11-30): the misaligned view was built on the CPU and copied to the
    GPU, which realigned it; it is now built on the device under test."""
    x = randn(8, 64, seed=12, dtype=torch.bfloat16).to(DEVICE)  # the view is made where it runs
    odd = x.reshape(-1)[1:1 + 7 * 64].reshape(7, 64)
    check(odd, fast=False)
    check(randn(5, 32, seed=13), fast=False)
    check(randn(32, 32, seed=14), fast=False, global_scale="tensor", tile=(16, 16))


# ---- 16x16 weight tiles (issue 16: the weights' quantize on the fast kernel) -----------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k", [32, 96, 256])
def test_weight_tiles_tensor_and_group_scales(dtype, k):
    """16x16 tiles with a tensor or a per-expert (group) scale: random and heavy-tailed data, K
    with one, odd and many block columns per program."""
    check(randn(48, k, seed=20 + k, scale=3.0, dtype=dtype), global_scale="tensor", tile=(16, 16))
    check(heavy_tailed(32, k, seed=21, dtype=dtype), global_scale="tensor", tile=(16, 16))
    check(randn(3, 32, k, seed=22, dtype=dtype), global_scale="group", tile=(16, 16))


def test_weight_tiles_hard_cases():
    """Ties, bin-edge neighbours and saturation inside 16x16 tiles whose amax sits in another row,
    zeros, an amax override, and NaN / inf: a NaN marks its tile (finite amax) or its domain."""
    x = half_tie_matrix(torch.bfloat16, rows=16)
    check(x, global_scale="tensor", tile=(16, 16))
    z = torch.zeros(32, 64, dtype=torch.bfloat16)
    z[17, 5] = 2.0  # one non-zero: only its tile gets a non-zero scale
    check(z, global_scale="tensor", tile=(16, 16))
    w = randn(32, 64, seed=23, dtype=torch.bfloat16)
    check(w, global_scale="tensor", tile=(16, 16), amax=torch.tensor([0.5]))
    w[18, 33] = float("nan")
    w[3, 50] = float("inf")
    check(w, global_scale="tensor", tile=(16, 16), amax=torch.tensor([3.0]))
    check(w, global_scale="tensor", tile=(16, 16))
    g = randn(2, 16, 32, seed=24, dtype=torch.bfloat16)
    g[1, 2, 3] = float("nan")
    check(g, global_scale="group", tile=(16, 16))


def test_weight_tiles_stochastic_and_without_image():
    x = randn(32, 64, seed=25, scale=2.0, dtype=torch.bfloat16)
    check(x, global_scale="tensor", tile=(16, 16), rounding="stochastic", seed=5)
    check(x, global_scale="tensor", tile=(16, 16), with_image=False)
