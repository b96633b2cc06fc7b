"""The tracer on a real tiny Megatron-Core GPT (MoE, local spec, one process, gloo world 1).

Two "engines" run the same weights on the same tokens, the second with its batch in another
order (rows are keyed by (sequence, position[, expert]), not by layout) and with one planted
change; the tracer must name exactly the planted point as the first divergence:

(a) router logits in BF16 instead of FP32 (``moe_router_dtype`` None vs ``"fp32"``, BF16 model);
(b) another attention reduction order (keys visited in reverse: same math, other rounding);
(c) one layer's fc2 output moved by one ulp (stands in for a changed rounding in that layer's
    fc2 until the NVFP4 modules carry quantizer capture points).
"""


import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only test (gloo, cpu_compat); GPUs run the same code")

B, S, VOCAB = 3, 16, 128


@pytest.fixture(scope="module")
def megatron():
    from minite_megatron import cpu_compat

    was_active = cpu_compat.is_active()
    cpu_compat.activate()
    import torch.distributed as dist

    from minite_megatron.training.presets import init_single_process

    init_single_process(seed=None)
    assert dist.get_world_size() == 1
    yield
    if not was_active:  # leave the process as we found it for the tests that follow
        cpu_compat.deactivate()


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2,
        normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.float32, moe_token_dispatcher_type="alltoall", bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_router_dtype="fp32",
    )
    base.update(kw)
    return TransformerConfig(**base)


def _gpt(config, core_attention=None, seed=123, recipe=None):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if recipe is not None:  # miniTE's NVFP4 modules (the minite specs)
        from minite_megatron.model import finalize_gpt_model
        from minite_megatron.specs import get_gpt_decoder_block_minite_spec

        spec = get_gpt_decoder_block_minite_spec(config, recipe)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True)
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=S,
                     position_embedding_type="rope")
    if recipe is not None:
        finalize_gpt_model(model, recipe)
    return model.eval()


def _twin(ref, config, core_attention=None, recipe=None):
    model = _gpt(config, core_attention, recipe=recipe)
    model.load_state_dict(ref.state_dict())
    return model


def _run(model, order, engine):
    """Teacher-forced forward of the batch (sequences in ``order``) under a tracer."""
    from minite_megatron.diagnostics import Tracer

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)[list(order)]
    pos = torch.arange(S).unsqueeze(0).expand(B, -1)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
    with Tracer(engine=engine) as tr:
        tr.attach(model)
        tr.set_tokens(torch.tensor(order).view(1, B), pos.t())  # Megatron's [s, b] token grid
        with torch.no_grad():
            model(tokens, pos, mask)
    return tr.trace()


@pytest.fixture(scope="module")
def fp32_ref(megatron):
    model = _gpt(_config())
    return model, _run(model, (0, 1, 2), "learner")


def test_same_model_other_batch_order_is_bitwise_equal(fp32_ref):
    """Alignment on real Megatron: norms, qkv, q/k norms, core attention, router probs and
    routing map, every expert's fc1/fc2 (routed rows keyed by (token, expert)), MoE output, final
    norm and logits all match row for row when the batch is permuted."""
    from minite_megatron.diagnostics import compare_traces

    model, ref = fp32_ref
    cmp = compare_traces(ref, _run(model, (2, 0, 1), "rollout"))
    assert cmp.first_divergence is None
    assert {r.status for r in cmp.results} == {"equal"}
    names = set(ref.order)
    for n in ("embedding.output", "decoder.layers.1.self_attention.core_attention.output",
              "decoder.layers.0.mlp.router.routing_map", "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.output",
              "decoder.final_layernorm.output", "output_layer.output"):
        assert n in names, n
    routed = [r for r in cmp.results if r.kind == "routed"]
    assert routed and sum(r.rows_common for r in routed if "layers.0" in r.name and "fc1" in r.name) == B * S * 2


