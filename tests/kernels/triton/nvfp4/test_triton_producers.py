"""Fused producers (issue 4): RMSNorm -> NVFP4 and SwiGLU -> NVFP4, per-row global scales.

Contracts pinned here (each kernel on the device under test: the GPU, or the CPU under
TRITON_INTERPRET=1; references on the CPU):

* ``rmsnorm_quantize``: ``y`` bitwise ``bi_rmsnorm(x, w, eps, zc)``; ``q`` bitwise
  ``quantize_reference(y, global_scale="row", with_image=...)``. Under the interpreter the oracle
  for ``y`` is ``bi_rmsnorm(x.float(), w).to(x.dtype)`` (the same fp32 arithmetic and one RNE):
  the interpreter's own bf16 -> fp32 cast mangles bf16 subnormals (TOOLCHAIN.md), which
  ``bi_rmsnorm(x)`` suffers and the fused kernel (bits) does not; without subnormal inputs both
  oracles are checked.
* ``swiglu_quantize``: ``q`` bitwise ``quantize_reference(a)`` always. ``a`` is bitwise torch's
  eager ``F.silu(gate) * up`` on the GPU. Under the interpreter the kernel's exp is numpy's, so
  ``a`` is checked bitwise against the same formula evaluated with numpy's exp, and against the
  torch reference (torch's CPU exp) with the principled bound: every differing element must
  equal ``round(round(s') * up)`` for an fp32 ``s'`` within 2 ulps of torch's fp32 silu (two
  exps that are each within ~1 ulp of exp(-g) give silus within ~2 ulps), i.e. a difference
  only where the silu sits at a 16-bit rounding boundary; no count tolerance.
* Non-finite policy: a row with NaN/inf (in the input, or produced by the op) gets NaN scales;
  ``nonfinite="raise"`` raises ValueError naming the first bad element. Bad arguments raise
  TypeError / ValueError; M = 0 works.
* On sm_90a (compiled on the CPU): the norm kernel's reduction PTX equals bi_rmsnorm's, no
  spills, and FMA contraction adds nothing but exact products (module docstrings).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.producers import (
    rmsnorm_quantize_reference,
    rmsnorm_reference,
    swiglu_quantize_reference,
    swiglu_reference,
)
from minite_megatron.testing import assert_bitwise_equal

from minite_kernels.triton._build._testing import (
    DEVICE,
    HAS_CUDA,
    assert_quantized_equal,
    heavy_tailed,
    kernels_runnable,
    randn,
    run_aot_script,
    tie_matrix,
)

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.nvfp4 import norm_quantize
from minite_kernels.triton.nvfp4 import swiglu_quantize as swiglu_mod  # noqa: E402
from minite_kernels.triton.invariant.bi_rmsnorm import bi_rmsnorm  # noqa: E402
from minite_kernels.triton.nvfp4.norm_quantize import rmsnorm_quantize  # noqa: E402
from minite_kernels.triton.nvfp4.swiglu_quantize import swiglu_quantize  # noqa: E402

HALF = [torch.bfloat16, torch.float16]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _cpu_q(q):
    from dataclasses import replace

    return replace(q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
                   image=None if q.image is None else q.image.cpu())


def _has_bf16_subnormal(x: torch.Tensor) -> bool:
    e = (x.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    return x.dtype == torch.bfloat16 and bool(((e == 0) & (x != 0)).any())


def check_norm(x, w, eps=1e-5, zc=False, name="norm", with_image=True):
    """Fused kernel on DEVICE vs bi_rmsnorm (y) and quantize_reference(y) (q)."""
    y, q = rmsnorm_quantize(x.to(DEVICE), w.to(DEVICE), eps, zc, with_image=with_image)
    y = y.cpu()
    if HAS_CUDA:
        assert_bitwise_equal(y, bi_rmsnorm(x.to(DEVICE), w.to(DEVICE), eps, zc).cpu(), f"{name}.y")
    else:
        oracle = bi_rmsnorm(x.float(), w, eps, zc).to(x.dtype)
        assert_bitwise_equal(y, oracle, f"{name}.y", nan_equal=True)
        if not _has_bf16_subnormal(x):
            assert_bitwise_equal(y, bi_rmsnorm(x, w, eps, zc), f"{name}.y (bi_rmsnorm)", nan_equal=True)
    ref = nvfp4.quantize_reference(y, global_scale="row", with_image=with_image)
    assert_quantized_equal(_cpu_q(q), ref, f"{name}.q")
    assert q.global_decode.shape == (x.shape[0],) and q.shape == x.shape and (q.image is None) == (not with_image)
    return y, q


def _numpy_exp_swiglu(h: torch.Tensor) -> torch.Tensor:
    """The formula with numpy's fp32 exp (the interpreter's ``tl.exp``)."""
    g, u = torch.chunk(h, 2, -1)
    gf = g.float()
    e = torch.from_numpy(np.exp((-gf).numpy()))
    return (gf / (1.0 + e)).to(h.dtype) * u


def _silu_candidates(h: torch.Tensor, k: int = 2) -> list[torch.Tensor]:
    """``round(round(s') * up)`` for ``s'`` the torch fp32 silu moved by -k..k fp32 ulps."""
    g, u = torch.chunk(h, 2, -1)
    gf = g.float()
    s = gf / (1.0 + torch.exp(-gf))
    out = []
    for step in range(-k, k + 1):
        t = s.clone()
        for _ in range(abs(step)):
            t = torch.nextafter(t, torch.full_like(t, float("inf") if step > 0 else float("-inf")))
        out.append(t.to(h.dtype) * u)
    return out


def check_swiglu(h, name="swiglu", with_image=True):
    """Fused kernel on DEVICE: q vs quantize_reference(a) bitwise; a vs torch (see the docstring)."""
    a, q = swiglu_quantize(h.to(DEVICE), with_image=with_image)
    if HAS_CUDA:
        g, u = torch.chunk(h.to(DEVICE), 2, -1)
        assert_bitwise_equal(a.cpu(), (torch.nn.functional.silu(g) * u).cpu(), f"{name}.a")
    a = a.cpu()
    ref = nvfp4.quantize_reference(a, global_scale="row", with_image=with_image)
    assert_quantized_equal(_cpu_q(q), ref, f"{name}.q")
    assert q.global_decode.shape == (h.shape[0],) and q.shape == a.shape
    if not HAS_CUDA:
        with np.errstate(all="ignore"):
            assert_bitwise_equal(a, _numpy_exp_swiglu(h), f"{name}.a (numpy exp)", nan_equal=True)
        expected = swiglu_reference(h)
        diff = (a.view(torch.int16) != expected.view(torch.int16)) & ~(torch.isnan(a.float()) & torch.isnan(expected.float()))
        if bool(diff.any()):
            ok = torch.zeros_like(diff)
            for cand in _silu_candidates(h):
                ok |= a.view(torch.int16) == cand.view(torch.int16)
            bad = diff & ~ok
            assert not bool(bad.any()), f"{name}.a: {int(bad.sum())} elements beyond 2 fp32 ulps of torch's silu"
    return a, q


# ---------------------------------------------------------------- RMSNorm -> NVFP4

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m,h", [(1, 16), (3, 48), (5, 256), (2, 2048), (3, 80)])
def test_norm_random(dtype, m, h):
    """Fresh normal data; H = 48 (3 chunks of one block held in registers), 80 (5 chunks: y
    stored and read back), 2048 (one block per thread, one chunk)."""
    x = randn(m, h, seed=m * h, scale=2.5, dtype=dtype)
    w = (torch.rand(h, generator=torch.Generator().manual_seed(h)) + 0.5).to(dtype)
    check_norm(x, w)


def test_norm_long_rows_zero_centered_fp32_weight_heavy_tails():
    """H = 8192 (phase 1 loops over two 4096-lane chunks; 4 chunks of 128 blocks held), zero-centered
    gamma, fp32 weights, heavy-tailed data."""
    x = heavy_tailed(2, 8192, seed=3, dtype=torch.bfloat16)
    w = randn(8192, seed=4, scale=0.1)
    check_norm(x, w, zc=True, name="long zc fp32w")
    check_norm(heavy_tailed(3, 256, seed=5, dtype=torch.float16), randn(256, seed=6, scale=0.2).half(), eps=1e-6,
               zc=True, name="zc fp16")


def test_norm_ties_saturation_and_subnormal_scales():
    """Rows of +-1024 have r = 2^-10 exactly, so y = +-w: w carries every E2M1 bin edge, its
    bf16 neighbours, 6.5 -> 6, 2688 (S_enc = 1) and tiny blocks (subnormal E4M3 scales, a scale
    that rounds to zero). A row with one outlier puts the others' blocks at subnormal scales."""
    base = tie_matrix(1)[0]  # 64 values
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.bfloat16)
    up, dn = (edges.view(torch.int16) + 1).view(torch.bfloat16), (edges.view(torch.int16) - 1).view(torch.bfloat16)
    extra = torch.cat([torch.tensor([6.0]), up.float(), -dn.float(), torch.tensor([-6.5])])
    w = torch.cat([base, extra]).to(torch.bfloat16)  # 80
    signs = torch.where(torch.rand(4, 80, generator=torch.Generator().manual_seed(7)) < 0.5, -1.0, 1.0)
    x = (signs * 1024.0).to(torch.bfloat16)
    y, _ = check_norm(x, w, eps=1e-5, name="ties")
    assert_bitwise_equal(y.abs(), w.abs().expand(4, 80).contiguous(), "y = +-w")
    out = randn(3, 256, seed=8, scale=1e-3, dtype=torch.bfloat16)
    out[:, 5] = 1e4
    check_norm(out, torch.ones(256, dtype=torch.bfloat16), name="outlier")


@pytest.mark.parametrize("dtype", HALF)
def test_norm_zeros_and_subnormal_inputs(dtype):
    x = torch.zeros(4, 48, dtype=dtype)
    tiny = 9.2e-41 if dtype == torch.bfloat16 else 6e-8
    x[1] = torch.tensor(tiny).to(dtype)  # a row of subnormals
    x[2, ::3] = -torch.tensor(tiny).to(dtype)
    x[3, 7] = 1.0
    check_norm(x, torch.full((48,), 1.5, dtype=dtype), name=f"zeros/subnormal {dtype}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_norm_nonfinite_propagates_to_its_row(dtype, bad):
    x = randn(3, 48, seed=9, dtype=dtype)
    x[1, 17] = bad
    y, q = check_norm(x, torch.ones(48, dtype=dtype), name=f"nonfinite {bad}")
    sc = q.block_scales.cpu().view(torch.uint8)
    assert bool((sc[1] == 0x7F).all()) and bool((sc[0] != 0x7F).all()) and bool((sc[2] != 0x7F).all())
    assert torch.isnan(q.global_decode.cpu()[1]) and bool(torch.isfinite(q.global_decode.cpu()[[0, 2]]).all())
    with pytest.raises(ValueError, match=r"\(1, 17\)"):
        rmsnorm_quantize(x.to(DEVICE), torch.ones(48, dtype=dtype, device=DEVICE), nonfinite="raise")


def test_norm_overflowing_output_is_nonfinite_too():
    """A finite x with a huge weight overflows y to inf: the row gets NaN scales; "raise" names y's element."""
    x = randn(2, 32, seed=10, dtype=torch.float16)
    w = torch.ones(32, dtype=torch.float16)
    w[4] = 60000.0
    x[0, 4] = 8.0
    y, q = check_norm(x, w, name="overflow")
    assert torch.isinf(y[0, 4]) and torch.isnan(q.global_decode.cpu()[0])
    with pytest.raises(ValueError, match=r"normalized output y.*\(0, 4\)"):
        rmsnorm_quantize(x.to(DEVICE), w.to(DEVICE), nonfinite="raise")


def test_norm_without_image_empty_and_strided():
    check_norm(randn(3, 32, seed=11, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16), with_image=False,
               name="no image")
    y, q = rmsnorm_quantize(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE),
                            torch.ones(64, dtype=torch.bfloat16, device=DEVICE))
    assert y.shape == (0, 64) and q.codes.shape == (0, 32) and q.block_scales.shape == (0, 4)
    assert q.global_decode.shape == (0,) and q.image.shape == (0, 64)
    big = randn(4, 96, seed=12, dtype=torch.bfloat16)
    check_norm(big[:, 16:80], torch.ones(64, dtype=torch.bfloat16), name="column slice (row stride 96)")


def test_norm_bad_arguments():
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        rmsnorm_quantize(x.float(), w)
    with pytest.raises(ValueError, match="multiple of 16"):
        rmsnorm_quantize(torch.zeros(2, 24, dtype=torch.bfloat16, device=DEVICE), w[:24])
    with pytest.raises(ValueError, match="weight shape"):
        rmsnorm_quantize(x, w[:16])
    with pytest.raises(ValueError, match="2D"):
        rmsnorm_quantize(x.reshape(1, 2, 32), w)
    with pytest.raises(ValueError, match="nonfinite"):
        rmsnorm_quantize(x, w, nonfinite="ignore")
    with pytest.raises(TypeError):
        rmsnorm_quantize(x, torch.ones(32, dtype=torch.int32, device=DEVICE))


def test_norm_reference_is_rms_norm_torch_and_the_cpu_path(monkeypatch):
    """The reference's y is strict mode's ``rms_norm_torch`` bitwise; without a GPU (and outside
    the interpreter) ``rmsnorm_quantize`` returns the reference."""
    from minite_megatron.invariant.rmsnorm import rms_norm_torch

    x = heavy_tailed(5, 80, seed=13, dtype=torch.bfloat16)
    w = randn(80, seed=14, dtype=torch.bfloat16)
    for zc in (False, True):
        assert_bitwise_equal(rmsnorm_reference(x, w, 1e-5, zc), rms_norm_torch(x, w, 1e-5, zc), "reference y")
    monkeypatch.setattr(norm_quantize, "interpreting", lambda: False)
    y, q = rmsnorm_quantize(x, w)
    yr, qr = rmsnorm_quantize_reference(x, w)
    assert_bitwise_equal(y, yr, "cpu path y")
    assert_quantized_equal(q, qr, "cpu path q")


# ---------------------------------------------------------------- SwiGLU -> NVFP4

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m,f", [(1, 16), (17, 48), (64, 256), (3, 80), (5, 768)])
def test_swiglu_random(dtype, m, f):
    """Fresh data; F = 48 / 768 (3 chunks in registers), 80 (5 chunks: a stored and read back
    under the interpreter's config), 256 (one chunk, several rows per program)."""
    check_swiglu(randn(m, 2 * f, seed=m + f, scale=3.0, dtype=dtype))


@pytest.mark.parametrize("m,f", [(5, 48), (6, 80)])
def test_weighted_swiglu_is_megatrons_grouped_expert_activation(m, f):
    """``probs`` (the MoE decode step's routing weights): ``a = round(fp32(swiglu) * p)``, what
    ``TEGroupedMLP`` computes after the activation (``(x * permuted_probs).to(dtype)``), and ``q``
    its quantization; a zero probability, one of 1, subnormal-producing ones."""
    h = randn(m, 2 * f, seed=m * f, scale=3.0, dtype=torch.bfloat16)
    p = torch.rand(m, generator=torch.Generator().manual_seed(f))
    p[0], p[1] = 0.0, 1.0
    p[-1] = 1e-38
    a, q = swiglu_quantize(h.to(DEVICE), probs=p.to(DEVICE))
    if HAS_CUDA:
        g, u = torch.chunk(h.to(DEVICE), 2, -1)
        expected = ((torch.nn.functional.silu(g) * u) * p.to(DEVICE).unsqueeze(-1)).to(h.dtype).cpu()
    else:
        with np.errstate(all="ignore"):
            expected = (_numpy_exp_swiglu(h) * p.unsqueeze(-1)).to(h.dtype)
    assert_bitwise_equal(a.cpu(), expected, "weighted a", nan_equal=True)
    assert_quantized_equal(_cpu_q(q), nvfp4.quantize_reference(a.cpu(), global_scale="row", with_image=True), "weighted q")
    ref_a, _ = swiglu_quantize_reference(h, probs=p)
    assert ref_a.dtype == h.dtype and ref_a.shape == a.shape
    with pytest.raises(ValueError, match="probs"):
        swiglu_quantize(h.to(DEVICE), probs=p[:-1].to(DEVICE))


def test_swiglu_heavy_tails_and_dense_width():
    check_swiglu(heavy_tailed(7, 2 * 160, seed=15, dtype=torch.bfloat16), name="heavy")
    check_swiglu(randn(2, 2 * 2048, seed=16, scale=2.0, dtype=torch.float16), name="F=2048")


@pytest.mark.parametrize("dtype", HALF)
def test_swiglu_ties_saturation_and_subnormal_scales(dtype):
    """gate = 32 gives silu = 32 exactly (exp(-32) < 2^-24), so a = round(32 * up) = the tie
    matrix: every E2M1 bin edge and its neighbours, 6.5 -> 6, 2688, subnormal E4M3 scales, a
    scale that rounds to zero."""
    t = tie_matrix(4)
    up = (t / 32.0).to(dtype)
    h = torch.cat([torch.full_like(up, 32.0), up], dim=1)
    a, _ = check_swiglu(h, name=f"ties {dtype}")
    assert_bitwise_equal(a, (up.float() * 32.0).to(dtype), "a = 32 * up (the tie matrix where representable)")
    if dtype == torch.bfloat16:
        assert_bitwise_equal(a, t.to(dtype), "a = tie matrix")


@pytest.mark.parametrize("dtype", HALF)
def test_swiglu_zeros_subnormals_and_extremes(dtype):
    h = torch.zeros(5, 64, dtype=dtype)
    tiny = 9.2e-41 if dtype == torch.bfloat16 else 6e-8
    h[1, :32] = torch.tensor(tiny).to(dtype)  # subnormal gates
    h[1, 32:] = 3.0
    h[2, :32] = 2.0
    h[2, 32:] = torch.tensor(tiny).to(dtype)  # subnormal ups
    h[3, :32] = torch.linspace(-90.0, 90.0, 32).to(dtype)  # exp under/overflow ends of silu
    h[3, 32:] = 1.0
    h[4, :32] = -0.0
    h[4, 32:] = -1.0
    check_swiglu(h, name=f"extremes {dtype}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_swiglu_nonfinite_propagates_to_its_row(dtype, bad):
    """NaN/inf in gate or up; -inf gate gives silu NaN, +inf gate with up 0 gives NaN."""
    h = randn(4, 64, seed=17, dtype=dtype)
    h[1, 5] = bad  # gate
    h[3, 40] = bad  # up
    a, q = check_swiglu(h, name=f"nonfinite {bad}")
    gd = q.global_decode.cpu()
    assert torch.isnan(gd[1]) and torch.isnan(gd[3]) and bool(torch.isfinite(gd[[0, 2]]).all())
    with pytest.raises(ValueError, match=r"\(1, 5\)"):
        swiglu_quantize(h.to(DEVICE), nonfinite="raise")


def test_swiglu_overflowing_output():
    """silu(300) * 300 = 90000 overflows fp16: that row gets NaN scales; "raise" names a's element."""
    h = randn(2, 64, seed=18, dtype=torch.float16)
    h[0, 3], h[0, 35] = 300.0, 300.0
    a, q = check_swiglu(h, name="overflow")
    assert torch.isinf(a[0, 3]) and torch.isnan(q.global_decode.cpu()[0])
    with pytest.raises(ValueError, match=r"activation a.*\(0, 3\)"):
        swiglu_quantize(h.to(DEVICE), nonfinite="raise")


def test_swiglu_without_image_empty_strided_and_bad_arguments():
    check_swiglu(randn(3, 64, seed=19, dtype=torch.bfloat16), with_image=False, name="no image")
    a, q = swiglu_quantize(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE))
    assert a.shape == (0, 32) and q.codes.shape == (0, 16) and q.global_decode.shape == (0,)
    big = randn(3, 128, seed=20, dtype=torch.bfloat16)
    check_swiglu(big[:, 32:96], name="column slice")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        swiglu_quantize(torch.zeros(2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 16"):
        swiglu_quantize(torch.zeros(2, 48, dtype=torch.bfloat16, device=DEVICE))  # F = 24
    with pytest.raises(ValueError, match="2D"):
        swiglu_quantize(torch.zeros(64, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="nonfinite"):
        swiglu_quantize(torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE), nonfinite="no")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_reference_gives_torchs_cuda_silu_bits(dtype):
    """On CUDA tensors the reference's spelled-out silu (fp32 ``x / (1 + exp(-x))``, one rounding)
    is bitwise ``torch.nn.functional.silu`` -- what Megatron's eager SwiGLU calls there: every
    finite value of the dtype's range walked densely, +-0, +-inf, NaN, and a vector tail."""
    finite = torch.linspace(-90.0, 90.0, 1 << 20, dtype=torch.float32)
    tiny = torch.logspace(-30, 0, 4096, dtype=torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e4, -1e4, 3e38, -3e38])
    gate = torch.cat([finite, tiny, -tiny, special]).to(dtype).cuda()
    gate = torch.cat([gate, gate[:7]])  # a length that leaves a tail in any vector width
    up = torch.ones_like(gate)
    h = torch.stack([gate, up]).reshape(2, 1, -1).transpose(0, 1).reshape(1, -1)
    assert_bitwise_equal(swiglu_reference(h), torch.nn.functional.silu(gate).reshape(1, -1) * up.reshape(1, -1),
                         "reference silu vs torch's CUDA silu", nan_equal=True)


def test_swiglu_reference_is_megatrons_formula_and_the_cpu_path(monkeypatch):
    """On the CPU the reference is strict mode's silu (x / (1 + exp(-x)) in fp32, one rounding)
    times up, bitwise; without a GPU (outside the interpreter) ``swiglu_quantize`` returns it."""
    from minite_megatron.invariant.activations import silu

    h = randn(6, 2 * 48, seed=21, scale=4.0, dtype=torch.bfloat16)
    g, u = torch.chunk(h, 2, -1)
    assert_bitwise_equal(swiglu_reference(h), silu(g) * u, "reference a")
    monkeypatch.setattr(swiglu_mod, "interpreting", lambda: False)
    a, q = swiglu_quantize(h)
    ar, qr = swiglu_quantize_reference(h)
    assert_bitwise_equal(a, ar, "cpu path a")
    assert_quantized_equal(q, qr, "cpu path q")


# ---------------------------------------------------------------- sm_90a, compiled on this CPU

AOT_SCRIPT = r"""
import json, os, re, subprocess, tempfile, triton
from minite_kernels.triton._build._aot import report, sass
from minite_kernels.triton.nvfp4 import norm_quantize as N
from minite_kernels.triton.nvfp4 import swiglu_quantize as S

def ffma(ptx, fmad):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        open(d + "/k.ptx", "w").write(ptx)
        subprocess.run([tool + "/ptxas", "-arch=sm_90a", *([] if fmad else ["--fmad=false"]), d + "/k.ptx",
                        "-o", d + "/k.cubin"], check=True)
        t = subprocess.run([tool + "/cuobjdump", "-sass", d + "/k.cubin"], capture_output=True, text=True).stdout
    return len(re.findall(r"\bFFMA\b", t))

out = {}
kn, kb, ks = N.aot_kernel(2048, "bf16"), N.aot_bi_rmsnorm(2048, "bf16"), S.aot_kernel(65536, 768, "bf16")
kw = S.aot_kernel(512, 768, "bf16", weighted=True)
out["same_reduction"] = N.reduction_ptx(kn.asm["ptx"]) == N.reduction_ptx(kb.asm["ptx"])
out["reduction_len"] = len(N.reduction_ptx(kn.asm["ptx"]))
for name, k in (("norm", kn), ("bi", kb), ("swiglu", ks), ("swiglu_weighted", kw)):
    ptx = k.asm["ptx"]
    fmas = [re.sub(r"%r\d+", "R", l.split(None, 1)[1].split(",", 1)[1].strip())
            for l in ptx.splitlines() if "fma.rn.f32" in l]
    out[name] = dict(report(k), ptxas_contractions=ffma(ptx, True) - ffma(ptx, False),
                     fma_after_sqrt=[f for f in fmas[-8:]] if name == "norm" else None,
                     fma_forms=sorted(set(fmas)),
                     ops=sorted(set(re.findall(r"\b((?:div|rcp|ex2|sqrt)\.[a-z0-9.]+)", ptx))))
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def aot():
    return run_aot_script(AOT_SCRIPT)


@pytest.mark.aot  # compile-only (sm_90a on any machine): CI runs it; the GPU set leaves it out
def test_sm90_norm_reduction_is_bi_rmsnorms(aot):
    """The guarantee of ``y == bi_rmsnorm(x)`` on the GPU: the same fp32 / shuffle / barrier
    instruction sequence up to ``sqrt.rn`` (the layout, tree and FMA contraction of the sum of
    squares, ``div.full`` and ``+ eps``), and ptxas contracts the same single mul+add in both."""
    assert aot["same_reduction"] and aot["reduction_len"] > 20, aot
    assert aot["norm"]["ptxas_contractions"] == aot["bi"]["ptxas_contractions"] == 1, aot


@pytest.mark.aot  # compile-only (sm_90a on any machine): CI runs it; the GPU set leaves it out
def test_sm90_contraction_only_merges_exact_products(aot):
    """With FMA contraction on (needed for bi_rmsnorm's bits, nvcc's default for torch's silu),
    the only fused forms besides the sum of squares and libdevice's own explicit FMAs are
    ``fma(y, 512, 2^23)`` (E4M3 subnormal rounding: y * 512 is exact) and, in SwiGLU,
    ``fma(ex2(f) * 2^i, 1)`` (``1 + expf``: a product by a power of two, exact)."""
    norm_forms = set(aot["norm"]["fma_forms"])
    assert norm_forms <= {"R, R, R;", "R, 0f44000000, 0f4B000000;"}, norm_forms
    sw_forms = set(aot["swiglu"]["fma_forms"])
    assert sw_forms <= {"R, R, R;", "R, 0f44000000, 0f4B000000;", "R, R, 0f3F800000;"}, sw_forms
    assert aot["swiglu"]["ptxas_contractions"] == 0, aot["swiglu"]
    # the routing weight's multiply (probs=) is one more FMUL per element, never contracted
    assert set(aot["swiglu_weighted"]["fma_forms"]) <= sw_forms | {"R, R, R;"}, aot["swiglu_weighted"]
    assert aot["swiglu_weighted"]["FFMA"] == aot["swiglu"]["FFMA"] and aot["swiglu_weighted"]["ptxas_contractions"] == 0
    for name in ("norm", "swiglu", "swiglu_weighted"):
        ops = aot[name]["ops"]
        assert "div.rn.f32" in ops and not [o for o in ops if o.startswith(("rcp.approx", "div.approx"))], ops


@pytest.mark.aot  # compile-only (sm_90a on any machine): CI runs it; the GPU set leaves it out
def test_sm90_no_spills(aot):
    for name in ("norm", "swiglu"):
        assert aot[name]["spill_bytes"] == 0 and aot[name]["LDL"] == 0 and aot[name]["STL"] == 0, (name, aot[name])


# ---------------------------------------------------------------- GPU, real shapes

CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m,h,dtype,zc", [(16384, 2048, torch.bfloat16, False), (4096, 4096, torch.bfloat16, True),
                                          (2048, 5120, torch.bfloat16, False), (1024, 8192, torch.float16, False)])
def test_gpu_norm_real_shapes(m, h, dtype, zc):
    """y bitwise bi_rmsnorm on the H200; q bitwise the unfused quantize (itself bitwise the
    reference, test_triton_gpu) on every row and quantize_reference on 256 rows; row results
    do not depend on M (one row per program)."""
    from minite_kernels.triton.nvfp4.quantize import quantize_forward

    g = torch.Generator(device=CUDA).manual_seed(h)
    x = (torch.randn(m, h, device=CUDA, generator=g) * 3).to(dtype)
    x[7, 11] = float("nan")
    w = (torch.rand(h, device=CUDA, generator=g) + 0.5).to(dtype)
    y, q = rmsnorm_quantize(x, w, 1e-5, zc)
    assert_bitwise_equal(y, bi_rmsnorm(x, w, 1e-5, zc), "y")
    unfused = quantize_forward(y, global_scale="row", with_image=True)
    assert_quantized_equal(_cpu_q(q), _cpu_q(unfused), "q vs unfused")
    sub = slice(0, 256)
    assert_quantized_equal(_cpu_q(rmsnorm_quantize(x[sub], w, 1e-5, zc)[1]),
                           nvfp4.quantize_reference(y[sub].cpu(), global_scale="row", with_image=True), "q vs ref")
    y1, q1 = rmsnorm_quantize(x[100:101], w, 1e-5, zc)
    assert_bitwise_equal(y1, y[100:101], "y row 100, M=1")
    assert_bitwise_equal(q1.codes, q.codes[100:101], "codes row 100, M=1")


@pytest.mark.gpu
@pytest.mark.parametrize("m,f,dtype", [(65536, 768, torch.bfloat16), (16384, 6144, torch.bfloat16),
                                       (4096, 768, torch.float16), (1000, 80, torch.bfloat16)])
def test_gpu_swiglu_real_shapes(m, f, dtype):
    """a bitwise torch's eager ``F.silu(gate) * up`` on the H200 (libdevice expf == the expf of
    torch's silu kernel); q bitwise the unfused quantize on every row and the reference on 256."""
    from minite_kernels.triton.nvfp4.quantize import quantize_forward

    g = torch.Generator(device=CUDA).manual_seed(f)
    h = (torch.randn(m, 2 * f, device=CUDA, generator=g) * 3).to(dtype)
    h[5, 3] = float("inf")
    a, q = swiglu_quantize(h)
    gate, up = torch.chunk(h, 2, -1)
    assert_bitwise_equal(a, torch.nn.functional.silu(gate) * up, "a vs torch", nan_equal=True)
    assert_bitwise_equal(a, swiglu_reference(h), "a vs reference", nan_equal=True)
    unfused = quantize_forward(a, global_scale="row", with_image=True)
    assert_quantized_equal(_cpu_q(q), _cpu_q(unfused), "q vs unfused")
    assert_quantized_equal(_cpu_q(swiglu_quantize(h[:256])[1]),
                           nvfp4.quantize_reference(a[:256].cpu(), global_scale="row", with_image=True), "q vs ref")


@pytest.mark.gpu
def test_gpu_swiglu_every_bf16_gate():
    """All 65536 bf16 bit patterns as gates (up = 1): silu bitwise torch's, NaN/inf included."""
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 256)
    h = torch.cat([gates, torch.ones_like(gates)], dim=1).to(CUDA)
    a, _ = swiglu_quantize(h)
    assert_bitwise_equal(a, torch.nn.functional.silu(gates.to(CUDA)), "silu of every bf16", nan_equal=True)


@pytest.mark.parametrize("which", ["norm", "swiglu"])
def test_the_ops_producers_on_triton_hand_the_linear_the_fused_quantization(which):
    """``ops.producers`` on the Triton backend: the fused kernel's output goes on through autograd,
    its quantization is offered to the consuming linear (bitwise the quantization of that
    output), and the backward is the ordinary gradient (RMSNorm formula / Megatron's
    ``swiglu_back``)."""
    from minite_megatron.nvfp4 import get_backend
    from minite_megatron.ops import handoff, producers
    from minite_megatron.recipe import Recipe
    from minite_megatron.invariant.rmsnorm import rms_norm_backward

    recipe = Recipe(backend="triton")
    slot = handoff.Handoff(recipe)
    backend = get_backend("triton", DEVICE)
    h = randn(3, 8, 64, seed=21).bfloat16().to(DEVICE).requires_grad_()
    w = (1 + 0.1 * randn(64, seed=22)).to(DEVICE)
    if which == "norm":
        out = producers.rms_norm_offering(h, w, 1e-5, False, slot, norm_fn=None)  # fused: never calls it
    else:
        out = producers.swiglu_offering(h, slot, act_fn=None)
    q = slot.take(out.reshape(-1, out.shape[-1]), handoff.activation_key(recipe, backend))
    assert q is not None
    ref = nvfp4.quantize_reference(out.detach().reshape(-1, out.shape[-1]).cpu(), global_scale="row", with_image=True)
    assert_quantized_equal(_cpu_q(q), ref)
    g = randn(*out.shape, seed=23).bfloat16().to(DEVICE)
    out.backward(g)
    if which == "norm":
        want, _ = rms_norm_backward(g.reshape(-1, 64), h.detach().reshape(-1, 64), w, 1e-5, False, False)
    else:
        from megatron.core.fusions.fused_bias_swiglu import swiglu_back

        want = swiglu_back(g.reshape(-1, 32), h.detach().reshape(-1, 64))
    assert_bitwise_equal(h.grad.reshape(-1, 64).cpu(), want.cpu(), "input gradient")
