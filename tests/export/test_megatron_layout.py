"""The export's Megatron -> HF layout checked against a real tiny Megatron-Core GPT (MoE, local spec).

The row maps (q/k/v interleaved per query group inside ``linear_qkv``; ``[gate; up]`` inside
``linear_fc1``) are checked against what Megatron's own forward computes: HF q_proj/k_proj/v_proj
applied to the qkv input must give the query/key/value Megatron splits out, and
``silu(gate(x)) * up(x)`` (times the router prob Megatron folds into the expert activation)
must give each expert's fc2 input. These compare two fp32 matmuls of
different shapes, hence a tolerance (1e-5 relative): a layout error is O(1). Then the model's own
state dict (quantized linears, real ``TransformerConfig``) goes through export and load bitwise.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only test (gloo, cpu_compat)")


@pytest.fixture(scope="module")
def model_and_config():
    from minite_megatron import cpu_compat

    was_active = cpu_compat.is_active()
    cpu_compat.activate()
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from minite_megatron.training.presets import init_single_process

    init_single_process(seed=None)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2,
        normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, use_cpu_initialization=True,
        moe_token_dispatcher_type="alltoall", bias_activation_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, moe_router_dtype="fp32", moe_aux_loss_coeff=0.01,
    )
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16,
                     position_embedding_type="rope").eval()
    yield model, cfg
    if not was_active:
        cpu_compat.deactivate()


def test_row_maps_match_megatrons_forward(model_and_config):
    from minite_megatron.export.rows import fc1_row_ranges, qkv_row_ranges

    model, cfg = model_and_config
    layer = model.decoder.layers[1]
    seen = {}

    def keep(key, idx=0):
        def pre(module, args):
            seen[key] = args[idx].detach().clone()
        return pre

    hooks = [
        layer.self_attention.linear_qkv.register_forward_pre_hook(keep("x")),
        layer.self_attention.q_layernorm.register_forward_pre_hook(keep("q")),
        layer.self_attention.k_layernorm.register_forward_pre_hook(keep("k")),
        layer.self_attention.core_attention.register_forward_pre_hook(keep("v", 2)),
    ]
    for e, ex in enumerate(layer.mlp.experts.local_experts):
        hooks.append(ex.register_forward_pre_hook(keep(f"p{e}", 1)))  # expert(tokens, router probs)
        hooks.append(ex.linear_fc1.register_forward_pre_hook(keep(f"x{e}")))
        hooks.append(ex.linear_fc2.register_forward_pre_hook(keep(f"h{e}")))
    s, b = 12, 2
    tokens = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens, torch.arange(s).expand(b, s), torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s))
    for h in hooks:
        h.remove()

    w = layer.self_attention.linear_qkv.weight.detach()
    r = qkv_row_ranges(cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels)
    x = seen["x"]  # [s, b, h]
    for part, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_query_groups), ("v", cfg.num_query_groups)):
        wp = torch.cat([w[a0:a1] for a0, a1 in r[part]])
        hf_out = (x @ wp.t()).view(s, b, heads, cfg.kv_channels)
        torch.testing.assert_close(hf_out, seen[part], rtol=1e-5, atol=1e-6, msg=f"{part}_proj layout")
    naive_q = w[: cfg.num_attention_heads * cfg.kv_channels]  # a non-interleaved split: must not match
    assert not torch.allclose((x @ naive_q.t()).view_as(seen["q"]), seen["q"], rtol=1e-3, atol=1e-4)

    rr = fc1_row_ranges(cfg.moe_ffn_hidden_size)
    checked = 0
    for e, ex in enumerate(layer.mlp.experts.local_experts):
        if f"x{e}" not in seen or seen[f"x{e}"].shape[0] == 0:
            continue
        w1 = ex.linear_fc1.weight.detach()
        gate = torch.cat([w1[a0:a1] for a0, a1 in rr["gate"]])
        up = torch.cat([w1[a0:a1] for a0, a1 in rr["up"]])
        xe = seen[f"x{e}"]
        # Megatron scales the expert activation by the token's router prob (per_token_scale)
        hf_act = torch.nn.functional.silu(xe @ gate.t()) * (xe @ up.t()) * seen[f"p{e}"].unsqueeze(-1)
        torch.testing.assert_close(hf_act, seen[f"h{e}"], rtol=1e-5, atol=1e-6, msg=f"expert {e} gate/up layout")
        swapped = torch.nn.functional.silu(xe @ up.t()) * (xe @ gate.t()) * seen[f"p{e}"].unsqueeze(-1)
        assert not torch.allclose(swapped, seen[f"h{e}"], rtol=1e-3, atol=1e-4)  # the check can tell them apart
        checked += 1
    assert checked >= 2


def test_megatron_state_dict_exports_and_loads_bitwise(model_and_config, tmp_path):
    from minite_megatron import nvfp4
    from minite_megatron.export import export_modelopt, load_modelopt
    from minite_megatron.recipe import Recipe
    from minite_megatron.testing import assert_bitwise_equal, assert_nvfp4_equal

    model, cfg = model_and_config
    sd = {}
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor) and k.endswith(".weight") and ("linear_" in k):
            sd[k] = nvfp4.quantize(v.detach(), "tensor", (16, 16), backend="reference")
        else:
            sd[k] = v  # norms, router, embeddings, LM head (high precision) and None _extra_state
    res = export_modelopt(tmp_path, sd, cfg, Recipe(), rope_theta=10000.0, max_position_embeddings=16)
    assert res.config["rms_norm_eps"] == cfg.layernorm_epsilon
    assert res.config["router_aux_loss_coef"] == 0.01 and res.config["norm_topk_prob"] is True
    back = load_modelopt(tmp_path).to_megatron()
    weights = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    assert set(back) == set(weights)
    for k, v in weights.items():
        if isinstance(v, nvfp4.NVFP4Tensor):
            assert_nvfp4_equal(back[k], v, k)
        else:
            assert_bitwise_equal(back[k], v, k)
