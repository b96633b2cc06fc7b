"""The stock engines' rules (vLLM 0.33.0, SGLang 0.5.23) run on every export variant.

Pins issue 10's failure: an export that declared ModelOpt W4A4 NVFP4 with dynamic activations and
wrote no ``input_scale`` loaded into stock vLLM without an error and computed with uninitialised
activation scales. Now the default export is refused by both stock engines, and each stock variant
loads as what it claims.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.export import export_modelopt
from minite_megatron.export.engine_rules import ANCHORS, RULES, sglang_verdict, vllm_verdict
from minite_megatron.recipe import Recipe

CFG = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
    moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2, qk_layernorm=True, gated_linear_unit=True,
    normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
)


def _q(g, *shape, mode="tensor"):
    return nvfp4.quantize(torch.randn(*shape, generator=g), mode, (16, 16), backend="reference")


def _weights():
    """Layer 0 dense MLP, layer 1 MoE (one [E, N, K] tensor per fc, one global scale per expert)."""
    g = torch.Generator().manual_seed(0)
    W = {"embedding.word_embeddings.weight": torch.randn(128, 64, generator=g).bfloat16(),
         "decoder.final_layernorm.weight": torch.rand(64, generator=g).bfloat16(),
         "output_layer.weight": torch.randn(128, 64, generator=g).bfloat16()}
    for i in range(2):
        p = f"decoder.layers.{i}."
        W[p + "input_layernorm.weight"] = torch.rand(64, generator=g)
        W[p + "pre_mlp_layernorm.weight"] = torch.rand(64, generator=g)
        W[p + "self_attention.q_layernorm.weight"] = torch.rand(16, generator=g)
        W[p + "self_attention.k_layernorm.weight"] = torch.rand(16, generator=g)
        W[p + "self_attention.linear_qkv.weight"] = _q(g, 128, 64)
        W[p + "self_attention.linear_proj.weight"] = _q(g, 64, 64)
        if i == 0:
            W[p + "mlp.linear_fc1.weight"] = _q(g, 192, 64)
            W[p + "mlp.linear_fc2.weight"] = _q(g, 64, 96)
        else:
            W[p + "mlp.router.weight"] = torch.randn(4, 64, generator=g)
            W[p + "mlp.experts.linear_fc1.weight"] = _q(g, 4, 64, 64, mode="group")
            W[p + "mlp.experts.linear_fc2.weight"] = _q(g, 4, 64, 32, mode="group")
    return W


def _amax(W):
    return {n: (torch.rand(4) + 1 if v.global_scale == "group" else torch.tensor(2.0))
            for n, v in W.items() if isinstance(v, nvfp4.NVFP4Tensor)}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    W = _weights()
    out = {}
    for variant in ("minite", "modelopt-w4a4-static", "modelopt-w4a16"):
        d = tmp_path_factory.mktemp(variant)
        kw = {"activation_amax": _amax(W)} if variant == "modelopt-w4a4-static" else {}
        export_modelopt(d, W, CFG, Recipe(), rope_theta=1e6, max_position_embeddings=64, variant=variant, **kw)
        out[variant] = d
    return out


def test_default_export_is_refused_by_stock_vllm_and_sglang(exports):
    d = exports["minite"]
    v = vllm_verdict(d)
    assert v.refused and "Unknown quantization method: minite_nvfp4" in v.error
    forced = vllm_verdict(d, user_quantization="modelopt_fp4")  # `--quantization modelopt_fp4` does not help
    assert forced.refused and "does not match" in forced.error
    s = sglang_verdict(d)
    assert s.refused and "Unknown quantization method: minite_nvfp4" in s.error


def test_static_variant_loads_as_w4a4_with_every_scale_present(exports):
    for verdict in (vllm_verdict(exports["modelopt-w4a4-static"]), sglang_verdict(exports["modelopt-w4a4-static"])):
        assert verdict.outcome == "W4A4" and verdict.quant_method == "modelopt_fp4", verdict
        assert verdict.loads_as_declared, verdict.silent
        # the export already wrote each group's max: no engine-side max changes a value
        assert verdict.warnings == [], verdict.warnings


def test_weight_only_variant_loads_as_w4a16_in_both_engines(exports):
    for verdict in (vllm_verdict(exports["modelopt-w4a16"]), sglang_verdict(exports["modelopt-w4a16"])):
        assert verdict.outcome == "W4A16" and verdict.loads_as_declared, verdict


def _rewrite_config(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_the_old_default_was_silently_wrong(exports, tmp_path):
    """Regression (issue 10): ModelOpt W4A4 declared with dynamic activations and no input_scale.
    vLLM allocates the missing scales with torch.empty, SGLang fills 1.0; neither raises."""
    def as_old_default(cfg):
        cfg["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"input_activations": {"dynamic": True, "num_bits": 4, "type": "float",
                                                                "group_size": 16},
                                          "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}}},
        }
    d = _rewrite_config(exports["minite"], tmp_path / "old", as_old_default)
    v, s = vllm_verdict(d), sglang_verdict(d)
    assert v.outcome == s.outcome == "W4A4"
    assert any("uninitialised memory" in m and "V-linear-input-scale" in m for m in v.silent)
    assert any("V-moe-input-scale" in m for m in v.silent)
    assert any("fills 1.0" in m for m in s.silent)
    assert not v.loads_as_declared and not s.loads_as_declared


def test_engines_disagree_on_null_input_activations_under_quant_algo_nvfp4(exports, tmp_path):
    """vLLM serves NVFP4 + null input activations weight-only; SGLang serves it W4A4 with input
    scales of 1.0. The W4A16 variant therefore declares quant_algo W4A16_NVFP4, which both read alike."""
    def as_nvfp4(cfg):
        cfg["quantization_config"]["quant_algo"] = "NVFP4"
    d = _rewrite_config(exports["modelopt-w4a16"], tmp_path / "nvfp4-null", as_nvfp4)
    assert vllm_verdict(d).outcome == "W4A16" and vllm_verdict(d).loads_as_declared
    s = sglang_verdict(d)
    assert s.outcome == "W4A4" and not s.loads_as_declared


def test_every_rule_is_cited_and_used():
    used = set()
    for d in ("V-", "S-"):
        assert any(k.startswith(d) for k in RULES)
    for k, r in RULES.items():
        path, lines = r.where.rsplit(":", 1)
        first, last = map(int, lines.split("-"))
        assert path.endswith(".py") and 0 < first <= last, k
        assert k in ANCHORS, k
        used.add(k)
    assert used == set(ANCHORS)


@pytest.mark.parametrize("engine,env", [("vllm", "MINITE_VLLM_SRC"), ("sglang", "MINITE_SGLANG_SRC")])
def test_citations_match_the_released_sources(engine, env):
    """With MINITE_VLLM_SRC / MINITE_SGLANG_SRC set to the unpacked wheels' package roots
    (``.../vllm``, ``.../sglang/srt``), every cited line range still holds its anchor."""
    root = os.environ.get(env)
    if not root:
        pytest.skip(f"{env} is not set (unpack the {engine} wheel and point it at the package root)")
    for k, r in RULES.items():
        if r.engine != engine:
            continue
        path, lines = r.where.rsplit(":", 1)
        first, last = map(int, lines.split("-"))
        text = "\n".join(Path(root, path).read_text().splitlines()[first - 1 : last])
        assert ANCHORS[k] in text, f"{k}: {r.where} no longer holds {ANCHORS[k]!r}"
