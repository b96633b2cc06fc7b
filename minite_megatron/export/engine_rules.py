"""What stock vLLM 0.33.0 and SGLang 0.5.23 do with an NVFP4 checkpoint directory: the rules, each
citing the upstream file and lines it mirrors (read from the released wheels,
``vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl`` and ``sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl``).

:func:`vllm_verdict` / :func:`sglang_verdict` read an export (``config.json``, the legacy
``hf_quant_config.json``, the safetensors headers and the scalar scales) and say what the engine
would do: refuse it (with the engine's own error), or load it as ``"W4A4"`` or ``"W4A16"``, with the
problems it would *not* report (``silent``: tensors it allocates with ``torch.empty`` or fills with
a default when the checkpoint lacks them, scales it replaces by another piece's) and the warnings it
would log. A checkpoint is served as what it claims when :attr:`EngineVerdict.loads_as_declared`.

The rules are data (:data:`RULES`, one per upstream behaviour) so a test can walk them; the
engines are not imported (they pin torch 2.14; this module runs in the project's environment).
Paths are relative to the package roots ``vllm/`` and ``sglang/srt/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class Rule:
    """One upstream behaviour: ``where`` is ``file:first-last`` in the engine's release."""

    engine: str
    where: str
    what: str


_V = "vllm"
_S = "sglang"
_VMO = "model_executor/layers/quantization/modelopt.py"
_SMO = "layers/quantization/modelopt_quant.py"

