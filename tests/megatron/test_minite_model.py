"""The minite specs build real Megatron-Core models whose linears are miniTE's, and they train.

Single process (gloo, world size 1) through the CPU compatibility layer; parallel layouts are in
test_parallel*.py.
"""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.modules.grouped_linear import NVFP4GroupedLinear
from minite_megatron.modules.linear import MiniteConfigError, NVFP4ColumnParallelLinear, NVFP4RowParallelLinear
from minite_megatron.modules.norm import MiniteNorm
from minite_megatron.nvfp4.backends import ReferenceBackend, register_backend
from minite_megatron.recipe import Recipe
from minite_megatron.specs import (
    get_gpt_decoder_block_minite_spec,
    get_gpt_decoder_layer_minite_specs,
    get_gpt_layer_minite_spec,
)

from .minite_tiny import build_gpt, causal_mask, init_single_process, lm_batch, tiny_config, train


@pytest.fixture(scope="module", autouse=True)
def megatron_single_process():
    init_single_process()


# ---- spec wiring (no modules instantiated) -----------------------------------------------------
def _attn(spec):
    return spec.submodules.self_attention.submodules


def test_layer_spec_wires_nvfp4_linears_and_grouped_experts():
    recipe = Recipe()
    spec = get_gpt_layer_minite_spec(recipe, num_experts=8, qk_layernorm=True)
    attn = _attn(spec)
    assert attn.linear_qkv.func is NVFP4ColumnParallelLinear and attn.linear_qkv.keywords["precision"] == "nvfp4"
    assert attn.linear_proj.func is NVFP4RowParallelLinear and attn.linear_qkv.keywords["recipe"] is recipe
    assert attn.q_layernorm.func is MiniteNorm and attn.k_layernorm.func is MiniteNorm
    moe = spec.submodules.mlp.keywords["submodules"]
    experts = moe.experts.keywords["submodules"]
    assert experts.linear_fc1.func is NVFP4GroupedLinear and experts.linear_fc1.keywords["parallel_mode"] == "column"
    assert experts.linear_fc2.keywords["parallel_mode"] == "row" and experts.linear_fc2.keywords["precision"] == "nvfp4"
    shared = moe.shared_experts.keywords["submodules"]
    assert shared.linear_fc1.func is NVFP4ColumnParallelLinear


def test_bf16_first_and_last_layers_and_moe_frequency():
    cfg = tiny_config(num_layers=5, moe_layer_freq=[1, 0, 1, 1, 0])
    specs = get_gpt_decoder_layer_minite_specs(cfg, Recipe(bf16_first_layers=1, bf16_last_layers=2))
    precisions = [_attn(s).linear_qkv.keywords["precision"] for s in specs]
    assert precisions == ["bf16", "nvfp4", "nvfp4", "bf16", "bf16"]
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    is_moe = [isinstance(s.submodules.mlp.keywords["submodules"], MoESubmodules) for s in specs]
    assert is_moe == [True, False, True, True, False]
    moe0 = specs[0].submodules.mlp.keywords["submodules"].experts.keywords["submodules"]
    assert moe0.linear_fc1.keywords["precision"] == "bf16"


def test_recipe_knobs_keep_parts_in_bf16():
    spec = get_gpt_layer_minite_spec(Recipe(quantize_attention=False, quantize_experts=False), num_experts=4)
    assert _attn(spec).linear_qkv.keywords["precision"] == "bf16"
    experts = spec.submodules.mlp.keywords["submodules"].experts.keywords["submodules"]
    assert experts.linear_fc1.keywords["precision"] == "bf16"


# ---- built models --------------------------------------------------------------------------------
def test_built_model_uses_minite_modules():
    cfg = tiny_config()
    recipe = Recipe()
    model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe)
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, NVFP4ColumnParallelLinear)
    assert isinstance(layer.self_attention.linear_proj, NVFP4RowParallelLinear)
    assert isinstance(layer.mlp.experts.linear_fc1, NVFP4GroupedLinear)
    assert isinstance(layer.mlp.experts.linear_fc2, NVFP4GroupedLinear)
    assert isinstance(layer.input_layernorm, MiniteNorm)
    assert {n for n, _ in layer.mlp.experts.linear_fc1.named_parameters()} == {f"weight{i}" for i in range(4)}
    assert cfg.moe_router_dtype == "fp32"


