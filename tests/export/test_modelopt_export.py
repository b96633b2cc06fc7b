"""ModelOpt NVFP4 export: bitwise round trip, independent dequantization, config content, errors."""

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from minite_megatron import nvfp4
from minite_megatron.export import export_modelopt, load_modelopt
from minite_megatron.export.modelopt import fp32_bits
from minite_megatron.export.rows import fc1_row_ranges, qkv_row_ranges
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal, assert_nvfp4_equal

CFG = dict(
    num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
    moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2, qk_layernorm=True, gated_linear_unit=True,
    normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _qt(g, *shape, scale=1.0, mode="tensor"):
    w = torch.randn(*shape, generator=g) * scale
    w.view(-1)[:16] = 0.0  # a zero block
    w.view(-1)[17] = -1e-6 * scale  # rounds to -0 next to larger values
    return nvfp4.quantize(w, mode, (16, 16), backend="reference")


def _weights(seed=0, bf16_layer0=True):
    """A 3-layer model: layer 0 in BF16 (recipe bf16_first_layers=1) with per-expert names,
    layer 1 NVFP4 with TE-style per-expert weight{e} names, layer 2 NVFP4 with one [E, N, K]
    group tensor per fc and SequentialMLP-style norms."""
    g = torch.Generator().manual_seed(seed)
    W = {
        "embedding.word_embeddings.weight": torch.randn(128, 64, generator=g).bfloat16(),
        "decoder.final_layernorm.weight": torch.rand(64, generator=g).bfloat16(),
        "output_layer.weight": torch.randn(128, 64, generator=g).float(),  # FP32 LM head
    }
    for i in range(3):
        p = f"module.decoder.layers.{i}."  # DDP/Float16Module wrapper prefix is stripped
        W[p + "input_layernorm.weight"] = torch.rand(64, generator=g)
        W[p + "pre_mlp_layernorm.weight"] = torch.rand(64, generator=g)
        W[p + "self_attention.q_layernorm.weight"] = torch.rand(16, generator=g)
        W[p + "self_attention.k_layernorm.weight"] = torch.rand(16, generator=g)
        W[p + "mlp.router.weight"] = torch.randn(4, 64, generator=g)
        if i == 0 and bf16_layer0:
            W[p + "self_attention.linear_qkv.weight"] = torch.randn(128, 64, generator=g).bfloat16()
            W[p + "self_attention.linear_proj.weight"] = torch.randn(64, 64, generator=g).bfloat16()
            for e in range(4):
                W[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.randn(64, 64, generator=g).bfloat16()
                W[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = torch.randn(64, 32, generator=g).bfloat16()
            continue
        W[p + "self_attention.linear_qkv.weight"] = _qt(g, 128, 64, scale=0.02)
        W[p + "self_attention.linear_proj.weight"] = _qt(g, 64, 64, scale=3.0)
        if i == 1:
            for e in range(4):
                W[p + f"mlp.experts.linear_fc1.weight{e}"] = _qt(g, 64, 64, scale=10.0 ** (e - 2))
                W[p + f"mlp.experts.linear_fc2.weight{e}"] = _qt(g, 64, 32)
        else:
            W[p + "mlp.experts.linear_fc1.weight"] = _qt(g, 4, 64, 64, mode="group")
            W[p + "mlp.experts.linear_fc2.weight"] = _qt(g, 4, 64, 32, mode="group")
    return W


def _strip(name):
    return name.removeprefix("module.")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    W = _weights()
    recipe = Recipe(bf16_first_layers=1)
    res = export_modelopt(out, W, CFG, recipe, rope_theta=1e6, max_position_embeddings=4096, max_shard_bytes=20_000)
    return out, W, recipe, res


def test_megatron_roundtrip_is_bitwise(exported):
    """Export -> load -> Megatron names: every NVFP4 weight (codes, block scales, global scale)
    and every high-precision tensor equals the learner's, bit for bit."""
    out, W, _, _ = exported
    back = load_modelopt(out).to_megatron()
    assert set(back) == {_strip(n) for n in W}
    for n, v in W.items():
        if isinstance(v, nvfp4.NVFP4Tensor):
            assert_nvfp4_equal(back[_strip(n)], v, n)
        else:
            assert_bitwise_equal(back[_strip(n)], v, n)


def _independent_dequant(codes, scales, s2):
    """What an inference engine does with the three ModelOpt tensors (written from the format
    description, not from miniTE's code): LUT(code) * fp32(scale) * weight_scale_2."""
    lo, hi = (codes & 0xF).long(), (codes >> 4).long()
    vals = E2M1[torch.stack([lo, hi], -1).reshape(codes.shape[0], -1)]
    sf = scales.float().repeat_interleave(16, dim=1)
    return vals * sf * s2.float()


def test_dequantized_exported_weights_equal_the_learners_quantized_weights(exported):
    """Regression for the issue's acceptance test: the dequantized exported weights equal the
    learner's quantized weights bitwise, module by module, through the fused-layer splits."""
    out, W, _, res = exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    flat = {}
    for f in sorted(set(index["weight_map"].values())):
        flat.update(load_file(str(out / f)))
    d = dict(heads=4, groups=2, head_dim=16)
    checked = 0
    for module, meta in res.modules.items():
        if not meta["quantized"]:
            continue
        src = W["module." + meta["source"]] if "module." + meta["source"] in W else W[meta["source"]]
        dense = src.dequantize()
        if "expert" in meta and src.global_scale == "group":
            dense = dense[meta["expert"]]
        want = torch.cat([dense[a:b] for a, b in meta["rows"]])
        got = _independent_dequant(flat[f"{module}.weight"], flat[f"{module}.weight_scale"], flat[f"{module}.weight_scale_2"])
        assert_bitwise_equal(got, want, module)
        assert flat[f"{module}.weight"].dtype == torch.uint8
        assert flat[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
        assert flat[f"{module}.weight_scale_2"].dtype == torch.float32 and flat[f"{module}.weight_scale_2"].shape == ()
        checked += 1
    # layers 1-2: q,k,v,o + 4 experts x (gate, up, down)
    assert checked == 2 * (4 + 4 * 3)
    r = qkv_row_ranges(**{"num_heads": d["heads"], "num_groups": d["groups"], "head_dim": d["head_dim"]})
    assert res.modules["model.layers.1.self_attn.k_proj"]["rows"] == [list(x) for x in r["k"]]
    assert res.modules["model.layers.2.mlp.experts.3.up_proj"]["rows"] == [list(x) for x in fc1_row_ranges(32)["up"]]
    # fused pieces share one weight_scale_2 (what vLLM/SGLang expect of fused layers)
    for i in (1, 2):
        bits = {res.modules[f"model.layers.{i}.self_attn.{p}_proj"]["weight_scale_2_bits"] for p in "qkv"}
        assert len(bits) == 1


def test_loader_dequantized_state_dict(exported):
    out, W, _, _ = exported
    ck = load_modelopt(out)
    sd = ck.dequantized_state_dict()
    assert_bitwise_equal(sd["model.layers.2.mlp.experts.1.down_proj.weight"],
                         W["module.decoder.layers.2.mlp.experts.linear_fc2.weight"].dequantize()[1])
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # BF16 layer kept as is
    assert_bitwise_equal(sd["lm_head.weight"], W["output_layer.weight"])
    assert_bitwise_equal(sd["model.layers.1.mlp.gate.weight"], W["module.decoder.layers.1.mlp.router.weight"])
    assert len(sd) == len(ck.tensors) + len(ck.quantized)


def test_config_names_the_recipe_and_the_quantization_fields(exported):
    """The default export declares miniTE's own method (stock engines refuse it: tests/export/
    test_engine_rules.py) and writes no ModelOpt declaration at all (no hf_quant_config.json)."""
    out, _, recipe, res = exported
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == res.config
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 32)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (2, 16, 128)
    assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == [] and cfg["tie_word_embeddings"] is False
    assert cfg["torch_dtype"] == "bfloat16"
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("minite_nvfp4", "NVFP4_W4A4_PER_TOKEN", 16)
    assert qc["input_activations"]["global_scale"] == "per_token" and qc["weights"]["tiles"] == [[16, 16]]
    assert not (out / "hf_quant_config.json").exists()
    mini = cfg["minite"]
    assert mini["variant"] == "minite" and mini["serves_learner_policy"] is True and mini["different_model"] is None
    assert mini["recipe_class"] == "minite_megatron.recipe.Recipe"
    assert mini["recipe"] == recipe.to_dict() and mini["recipe"]["bf16_first_layers"] == 1
    assert mini["activations"]["global_scale"] == "per_token"
    assert "absent" in mini["activations"]["input_scale"]
    assert mini["weights"]["tiles"] == [[16, 16]]
    # layer 0 is BF16 (excluded, whole MoE too), routers and the LM head stay high precision
    ignore = set(qc["ignore"])
    assert {"lm_head", "model.layers.0.mlp.experts", "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.v_proj", "model.layers.2.mlp.gate"} <= ignore
    assert not any(m.startswith(("model.layers.1.self_attn", "model.layers.2.mlp.experts")) for m in ignore)
    quant = json.loads((out / "minite_quant.json").read_text())
    m = quant["modules"]["model.layers.1.mlp.experts.0.gate_proj"]
    assert m["source"] == "decoder.layers.1.mlp.experts.linear_fc1.weight0" and m["tile"] == [16, 16]
    assert quant["tensors"]["model.layers.1.mlp.gate.weight"] == "decoder.layers.1.mlp.router.weight"


def test_sharding_and_index(exported):
    out, _, _, res = exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    total = 0
    for f in files:
        part = load_file(str(out / f))
        assert all(index["weight_map"][k] == f for k in part)
        total += sum(t.numel() * t.element_size() for t in part.values())
    assert total == index["metadata"]["total_size"]


def test_static_input_scales_and_alpha(tmp_path):
    """variant='modelopt-w4a4-static': input_scale is the contract's S_dec of the max amax over a MoE
    layer's experts (and over a fused linear's pieces), the one value vLLM / SGLang compute with; the
    recorded alpha is fp32(input_scale * weight_scale_2), the product their kernels apply."""
    W = _weights(bf16_layer0=False)
    amax = {}
    for n, v in W.items():
        if isinstance(v, nvfp4.NVFP4Tensor):
            amax[n] = torch.rand(4) * 10 + 1 if v.global_scale == "group" else torch.tensor(3.5)
    res = export_modelopt(tmp_path, W, CFG, Recipe(), rope_theta=1e6, max_position_embeddings=64, activation_amax=amax,
                          variant="modelopt-w4a4-static")
    ck = load_modelopt(tmp_path)
    assert ck.variant == "modelopt-w4a4-static"
    meta = res.modules["model.layers.2.mlp.experts.3.down_proj"]
    fc2_amax = amax["module.decoder.layers.2.mlp.experts.linear_fc2.weight"]
    _, s_dec = nvfp4.global_scales(fc2_amax.max().reshape(1))
    for e in range(4):
        assert_bitwise_equal(ck.input_scales[f"model.layers.2.mlp.experts.{e}.down_proj"], s_dec.reshape(()))
    assert meta["input_amax"] == float(fc2_amax[3]) and meta["input_amax_used"] == float(fc2_amax.max())
    s2 = ck.quantized["model.layers.2.mlp.experts.3.down_proj"].global_decode
    assert meta["alpha_bits"] == fp32_bits(s_dec * s2)
    qkv = {fp32_bits(ck.input_scales[f"model.layers.1.self_attn.{p}_proj"]) for p in "qkv"}
    assert len(qkv) == 1  # one activation feeds q, k and v
    qc = res.config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "NVFP4")
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    assert res.config["minite"]["serves_learner_policy"] is False and "NOT the learner" in res.config["minite"]["different_model"]
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert hq["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                  "exclude_modules": qc["ignore"]}
    with pytest.raises(ValueError, match="activation_amax has no entry"):
        export_modelopt(tmp_path / "x", W, CFG, Recipe(), rope_theta=1e6, max_position_embeddings=64,
                        activation_amax={"decoder.layers.1.self_attention.linear_proj.weight": torch.tensor(1.0)},
                        variant="modelopt-w4a4-static")
    with pytest.raises(ValueError, match="variant='modelopt-w4a4-static' and only"):
        export_modelopt(tmp_path / "y", W, CFG, Recipe(), rope_theta=1e6, max_position_embeddings=64, activation_amax=amax)
    with pytest.raises(ValueError, match="variant='modelopt-w4a4-static' and only"):
        export_modelopt(tmp_path / "z", W, CFG, Recipe(), rope_theta=1e6, max_position_embeddings=64,
                        variant="modelopt-w4a4-static")


def test_weight_only_variant(tmp_path):
    """variant='modelopt-w4a16': the same weight bytes, declared W4A16_NVFP4 with null input
    activations (what both vLLM and SGLang read as weight-only), no input_scale, marked as a
    different model."""
    W = _weights()
    res = export_modelopt(tmp_path, W, CFG, Recipe(bf16_first_layers=1), rope_theta=1e6, max_position_embeddings=64,
                          variant="modelopt-w4a16")
    qc = res.config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "W4A16_NVFP4")
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    assert "weight-only" in res.config["minite"]["different_model"]
    ck = load_modelopt(tmp_path)
    assert ck.input_scales == {} and ck.variant == "modelopt-w4a16"
    for n, v in W.items():
        if isinstance(v, nvfp4.NVFP4Tensor):
            assert_nvfp4_equal(ck.to_megatron()[_strip(n)], v, n)
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W4A16_NVFP4"


@dataclass
class OtherRecipe:
    activation_scale: str = "row"
    knob: tuple = (1, 2)


def test_dense_model_and_any_dataclass_recipe(tmp_path):
    """A dense Qwen3 (no experts, tied embeddings) exports with a recipe of another class."""
    g = torch.Generator().manual_seed(1)
    cfg = dict(CFG, num_moe_experts=None, num_layers=1, qk_layernorm=False)
    W = {"embedding.word_embeddings.weight": torch.randn(128, 64, generator=g),
         "decoder.final_layernorm.weight": torch.ones(64),
         "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.ones(64),  # TE spec names
         "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": torch.ones(64),
         "decoder.layers.0.self_attention.linear_qkv.weight": _qt(g, 128, 64),
         "decoder.layers.0.self_attention.linear_proj.weight": _qt(g, 64, 64),
         "decoder.layers.0.mlp.linear_fc1.weight": _qt(g, 192, 64),
         "decoder.layers.0.mlp.linear_fc2.weight": _qt(g, 64, 96)}
    res = export_modelopt(tmp_path, W, cfg, OtherRecipe(), rope_theta=5e5, max_position_embeddings=64)
    assert res.config["architectures"] == ["Qwen3ForCausalLM"] and res.config["tie_word_embeddings"] is True
    assert res.config["minite"]["recipe"] == {"activation_scale": "row", "knob": [1, 2]}
    assert res.config["minite"]["recipe_class"].endswith("OtherRecipe")
    assert res.exclude_modules == []
    back = load_modelopt(tmp_path).to_megatron()
    assert_nvfp4_equal(back["decoder.layers.0.mlp.linear_fc1.weight"], W["decoder.layers.0.mlp.linear_fc1.weight"])


def _export(tmp_path, W, cfg=CFG, **kw):
    return export_modelopt(tmp_path, W, cfg, Recipe(), rope_theta=1e6, max_position_embeddings=64, **kw)


def test_bad_inputs_raise(tmp_path):
    W = _weights()
    with pytest.raises(ValueError, match="no Qwen3/Qwen3-MoE place"):
        _export(tmp_path, {**W, "decoder.layers.0.self_attention.linear_qkv.bias": torch.zeros(128)})
    with pytest.raises(ValueError, match="missing"):
        _export(tmp_path, {k: v for k, v in W.items() if "layers.2.self_attention.linear_proj" not in k})
    with pytest.raises(ValueError, match="missing.*experts"):
        _export(tmp_path, {k: v for k, v in W.items() if "experts.linear_fc2.weight3" not in k})
    with pytest.raises(ValueError, match="high-precision tensor"):
        _export(tmp_path, {**W, "module.decoder.layers.1.mlp.router.weight": nvfp4.quantize(torch.randn(16, 64), "tensor", (16, 16))})
    with pytest.raises(ValueError, match="shape"):
        _export(tmp_path, W, dict(CFG, kv_channels=32))
    with pytest.raises(ValueError, match="not representable"):
        _export(tmp_path, W, dict(CFG, moe_router_score_function="sigmoid", add_bias_linear=True))
    mixed = dict(W)
    mixed["module.decoder.layers.1.mlp.experts.linear_fc1.weight2"] = torch.randn(64, 64)
    with pytest.raises(ValueError, match="mixes quantized and high-precision experts"):
        _export(tmp_path, mixed)
    nan = dict(W)
    bad = torch.randn(64, 64)
    bad[3, 3] = float("nan")
    nan["module.decoder.layers.1.self_attention.linear_proj.weight"] = nvfp4.quantize(bad, "tensor", (16, 16), backend="reference")
    with pytest.raises(ValueError, match="non-finite"):
        _export(tmp_path, nan)
    with pytest.raises(TypeError, match="recipe"):
        export_modelopt(tmp_path, W, CFG, object(), rope_theta=1.0, max_position_embeddings=1)
    with pytest.raises(ValueError, match="qk_layernorm"):
        _export(tmp_path, W, dict(CFG, qk_layernorm=False))


def test_loader_rejects_tampered_files(exported, tmp_path):
    import shutil

    src, _, _, _ = exported
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    quant = json.loads((dst / "minite_quant.json").read_text())
    quant["modules"]["model.layers.1.self_attn.o_proj"]["weight_scale_2_bits"] = "0x3f800000"
    (dst / "minite_quant.json").write_text(json.dumps(quant))
    with pytest.raises(ValueError, match="weight_scale_2 bits"):
        load_modelopt(dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["quant_algo"] = "FP8"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a miniTE NVFP4 or ModelOpt NVFP4 checkpoint"):
        load_modelopt(dst)
