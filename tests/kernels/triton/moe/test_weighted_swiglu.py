"""The routed experts' weighted SwiGLU (issue 16): forward, fused backward, the handoff to fc2.

Contracts pinned here (kernels on the device under test: the GPU, or the CPU under
TRITON_INTERPRET=1; references on the CPU):

* forward ``weighted_swiglu(h, p)`` = ``round(fp32(round(round(silu(gate)) * up)) * p)``:
  bitwise the ``a`` of ``swiglu_quantize(h, probs=p)`` (one kernel, quantization compiled out)
  and, on the GPU, bitwise Megatron's unfused ``(F.silu(gate) * up * p[:, None]).to(dtype)``.
  Under the interpreter ``exp`` is numpy's: bitwise the formula with numpy's exp, and against
  torch's CPU composition the rule of ``test_triton_producers``: a differing element must be the
  result for an fp32 silu within 2 ulps of torch's (no count tolerance).
* backward ``(dh, dp)``: within ``_testing.weighted_swiglu_backward_bounds``' rule of the exact
  (fp64) gradient of ``silu(gate) * up * p``: one rounding to 16 bits plus the fp32 evaluation's
  error, derived there; the torch reference obeys the same rule.
* through the autograd function: Megatron's forward bits, the fused backward, ``dp`` in the
  probabilities' dtype, and the NVFP4 handoff: fc2's ``quantize_activation`` takes the offered
  quantization, bitwise ``quantize_reference`` of the unfused output.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.ops import moe_activation
from minite_megatron.ops.handoff import Handoff
from minite_megatron.ops.linear import LinearContext, backend_for, quantize_activation
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal

from minite_kernels.triton._build._testing import (
    DEVICE,
    HAS_CUDA,
    assert_quantized_equal,
    assert_weighted_swiglu_backward,
    kernels_runnable,
    randn,
)

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.nvfp4.swiglu_quantize import swiglu_quantize  # noqa: E402
from minite_kernels.triton.moe.weighted_swiglu import weighted_swiglu, weighted_swiglu_backward  # noqa: E402

HALF = [torch.bfloat16, torch.float16]


def _probs(r: int, seed: int) -> torch.Tensor:
    p = torch.rand(r, generator=torch.Generator().manual_seed(seed))
    p[: min(r, 1)] = 1.0 if r > 1 else p[:1]
    return p


def _inline(h: torch.Tensor) -> torch.Tensor:
    """Megatron's inline GLU (``use_te_activation_func`` off), SwiGLU with ``glu_linear_offset`` 0."""
    g, u = torch.chunk(h, 2, -1)
    return torch.nn.functional.silu(g) * (u + 0.0)


def _numpy_exp_weighted(h: torch.Tensor, p: torch.Tensor, inline_glu: bool = False) -> torch.Tensor:
    """The forward with numpy's fp32 exp (the interpreter's ``tl.exp``)."""
    g, u = torch.chunk(h, 2, -1)
    u = u + 0.0 if inline_glu else u
    gf = g.float()
    with np.errstate(all="ignore"):
        e = torch.from_numpy(np.exp((-gf).numpy()))
    return (((gf / (1.0 + e)).to(h.dtype) * u) * p.unsqueeze(-1)).to(h.dtype)


def _candidates(h: torch.Tensor, p: torch.Tensor, inline_glu: bool, k: int = 2) -> list[torch.Tensor]:
    """The forward for an fp32 silu moved by -k..k ulps from torch's CPU one."""
    g, u = torch.chunk(h, 2, -1)
    u = u + 0.0 if inline_glu else u
    gf = g.float()
    s = gf / (1.0 + torch.exp(-gf))
    out = []
    for step in range(-k, k + 1):
        t = s.clone()
        for _ in range(abs(step)):
            t = torch.nextafter(t, torch.full_like(t, float("inf") if step > 0 else float("-inf")))
        out.append(((t.to(h.dtype) * u) * p.unsqueeze(-1)).to(h.dtype))
    return out