RULES: dict[str, Rule] = {
    # ---- vLLM 0.33.0: which config, which method ------------------------------------------------
    "V-config-source": Rule(_V, "transformers_utils/config.py:951-962",
        "config.json's quantization_config is used; hf_quant_config.json only when config.json has none"),
    "V-normalize": Rule(_V, "transformers_utils/model_arch_config_convertor.py:241-283",
        "quant_method is lower-cased (a legacy file's quant_method is set only for producer 'modelopt')"),
    "V-override": Rule(_V, f"{_VMO}:776-783",
        "quant_method starting with 'modelopt' and a quant_algo containing 'NVFP4'/'FP4' selects modelopt_fp4"),
    "V-unknown-method": Rule(_V, "config/model.py:1453-1469",
        "a quant_method that no override claims and that is not registered: ValueError 'Unknown quantization "
        "method' (a --quantization that differs from the checkpoint's: 'does not match')"),
    "V-algo": Rule(_V, f"{_VMO}:362-401",
        "quant_algo (upper-cased) must be one of FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, NVFP4, W4A16_NVFP4, "
        "MXFP8, MIXED_PRECISION"),
    "V-w4a16-select": Rule(_V, f"{_VMO}:797-811",
        "quant_algo NVFP4 with input_activations null in every config group is served as W4A16_NVFP4"),
    "V-legacy-fields": Rule(_V, f"{_VMO}:817-828",
        "the nested (hf_quant_config.json) form needs group_size, kv_cache_quant_algo and exclude_modules"),
    "V-no-missing-check": Rule(_V, "model_executor/model_loader/default_loader.py:511-514",
        "the loader checks for tensors absent from the checkpoint only for unquantized models"),
    # ---- vLLM 0.33.0: linear tensors --------------------------------------------------------------
    "V-linear-weight": Rule(_V, f"{_VMO}:2023-2066",
        "NVFP4 linear: weight uint8 [N, K/2], weight_scale_2 fp32 per fused piece (torch.empty), weight_scale "
        "e4m3 [N, K/16] (NaN-initialised); K a multiple of 16"),
    "V-linear-weight-loaded": Rule(_V, f"{_VMO}:2068-2083",
        "a weight_scale still NaN after loading raises RuntimeError"),
    "V-linear-scale2-max": Rule(_V, f"{_VMO}:2085-2095",
        "weight_scale_2 of fused pieces (q/k/v, gate/up): the max is used for all pieces (a warning if they differ)"),
    "V-linear-input-scale": Rule(_V, f"{_VMO}:2104-2115",
        "W4A4 linear: input_scale fp32 per fused piece, torch.empty (an absent one is uninitialised memory)"),
    "V-linear-input-max": Rule(_V, f"{_VMO}:2116-2133",
        "input_scale of fused pieces: the max is used (a warning if they differ); activations are encoded with "
        "1 / input_scale"),
    "V-alpha": Rule(_V, f"{_VMO}:2411-2419", "alpha = input_global_scale * weight_global_scale (one per linear)"),
    "V-w4a16-drops-input": Rule(_V, f"{_VMO}:2756-2759", "W4A16: no activation quantization; input_scale is dropped"),
    # ---- vLLM 0.33.0: fused MoE -------------------------------------------------------------------
    "V-moe-weights": Rule(_V, f"{_VMO}:912-1004",
        "fused MoE: w13/w2 weight uint8, weight_scale e4m3, w13_weight_scale_2 [E, 2] and w2_weight_scale_2 [E] "
        "fp32 (torch.empty)"),
    "V-moe-input-scale": Rule(_V, f"{_VMO}:1008-1026",
        "W4A4 MoE: w13_input_scale [E, 2] and w2_input_scale [E], torch.empty (absent: uninitialised)"),
    "V-moe-gate-up-scale2": Rule(_V, f"{_VMO}:1055-1063",
        "w13: the gate's weight_scale_2 is used for gate and up (a warning if up's differs)"),
    "V-moe-input-max": Rule(_V, "model_executor/layers/quantization/utils/flashinfer_fp4_moe.py:386-397",
        "MoE input scales: one value, the max over experts (global-scale backends) or over gate/up"),
    # ---- SGLang 0.5.23 ----------------------------------------------------------------------------
    "S-config-source": Rule(_S, "configs/model_config.py:1727-1820",
        "config.json's quantization_config (ModelOpt-parsed when quant_method is absent or 'modelopt'); "
        "hf_quant_config.json only when config.json has none"),
    "S-parse": Rule(_S, "configs/model_config.py:1838-1867",
        "a ModelOpt quant_algo containing 'FP4'/'NVFP4' selects modelopt_fp4"),
    "S-unknown-method": Rule(_S, "configs/model_config.py:2150-2155",
        "a quant_method that is not in QUANTIZATION_METHODS: ValueError 'Unknown quantization method'"),
    "S-algo": Rule(_S, f"{_SMO}:1673-1680", "quant_algo must be one of FP8, NVFP4, NVFP4_AWQ, W4A16_NVFP4"),
    "S-fields": Rule(_S, f"{_SMO}:1682-1693", "group_size and exclude_modules / ignore are required"),
    "S-w4a16-select": Rule(_S, f"{_SMO}:1694-1701",
        "weight-only only for quant_algo W4A16_NVFP4 (NVFP4 is W4A4 whatever input_activations says)"),
    "S-linear-input-scale": Rule(_S, f"{_SMO}:1846-1852",
        "W4A4 linear: input_scale filled with 1.0 (an absent one silently means activations encoded with scale 1)"),
    "S-linear-max": Rule(_S, f"{_SMO}:1886-1913",
        "max over fused pieces of input_scale and weight_scale_2; alpha = input_scale * weight_scale_2"),
    "S-w4a16-drops-input": Rule(_S, f"{_SMO}:2259-2284", "W4A16 linear: input_scale deleted, weight_scale_2 maxed"),
    "S-moe-input-scale": Rule(_S, f"{_SMO}:2633-2648", "W4A4 MoE: w13/w2_input_scale filled with 1.0 when absent"),
    "S-moe-gate-up-scale2": Rule(_S, f"{_SMO}:2745-2753", "w13: gate and up weight_scale_2 should match (a warning)"),
    "S-moe-input-max": Rule(_S, f"{_SMO}:2769-2776", "MoE input scales: the max over experts"),
}

