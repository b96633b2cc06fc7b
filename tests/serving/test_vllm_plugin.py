"""The minite-vllm plugin inside the real vLLM (0.26.0, CPU): registration, config parsing, weights
held bitwise as exported, apply == the contract bitwise (dense and MoE), in-place refit, and stock
vLLM refusing the default export.

Runs in .venv-vllm (scripts/test_vllm.sh); skips where vLLM is not installed (the main .venv).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh runs this in .venv-vllm")

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from minite_megatron import nvfp4  # noqa: E402
from minite_megatron.export import export_modelopt, load_modelopt  # noqa: E402
from minite_megatron.export.modelopt import export_tensors  # noqa: E402
from minite_megatron.recipe import Recipe  # noqa: E402
from minite_megatron.serving import numerics  # noqa: E402
from minite_megatron.serving.refit import refit_vllm_model  # noqa: E402
from minite_megatron.modules.deterministic_moe import deterministic_unpermute  # noqa: E402
from minite_megatron.modules.router import topk_routing  # noqa: E402
from minite_megatron.testing import assert_bitwise_equal  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))
from test_engine_rules import CFG, _amax, _weights  # noqa: E402

HIDDEN, HEADS, KV, HEAD_DIM, EXPERTS, TOPK, FFN, MOE_FFN = 64, 4, 2, 16, 4, 2, 96, 32


@pytest.fixture(scope="module", params=[False, True], ids=["default", "strict"])
def export(request, tmp_path_factory):
    recipe = Recipe(strict=request.param)
    d = tmp_path_factory.mktemp("minite-" + ("strict" if request.param else "default"))
    W = _weights()
    export_modelopt(d, W, CFG, recipe, rope_theta=1e6, max_position_embeddings=64)
    return d, W, recipe


def _quant_config(d):
    from vllm.config import LoadConfig, ModelConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    mc = ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="bfloat16")
    return mc, get_quant_config(mc, LoadConfig())


def test_plugin_registers_through_the_entry_point(vllm_env):
    from importlib.metadata import entry_points

    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from minite_megatron.serving.vllm.config import MiniteNvfp4Config

    assert "minite_megatron.serving.vllm:register" in {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "minite_nvfp4" in QUANTIZATION_METHODS
    assert get_quantization_config("minite_nvfp4") is MiniteNvfp4Config


def test_vllm_parses_the_export_into_our_method(vllm_env, export):
    d, _, recipe = export
    mc, qc = _quant_config(d)
    assert mc.quantization == "minite_nvfp4" and type(qc).__name__ == "MiniteNvfp4Config"
    assert (qc.strict, qc.fp32_router, qc.fp32_lm_head) == (recipe.strict, recipe.fp32_router, recipe.fp32_lm_head)
    assert qc.invariant_routing == (recipe.strict or recipe.aligned_ops)
    assert "lm_head" in qc.exclude and "model.layers.1.mlp.gate" in qc.exclude


def test_stock_vllm_refuses_the_default_export(export, tmp_path):
    """Without the plugin (VLLM_PLUGINS=''), vLLM's own config check refuses minite_nvfp4; vLLM's
    ModelOpt NVFP4 config refuses its quantization_config as well (the stock path never loads it)."""
    import subprocess

    if export[2].strict:
        pytest.skip("the strict export declares the same quantization method: one stock-vLLM process suffices")
    d = export[0]
    code = ("from vllm.config import ModelConfig\n"
            f"ModelConfig(model={str(d)!r}, skip_tokenizer_init=True, dtype='bfloat16')\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "VLLM_PLUGINS": ""},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Unknown quantization method: minite_nvfp4" in r.stderr, r.stderr[-2000:]
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    qc = load_modelopt(d).config["quantization_config"]
    assert ModelOptNvFp4Config.override_quantization_method(qc, None) is None
    with pytest.raises(ValueError, match="ModelOpt currently only supports"):
        ModelOptNvFp4Config.from_config(qc)


@pytest.mark.parametrize("variant,algo", [("modelopt-w4a4-static", "NVFP4"), ("modelopt-w4a16", "W4A16_NVFP4")])
def test_stock_variants_parse_as_what_they_claim(vllm_env, tmp_path, variant, algo):
    """The real vLLM agrees with engine_rules on the stock variants: modelopt_fp4, W4A4 or W4A16."""
    W = _weights()
    kw = {"activation_amax": _amax(W)} if variant == "modelopt-w4a4-static" else {}
    export_modelopt(tmp_path, W, CFG, Recipe(), rope_theta=1e6, max_position_embeddings=64, variant=variant, **kw)
    mc, qc = _quant_config(tmp_path)
    assert mc.quantization == "modelopt_fp4" and qc.quant_method == algo


# ---- layers -------------------------------------------------------------------------------------

def _build_layers(qc):
    """vLLM's own layers of a Qwen3-MoE decoder layer (attention projections, MoE with its gate),
    dense MLP linears and the LM head, with the plugin's methods."""
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from vllm.config import get_current_vllm_config

    cc = get_current_vllm_config().compilation_config  # one MoE layer name per process: rebuilds replace it
    cc.static_forward_context.pop("model.layers.1.mlp.experts", None)
    if "model.layers.1.mlp.experts" in cc.static_all_moe_layers:
        cc.static_all_moe_layers.remove("model.layers.1.mlp.experts")
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = torch.nn.Module()
        m.qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV, bias=False, quant_config=qc,
                                  prefix="model.layers.1.self_attn.qkv_proj")
        m.o = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False, quant_config=qc, prefix="model.layers.1.self_attn.o_proj")
        m.gate_up = MergedColumnParallelLinear(HIDDEN, [FFN, FFN], bias=False, quant_config=qc,
                                               prefix="model.layers.0.mlp.gate_up_proj")
        m.down = RowParallelLinear(FFN, HIDDEN, bias=False, quant_config=qc, prefix="model.layers.0.mlp.down_proj")
        m.gate = ReplicatedLinear(HIDDEN, EXPERTS, bias=False, quant_config=qc, prefix="model.layers.1.mlp.gate")
        m.moe = FusedMoE(num_experts=EXPERTS, top_k=TOPK, hidden_size=HIDDEN, intermediate_size=MOE_FFN,
                         renormalize=True, quant_config=qc, prefix="model.layers.1.mlp.experts", gate=m.gate)
        m.lm_head = ParallelLMHead(128, HIDDEN, quant_config=qc, prefix="lm_head")
    finally:
        torch.set_default_dtype(torch.float32)
    return m


