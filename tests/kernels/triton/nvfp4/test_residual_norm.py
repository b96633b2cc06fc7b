"""The residual add fused into the norm (``norm_quantize.add_rmsnorm_quantize``: the decode step's
bias-dropout-add + RMSNorm -> NVFP4 in one kernel).

Contract pinned here (kernel on the device under test, references on the CPU): ``h`` is bitwise
torch's ``residual + out`` (16-bit add), ``y`` bitwise ``bi_rmsnorm(h)`` (interpreter oracle:
``bi_rmsnorm(h.float()).to(dtype)``, see test_triton_producers.py), ``q`` bitwise
``quantize_reference(y)``. Fresh random data in bf16 and fp16 at the kernel's block layouts
(H = 48, 80: several chunks; 2048: the qwen3-moe hidden; 8192: two phase-1 loop trips), zero-centered
gamma and fp32 weights; heavy tails; exact cancellation to zero; operands 2^20 apart (the fp32 sum
is then inexact: torch's fp32 add + rounding and the GPU's single-rounding ``add.bf16x2`` agree,
as double rounding through fp32 is innocuous for the sum of two 16-bit values: 24 >= 2 * 11 + 1
bits); subnormal sums; NaN / inf in either operand stay in their row; strided rows; M = 0.
On sm_90a (compiled on the CPU): before the residual pass's barrier the reduction list holds only
the barrier, after it the reduction PTX is bi_rmsnorm's; no spills.
"""

from __future__ import annotations

import pytest
import torch

from minite_kernels.triton._build._testing import DEVICE, HAS_CUDA, assert_quantized_equal, heavy_tailed, kernels_runnable, randn, run_aot_script
from minite_megatron import nvfp4
from minite_megatron.testing import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.invariant.bi_rmsnorm import bi_rmsnorm  # noqa: E402
from minite_kernels.triton.nvfp4.norm_quantize import add_rmsnorm_quantize  # noqa: E402

HALF = [torch.bfloat16, torch.float16]


def _cpu(q):
    from dataclasses import replace

    return replace(q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
                   image=None if q.image is None else q.image.cpu())


def check(residual, out, w, name, eps=1e-6, zc=False):
    """The kernel on DEVICE vs torch's add, bi_rmsnorm of the sum and quantize_reference of y."""
    h, y, q = add_rmsnorm_quantize(residual.to(DEVICE), out.to(DEVICE), w.to(DEVICE), eps, zc)
    h, y = h.cpu(), y.cpu()
    ref_h = residual + out
    assert_bitwise_equal(h, ref_h, f"{name}.h", nan_equal=True)
    if HAS_CUDA:
        assert_bitwise_equal(y, bi_rmsnorm(ref_h.to(DEVICE), w.to(DEVICE), eps, zc).cpu(), f"{name}.y", nan_equal=True)
    else:
        assert_bitwise_equal(y, bi_rmsnorm(ref_h.float(), w, eps, zc).to(h.dtype), f"{name}.y", nan_equal=True)
    assert_quantized_equal(_cpu(q), nvfp4.quantize_reference(y, global_scale="row", with_image=True), f"{name}.q")
    assert q.shape == out.shape and q.global_decode.shape == (out.shape[0],)
    return h, y, q


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m,hdim", [(1, 16), (3, 48), (5, 256), (3, 80), (2, 2048)])
def test_residual_add_then_norm_random(dtype, m, hdim):
    w = (torch.rand(hdim, generator=torch.Generator().manual_seed(hdim)) + 0.5).to(dtype)
    check(randn(m, hdim, seed=m * hdim, scale=3.0, dtype=dtype), randn(m, hdim, seed=m + hdim, dtype=dtype), w,
          f"random {dtype} {m}x{hdim}")