def check_forward(h: torch.Tensor, p: torch.Tensor, name: str, inline_glu: bool = False) -> torch.Tensor:
    """The kernel's y vs swiglu_quantize's a and Megatron's unfused path (module docstring);
    ``inline_glu``: Megatron's inline GLU (``up + 0.0``) instead of the activation module's."""
    act_fn = _inline if inline_glu else None
    y = weighted_swiglu(h.to(DEVICE), p.to(DEVICE), inline_glu=inline_glu)
    a, _q = swiglu_quantize(h.to(DEVICE), probs=p.to(DEVICE), inline_glu=inline_glu)
    assert_bitwise_equal(y.cpu(), a.cpu(), f"{name}: y vs swiglu_quantize's a", nan_equal=True)
    if HAS_CUDA:
        megatron = moe_activation.weighted_swiglu_reference(h.to(DEVICE), p.to(DEVICE), act_fn)
        assert_bitwise_equal(y.cpu(), megatron.cpu(), f"{name}: y vs Megatron's unfused path", nan_equal=True)
        return y.cpu()
    y = y.cpu()
    assert_bitwise_equal(y, _numpy_exp_weighted(h, p, inline_glu), f"{name}: y (numpy exp)", nan_equal=True)
    expected = moe_activation.weighted_swiglu_reference(h, p, act_fn)
    nan = torch.isnan(y.float()) & torch.isnan(expected.float())
    diff = (y.view(torch.int16) != expected.view(torch.int16)) & ~nan
    if bool(diff.any()):
        ok = torch.zeros_like(diff)
        for cand in _candidates(h, p, inline_glu):
            ok |= y.view(torch.int16) == cand.view(torch.int16)
        bad = diff & ~ok
        assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements beyond 2 fp32 ulps of torch's silu"
    return y