# A string each cited range contains (tests/export/test_engine_rules.py checks them against the
# released sources when MINITE_VLLM_SRC / MINITE_SGLANG_SRC point at the unpacked wheels).
ANCHORS: dict[str, str] = {
    "V-config-source": 'if quantization_config is None and file_or_path_exists(',
    "V-normalize": 'quant_cfg["quant_method"] = quant_method',
    "V-override": 'return "modelopt_fp4"',
    "V-unknown-method": "Unknown quantization method",
    "V-algo": "if quant_method not in QUANT_ALGOS:",
    "V-w4a16-select": 'quant_method = "W4A16_NVFP4"',
    "V-legacy-fields": 'required_fields = ["group_size", "kv_cache_quant_algo", "exclude_modules"]',
    "V-no-missing-check": "model_config.quantization is None and loaded_weights is not None",
    "V-linear-weight": 'init=float("nan")',
    "V-linear-weight-loaded": "was never loaded",
    "V-linear-scale2-max": "weight_global_scale = layer.weight_scale_2.max()",
    "V-linear-input-scale": '"input_scale",',
    "V-linear-input-max": "input_global_scale = layer.input_scale.max()",
    "V-alpha": "layer.input_global_scale * layer.weight_global_scale",
    "V-w4a16-drops-input": "activation=None), ctx, _DROP_INPUT_SCALE",
    "V-moe-weights": "w13_weight_scale_2 = PerTensorScaleParameter(",
    "V-moe-input-scale": "w13_input_scale = PerTensorScaleParameter(",
    "V-moe-gate-up-scale2": "w13_weight_scale_2 = layer.w13_weight_scale_2[:, 0].contiguous()",
    "V-moe-input-max": "a13_scale = a13_scale.max(dim=1).values",
    "S-config-source": '"hf_quant_config.json"',
    "S-parse": 'return {"quant_method": "modelopt_fp4", "quant_algo": quant_algo}',
    "S-unknown-method": "Unknown quantization method",
    "S-algo": 'if quant_method not in ["FP8", "NVFP4", "NVFP4_AWQ", "W4A16_NVFP4"]:',
    "S-fields": "if group_size is None or exclude_modules is None:",
    "S-w4a16-select": 'quant_config.is_w4a16 = quant_method == "W4A16_NVFP4"',
    "S-linear-input-scale": "fill_value=1.0,",
    "S-linear-max": "input_scale_2 = layer.input_scale.max().to(torch.float32)",
    "S-w4a16-drops-input": "del layer.input_scale",
    "S-moe-input-scale": "input_scale_fill = 1.0 if not is_nvfp4_online else None",
    "S-moe-gate-up-scale2": "w13_weight_scale_2 = layer.w13_weight_scale_2",
    "S-moe-input-max": "w13_input_scale = layer.w13_input_scale.max().to(torch.float32)",
}

VLLM_QUANTIZATION_METHODS = (  # vllm/model_executor/layers/quantization/__init__.py:15-50 (0.33.0)
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online",
    "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
)
VLLM_MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION")
SGLANG_MODELOPT_FP4_ALGOS = ("FP8", "NVFP4", "NVFP4_AWQ", "W4A16_NVFP4")


@dataclass
class EngineVerdict:
    """What one engine does with a checkpoint (module docstring)."""

    engine: str
    outcome: str  # "refused" | "W4A4" | "W4A16"
    quant_method: str | None = None
    error: str | None = None
    silent: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)

    @property
    def refused(self) -> bool:
        return self.outcome == "refused"

    @property
    def loads_as_declared(self) -> bool:
        """Loads, and computes with exactly the checkpoint's tensors (nothing silent)."""
        return not self.refused and not self.silent


