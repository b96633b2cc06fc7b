"""Export the learner's NVFP4 weights in the ModelOpt NVFP4 checkpoint layout (vLLM / SGLang).

The learner's quantized bytes are written as they are, never re-quantized. Per quantized HF
linear module ``M`` (``model.layers.{i}.self_attn.q_proj``, ``...mlp.experts.{e}.down_proj``):

=====================  ==========================  ==============================================
tensor                 dtype / shape               meaning
=====================  ==========================  ==============================================
``M.weight``           uint8 ``[N, K/2]``          E2M1 codes, two per byte, even element low nibble
``M.weight_scale``     float8_e4m3fn ``[N, K/16]`` block decode scales, linear layout (a 16x16
                                                   tile's scale repeated on its 16 rows)
``M.weight_scale_2``   float32 ``[]``              the per-tensor *decode* global scale ``S_dec``
``M.input_scale``      float32 ``[]``              only with calibrated activation amaxes: the
                                                   activation decode scale ``S_dec(amax)``
=====================  ==========================  ==============================================

so that ``W[n, k] = e2m1(code) * fp32(weight_scale[n, k // 16]) * weight_scale_2`` (fp32, that
order), bitwise the learner's ``NVFP4Tensor.dequantize()``. ModelOpt and vLLM define
``weight_scale_2 = amax / (448 * 6)``; miniTE writes the ``S_dec`` its codes were made with,
``fp32(1 / fp64(fp32(2688 / amax)))``, which can differ from ``fp32(amax / 2688)`` in the last bit:
the stored value is the one that decodes the stored codes exactly.

Fused Megatron linears are split by rows: ``linear_qkv`` (interleaved per query group) into
``q_proj``/``k_proj``/``v_proj``, gated ``linear_fc1`` into ``gate_proj``/``up_proj``. Whole 16-row
tiles move and the pieces keep the fused tensor's global scale, so the split is exact, and the
pieces share one ``weight_scale_2`` (what vLLM and SGLang expect from fused layers).

Files: ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``; ``config.json``
(Qwen3 / Qwen3-MoE names, ``quantization_config`` per variant, below); for the stock variants
``hf_quant_config.json`` (``producer``, ``quantization: {quant_algo, kv_cache_quant_algo,
group_size, exclude_modules}``);
and miniTE's own section ``config.json["minite"]`` (recipe, scale semantics, activation scaling)
plus ``minite_quant.json`` (per linear module: Megatron source and rows, ``weight_scale_2`` and its
bits, ``input_scale`` and ``alpha`` when static; per other tensor: its Megatron source). Format details: ``docs/export.md``.

Variants (``variant=``; never a checkpoint a stock engine loads as a different model silently):

- ``"minite"`` (default): the learner's exact policy (per-token activation scales, the contract's
  quantizer and epilogue). ``quantization_config.quant_method`` is ``"minite_nvfp4"``, a method of
  our own: stock vLLM / SGLang refuse it with "Unknown quantization method", the ``minite-vllm``
  plugin (:mod:`minite_megatron.serving.vllm`) serves it. No ``hf_quant_config.json``, no
  ``input_scale``.
- ``"modelopt-w4a4-static"``: stock ModelOpt NVFP4 W4A4 with static ``input_scale`` from calibrated
  ``activation_amax`` (per linear; the max over a fused layer's pieces and over a layer's experts,
  which is the one value the engines use). A different model: one activation scale per layer and
  the engine's own FP4 quantizer.
- ``"modelopt-w4a16"``: stock ModelOpt NVFP4 weight-only (``quant_algo: "W4A16_NVFP4"``, input
  activations null): the same weights, BF16 activations. A different model.

The stock variants say so in ``config.json["minite"]`` (``serves_learner_policy: false`` and
``different_model``). :mod:`.engine_rules` encodes what vLLM 0.33 and SGLang 0.5.23 do with each.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..nvfp4 import BLOCK, NVFP4Tensor, global_scales
from .hf_config import build_hf_config, cfg_get, dims
from .names import megatron_target, strip_wrappers
from .rows import check_weight, fc1_row_ranges, qkv_row_ranges, split_groups, take_rows

FORMAT_VERSION = 1
QUANT_METHOD = "minite_nvfp4"  # the quantization method of our own (only the minite-vllm plugin serves it)
VARIANT_MINITE = "minite"
VARIANT_W4A4_STATIC = "modelopt-w4a4-static"
VARIANT_W4A16 = "modelopt-w4a16"
VARIANTS = (VARIANT_MINITE, VARIANT_W4A4_STATIC, VARIANT_W4A16)
DIFFERENT_MODEL = {
    VARIANT_W4A4_STATIC: (
        "NOT the learner's policy: stock ModelOpt NVFP4 W4A4 with one static activation scale per linear "
        "(input_scale, the max over fused pieces and experts) and the engine's own FP4 quantizer, instead "
        "of per-token scales and the contract's quantizer"
    ),
    VARIANT_W4A16: (
        "NOT the learner's policy: stock ModelOpt NVFP4 weight-only (W4A16): the learner's 4-bit weights "
        "with BF16 activations, instead of 4-bit per-token activations"
    ),
}
QUANT_FILE = "minite_quant.json"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
PRODUCER = {"name": "minite-megatron", "version": __version__}


@dataclass
class ExportResult:
    """What :func:`export_modelopt` wrote."""

    path: Path
    files: list[Path]
    config: dict
    quantized_modules: list[str]
    exclude_modules: list[str]
    modules: dict[str, dict] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # HF name -> tensor, as written


def fp32_bits(x: torch.Tensor | float) -> str:
    """The IEEE bits of an fp32 scalar as ``0x%08x`` (exact, for the JSON metadata)."""
    t = torch.as_tensor(x, dtype=torch.float32).reshape(1)
    return f"0x{int(t.view(torch.int32).item()) & 0xFFFFFFFF:08x}"


def jsonable(obj: Any) -> Any:
    """Recipe values -> JSON (dataclasses, enums, tuples, dtypes); anything else by ``repr``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj)
    return repr(obj)


