"""The fused MoE activation on the GPU (issue 16), at the qwen3-moe learner's shape: 16384
tokens x top-8 = 131072 routed rows of fc1 output [R, 2 x 768].

* forward: ``weighted_swiglu`` and ``swiglu_quantize(probs=)``'s ``a`` bitwise Megatron's unfused
  ``(F.silu(gate) * up * p[:, None]).to(bf16)`` (fresh data and the hard rows of the CPU test; and
  its inline GLU, ``up + 0.0``, with ``inline_glu=True``);
  the offered quantization bitwise ``quantize_reference`` of that unfused output;
* backward: within the rule of ``_testing.weighted_swiglu_backward_bounds`` of the exact (fp64)
  gradient, dp too;
* a tiny bf16 MoE GPT on the GPU: the same loss bits with and without the fusion (BF16 twin and
  NVFP4: here the forward *is* the kernel), both fc2 handoffs taken, gradients by the 2x rule.

    python -m pytest -q tests/megatron/test_fused_moe_activation_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.ops import moe_activation
from minite_megatron.ops.handoff import Handoff
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal

pytestmark = pytest.mark.gpu

R, F = 131072, 768


def _data(seed: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(R, 2 * F, generator=g, device="cuda") * 3.0).to(dtype)
    p = torch.rand(R, generator=g, device="cuda")
    return h, p


def _megatron(h, p, inline_glu=False):
    """Megatron's unfused path: the activation module's ``silu(gate) * up``, or its inline GLU's
    ``silu(gate) * (up + glu_linear_offset)`` (offset 0), times p, cast."""
    gate, up = torch.chunk(h, 2, -1)
    if inline_glu:
        up = up + 0.0
    return ((torch.nn.functional.silu(gate) * up) * p.unsqueeze(-1)).to(h.dtype)


@pytest.mark.parametrize("inline_glu", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_bitwise_at_the_learner_shape(dtype, inline_glu):
    from minite_kernels.triton.nvfp4.swiglu_quantize import swiglu_quantize
    from minite_kernels.triton.moe.weighted_swiglu import weighted_swiglu

    from tests.kernels.triton.moe.test_weighted_swiglu import hard_rows

    h, p = _data(1, dtype)
    hh, hp = hard_rows(F, dtype)
    h[: hh.shape[0]], p[: hp.shape[0]] = hh.cuda(), hp.cuda()
    expected = _megatron(h, p, inline_glu)
    y = weighted_swiglu(h, p, inline_glu=inline_glu)
    assert_bitwise_equal(y, expected, f"weighted_swiglu {dtype}", nan_equal=True)
    a, q = swiglu_quantize(h, probs=p, inline_glu=inline_glu)
    assert_bitwise_equal(a, expected, f"swiglu_quantize(probs=).a {dtype}", nan_equal=True)
    ref = nvfp4.quantize_reference(expected, global_scale="row", with_image=True)
    assert_bitwise_equal(q.codes, ref.codes, "codes")
    assert_bitwise_equal(q.block_scales.view(torch.uint8), ref.block_scales.view(torch.uint8), "block scales")
    assert_bitwise_equal(q.global_decode, ref.global_decode, "global decode", nan_equal=True)


def test_backward_at_the_learner_shape():
    from minite_kernels.triton._build._testing import assert_weighted_swiglu_backward
    from minite_kernels.triton.moe.weighted_swiglu import weighted_swiglu_backward

    from tests.kernels.triton.moe.test_weighted_swiglu import hard_rows

    h, p = _data(2)
    hh, hp = hard_rows(F, torch.bfloat16)
    h[: hh.shape[0]], p[: hp.shape[0]] = hh.cuda(), hp.cuda()
    dy = (torch.randn(R, F, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda") * 0.5).bfloat16()
    dh, dp = weighted_swiglu_backward(dy, h, p)
    assert_weighted_swiglu_backward(dh, dp, dy, h, p, "kernel at [131072, 1536]")


def test_the_op_hands_fc2_the_quantization_of_megatrons_output():
    from minite_megatron.ops.linear import LinearContext, backend_for, quantize_activation

    h, p = _data(4)
    h, p = h[:8192], p[:8192]
    recipe = Recipe()
    slot = Handoff(recipe)
    y = moe_activation.weighted_swiglu(h, p, slot)
    assert_bitwise_equal(y, _megatron(h, p), "y")
    q = quantize_activation(y, LinearContext(recipe, None, handoff=slot), backend_for(recipe, y.device))
    ref = nvfp4.quantize_reference(y, global_scale="row", with_image=True)
    assert_bitwise_equal(q.codes, ref.codes, "taken codes")
    assert_bitwise_equal(q.global_decode, ref.global_decode, "taken global decode")


@pytest.fixture(scope="module")
def gpu_runs():
    """The CPU test's three runs per case, on the GPU (kernel forward and backward)."""
    from tests.megatron.test_fused_moe_activation import three_runs

    return three_runs("cuda")


@pytest.mark.parametrize("precision", ["bf16", "nvfp4", "bf16-inline", "nvfp4-inline"])
def test_model_same_loss_bits_handoff_and_2x_rule_on_the_gpu(gpu_runs, precision):
    from tests.megatron import test_fused_moe_activation as cpu

    cpu.test_same_loss_bits_and_the_handoff(gpu_runs, precision)
    cpu.test_gradients_follow_the_2x_rule(gpu_runs, precision)