class CountingBackend(ReferenceBackend):
    name = "counting"

    def __init__(self):
        self.roles = []

    def quantize(self, x, **kw):
        self.roles.append((kw.get("tile"), kw.get("rounding"), kw.get("rht_seed") is not None, kw.get("global_scale")))
        return super().quantize(x, **kw)


def test_quantization_runs_in_fprop_dgrad_and_wgrad_of_a_real_model():
    spy = CountingBackend()
    register_backend(spy)
    cfg = tiny_config()
    recipe = Recipe(backend="counting")
    model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe)
    tokens, labels = lm_batch(0)
    pos = torch.arange(32).unsqueeze(0).expand(4, -1)
    model(tokens, pos, causal_mask(32), labels=labels).mean().backward()
    roles = set(spy.roles)
    assert any(r[0] == (16, 16) and r[3] == "tensor" for r in roles), "dense weights: 16x16 tiles"
    assert any(r[0] == (16, 16) and r[3] == "group" for r in roles), "expert weights: 16x16, one scale per expert"
    assert any(r[3] == "row" for r in roles), "fprop activations (per token)"
    assert any(r[1] == "stochastic" and not r[2] for r in roles), "dgrad: gradients with SR"
    assert any(r[1] == "stochastic" and r[2] for r in roles), "wgrad: gradients with SR + RHT"
    assert any(r[1] in (None, "nearest") and r[2] for r in roles), "wgrad: activations with RHT"
    # every linear weight got a gradient
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_tiny_moe_trains_like_bf16():
    """50 steps on a learnable toy language from the same seed and data: the NVFP4 (full update,
    SR, RHT) loss must fall like the BF16 local-spec loss. Stated tolerance: both end below half
    the initial loss and the NVFP4 final loss (mean of the last 5 steps) is within 10% of BF16's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    steps = 50
    cfg = tiny_config()
    recipe = Recipe()
    fp4 = train(build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe), steps)
    cfg_bf16 = tiny_config()
    bf16 = train(build_gpt(cfg_bf16, get_gpt_decoder_block_spec(cfg_bf16, use_transformer_engine=False, normalization="RMSNorm")), steps)
    assert abs(fp4[0] - bf16[0]) < 0.05  # same init and data
    end_fp4, end_bf16 = sum(fp4[-5:]) / 5, sum(bf16[-5:]) / 5
    assert end_bf16 < 0.5 * bf16[0] and end_fp4 < 0.5 * fp4[0]
    assert abs(end_fp4 - end_bf16) <= 0.10 * end_bf16, (end_fp4, end_bf16)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hidden_size=72, num_attention_heads=4, kv_channels=18), "--hidden-size"),
        (dict(moe_ffn_hidden_size=40), "--moe-ffn-hidden-size"),
    ],
)
def test_bad_model_shapes_fail_fast_naming_the_flag(overrides, match):
    cfg = tiny_config(**overrides)
    with pytest.raises(MiniteConfigError, match=match):
        build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, Recipe()))


def test_fp32_lm_head():
    cfg = tiny_config(params_dtype=torch.float32)
    recipe = Recipe(fp32_lm_head=True)
    model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe)
    from minite_megatron.model import FP32OutputLayer

    assert isinstance(model.output_layer, FP32OutputLayer)
    tokens, _ = lm_batch(0)
    pos = torch.arange(32).unsqueeze(0).expand(4, -1)
    logits = model(tokens, pos, causal_mask(32))
    assert logits.dtype == torch.float32


def test_exported_weight_is_the_forward_weight():
    """quantized_weight() is exactly the operand the forward used (export never re-quantizes)."""
    cfg = tiny_config()
    recipe = Recipe()
    model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    q = qkv.quantized_weight()
    want = nvfp4.quantize(qkv.weight.detach(), "tensor", (16, 16))
    assert torch.equal(q.codes, want.codes) and torch.equal(q.global_decode, want.global_decode)
    experts = model.decoder.layers[0].mlp.experts.linear_fc1.quantized_weight()
    assert experts.shape == (4, 64, 64) and experts.global_scale == "group"