class _Checkpoint:
    """The parts of an export directory the engines look at (config files, tensor headers)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        self.config = json.loads((self.path / "config.json").read_text())
        legacy = self.path / "hf_quant_config.json"
        self.legacy = json.loads(legacy.read_text()) if legacy.exists() else None
        index = json.loads((self.path / "model.safetensors.index.json").read_text())
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.scalars: dict[str, list[float]] = {}
        for fname in sorted(set(index["weight_map"].values())):
            with safe_open(str(self.path / fname), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    self.meta[name] = (sl.get_dtype(), tuple(sl.get_shape()))
                    if name.endswith(("weight_scale_2", "input_scale")):
                        self.scalars[name] = [float(v) for v in f.get_tensor(name).float().reshape(-1)]

    def quantized_modules(self) -> list[str]:
        return sorted(n[: -len(".weight")] for n, (dt, _) in self.meta.items() if n.endswith(".weight") and dt == "U8")


def _fused_groups(modules: list[str]) -> dict[str, list[str]]:
    """Engine-side fused linears: q/k/v -> qkv_proj, dense gate/up -> gate_up_proj; the rest alone.
    Routed experts are grouped per layer by :func:`_expert_layers`."""
    groups: dict[str, list[str]] = {}
    for m in modules:
        if ".mlp.experts." in m:
            continue
        head, _, leaf = m.rpartition(".")
        key = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}.get(leaf, leaf)
        groups.setdefault(f"{head}.{key}", []).append(m)
    return groups


def _expert_layers(modules: list[str]) -> dict[str, dict[int, dict[str, str]]]:
    """``model.layers.{i}.mlp.experts`` -> expert -> leaf (gate_proj / up_proj / down_proj) -> module."""
    out: dict[str, dict[int, dict[str, str]]] = {}
    for m in modules:
        if ".mlp.experts." in m:
            layer, _, rest = m.partition(".mlp.experts.")
            e, _, leaf = rest.partition(".")
            out.setdefault(f"{layer}.mlp.experts", {}).setdefault(int(e), {})[leaf] = m
    return out


def _check_nvfp4_tensors(ck: _Checkpoint, v: EngineVerdict, rule: str) -> None:
    for m in ck.quantized_modules():
        _, (n, half_k) = ck.meta[f"{m}.weight"]
        scale = ck.meta.get(f"{m}.weight_scale")
        if scale is None:
            v.error = v.error or f"RuntimeError: NVFP4 weight_scale for layer {m!r} was never loaded (still NaN)"
            v.outcome = "refused"
        elif scale != ("F8_E4M3", (n, 2 * half_k // 16)):
            v.error = v.error or f"{m}.weight_scale is {scale}, the engine allocates F8_E4M3 {(n, 2 * half_k // 16)}"
            v.outcome = "refused"
        if f"{m}.weight_scale_2" not in ck.meta:
            v.silent.append(f"{m}.weight_scale_2 is absent: the engine decodes with uninitialised memory ({rule})")
    v.rules.append(rule)


def _scalar(ck: _Checkpoint, name: str) -> float | None:
    vals = ck.scalars.get(name)
    return None if vals is None else vals[0]


def _check_pieces(ck: _Checkpoint, v: EngineVerdict, suffix: str, rule: str, silent_if_differ: bool) -> None:
    for fused, pieces in _fused_groups(ck.quantized_modules()).items():
        vals = {_scalar(ck, f"{p}.{suffix}") for p in pieces}
        vals.discard(None)
        if len(vals) > 1:
            msg = f"{fused}: the pieces' {suffix} differ {sorted(vals)}; the engine uses the max for all ({rule})"
            (v.silent if silent_if_differ else v.warnings).append(msg)
    v.rules.append(rule)


def _check_input_scales(ck: _Checkpoint, v: EngineVerdict, linear_rule: str, moe_rule: str, absent: str) -> None:
    missing = [m for m in ck.quantized_modules() if f"{m}.input_scale" not in ck.meta]
    dense = [m for m in missing if ".mlp.experts." not in m]
    experts = [m for m in missing if ".mlp.experts." in m]
    if dense:
        v.silent.append(f"{len(dense)} W4A4 linears have no input_scale (e.g. {dense[0]}): {absent} ({linear_rule})")
    if experts:
        v.silent.append(f"{len(experts)} W4A4 experts have no input_scale (e.g. {experts[0]}): {absent} ({moe_rule})")
    v.rules += [linear_rule, moe_rule]


def _check_experts(ck: _Checkpoint, v: EngineVerdict, gate_up_rule: str, max_rule: str, gate_up_silent: bool,
                   w4a4: bool) -> None:
    for layer, experts in _expert_layers(ck.quantized_modules()).items():
        for e, leaves in sorted(experts.items()):
            g, u = (_scalar(ck, f"{leaves[k]}.weight_scale_2") for k in ("gate_proj", "up_proj"))
            if g is not None and u is not None and g != u:
                msg = f"{layer}.{e}: gate and up weight_scale_2 differ ({g} vs {u}); up is decoded with gate's ({gate_up_rule})"
                (v.silent if gate_up_silent else v.warnings).append(msg)
        if w4a4:
            for leaf_set, name in ((("gate_proj", "up_proj"), "w13"), (("down_proj",), "w2")):
                vals = {_scalar(ck, f"{leaves[k]}.input_scale") for leaves in experts.values() for k in leaf_set}
                vals.discard(None)
                if len(vals) > 1:
                    v.warnings.append(f"{layer}: {name} input scales differ over experts; the engine uses the max ({max_rule})")
    v.rules += [gate_up_rule, max_rule]


def _input_activations_all_null(qc: dict) -> bool:
    groups = qc.get("config_groups")
    return isinstance(groups, dict) and bool(groups) and all(
        isinstance(g, dict) and g.get("input_activations") is None for g in groups.values()
    )


def vllm_verdict(path: str | Path, user_quantization: str | None = None) -> EngineVerdict:
    """What stock vLLM 0.33.0 does with the checkpoint at ``path`` (``--quantization`` optional)."""
    ck = _Checkpoint(path)
    v = EngineVerdict(f"vllm-{VLLM_VERSION}", "refused", rules=["V-config-source", "V-normalize"])
    qc = ck.config.get("quantization_config")
    if qc is None:
        qc = ck.legacy
    if qc is None:
        v.error = "no quantization config: the checkpoint would load as an unquantized model (uint8 weights refused)"
        return v
    method = str(qc.get("quant_method", "")).lower()
    nested = "quantization" in qc
    algo = str((qc["quantization"] if nested else qc).get("quant_algo", "")).upper()
    v.rules.append("V-override")
    if method.startswith("modelopt") and ("NVFP4" in algo or "FP4" in algo):
        method = "modelopt_fp4"
    v.rules.append("V-unknown-method")
    if user_quantization is not None and user_quantization != method:
        v.error = (f"ValueError: Quantization method specified in the model config ({method}) does not match the "
                   f"quantization method specified in the `quantization` argument ({user_quantization}).")
        return v
    if method not in VLLM_QUANTIZATION_METHODS:
        v.error = f"ValueError: Unknown quantization method: {method}. Must be one of {list(VLLM_QUANTIZATION_METHODS)}."
        return v
    v.quant_method = method
    if method != "modelopt_fp4":
        v.error = f"not an NVFP4 method: {method} (these rules cover modelopt_fp4)"
        return v
    v.rules.append("V-algo")
    if algo not in VLLM_MODELOPT_ALGOS:
        v.error = f"ValueError: ModelOpt currently only supports: {list(VLLM_MODELOPT_ALGOS)} quantizations in vLLM."
        return v
    v.rules.append("V-w4a16-select")
    if algo == "NVFP4" and not nested and _input_activations_all_null(qc):
        algo = "W4A16_NVFP4"
    if nested:
        v.rules.append("V-legacy-fields")
        lacking = [f for f in ("group_size", "kv_cache_quant_algo", "exclude_modules") if f not in qc["quantization"]]
        if lacking:
            v.error = f"ValueError: NVFP4 quantization requires the following fields in hf_quant_config.json: {lacking}"
            return v
    v.outcome = "W4A16" if algo == "W4A16_NVFP4" else "W4A4"
    v.rules.append("V-no-missing-check")
    _check_nvfp4_tensors(ck, v, "V-linear-weight")
    v.rules.append("V-linear-weight-loaded")
    if v.outcome == "refused":
        return v
    _check_pieces(ck, v, "weight_scale_2", "V-linear-scale2-max", silent_if_differ=True)
    if v.outcome == "W4A4":
        _check_input_scales(ck, v, "V-linear-input-scale", "V-moe-input-scale", "uninitialised memory (torch.empty)")
        _check_pieces(ck, v, "input_scale", "V-linear-input-max", silent_if_differ=False)
        v.rules.append("V-alpha")
    else:
        v.rules.append("V-w4a16-drops-input")
    v.rules.append("V-moe-weights")
    _check_experts(ck, v, "V-moe-gate-up-scale2", "V-moe-input-max", gate_up_silent=True, w4a4=v.outcome == "W4A4")
    return v


def sglang_verdict(path: str | Path) -> EngineVerdict:
    """What stock SGLang 0.5.23 does with the checkpoint at ``path``."""
    ck = _Checkpoint(path)
    v = EngineVerdict(f"sglang-{SGLANG_VERSION}", "refused", rules=["S-config-source"])
    qc = ck.config.get("quantization_config")
    nested = False
    if qc is None and ck.legacy is not None:
        qc, nested = ck.legacy, True
    if qc is None:
        v.error = "no quantization config: the checkpoint would load as an unquantized model (uint8 weights refused)"
        return v
    body = qc["quantization"] if nested else qc
    method = qc.get("quant_method")
    algo = str(body.get("quant_algo", ""))
    v.rules.append("S-parse")
    if method in (None, "modelopt") and ("FP4" in algo or "NVFP4" in algo):
        method = "modelopt_fp4"
    v.rules.append("S-unknown-method")
    if method != "modelopt_fp4":
        v.error = f"ValueError: Unknown quantization method: {method}."
        return v
    v.quant_method = method
    v.rules.append("S-algo")
    if algo not in SGLANG_MODELOPT_FP4_ALGOS:
        v.error = "ValueError: ModelOpt currently only supports: FP8, NVFP4, NVFP4_AWQ, W4A16_NVFP4 quantizations in sglang."
        return v
    v.rules.append("S-fields")
    exclude = body.get("ignore", body.get("modules_to_not_convert", body.get("exclude_modules")))
    if body.get("group_size") is None or exclude is None:
        v.error = "ValueError: NVFP4 quantization requires group_size and exclude_modules specified in the quantization config"
        return v
    v.rules.append("S-w4a16-select")
    v.outcome = "W4A16" if algo == "W4A16_NVFP4" else "W4A4"
    _check_nvfp4_tensors(ck, v, "V-linear-weight")  # same layout (modelopt_quant.py 1796-1884)
    if v.outcome == "refused":
        return v
    if v.outcome == "W4A4":
        if _input_activations_all_null(qc):
            v.silent.append("input_activations are null (weight-only intent) but quant_algo NVFP4 is served W4A4 "
                            "(S-w4a16-select)")
        _check_input_scales(ck, v, "S-linear-input-scale", "S-moe-input-scale", "the engine fills 1.0")
        _check_pieces(ck, v, "input_scale", "S-linear-max", silent_if_differ=False)
    else:
        v.rules.append("S-w4a16-drops-input")
    _check_pieces(ck, v, "weight_scale_2", "S-linear-max", silent_if_differ=True)
    _check_experts(ck, v, "S-moe-gate-up-scale2", "S-moe-input-max", gate_up_silent=False, w4a4=v.outcome == "W4A4")
    return v


__all__ = ["ANCHORS", "RULES", "EngineVerdict", "Rule", "sglang_verdict", "vllm_verdict"]
