"""The BF16 twin's grouped expert linear (``torch._grouped_mm``) and the experts' one-buffer layout.

On a CPU ``torch._grouped_mm`` runs the same matmul per expert as a loop of ``F.linear`` does, so
forward, dgrad and wgrad are bitwise equal to the sequential experts there; on the GPU (CUTLASS
grouped kernel vs cuBLAS) they agree within the bf16 rule of docs/numerics.md.
"""

import pytest
import torch

from minite_megatron.ops.grouped_linear import bf16_grouped_linear, stacked_view, stacked_weights
from minite_megatron.testing import assert_bitwise_equal


def _experts(groups=4, n=24, k=32, dtype=torch.float32, device="cpu", one_buffer=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    if one_buffer:
        buf = torch.randn(groups, n, k, generator=g).to(device, dtype)
        return [torch.nn.Parameter(buf[i]) for i in range(groups)]
    return [torch.nn.Parameter(torch.randn(n, k, generator=g).to(device, dtype)) for _ in range(groups)]


def _sequential(x, sizes, weights, dy):
    xs = x.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_() for w in weights]
    y = torch.cat([torch.nn.functional.linear(xe, w) for xe, w in zip(torch.split(xs, sizes), ws)])
    y.backward(dy)
    return y.detach(), xs.grad, [w.grad for w in ws]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_buffer", [True, False])
def test_grouped_equals_sequential_experts_bitwise_on_cpu(dtype, one_buffer):
    """fprop, dgrad and wgrad, with an empty expert and an expert of one token; both weight
    layouts (one buffer: no stacked copy; separate tensors: the stacked fallback)."""
    sizes = [5, 0, 1, 10]
    weights = _experts(dtype=dtype, one_buffer=one_buffer)
    assert (stacked_view(weights) is not None) == one_buffer
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), 32, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(sum(sizes), 24, generator=g).to(dtype)
    y = bf16_grouped_linear(x, sizes, weights)
    y.backward(dy)
    want_y, want_dx, want_dw = _sequential(x, sizes, weights, dy)
    assert_bitwise_equal(y, want_y, "y")
    assert_bitwise_equal(x.grad, want_dx, "dx")
    for i, (w, d) in enumerate(zip(weights, want_dw)):
        assert_bitwise_equal(w.grad, d, f"dW[{i}]")
    assert bool((weights[1].grad == 0).all())


def test_grouped_linear_bias_and_main_grad():
    sizes = [3, 4]
    weights = _experts(groups=2)
    biases = [torch.nn.Parameter(torch.randn(24)) for _ in range(2)]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    x = torch.randn(7, 32)
    y = bf16_grouped_linear(x, sizes, weights, biases)
    want = torch.cat([torch.nn.functional.linear(xe, w, b) for xe, w, b in zip(torch.split(x, sizes), weights, biases)])
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    assert all(w.grad_added_to_main_grad for w in weights)
    torch.testing.assert_close(weights[0].main_grad, torch.ones(3, 24).t() @ x[:3])
    torch.testing.assert_close(biases[1].grad, torch.full((24,), 4.0))
    with pytest.raises(ValueError, match="sums to"):
        bf16_grouped_linear(x, [3, 3], weights)


def test_experts_of_the_grouped_module_share_one_buffer():
    """NVFP4GroupedLinear allocates weight{i} as slices of one [G, N, K] buffer (no stacked copy
    per step); a parameter rebound elsewhere falls back to a copy, same values."""
    from tests.megatron.minite_tiny import init_single_process, tiny_config
    from minite_megatron.modules.grouped_linear import NVFP4GroupedLinear
    from minite_megatron.recipe import Recipe

    init_single_process()
    cfg = tiny_config()
    lin = NVFP4GroupedLinear(4, 64, 32, config=cfg, init_method=cfg.init_method, bias=False, skip_bias_add=False,
                             recipe=Recipe(precision="bf16"), precision="bf16")
    view = stacked_view(lin.weights)
    assert view is not None and view.data_ptr() == lin.weight0.data_ptr()
    assert_bitwise_equal(view[2], lin.weight2.detach())
    lin.weight1.data = lin.weight1.data.clone()
    assert stacked_view(lin.weights) is None
    assert_bitwise_equal(stacked_weights(lin.weights), view)
    x = torch.randn(6, 64)
    torch.testing.assert_close(lin(x, [2, 0, 3, 1])[0], torch.cat([x[:2] @ lin.weight0.t(), x[2:5] @ lin.weight2.t(),
                                                                     x[5:] @ lin.weight3.t()]))


