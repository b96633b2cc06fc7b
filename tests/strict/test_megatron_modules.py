"""The strict Megatron modules one by one: router, MoE combine, core attention, TP linears,
specs and config checks (real megatron-core, one CPU process)."""

import dataclasses

import pytest
import torch

from minite_megatron.testing import assert_bitwise_equal


# ---- routing ------------------------------------------------------------------------------------
def test_topk_routing_matches_megatron_without_ties():
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from minite_megatron.modules.router import topk_routing

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g)
    for kw in (dict(), dict(use_pre_softmax=True), dict(score_function="sigmoid"), dict(scaling_factor=2.5)):
        probs, rmap = topk_routing(logits, 2, **kw)
        ref_probs, ref_map = topk_routing_with_score_function(logits, 2, **kw)
        assert torch.equal(rmap, ref_map)
        torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    bias = torch.randn(8, generator=g)
    probs, rmap = topk_routing(logits, 3, score_function="sigmoid", expert_bias=bias)
    ref_probs, ref_map = topk_routing_with_score_function(logits, 3, score_function="sigmoid", expert_bias=bias)
    assert torch.equal(rmap, ref_map)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)


def test_topk_routing_is_batch_invariant_with_stable_ties():
    from minite_megatron.modules.router import topk_routing

    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.5], [2.0, 2.0, -1.0, 2.0, 2.0], [0.0, -0.0, 0.0, 0.0, 0.0]])
    probs, rmap = topk_routing(logits, 2)
    assert rmap[0].nonzero().flatten().tolist() == [1, 2]
    assert rmap[1].nonzero().flatten().tolist() == [0, 1]
    assert rmap[2].nonzero().flatten().tolist() == [0, 1]
    g = torch.Generator().manual_seed(1)
    big = torch.randn(50, 8, generator=g).round(decimals=1)  # many ties
    p_all, m_all = topk_routing(big, 2)
    for rows in ([0], [49], list(range(10, 30))):
        p, m = topk_routing(big[rows], 2)
        assert_bitwise_equal(p, p_all[rows])
        assert torch.equal(m, m_all[rows])
    with pytest.raises(ValueError, match="NaN"):
        topk_routing(torch.tensor([[0.0, float("nan")]]), 1)


def test_strict_router_gating_and_refusals(tiny_gpt):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from minite_megatron.modules.router import StrictTopKRouter

    config = tiny_gpt.tiny_config(True)
    router = StrictTopKRouter(config, pg_collection=get_default_pg_collection()).eval()
    x = torch.randn(6, 3, 64, generator=torch.Generator().manual_seed(2))
    probs, rmap = router(x)
    assert probs.dtype == torch.float32 and probs.shape == (18, 8) and rmap.sum(-1).eq(2).all()
    p1, m1 = router(x[2:3, 1:2])
    assert_bitwise_equal(p1, probs[7:8])
    for bad in (dict(moe_expert_capacity_factor=1.0), dict(moe_router_load_balancing_type="sinkhorn"),
                dict(moe_router_dtype="fp64")):
        with pytest.raises(NotImplementedError):
            StrictTopKRouter(dataclasses.replace(config, **bad), pg_collection=get_default_pg_collection())


# ---- MoE combine --------------------------------------------------------------------------------
def test_deterministic_unpermute_equals_sequential_scatter_add():
    from megatron.core.transformer.moe.moe_utils import permute

    from minite_megatron.modules.deterministic_moe import deterministic_unpermute

    g = torch.Generator().manual_seed(3)
    tokens, experts, k = 20, 6, 3
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):
        routing[t, torch.randperm(experts, generator=g)[:k]] = True
    routing[4] = False  # a token routed nowhere
    hidden = torch.randn(tokens, 16, generator=g)
    _, _, sorted_idx, _, _ = permute(hidden, routing, num_out_tokens=int(routing.sum()))
    expert_out = torch.randn(int(routing.sum()), 16, generator=g) * 1e3
    ref = torch.zeros(tokens, 16)
    for row, t in enumerate(sorted_idx.tolist()):  # the fixed order: increasing permuted position
        ref[t] = ref[t] + expert_out[row]
    got = deterministic_unpermute(expert_out, sorted_idx, tokens)
    assert_bitwise_equal(got + 0.0, ref + 0.0)
    assert bool((got[4] == 0).all())
    with pytest.raises(ValueError):
        deterministic_unpermute(expert_out, sorted_idx + tokens, tokens)


def test_strict_moe_layer_uses_the_deterministic_dispatcher(tiny_gpt):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from minite_megatron.modules.deterministic_moe import StrictAlltoAllTokenDispatcher, StrictMoELayer

    config = tiny_gpt.tiny_config(True)
    model = GPTModel(config=config, transformer_layer_spec=tiny_gpt.strict_block_spec(config),
                     vocab_size=32, max_sequence_length=16, position_embedding_type="rope")
    moe = model.decoder.layers[0].mlp
    assert isinstance(moe, StrictMoELayer) and isinstance(moe.token_dispatcher, StrictAlltoAllTokenDispatcher)
    x = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out, _ = moe(x)
        one, _ = moe(x[3:4, 1:2])
    assert_bitwise_equal(one, out[3:4, 1:2])