def _recipe_dict(recipe: Any) -> tuple[str, dict]:
    if dataclasses.is_dataclass(recipe) and not isinstance(recipe, type):
        cls = type(recipe)
        return f"{cls.__module__}.{cls.__qualname__}", jsonable(dataclasses.asdict(recipe))
    if isinstance(recipe, Mapping):
        return "dict", jsonable(recipe)
    raise TypeError(f"export: recipe must be a dataclass instance or a dict, got {type(recipe).__name__}")


def _hf_sort_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


class _Writer:
    """Collects the tensors and per-module metadata of one export."""

    def __init__(self, cfg: Any, activation_amax: Mapping[str, torch.Tensor] | None):
        self.d = dims(cfg)
        self.tensors: dict[str, torch.Tensor] = {}
        self.modules: dict[str, dict] = {}
        self.exclude: list[str] = []
        self.sources: dict[str, str] = {}  # high-precision tensor (HF name) -> Megatron name
        self.amax = {strip_wrappers(k): v for k, v in (activation_amax or {}).items()}
        self.static_inputs = activation_amax is not None

    def put(self, name: str, t: torch.Tensor) -> None:
        if name in self.tensors:
            raise ValueError(f"export: two Megatron tensors map to {name!r}")
        self.tensors[name] = t.detach().contiguous().cpu()

    def _expect_shape(self, what: str, shape: tuple, want: tuple) -> None:
        if tuple(shape) != tuple(want):
            raise ValueError(f"export: {what} has shape {tuple(shape)}, the config implies {tuple(want)}")

    def linear(self, role: str, hf: str, value, source: str, expert: int | None, amax: torch.Tensor | None) -> None:
        d = self.d
        shape = tuple(value.shape)
        if role == "qkv":
            self._expect_shape(source, shape, ((d["heads"] + 2 * d["groups"]) * d["head_dim"], d["hidden"]))
            r = qkv_row_ranges(d["heads"], d["groups"], d["head_dim"])
            pieces = {f"{hf}.q_proj": r["q"], f"{hf}.k_proj": r["k"], f"{hf}.v_proj": r["v"]}
        elif role == "fc1":
            ffn = d["moe_ffn"] if expert is not None else d["ffn"]
            self._expect_shape(source, shape, (2 * ffn, d["hidden"]))
            r = fc1_row_ranges(ffn)
            pieces = {f"{hf}.gate_proj": r["gate"], f"{hf}.up_proj": r["up"]}
        else:
            if hf.endswith("o_proj"):
                self._expect_shape(source, shape, (d["hidden"], d["heads"] * d["head_dim"]))
            elif hf.endswith("down_proj"):
                self._expect_shape(source, shape, (d["hidden"], d["moe_ffn"] if expert is not None else d["ffn"]))
            elif hf == "lm_head" and shape[1] != d["hidden"]:
                raise ValueError(f"export: {source} has shape {shape}, expected [vocab, {d['hidden']}]")
            pieces = {hf: [(0, shape[0])]}

        quantized = isinstance(value, NVFP4Tensor)
        if quantized:
            value = check_weight(value, source)
            bad_scales = torch.isnan(value.block_scales.to(torch.float32))
            if not bool(torch.isfinite(value.global_decode).all()) or bool(bad_scales.any()):
                raise ValueError(
                    f"export: {source} holds non-finite scales (the learner's weight had NaN/inf); refusing to "
                    "export a weight that decodes to NaN"
                )
            if self.static_inputs and amax is None:
                raise ValueError(f"export: activation_amax has no entry for {source} (give all quantized linears or none)")
        elif not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(f"export: {source} must be an NVFP4Tensor or a floating-point tensor")
        for module, ranges in pieces.items():
            meta: dict[str, Any] = {"source": source, "rows": [list(r) for r in ranges]}
            if expert is not None:
                meta["expert"] = expert
            if quantized:
                q = value if ranges == [(0, shape[0])] else take_rows(value, ranges, f"{source} -> {module}")
                s2 = q.global_decode.reshape(()).to(torch.float32)
                self.put(f"{module}.weight", q.codes)
                self.put(f"{module}.weight_scale", q.block_scales.reshape(q.shape[0], q.shape[1] // BLOCK))
                self.put(f"{module}.weight_scale_2", s2)
                meta.update(
                    quantized=True,
                    tile=list(q.tile),
                    weight_scale_2=float(s2),
                    weight_scale_2_bits=fp32_bits(s2),
                )
                if amax is not None:
                    a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
                    if not bool(torch.isfinite(a)) or float(a) < 0:
                        raise ValueError(f"export: activation amax of {source} is not a finite amax >= 0: {float(a)!r}")
                    meta["input_amax"] = float(a)
            else:
                w = torch.cat([value[a:b] for a, b in ranges]) if len(ranges) > 1 or ranges[0] != (0, shape[0]) else value
                self.put(f"{module}.weight", w)
                meta.update(quantized=False, dtype=str(value.dtype).removeprefix("torch."))
                self.exclude.append(module)
            self.modules[module] = meta

    def write_input_scales(self) -> None:
        """Static variant: one ``input_scale`` per linear, as the engines use it.

        vLLM and SGLang keep one activation scale per fused linear (the max over q/k/v or gate/up:
        vLLM ``modelopt.py`` 2116-2133, SGLang ``modelopt_quant.py`` 1886-1888) and one per MoE
        layer and GEMM (the max over experts: vLLM ``flashinfer_fp4_moe.py`` 387-397, SGLang
        ``modelopt_quant.py`` 2769-2770), so every piece of a group is written with the group's
        max amax: the file states the scale the engine computes with. ``S_dec`` is increasing in
        the amax, so ``S_dec(max amax) = max S_dec``.
        """
        groups: dict[tuple, list[str]] = {}
        for module, meta in self.modules.items():
            if meta.get("quantized") and "input_amax" in meta:
                if "expert" in meta:  # model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj
                    layer = module.split(".mlp.experts.")[0]
                    key = (layer, "w2" if module.endswith("down_proj") else "w13")
                else:
                    key = ("source", meta["source"])
                groups.setdefault(key, []).append(module)
        for members in groups.values():
            amax = max(self.modules[m]["input_amax"] for m in members)
            _, s_dec = global_scales(torch.tensor([amax], dtype=torch.float32))
            in_scale = s_dec.reshape(())
            for m in members:
                meta = self.modules[m]
                s2 = self.tensors[f"{m}.weight_scale_2"]
                alpha = (in_scale * s2).to(torch.float32)
                self.put(f"{m}.input_scale", in_scale.clone())
                meta.update(input_amax_used=amax, input_scale=float(in_scale), input_scale_bits=fp32_bits(in_scale),
                            alpha=float(alpha), alpha_bits=fp32_bits(alpha))


SERVING_RECIPE_FIELDS = ("strict", "fp32_router", "fp32_lm_head", "activation_scale", "weight_tile", "aligned_ops",
                         "aligned_attention")


def _quantization_config(variant: str, exclude: list[str], tiles: list, recipe: dict) -> dict:
    """``config.json["quantization_config"]`` of each variant (module docstring). The default's
    ``recipe`` holds the recipe fields a serving plugin needs (strict mode, FP32 router / LM head,
    default mode's aligned ops and attention)."""
    fp4 = {"num_bits": 4, "type": "float", "group_size": BLOCK}
    if variant == VARIANT_MINITE:
        return {
            "quant_method": QUANT_METHOD,
            "format_version": FORMAT_VERSION,
            "quant_algo": "NVFP4_W4A4_PER_TOKEN",
            "group_size": BLOCK,
            "weights": {**fp4, "dynamic": False, "tiles": [list(t) for t in tiles]},
            "input_activations": {**fp4, "dynamic": True, "global_scale": "per_token"},
            "recipe": {k: recipe[k] for k in SERVING_RECIPE_FIELDS if k in recipe},
            "ignore": exclude,
            "producer": dict(PRODUCER),
        }
    w4a16 = variant == VARIANT_W4A16
    return {
        "quant_method": "modelopt",
        "quant_algo": "W4A16_NVFP4" if w4a16 else "NVFP4",
        "group_size": BLOCK,
        "config_groups": {
            "group_0": {
                "input_activations": None if w4a16 else {**fp4, "dynamic": False},
                "weights": {**fp4, "dynamic": False},
            }
        },
        "ignore": exclude,
        "producer": dict(PRODUCER),
        "quant_library": "modelopt",
    }


def export_modelopt(
    out_dir: str | Path,
    weights: Mapping[str, NVFP4Tensor | torch.Tensor],
    config: Any,
    recipe: Any,
    *,
    rope_theta: float,
    max_position_embeddings: int,
    vocab_size: int | None = None,
    activation_amax: Mapping[str, torch.Tensor] | None = None,
    activation_global_scale: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    variant: str = VARIANT_MINITE,
    write: bool = True,
) -> ExportResult:
    """Write a ModelOpt NVFP4 checkpoint of the learner's weights into ``out_dir``.

    Args:
        weights: Megatron parameter name (unsharded, TP=EP=1 view) -> the learner's
            :class:`NVFP4Tensor` (quantized linears: 16x16 tiles or 1x16 blocks, one global scale
            per tensor; ``[E, N, K]`` ``"group"`` tensors for all experts at once) or a plain
            tensor (embeddings, norms, router, LM head, and linears kept in BF16, which are written
            unquantized and listed in the exclude list). Names: :mod:`.names`; ``*._extra_state``
            entries of a Megatron state dict are skipped.
        config: Megatron ``TransformerConfig`` (or object/dict with its field names).
        recipe: the training recipe (any dataclass, or a dict), written to ``config.json``.
        rope_theta, max_position_embeddings: GPT-level settings outside TransformerConfig.
        vocab_size: default: rows of the embedding.
        activation_amax: calibrated activation amax per quantized Megatron weight name (``[E]``
            for a group tensor); required by, and only allowed with,
            ``variant="modelopt-w4a4-static"``: writes static ``input_scale`` = the contract's
            ``S_dec`` of the max amax over each fused linear's pieces and each MoE layer's experts.
        activation_global_scale: ``"row"`` / ``"tensor"``; default: ``recipe.activation_scale``.
        max_shard_bytes: safetensors shard size limit.
        variant: ``"minite"`` (default: the learner's policy under ``quant_method: "minite_nvfp4"``,
            which stock engines refuse), ``"modelopt-w4a4-static"`` or ``"modelopt-w4a16"`` (stock
            ModelOpt checkpoints of a different model, marked so in ``config.json["minite"]``).
        write: False builds everything (checks included) and writes no file: the returned
            ``tensors`` are what a refit sends (:func:`export_tensors`).

    Returns:
        :class:`ExportResult`.

    Raises:
        ValueError for a name with no Qwen3 place, a shape the config contradicts, a missing
        tensor, an unsupported config, a tile-cutting split, or a quantized norm/router;
        TypeError for a bad value or recipe.
    """
    out = Path(out_dir)
    if variant not in VARIANTS:
        raise ValueError(f"export: variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if (activation_amax is not None) != (variant == VARIANT_W4A4_STATIC):
        raise ValueError(
            "export: activation_amax (static input scales) goes with variant='modelopt-w4a4-static' and only "
            f"with it; got variant={variant!r} with{'' if activation_amax is not None else 'out'} activation_amax"
        )
    recipe_class, recipe_dict = _recipe_dict(recipe)
    act_scale = activation_global_scale or recipe_dict.get("activation_scale")
    if act_scale not in ("row", "tensor"):
        raise ValueError(
            "export: activation_global_scale must be 'row' or 'tensor' (pass it, or use a recipe with activation_scale)"
        )
    if variant == VARIANT_MINITE and act_scale != "row":
        raise ValueError(
            "export: variant='minite' serves the per-token recipe (activation_scale='row'); a per-tensor dynamic "
            "activation scale depends on the batch and has no serving path: export a stock variant instead"
        )
    w = _Writer(config, activation_amax)
    d = w.d
    moe_layers: set[int] = set()
    experts_seen: dict[int, dict[str, set[int]]] = {}
    lm_head_present = False

    for name, value in weights.items():
        src = strip_wrappers(name)
        if src.endswith("._extra_state"):
            continue  # Megatron/TE module metadata (None for local modules), not a weight
        t = megatron_target(name)
        if t.role in ("tensor", "router"):
            if isinstance(value, NVFP4Tensor):
                raise ValueError(f"export: {src} is quantized, but {t.hf} is a high-precision tensor in the Qwen3 layout")
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"export: {src} must be a tensor, got {type(value).__name__}")
            w.put(t.hf, value)
            w.sources[t.hf] = src
            if t.role == "router":
                moe_layers.add(t.layer)
                w.exclude.append(t.hf.removesuffix(".weight"))
            continue
        if t.layer is not None and t.layer >= d["layers"]:
            raise ValueError(f"export: {src} is layer {t.layer}, the config has {d['layers']} layers")
        amax = w.amax.get(src)
        lm_head_present |= t.hf == "lm_head"
        if t.expert is None:
            w.linear(t.role, t.hf, value, src, None, amax)
            continue
        if t.expert == -1:
            parts = split_groups(value, src) if isinstance(value, NVFP4Tensor) else list(value.unbind(0))
            if amax is not None and torch.as_tensor(amax).numel() != len(parts):
                raise ValueError(f"export: activation_amax[{src}] needs {len(parts)} values (one per expert)")
            for e, p in enumerate(parts):
                a = None if amax is None else torch.as_tensor(amax).reshape(-1)[e]
                w.linear(t.role, t.hf.format(expert=e), p, src, e, a)
                experts_seen.setdefault(t.layer, {}).setdefault(t.role, set()).add(e)
        else:
            w.linear(t.role, t.hf, value, src, t.expert, amax)
            experts_seen.setdefault(t.layer, {}).setdefault(t.role, set()).add(t.expert)

    # ---- completeness: never export a model with a hole in it ------------------------------
    missing = []
    if "model.embed_tokens.weight" not in w.tensors:
        missing.append("embedding.word_embeddings.weight")
    if "model.norm.weight" not in w.tensors:
        missing.append("decoder.final_layernorm.weight")
    qk_norm = bool(cfg_get(config, "qk_layernorm", False))
    for i in range(d["layers"]):
        need = [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
        need += [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
        if qk_norm:
            need += [f"model.layers.{i}.self_attn.{p}_norm.weight" for p in "qk"]
        if i in moe_layers:
            seen = experts_seen.get(i, {})
            for role in ("fc1", "linear"):
                lacking = sorted(set(range(d["experts"])) - seen.get(role, set()))
                if lacking:
                    missing.append(f"layer {i} experts {lacking[:8]} {'fc1' if role == 'fc1' else 'fc2'}")
        else:
            if i in experts_seen:
                missing.append(f"decoder.layers.{i}.mlp.router.weight (layer {i} has experts)")
            need += [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        missing += [n for n in need if n not in w.tensors]
    if not qk_norm and any(".q_norm." in n for n in w.tensors):
        raise ValueError("export: q/k layernorm weights given but the config has qk_layernorm=False")
    if missing:
        raise ValueError(f"export: the weights are incomplete; missing {missing[:10]}{' ...' if len(missing) > 10 else ''}")

    # vLLM matches a fused MoE by its "experts" prefix: a layer's experts are all quantized or none.
    for i in sorted(moe_layers):
        flags = {w.modules[m]["quantized"] for m in w.modules if m.startswith(f"model.layers.{i}.mlp.experts.")}
        if len(flags) > 1:
            raise ValueError(f"export: layer {i} mixes quantized and high-precision experts (engines cannot load that)")
        if flags == {False}:
            w.exclude.append(f"model.layers.{i}.mlp.experts")

    if w.static_inputs:
        w.write_input_scales()

    emb = w.tensors["model.embed_tokens.weight"]
    vocab = int(vocab_size) if vocab_size is not None else int(emb.shape[0])
    if emb.shape != (vocab, d["hidden"]):
        raise ValueError(f"export: embedding has shape {tuple(emb.shape)}, expected [{vocab}, {d['hidden']}]")
    if lm_head_present and w.tensors["lm_head.weight"].shape[0] != vocab:
        raise ValueError(f"export: lm_head has {w.tensors['lm_head.weight'].shape[0]} rows, vocab is {vocab}")

    hf = build_hf_config(
        config,
        vocab_size=vocab,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=not lm_head_present,
        moe_layers=sorted(moe_layers),
        torch_dtype=emb.dtype,
    )
    exclude = sorted(set(w.exclude), key=_hf_sort_key)
    quantized = sorted((m for m, v in w.modules.items() if v["quantized"]), key=_hf_sort_key)
    if not quantized:
        raise ValueError("export: no quantized linear in the weights (nothing NVFP4 to export)")
    tiles = sorted({tuple(w.modules[m]["tile"]) for m in quantized})
    hf["quantization_config"] = _quantization_config(variant, exclude, tiles, recipe_dict)
    hf["minite"] = {
        "format_version": FORMAT_VERSION,
        "variant": variant,
        "serves_learner_policy": variant == VARIANT_MINITE,
        "different_model": DIFFERENT_MODEL.get(variant),
        "producer": dict(PRODUCER),
        "recipe_class": recipe_class,
        "recipe": recipe_dict,
        "weights": {
            "tiles": [list(t) for t in tiles],
            "global_scale": "one per tensor (per expert for experts); fused q/k/v and gate/up share theirs",
            "codes": "uint8 [N, K/2], two E2M1 codes per byte, even element in the low nibble",
            "weight_scale": "float8_e4m3fn [N, K/16], linear layout, a 16x16 tile's scale repeated on its rows",
            "weight_scale_2": "S_dec = fp32(1 / fp64(fp32(2688 / amax))) as the learner quantized (decode scale)",
            "dequantize": "fp32(e2m1(code) * fp32(weight_scale)) * weight_scale_2, bitwise the learner's weight",
        },
        "activations": {
            "global_scale": "per_token" if act_scale == "row" else "per_tensor",
            "block": [1, BLOCK],
            "input_scale": "static, S_dec(max calibrated amax over fused pieces / experts)" if w.static_inputs
            else "absent (dynamic per-token scales)" if variant == VARIANT_MINITE
            else "absent (weight-only: BF16 activations)",
            "alpha": "alpha[m] = fp32(S_dec_act[m] * weight_scale_2): per token at run time"
            if act_scale == "row"
            else "alpha = fp32(S_dec_act * weight_scale_2)",
        },
        "quant_file": QUANT_FILE,
        "num_quantized_modules": len(quantized),
        "num_excluded_modules": len(exclude),
    }

    modules = {m: w.modules[m] for m in sorted(w.modules, key=_hf_sort_key)}
    if not write:
        return ExportResult(out, [], hf, quantized, exclude, modules, w.tensors)
    out.mkdir(parents=True, exist_ok=True)
    files = _write_shards(out, w.tensors, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    hf_quant = out / "hf_quant_config.json"
    if variant == VARIANT_MINITE:
        hf_quant.unlink(missing_ok=True)  # no ModelOpt declaration anywhere in the default export
    else:  # ModelOpt's legacy file (engines read it only when config.json has no quantization_config)
        algo = hf["quantization_config"]["quant_algo"]
        legacy = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": BLOCK, "exclude_modules": exclude}
        hf_quant.write_text(json.dumps({"producer": dict(PRODUCER), "quantization": legacy}, indent=2))
    tensor_sources = {n: w.sources[n] for n in sorted(w.sources, key=_hf_sort_key)}
    (out / QUANT_FILE).write_text(
        json.dumps({"format_version": FORMAT_VERSION, "modules": modules, "tensors": tensor_sources}, indent=1)
    )
    files += [out / "config.json", out / QUANT_FILE] + ([hf_quant] if hf_quant.exists() else [])
    return ExportResult(out, files, hf, quantized, exclude, modules, w.tensors)


def export_tensors(weights: Mapping[str, NVFP4Tensor | torch.Tensor], config: Any, recipe: Any, *,
                   variant: str = VARIANT_MINITE, activation_amax: Mapping[str, torch.Tensor] | None = None,
                   vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """The HF-named tensors :func:`export_modelopt` would write (same checks, no files): the
    learner's bytes split into the engine's modules, for an in-memory refit
    (:func:`minite_megatron.serving.refit.refit_vllm_model`)."""
    res = export_modelopt(".", weights, config, recipe, rope_theta=1.0, max_position_embeddings=1, vocab_size=vocab_size,
                          activation_amax=activation_amax, variant=variant, write=False)
    return res.tensors


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[Path]:
    from safetensors.torch import save_file

    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    names = sorted(tensors, key=_hf_sort_key)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    total = len(shards)
    weight_map, files = {}, []
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
        files.append(out / fname)
        weight_map.update({n: fname for n in shard})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=1))
    return files + [out / INDEX_FILE]


__all__ = [
    "QUANT_METHOD",
    "VARIANTS",
    "VARIANT_MINITE",
    "VARIANT_W4A16",
    "VARIANT_W4A4_STATIC",
    "ExportResult",
    "export_modelopt",
    "export_tensors",
    "fp32_bits",
    "jsonable",
]