def hard_rows(f: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeros, gates at the ends of exp's range (|gate| up to 1e4), subnormal gates and ups, -0.0;
    probabilities 0, 1, tiny, above 1 and negative (the router gives >= 0; the kernel is a product)."""
    h = randn(8, 2 * f, seed=f, scale=2.0, dtype=dtype)
    tiny = 9.2e-41 if dtype == torch.bfloat16 else 6e-8
    big = 1e4 if dtype == torch.bfloat16 else 6e3
    h[0] = 0.0
    h[1, :f] = torch.linspace(-big, big, f).to(dtype)
    h[2, :f] = torch.linspace(-104.0, 104.0, f).to(dtype)
    h[3, :f] = tiny
    h[3, f:] = -0.0  # up = -0.0: Megatron's inline GLU makes it +0.0
    h[4, f:] = tiny
    h[5, :f] = -0.0
    h[6, :f] = torch.linspace(-1.5, -1.0, f).to(dtype)  # around silu's minimum (d silu = 0 at -1.278)
    p = torch.tensor([0.5, 1.0, 0.25, 0.75, 1e-38, 2.5, 0.0, -0.5])
    return h, p


# ---------------------------------------------------------------- forward

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("r,f", [(1, 16), (37, 48), (8, 80), (3, 768)])
def test_forward_random(dtype, r, f):
    """Fresh data; one row, an odd row count, F = 80 (a stored and read back), F = 768 (the preset)."""
    check_forward(randn(r, 2 * f, seed=r * f, scale=3.0, dtype=dtype), _probs(r, seed=f), f"random {dtype} {r}x{f}")


@pytest.mark.parametrize("dtype", HALF)
def test_forward_hard_cases(dtype):
    """Also Megatron's inline GLU (``inline_glu``): the same bits but for its +0.0 where up is -0.0."""
    h, p = hard_rows(48, dtype)
    y = check_forward(h, p, f"hard {dtype}")
    y_inline = check_forward(h, p, f"hard {dtype} inline GLU", inline_glu=True)
    assert bool((y[3].view(torch.int16) == torch.tensor(-0.0, dtype=dtype).view(torch.int16)).all())
    assert not bool(y_inline[3].view(torch.int16).any())  # +0.0
    same = torch.ones(8, dtype=torch.bool)
    same[3] = False
    assert_bitwise_equal(y_inline[same], y[same], "inline GLU elsewhere")
    assert not bool(y[0].float().any()) and not bool(y[5].float().any())  # zeros in (gate 0), zeros out
    assert not bool(y[6].float().any())  # p = 0
    y_pos = check_forward(h[7:], p[7:].abs(), f"hard {dtype}, |p|")
    assert_bitwise_equal(y[7:], -y_pos, "a negative probability: the exact negation (RNE is symmetric)")


def test_forward_empty_strided_and_bad_arguments():
    assert weighted_swiglu(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE),
                           torch.zeros(0, device=DEVICE)).shape == (0, 32)
    big = randn(5, 160, seed=3, dtype=torch.bfloat16)
    check_forward(big[:, 32:128], _probs(5, 4), "column slice")
    h = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="h must be a bfloat16 or float16"):
        weighted_swiglu(h.float(), torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 16"):
        weighted_swiglu(torch.zeros(2, 48, dtype=torch.bfloat16, device=DEVICE), torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="probs must be an fp32 \\[2\\]"):
        weighted_swiglu(h, torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="probs must be an fp32"):
        weighted_swiglu(h, torch.ones(2, dtype=torch.bfloat16, device=DEVICE))


# ---------------------------------------------------------------- backward

def check_backward(h, p, name, seed=0):
    f = h.shape[1] // 2
    dy = randn(h.shape[0], f, seed=seed + 7, scale=0.5, dtype=h.dtype)
    dh, dp = weighted_swiglu_backward(dy.to(DEVICE), h.to(DEVICE), p.to(DEVICE))
    assert dh.dtype == h.dtype and dh.shape == h.shape and dp.dtype == torch.float32 and dp.shape == p.shape
    assert_weighted_swiglu_backward(dh, dp, dy, h, p, name)
    rdh, rdp = moe_activation.weighted_swiglu_backward_reference(dy, h, p)
    assert_weighted_swiglu_backward(rdh, rdp, dy, h, p, f"{name} (torch reference)")
    return dh.cpu(), dp.cpu()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("r,f", [(1, 16), (37, 48), (6, 96), (5, 768)])
def test_backward_random(dtype, r, f):
    """BLOCK_F = 16 (F = 48: three chunks), 32 (F = 96), 256 (F = 768: the preset's); R not a
    multiple of the 4-row tile."""
    check_backward(randn(r, 2 * f, seed=r + f, scale=3.0, dtype=dtype), _probs(r, seed=r), f"random {dtype} {r}x{f}")


@pytest.mark.parametrize("dtype", HALF)
def test_backward_hard_cases(dtype):
    h, p = hard_rows(48, dtype)
    if dtype == torch.float16:
        h[1, :48] = torch.linspace(-300.0, 300.0, 48).to(dtype)  # keep d gate = da * up * ~gate within fp16
    dh, dp = check_backward(h, p, f"hard {dtype}", seed=1)
    assert not bool(dh[0].float().any()) and dp[0] == 0.0  # zeros
    assert not bool(dh[6].float().any()) and dp[6] != 0.0  # p = 0: no gradient to h, but one to p


def test_backward_empty_and_bad_arguments():
    dh, dp = weighted_swiglu_backward(torch.zeros(0, 32, dtype=torch.bfloat16, device=DEVICE),
                                      torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE), torch.zeros(0, device=DEVICE))
    assert dh.shape == (0, 64) and dp.shape == (0,)
    with pytest.raises(ValueError, match="dy must be \\[2, 32\\]"):
        weighted_swiglu_backward(torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE),
                                 torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE), torch.ones(2, device=DEVICE))


# ---------------------------------------------------------------- the autograd op and its handoff