def _load(m, tensors):
    """What Qwen3MoeModel.load_weights does for these layers: the stacked q/k/v and gate/up
    mapping, vLLM's expert mapping, and each parameter's own weight_loader."""
    from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping

    stacked = {"q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"),
               "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1)}
    plain = {"model.layers.1.self_attn.o_proj": "o", "model.layers.0.mlp.down_proj": "down",
             "model.layers.1.mlp.gate": "gate", "lm_head": "lm_head"}
    params = dict(m.named_parameters())
    experts = fused_moe_make_expert_params_mapping(m.moe, "gate_proj", "down_proj", "up_proj", EXPERTS)
    for name, t in tensors:
        module, _, leaf = name.rpartition(".")
        if ".mlp.experts." in name and name.startswith("model.layers.1."):
            for param_name, weight_name, expert_id, shard_id in experts:
                if weight_name in name:
                    mapped = name.replace(weight_name, param_name)  # ...mlp.experts.routed_experts.w13_weight
                    p = params["moe." + mapped.split("mlp.experts.", 1)[1]]
                    p.weight_loader(p, t, mapped, shard_id=shard_id, expert_id=expert_id)
                    break
            continue
        head, _, proj = module.rpartition(".")
        if proj in stacked and (module.startswith("model.layers.1.self_attn") or module.startswith("model.layers.0.mlp")):
            attr, shard = stacked[proj]
            p = params[f"{attr}.{leaf}"]
            p.weight_loader(p, t, shard)
        elif module in plain:
            p = params[f"{plain[module]}.{leaf}"]
            p.weight_loader(p, t)


def _names(tensors):
    keep = ("model.layers.1.self_attn.", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
            "model.layers.0.mlp.down_proj", "model.layers.1.mlp.", "lm_head.")
    return [(n, t) for n, t in tensors.items() if n.startswith(keep) and "_norm" not in n]