def test_planted_attention_reduction_order(fp32_ref):
    """(b) Regression: a core attention that visits keys in reverse order (identical math) must be
    named first at layer 0's core attention, nothing before it differing."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from minite_megatron.diagnostics import compare_traces

    class ReversedKeyOrderAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            return super().forward(query, key.flip(0), value.flip(0), attention_mask.flip(-1),
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)

    model, ref = fp32_ref
    other = _twin(model, _config(), ReversedKeyOrderAttention)
    cmp = compare_traces(ref, _run(other, (2, 0, 1), "rollout"))
    assert cmp.first_divergence.name == "decoder.layers.0.self_attention.core_attention.output"
    assert all(r.status == "equal" for r in cmp.results[: cmp.first_divergence.index])
    assert 0 < cmp.first_divergence.max_abs < 1e-4  # a rounding difference, not a bug


def test_planted_fc2_ulp_in_layer_1(fp32_ref):
    """(c) Regression: one ulp on one element of layer 1's expert fc2 outputs must be named
    first at the first of those experts to run, not at the MoE output or the logits."""
    from minite_megatron.diagnostics import compare_traces

    model, ref = fp32_ref
    other = _twin(model, _config())

    def one_ulp(module, args, output):
        out, bias = output
        out = out.clone()
        flat = out.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
        return out, bias

    for expert in other.decoder.layers[1].mlp.experts.local_experts:
        expert.linear_fc2.register_forward_hook(one_ulp)  # before the tracer's hooks: it sees the change
    cmp = compare_traces(ref, _run(other, (2, 0, 1), "rollout"))
    first_fc2 = next(n for n in ref.order if n.startswith("decoder.layers.1.mlp.experts.") and n.endswith("linear_fc2.output"))
    assert cmp.first_divergence.name == first_fc2
    assert cmp.first_divergence.mismatched == 1
    assert all(r.status == "equal" for r in cmp.results[: cmp.first_divergence.index])


def test_planted_bf16_router(megatron):
    """(a) Regression: a BF16 model whose router computes logits in BF16 instead of FP32 must be
    named first at layer 0's router, with the values (not only the dtype) differing."""
    from minite_megatron.diagnostics import compare_traces

    ref_model = _gpt(_config(params_dtype=torch.bfloat16, bf16=True, moe_router_dtype="fp32"))
    other = _twin(ref_model, _config(params_dtype=torch.bfloat16, bf16=True, moe_router_dtype=None))
    ref = _run(ref_model, (0, 1, 2), "learner")
    assert compare_traces(ref, _run(ref_model, (1, 2, 0), "same")).first_divergence is None
    cmp = compare_traces(ref, _run(other, (2, 0, 1), "rollout"))
    fd = cmp.first_divergence
    assert fd.name == "decoder.layers.0.mlp.router.probs"
    assert fd.max_abs > 0 and "dtype differs" in fd.note
    assert all(r.status == "equal" for r in cmp.results[: fd.index])


def test_minite_nvfp4_modules_quantizer_points(megatron):
    """On miniTE's own NVFP4 modules (minite specs, grouped experts): attach names the linears so
    their quantizer codes are captured, grouped-expert codes are keyed by (token, expert) through
    the routed context, a permuted batch is bitwise equal everywhere, and a per-tensor instead of
    per-token activation scale (the batch-dependent choice the recipe avoids) is named first at
    the first NVFP4 quantizer, layer 0's qkv input codes."""
    from minite_megatron.diagnostics import compare_traces
    from minite_megatron.recipe import Recipe

    cfg = _config(moe_grouped_gemm=True)
    model = _gpt(cfg, recipe=Recipe())
    ref = _run(model, (0, 1, 2), "learner")
    assert model.decoder.layers[0].self_attention.linear_qkv.trace_name is None  # reset on exit
    codes = "decoder.layers.1.mlp.experts.linear_fc2.input_codes"
    assert ref[codes].kind == "routed" and ref[codes].rows == B * S * 2
    assert ref["decoder.layers.0.self_attention.linear_qkv.input_codes"].kind == "token"
    same = compare_traces(ref, _run(model, (2, 0, 1), "rollout"))
    assert same.first_divergence is None and {r.status for r in same.results} == {"equal"}

    other = _twin(model, _config(moe_grouped_gemm=True), recipe=Recipe(activation_scale="tensor"))
    cmp = compare_traces(ref, _run(other, (2, 0, 1), "rollout"))
    assert cmp.first_divergence.name == "decoder.layers.0.self_attention.linear_qkv.input_codes"
    assert all(r.status == "equal" for r in cmp.results[: cmp.first_divergence.index])