def test_residual_add_then_norm_hard_cases():
    """Heavy tails; exact cancellation and operands 2^20 apart; a long zero-centered row with fp32
    weights; bf16 / fp16 subnormal sums (a row that sums to subnormals only)."""
    w = (torch.rand(256, generator=torch.Generator().manual_seed(1)) + 0.5).to(torch.bfloat16)
    r = randn(5, 256, seed=2, scale=3.0, dtype=torch.bfloat16)
    check(heavy_tailed(4, 256, seed=4, dtype=torch.bfloat16), heavy_tailed(4, 256, seed=5, dtype=torch.bfloat16), w,
          "heavy")
    o = -r.clone()
    o[:, ::3] *= 2.0**-20  # exact cancellation elsewhere, and sums of operands 2^20 apart here
    h, _, _ = check(r, o, w, "cancel and far apart")
    assert bool((h[:, 1::3] == 0).all())
    check(heavy_tailed(2, 8192, seed=6, dtype=torch.bfloat16), randn(2, 8192, seed=7, dtype=torch.bfloat16),
          randn(8192, seed=8, scale=0.1), "long zc fp32 weight", eps=1e-5, zc=True)
    for dtype, tiny in ((torch.bfloat16, 9.2e-41), (torch.float16, 6e-8)):
        a = torch.zeros(3, 48, dtype=dtype)
        a[0] = torch.tensor(tiny * 3).to(dtype)
        a[1, ::2] = torch.tensor(-tiny).to(dtype)
        a[2, 5] = 1.0
        b = torch.full((3, 48), tiny, dtype=dtype)
        check(a, b, torch.full((48,), 1.5, dtype=dtype), f"subnormal sums {dtype}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_residual_add_nonfinite_stays_in_its_row(bad):
    """A NaN / inf in either operand (inf - inf = NaN in the sum) gives that row NaN scales only."""
    r = randn(4, 48, seed=9, dtype=torch.bfloat16)
    o = randn(4, 48, seed=10, dtype=torch.bfloat16)
    r[1, 3] = bad
    o[2, 7] = bad
    if bad == float("inf"):
        o[1, 3] = -bad
    _, _, q = check(r, o, torch.ones(48, dtype=torch.bfloat16), f"nonfinite {bad}")
    sc = q.block_scales.cpu().view(torch.uint8)
    for row in (1, 2):
        assert bool((sc[row] == 0x7F).all()) and torch.isnan(q.global_decode.cpu()[row])
    assert bool((sc[[0, 3]] != 0x7F).all()) and bool(torch.isfinite(q.global_decode.cpu()[[0, 3]]).all())


def test_residual_add_strided_empty_and_bad_arguments():
    big = randn(4, 96, seed=11, dtype=torch.bfloat16)
    check(big[:, 16:80], randn(4, 64, seed=12, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16),
          "residual a column slice (row stride 96)")
    check(randn(4, 64, seed=13, dtype=torch.bfloat16), big[:, 8:72], torch.ones(64, dtype=torch.bfloat16),
          "out a column slice (row stride 96)")
    e = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE)
    h, y, q = add_rmsnorm_quantize(e, e, torch.ones(64, dtype=torch.bfloat16, device=DEVICE))
    assert h.shape == y.shape == (0, 64) and q.codes.shape == (0, 32)
    r = randn(5, 256, seed=2, dtype=torch.bfloat16).to(DEVICE)
    w = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm_quantize(r[:4], r, w)
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm_quantize(r.half(), r, w)


