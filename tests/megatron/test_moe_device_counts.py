"""The default-mode MoE layer without its host wait: with one EP and one TP rank and the fused
minite experts, the dispatcher neither copies the token counts to the host nor waits for them,
and the layer computes the bits of Megatron's synced path (forward output and every gradient).

Regression (issue 16 item 3; H200, qwen3-moe at 16384 tokens, 2026-12-01: the NVFP4 learner step
took 127.1 ms of wall time for 122.1 ms of GPU time): Megatron's all-to-all dispatcher made the
host wait once per MoE layer (``_maybe_dtoh_and_synchronize``, for ``TEGroupedMLP.forward``'s
host list), so the host could never run more than one layer ahead of the GPU.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from minite_megatron.modules import deterministic_moe
from minite_megatron.modules.moe import DeviceTokenCounts
from minite_megatron.nvfp4.group_sizes import DeviceGroupSizes
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal

HIDDEN, EXPERTS, SEQ, BATCH = 16, 4, 11, 2  # 22 tokens, 44 routed rows


def _config(**overrides):
    from .minite_tiny import tiny_config

    kw = dict(hidden_size=HIDDEN, moe_ffn_hidden_size=16, num_moe_experts=EXPERTS, moe_router_topk=2,
              use_te_activation_func=True, params_dtype=torch.bfloat16, bf16=True)
    return tiny_config(**{**kw, **overrides})


def build_moe_layer(recipe: Recipe, grouped: bool = True, **overrides):
    """One MoE layer of the minite spec (default mode: the deterministic combine, its kernel
    interpreted); ``grouped=False``: Megatron's ``SequentialMLP`` experts."""
    from megatron.core import tensor_parallel

    from minite_megatron.specs import get_gpt_decoder_block_minite_spec, get_gpt_layer_minite_spec

    from .minite_tiny import init_single_process

    init_single_process()
    cfg = _config(**overrides)
    if grouped:
        moe = get_gpt_decoder_block_minite_spec(cfg, recipe).layer_specs[0].submodules.mlp
    else:
        moe = get_gpt_layer_minite_spec(recipe, num_experts=EXPERTS, qk_layernorm=True,
                                        moe_grouped_gemm=False).submodules.mlp
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    return moe(config=cfg, layer_number=1)


def _skew(layer, x):
    """Router weights that send every token to expert 0 and none to expert 1 (experts 2 and 3
    share the second slot): an expert with all rows, one with none, counts not multiples of 16."""
    d = torch.nn.functional.normalize(torch.randn(HIDDEN, generator=torch.Generator().manual_seed(2)), dim=0)
    with torch.no_grad():
        w = layer.router.weight
        w[2:] -= (w[2:].float() @ d)[:, None].to(w.dtype) * d.to(w.dtype)  # experts 2, 3: orthogonal to d
        w[0], w[1] = 8 * d, -8 * d
    return x + 3 * d.to(x.dtype)


def _run(layer, x, dy, *, on_device: bool, main_grad: bool):
    """(output, dx, {name: gradient}, Megatron's host-copy calls, the experts' count types)."""
    dispatcher = layer.token_dispatcher
    dispatcher.counts_on_device = on_device
    deterministic_moe.use_kernels_on_cpu(layer)  # the GPU's combine kernels (interpreted on a CPU)
    assert dispatcher.kernels_on_cpu
    params = dict(layer.named_parameters())
    for p in params.values():
        p.grad = None
        if main_grad:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.grad_added_to_main_grad = False
    calls, kinds = [], []
    megatron = MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
    hook = layer.experts.linear_fc1.register_forward_pre_hook(lambda m, args: kinds.append(type(args[1])))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize",
                   lambda self, point, t=None: (calls.append(point), megatron(self, point, t))[1])
        if on_device:  # nothing may bring the counts to the host
            mp.setattr(DeviceGroupSizes, "tolist", lambda self: pytest.fail("device counts brought to the host"))
        xx = x.clone().requires_grad_()
        torch.manual_seed(9)  # the stochastic-rounding seeds: the same draws on both paths
        out, bias = layer(xx)
        out.backward(dy)
    hook.remove()
    assert bias is None
    grads = {}
    for name, p in params.items():
        used_main = main_grad and getattr(p, "grad_added_to_main_grad", False)
        grads[name] = p.main_grad.clone() if used_main else p.grad.clone()
        if main_grad:
            del p.main_grad, p.grad_added_to_main_grad
    return out.detach(), xx.grad, grads, calls, kinds


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).bfloat16()
    return x, torch.randn(SEQ, BATCH, HIDDEN, generator=g).bfloat16()