@pytest.mark.gpu
def test_grouped_mm_on_the_gpu_within_the_bf16_rule():
    sizes = [300, 0, 1, 211, 64]
    weights = _experts(groups=5, n=256, k=512, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(sizes), 512, generator=g).cuda().bfloat16().requires_grad_()
    dy = torch.randn(sum(sizes), 256, generator=g).cuda().bfloat16()
    y = bf16_grouped_linear(x, sizes, weights)
    y.backward(dy)
    got = [y.detach(), x.grad] + [w.grad for w in weights]
    seq = _sequential(x, sizes, weights, dy)
    want = [seq[0], seq[1]] + seq[2]
    x64, w64 = x.detach().double(), [w.detach().double() for w in weights]
    exact = _sequential(x64, sizes, w64, dy.double())
    exact = [exact[0], exact[1]] + exact[2]
    for i, (a, m, e) in enumerate(zip(got, want, exact)):
        if e.norm() == 0:
            assert bool((a == 0).all()), f"tensor {i} (an empty expert) must be zeros"
            continue
        err = float((a.double() - e).norm() / e.norm())
        ref = float((m.double() - e).norm() / e.norm())
        assert err <= 2 * ref + 1e-6, f"tensor {i}: grouped error {err:.3e} vs sequential {ref:.3e}"


def test_precision_flag_builds_the_bf16_twin():
    """``--minite-precision bf16`` (generated from the recipe field) gives a recipe whose specs
    build every linear and the experts in BF16; its core attention is the recipe's (the aligned
    attention by default, torch SDPA with ``aligned_attention`` off: the benchmark's best-BF16
    twin); a bad value names the flag."""
    import argparse

    from minite_megatron.modules.attention import MiniteDotProductAttention
    from minite_megatron.modules.core_attention import AlignedDotProductAttention
    from minite_megatron.recipe import Recipe, RecipeError, add_recipe_args, recipe_from_args
    from minite_megatron.specs import get_gpt_layer_minite_spec

    parser = add_recipe_args(argparse.ArgumentParser())
    recipe = recipe_from_args(parser.parse_args(["--minite-precision", "bf16"]))
    assert recipe.precision == "bf16" and not recipe.quantized
    spec = get_gpt_layer_minite_spec(recipe, num_experts=4, qk_layernorm=True)
    attn = spec.submodules.self_attention.submodules
    assert attn.linear_qkv.keywords["precision"] == "bf16" and attn.linear_proj.keywords["precision"] == "bf16"
    assert attn.core_attention is AlignedDotProductAttention
    sdpa = get_gpt_layer_minite_spec(Recipe(precision="bf16", aligned_attention=False), num_experts=4, qk_layernorm=True)
    assert sdpa.submodules.self_attention.submodules.core_attention is MiniteDotProductAttention
    experts = spec.submodules.mlp.keywords["submodules"].experts.keywords["submodules"]
    assert experts.linear_fc1.keywords["precision"] == "bf16" and experts.linear_fc2.keywords["precision"] == "bf16"
    assert spec.submodules.input_layernorm.keywords["offer_to"] is None  # no NVFP4 handoff in the twin
    assert Recipe().precision == "nvfp4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--minite-precision", "fp8"])
    with pytest.raises(RecipeError, match="--minite-precision"):
        Recipe(precision="fp8")