def check_combined(residual, rows, combine, w, name):
    """The combine variant (``out`` = expert rows, each output row their ordered sum first) == the
    plain kernel on the torch combine (``ordered_sum_reference``), which :func:`check` pins against
    torch's add, bi_rmsnorm and quantize_reference: h, y and q bit for bit."""
    from minite_megatron.nvfp4.moe_reference import ordered_sum_reference

    t, k = residual.shape[0], combine.numel() // residual.shape[0]
    out = ordered_sum_reference(rows.index_select(0, combine.long()).view(t, k, rows.shape[1]))
    want = check(residual, out, w, name)
    got = add_rmsnorm_quantize(residual.to(DEVICE), rows.to(DEVICE), w.to(DEVICE), 1e-6, False, combine=combine.to(DEVICE))
    for field, a, b in zip(("h", "y"), got[:2], want[:2]):
        assert_bitwise_equal(a.cpu(), b, f"{name}.{field}", nan_equal=True)
    assert_quantized_equal(_cpu(got[2]), want[2], f"{name}.q")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("t,k,hdim", [(1, 8, 256), (3, 4, 48), (2, 8, 2048)])
def test_the_moe_combine_fused_before_the_add(dtype, t, k, hdim):
    """Expert rows in expert-major order (a permutation of the tokens' rows, as the routing kernel
    lays them out), heavy tails, a row's k rows cancelling to zero, NaN and inf in one expert row."""
    g = torch.Generator().manual_seed(t * k + hdim)
    combine = torch.randperm(t * k, generator=g).to(torch.int32)
    w = (torch.rand(hdim, generator=g) + 0.5).to(dtype)
    rows = heavy_tailed(t * k, hdim, seed=hdim, dtype=dtype)
    check_combined(randn(t, hdim, seed=t, scale=3.0, dtype=dtype), rows, combine, w, f"combine {dtype} {t}x{k}x{hdim}")
    if k % 2 == 0:  # token 0's rows in +/- pairs: its combine is exactly 0 before the add
        pairs = combine[:k].long()
        rows[pairs[1::2]] = -rows[pairs[0::2]]
    rows[combine[-1].long(), 5] = float("nan")
    rows[combine[-2].long(), 7] = float("inf")
    check_combined(randn(t, hdim, seed=t + 1, dtype=dtype), rows, combine, w, f"combine hard {dtype} {t}x{k}x{hdim}")


def test_the_moe_combine_refuses_a_combine_index_of_the_wrong_size():
    r = randn(3, 64, seed=14, dtype=torch.bfloat16).to(DEVICE)
    rows = randn(12, 64, seed=15, dtype=torch.bfloat16).to(DEVICE)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="combine must be int32/int64"):
        add_rmsnorm_quantize(r, rows, w, combine=torch.arange(10, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm_quantize(r[:, :48], rows, w, combine=torch.arange(12, dtype=torch.int32, device=DEVICE))


AOT_SCRIPT = r"""
import json
from minite_kernels.triton._build._aot import report
from minite_kernels.triton.nvfp4 import norm_quantize as N
kb = N.aot_bi_rmsnorm(2048, "bf16")
out = {}
for combine in (0, 8):
    ka = N.aot_add_kernel(2048, "bf16", combine=combine)
    before, red = N.reduction_ptx_after_residual(ka.asm["ptx"])
    out[combine] = dict(before=before, same=red == N.reduction_ptx(kb.asm["ptx"]), n=len(red), **report(ka))
print("JSON" + json.dumps(out))
"""


@pytest.mark.aot  # compile-only (sm_90a on any machine): CI runs it; the GPU set leaves it out
def test_sm90_reduction_after_the_residual_pass_is_bi_rmsnorms():
    """The plain residual add and the MoE combine of 8 expert rows before it (whose sums are plain
    ``add.f32``, each rounded to bf16: nothing before the barrier can contract into an FMA)."""
    got = run_aot_script(AOT_SCRIPT)
    assert sorted(got) == ["0", "8"], got
    assert got["0"]["before"] == ["bar.sync"], got["0"]
    assert got["8"]["before"][-1] == "bar.sync" and set(got["8"]["before"]) == {"add.f32", "bar.sync"}, got["8"]
    for combine, aot in got.items():
        assert aot["same"] and aot["n"] > 20, (combine, aot)
        assert aot["spill_bytes"] == 0 and aot["LDL"] == 0, (combine, aot)