@pytest.fixture(scope="module")
def loaded(vllm_env, export):
    d, W, recipe = export
    _, qc = _quant_config(d)
    m = _build_layers(qc)
    ck = load_modelopt(d)
    from safetensors.torch import load_file

    flat = {}
    for f in sorted(d.glob("model-*.safetensors")):
        flat.update(load_file(str(f)))
    _load(m, _names(flat))
    for mod in m.modules():
        method = getattr(mod, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(mod)
    return m, ck, flat, W, recipe


def test_layers_get_the_plugin_methods(loaded):
    m = loaded[0]
    assert type(m.qkv.quant_method).__name__ == "MiniteNvfp4LinearMethod"
    assert type(m.gate.quant_method).__name__ == "MiniteFP32LinearMethod"
    assert type(m.moe.routed_experts.quant_method).__name__ == "MiniteNvfp4MoEMethod"
    want_head = "MiniteFP32LinearMethod" if loaded[4].fp32_lm_head else "MiniteBF16LinearMethod"
    assert type(m.lm_head.quant_method).__name__ == want_head


def test_parameters_hold_exactly_the_exported_bytes(loaded):
    m, _, flat, _, _ = loaded
    p = "model.layers.1.self_attn."
    for leaf in ("weight", "weight_scale"):
        want = torch.cat([flat[f"{p}{x}_proj.{leaf}"] for x in "qkv"])
        assert_bitwise_equal(getattr(m.qkv, leaf).data, want, f"qkv.{leaf}")
    assert_bitwise_equal(m.qkv.weight_scale_2.data, torch.stack([flat[f"{p}{x}_proj.weight_scale_2"] for x in "qkv"]))
    for leaf in ("weight", "weight_scale", "weight_scale_2"):
        assert_bitwise_equal(getattr(m.o, leaf).data.reshape(-1), flat[f"{p}o_proj.{leaf}"].reshape(-1), f"o.{leaf}")
    e = m.moe.routed_experts
    for i in range(EXPERTS):
        x = f"model.layers.1.mlp.experts.{i}."
        assert_bitwise_equal(e.w13_weight.data[i], torch.cat([flat[x + "gate_proj.weight"], flat[x + "up_proj.weight"]]))
        assert_bitwise_equal(e.w13_weight_scale.data[i],
                             torch.cat([flat[x + "gate_proj.weight_scale"], flat[x + "up_proj.weight_scale"]]))
        assert_bitwise_equal(e.w2_weight.data[i], flat[x + "down_proj.weight"])
        assert_bitwise_equal(e.w2_weight_scale.data[i], flat[x + "down_proj.weight_scale"])
        assert_bitwise_equal(e.w13_weight_scale_2.data[i, 0], flat[x + "gate_proj.weight_scale_2"].reshape(()))
        assert_bitwise_equal(e.w2_weight_scale_2.data[i], flat[x + "down_proj.weight_scale_2"].reshape(()))
    assert_bitwise_equal(m.gate.weight.data, flat["model.layers.1.mlp.gate.weight"].to(torch.bfloat16))


def _x(tokens, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    x[0, :16] = 0.0  # a zero block
    x[1] *= 1e3  # a row far from the others: per-token scales
    return x


def test_dense_apply_equals_the_contract_linear_bitwise(loaded):
    """qkv / o_proj / gate_up / down through vLLM's forward == the learner's linear on the learner's
    own quantized weights (the Megatron tensors): quantize(x, per token) then gemm_reference."""
    m, _, _, W, recipe = loaded
    x = _x(7)
    for layer, src, k in ((m.qkv, "decoder.layers.1.self_attention.linear_qkv.weight", HIDDEN),
                          (m.o, "decoder.layers.1.self_attention.linear_proj.weight", HEADS * HEAD_DIM),
                          (m.gate_up, "decoder.layers.0.mlp.linear_fc1.weight", HIDDEN),
                          (m.down, "decoder.layers.0.mlp.linear_fc2.weight", FFN)):
        xi = x if k == HIDDEN else torch.randn(7, k, generator=torch.Generator().manual_seed(k)).bfloat16()
        got, _ = layer(xi)
        from minite_megatron.export.rows import qkv_row_ranges

        qw = W[src]
        want = nvfp4.gemm_reference(nvfp4.quantize(xi, "row", backend="reference"), qw)
        if layer is m.qkv:  # vLLM's q|k|v order vs Megatron's per-group interleave: compare by rows
            r = qkv_row_ranges(HEADS, KV, HEAD_DIM)
            want = torch.cat([want[:, a:b] for part in ("q", "k", "v") for a, b in r[part]], dim=1)
        if layer is m.gate_up:  # vLLM gate|up == Megatron [gate; up]
            pass
        assert_bitwise_equal(got, want, src)


def test_router_and_lm_head_are_fp32_as_the_learner(loaded):
    m, _, flat, W, recipe = loaded
    x = _x(5)
    logits, _ = m.gate(x)
    assert logits.dtype == torch.float32
    w = W["decoder.layers.1.mlp.router.weight"].to(torch.bfloat16)
    # the strict and the aligned router (default mode's aligned_ops) gate with the batch-invariant GEMM
    assert_bitwise_equal(logits, numerics.high_precision_linear(x, w, strict=recipe.strict or recipe.aligned_ops))
    head = m.lm_head.quant_method.apply(m.lm_head, x)
    if recipe.fp32_lm_head:
        assert head.dtype == torch.float32
        assert_bitwise_equal(head[:, :128], numerics.high_precision_linear(x, W["output_layer.weight"], strict=True))


def _contract_moe(x, W, recipe):
    """The learner's MoE block composed by hand from the contract (independent of numerics.py's
    permutation code): the learner's routing (strict top-k, or Megatron's), per expert, per-token
    quantized fc1, SwiGLU, prob in fp32 -> bf16, fc2; rows added per token in increasing expert
    order starting from +0 (the strict combine; ``test_learner_oracle`` compares with the
    learner's own MoE layer)."""
    wr = W["decoder.layers.1.mlp.router.weight"].to(torch.bfloat16)
    logits = numerics.high_precision_linear(x, wr, strict=recipe.strict or recipe.aligned_ops)
    if recipe.strict or recipe.aligned_ops:  # StrictTopKRouter / AlignedTopKRouter
        probs, rmap = topk_routing(logits, TOPK, use_pre_softmax=False)
    else:  # Megatron's TopKRouter in the training forward (grad enabled: sorted top-k)
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        with torch.enable_grad():
            probs, rmap = topk_routing_with_score_function(logits, TOPK, use_pre_softmax=False)
    fc1, fc2 = W["decoder.layers.1.mlp.experts.linear_fc1.weight"], W["decoder.layers.1.mlp.experts.linear_fc2.weight"]
    rows, owners = [], []
    for e in range(EXPERTS):
        tok = rmap[:, e].nonzero().flatten()
        if tok.numel() == 0:
            continue
        h = nvfp4.gemm_reference(nvfp4.quantize(x[tok], "row", backend="reference"), fc1.group(e))
        act = numerics.glu_activation(h, recipe.strict)
        inter = (act * probs[tok, e].unsqueeze(-1)).to(torch.bfloat16)
        rows.append(nvfp4.gemm_reference(nvfp4.quantize(inter, "row", backend="reference"), fc2.group(e)))
        owners.append(tok)
    return deterministic_unpermute(torch.cat(rows), torch.cat(owners), x.shape[0])


def test_moe_apply_equals_the_contract_bitwise(loaded):
    """vLLM's FusedMoE forward (its runner, the gate inside, our monolithic method) == the learner's
    MoE block composed from the contract, bit for bit; and each token's output does not depend on
    the batch (one token alone gives the same bits)."""
    from vllm.forward_context import set_forward_context
    from vllm.config import get_current_vllm_config

    m, _, _, W, recipe = loaded
    x = _x(9)
    with set_forward_context(None, get_current_vllm_config()):
        got = m.moe(x, x)
        one = m.moe(x[3:4], x[3:4])
    assert_bitwise_equal(got, _contract_moe(x, W, recipe), "moe")
    assert_bitwise_equal(one, got[3:4], "moe, one token")


def test_refit_updates_the_bytes_in_place(loaded):
    """A refit with new learner weights (export_tensors, no files) copies into the same storage,
    and the next forward computes with the new weights; the bytes moved are ~0.28x BF16."""
    m, _, _, W, recipe = loaded
    g = torch.Generator().manual_seed(7)
    W2 = dict(W)
    W2["decoder.layers.1.self_attention.linear_proj.weight"] = nvfp4.quantize(
        torch.randn(64, 64, generator=g) * 3, "tensor", (16, 16), backend="reference")
    W2["decoder.layers.1.mlp.experts.linear_fc1.weight"] = nvfp4.quantize(
        torch.randn(4, 64, 64, generator=g), "group", (16, 16), backend="reference")
    tensors = export_tensors(W2, CFG, recipe)
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    stats = refit_vllm_model(m, _names(tensors), load_weights=lambda it: _load(m, it))
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs
    x = _x(6)
    got, _ = m.o(x)
    assert_bitwise_equal(got, nvfp4.gemm_reference(nvfp4.quantize(x, "row", backend="reference"),
                                                   W2["decoder.layers.1.self_attention.linear_proj.weight"]))
    from vllm.forward_context import set_forward_context
    from vllm.config import get_current_vllm_config

    with set_forward_context(None, get_current_vllm_config()):
        assert_bitwise_equal(m.moe(x, x), _contract_moe(x, W2, recipe), "moe after refit")
    assert 0 < stats.ratio_vs_bf16 < 0.5 and stats.tensors == len(_names(tensors))