# ---- core attention ------------------------------------------------------------------------------
def test_strict_core_attention_matches_megatron_and_its_decode_layout(tiny_gpt):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from minite_megatron.modules.core_attention import StrictDotProductAttention

    config = tiny_gpt.tiny_config(True)
    strict = StrictDotProductAttention(config, 1, AttnMaskType.causal, "self")
    plain = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(5)
    s, b = 9, 2
    q, k, v = (torch.randn(s, b, n, 16, generator=g) for n in (4, 2, 2))
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    out = strict(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
    ref = plain(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (s, b, 64)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for t in range(s):  # what the static KV-cache decode step passes
        step = strict(q[t : t + 1], k[: t + 1], v[: t + 1], mask[..., t : t + 1, : t + 1], attn_mask_type=AttnMaskType.no_mask)
        assert_bitwise_equal(step, out[t : t + 1], f"decode step {t}")
    with pytest.raises(NotImplementedError):
        StrictDotProductAttention(dataclasses.replace(config, softmax_type="off-by-one"), 1, AttnMaskType.causal, "self")


# ---- tensor-parallel linears (TP = 1 here; the reductions are tested in test_collectives.py) ----
def test_strict_parallel_linears_are_batch_invariant_and_train(tiny_gpt):
    from minite_megatron.invariant.matmul import linear
    from minite_megatron.modules.linear import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear
    from minite_megatron.recipe import Recipe

    config = tiny_gpt.tiny_config(True)
    init = torch.nn.init.normal_
    strict = dict(recipe=Recipe(precision="bf16", strict=True), precision="bf16")
    col = NVFP4ColumnParallelLinear(64, 48, config=config, init_method=init, bias=True, gather_output=True, **strict)
    row = NVFP4RowParallelLinear(48, 64, config=config, init_method=init, bias=True, input_is_parallel=True,
                                 skip_bias_add=False, **strict)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    h, hb = col(x)
    y, yb = row(h)
    assert hb is None and yb is None
    assert_bitwise_equal(h.detach(), linear(x.detach(), col.weight, col.bias))
    assert_bitwise_equal(y.detach(), linear(h.detach(), row.weight) + row.bias)
    y1, _ = row(col(x[2:3, 1:2])[0])
    assert_bitwise_equal(y1.detach(), y[2:3, 1:2].detach())
    y.square().sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in (col.weight, col.bias, row.weight, x))


# ---- specs and config ----------------------------------------------------------------------------
def test_strict_block_spec_wiring(tiny_gpt):
    """Inspects the built spec without instantiating modules."""
    from minite_megatron.modules.core_attention import StrictDotProductAttention
    from minite_megatron.modules.linear import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear
    from minite_megatron.modules.norm import MiniteNorm

    def strict_norm(spec):
        return spec.func is MiniteNorm and spec.keywords["batch_invariant"]

    def strict_linear(spec, cls):
        return spec.func is cls and spec.keywords["precision"] == "bf16" and spec.keywords["recipe"].strict

    config = tiny_gpt.tiny_config(True, moe_layer_freq=[1, 0])
    block = tiny_gpt.strict_block_spec(config)
    assert strict_norm(block.layer_norm) and len(block.layer_specs) == 2
    moe_layer, dense_layer = (spec.submodules for spec in block.layer_specs)
    attn = moe_layer.self_attention.submodules
    assert attn.core_attention is StrictDotProductAttention
    assert strict_linear(attn.linear_qkv, NVFP4ColumnParallelLinear) and strict_linear(attn.linear_proj, NVFP4RowParallelLinear)
    assert strict_norm(attn.q_layernorm) and strict_norm(moe_layer.input_layernorm)
    moe = moe_layer.mlp
    assert moe.func.__name__ == "StrictMoELayer" and moe.keywords["submodules"].router.__name__ == "StrictTopKRouter"
    experts = moe.keywords["submodules"].experts
    assert experts.func.__name__ == "SequentialMLP"
    assert strict_linear(experts.keywords["submodules"].linear_fc1, NVFP4ColumnParallelLinear)
    assert strict_linear(dense_layer.mlp.keywords["submodules"].linear_fc2, NVFP4RowParallelLinear)


def test_strict_config_errors_and_overrides(tiny_gpt):
    from minite_megatron.strict_config import StrictConfigError, check_strict_config, strict_config_errors

    plain = tiny_gpt.tiny_config(False, attention_dropout=0.1, bias_activation_fusion=True)
    errors = "\n".join(strict_config_errors(plain))
    for field in ("activation_func", "bias_activation_fusion", "attention_dropout"):
        assert field in errors
    with pytest.raises(StrictConfigError):
        check_strict_config(plain)
    check_strict_config(tiny_gpt.tiny_config(True))  # the overrides fix everything