RECIPES = {"bf16_twin": Recipe(precision="bf16"), "nvfp4": Recipe(backend="triton"),
           "strict": Recipe(backend="triton", strict=True)}


@pytest.fixture(scope="module")
def layers():
    return {name: build_moe_layer(recipe) for name, recipe in RECIPES.items()}


@pytest.mark.parametrize("name,routing,main_grad", [
    ("bf16_twin", "random", False), ("bf16_twin", "skewed", True), ("bf16_twin", "skewed", False),
    ("nvfp4", "skewed", False), ("nvfp4", "random", True), ("strict", "skewed", False), ("strict", "random", True),
])
def test_no_host_wait_and_the_synced_paths_bits(layers, name, routing, main_grad):
    """No call of Megatron's device-to-host copy / wait, the experts get ``DeviceGroupSizes``
    (nothing calls its ``tolist``), and the output, the input gradient, the router's and every
    expert weight's gradient equal the synced path's bit for bit (with Megatron's ``main_grad``
    where marked). Skewed routing: an expert with all 22 tokens, one with none. Strict too: its
    batch-invariant grouped GEMMs take the device counts with the host counts' bits (a replayed
    CUDA graph of a strict step needs them there)."""
    layer = layers[name]
    assert isinstance(layer.token_dispatcher, DeviceTokenCounts)
    layer.token_dispatcher.counts_on_device = True
    assert layer.token_dispatcher.why_host_counts() is None
    x, dy = _inputs(seed=len(routing) + main_grad)
    state = {k: v.clone() for k, v in layer.state_dict().items() if torch.is_tensor(v)}
    try:
        if routing == "skewed":
            x = _skew(layer, x)
        want = _run(layer, x, dy, on_device=False, main_grad=main_grad)
        got = _run(layer, x, dy, on_device=True, main_grad=main_grad)
    finally:
        layer.load_state_dict(state, strict=False)
    assert got[3] == [] and want[3], (got[3], want[3])
    assert got[4] == [DeviceGroupSizes] and want[4] == [list], (got[4], want[4])
    assert_bitwise_equal(got[0], want[0], "output")
    assert_bitwise_equal(got[1], want[1], "input gradient")
    assert got[2].keys() == want[2].keys() and "router.weight" in got[2]
    for n in want[2]:
        assert_bitwise_equal(got[2][n], want[2][n], n)


@pytest.mark.parametrize("recipe,overrides,reason", [
    (Recipe(), {}, "the reference backend's grouped_gemm takes host group sizes"),
    (Recipe(precision="bf16", fused_moe_activation=False), {}, "the experts run Megatron's forward"),
    (Recipe(precision="bf16"), dict(moe_expert_capacity_factor=2.0), "moe_expert_capacity_factor"),
    (Recipe(precision="bf16"), dict(params_dtype=torch.float32, bf16=False), "on torch.float32 tokens"),
    (Recipe(precision="bf16"), dict(grouped=False), "the experts take host counts"),
])
def test_where_the_wait_stays_it_says_why(recipe, overrides, reason):
    """Configurations that need the counts on the host keep Megatron's copy and wait and say
    why (``why_host_counts``); the NVFP4 experts on the CPU's default (reference) backend among them."""
    layer = build_moe_layer(recipe, **overrides)
    why = layer.token_dispatcher.why_host_counts()
    assert why is not None and reason in why, why


def test_router_padding_for_quantization_keeps_the_wait(layers, monkeypatch):
    """(Megatron accepts the flag only with TE's fp8/fp4: set on a built layer's config.)"""
    dispatcher = layers["bf16_twin"].token_dispatcher
    monkeypatch.setattr(dispatcher.config, "moe_router_padding_for_quantization", True)
    assert "moe_router_padding_for_quantization" in dispatcher.why_host_counts()


def test_cuda_tensors_take_the_device_counts_too(layers, monkeypatch):
    """CUDA tensors leave the counts on the device like CPU ones (no gate: the GPU tests passed and
    the step measured faster, issue 24); a regression would put Megatron's wait back on a GPU."""
    dispatcher = layers["bf16_twin"].token_dispatcher
    experts = layers["bf16_twin"].experts
    monkeypatch.setattr(experts, "why_host_counts", lambda dtype=None, device=None: None)
    assert dispatcher.why_host_counts(torch.bfloat16, "cuda") is None