@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16])
def test_autograd_op_forward_bits_backward_and_probs_dtype(probs_dtype):
    """``ops.moe_activation.weighted_swiglu``: Megatron's unfused forward bits (CPU: its torch
    composition; GPU: the kernel), the fused backward (the kernel: ``kernels_on_cpu``), ``dp`` in
    the probabilities' dtype, and gradients within the rule -- autograd's own chain through
    Megatron's three roundings is checked against the same exact gradient to show what it
    costs: it is allowed the rule plus its extra roundings (it is not the contract)."""
    h = randn(21, 2 * 48, seed=5, scale=3.0, dtype=torch.bfloat16).to(DEVICE).requires_grad_()
    p = _probs(21, 6).to(probs_dtype).to(DEVICE).requires_grad_()
    y = moe_activation.weighted_swiglu(h, p, kernels_on_cpu=True)
    megatron = moe_activation.weighted_swiglu_reference(h.detach(), p.detach())
    assert_bitwise_equal(y.detach().cpu(), megatron.cpu(), "forward vs Megatron's unfused path")
    dy = randn(21, 48, seed=8, dtype=torch.bfloat16).to(DEVICE)
    y.backward(dy)
    assert p.grad.dtype == probs_dtype and h.grad.dtype == torch.bfloat16
    if probs_dtype == torch.float32:
        assert_weighted_swiglu_backward(h.grad, p.grad, dy, h.detach(), p.detach(), "autograd op")
    else:  # dp rounded to bf16 once more
        _dh, dp32 = moe_activation.weighted_swiglu_backward(dy, h.detach(), p.detach().float(), kernels_on_cpu=True)
        assert_bitwise_equal(p.grad.cpu(), dp32.to(torch.bfloat16).cpu(), "dp in bf16")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nvfp4_handoff_is_what_fc2_would_quantize(backend):
    """With an NVFP4 fc2's slot the op offers its output's per-token quantization; fc2's
    ``quantize_activation`` takes it (no second quantize) and it is bitwise ``quantize_reference``
    of the unfused output (reference backend: Megatron's composition, then the quantizer; Triton:
    ``swiglu_quantize(probs=)``, one kernel)."""
    if backend == "reference" and HAS_CUDA:
        pytest.skip("the reference backend's path is the CPU's")
    recipe = Recipe(backend=backend)
    slot = Handoff(recipe)
    h = randn(19, 2 * 80, seed=9, scale=3.0, dtype=torch.bfloat16).to(DEVICE)
    p = _probs(19, 10).to(DEVICE)
    y = moe_activation.weighted_swiglu(h, p, slot)
    if backend == "reference":
        assert_bitwise_equal(y, moe_activation.weighted_swiglu_reference(h, p), "y vs Megatron's unfused path")
    else:
        assert_bitwise_equal(y.cpu(), check_forward(h.cpu(), p.cpu(), "handoff y"), "y vs the kernel")
    offered = slot._offer.quantized
    lctx = LinearContext(recipe, None, handoff=slot)
    taken = quantize_activation(y, lctx, backend_for(recipe, y.device))
    assert taken is offered and slot._offer is None
    cpu = replace(taken, codes=taken.codes.cpu(), block_scales=taken.block_scales.cpu(),
                  global_decode=taken.global_decode.cpu(), image=None if taken.image is None else taken.image.cpu())
    assert_quantized_equal(cpu, nvfp4.quantize_reference(y.cpu(), global_scale="row", with_image=True), "offered q")


# ---------------------------------------------------------------- sm_90a, compiled on this CPU

AOT_SCRIPT = r"""
import json
from minite_kernels.triton._build._aot import loop_opcode_counts, report, sass
from minite_kernels.triton.moe.weighted_swiglu import aot_kernels

fwd, bwd = aot_kernels(131072, 768, "bf16")
inline, _ = aot_kernels(131072, 768, "bf16", inline_glu=True)
out = {"fwd": report(fwd), "bwd": report(bwd), "bwd_loop": loop_opcode_counts(sass(bwd)),
       "adds_of_zero": [k.asm["ptx"].count(", 0f00000000;") for k in (fwd, inline)]}
print("JSON" + json.dumps(out))
"""


@pytest.mark.aot  # compile-only (sm_90a on any machine): CI runs it; the GPU set leaves it out
def test_kernels_compile_for_sm90a_without_spills():
    """Both kernels at the learner's launch config ([131072, 1536] bf16) compile for sm_90a
    (the interpreter checks no typing), without spills; the inline GLU build keeps its
    ``up + 0.0``; the backward's column loop reads dy,
    gate and up with one wide load each and writes d gate, d up with one store each (8
    elements per thread: memory bound at ~31 SASS instructions per element)."""
    from minite_kernels.triton._build._testing import run_aot_script

    r = run_aot_script(AOT_SCRIPT)
    for k in ("fwd", "bwd"):
        assert r[k]["spill_bytes"] == 0 and r[k]["LDL"] == 0 and r[k]["STL"] == 0, r[k]
    assert r["bwd_loop"].get("LDG") == 3 and r["bwd_loop"].get("STG") == 2, r["bwd_loop"]
    # the inline GLU's up + 0.0 is kept (not folded away: it is what turns -0.0 into +0.0)
    assert r["adds_of_zero"][1] > r["adds_of_zero"][0], r["adds_of_zero"]
