"""The learner of an export: a Megatron GPT on the minite specs that computes the exported policy.

``minite-diagnose vllm`` compares a serving engine with the learner, but all it is given is the
export directory (:func:`minite_megatron.export.export_modelopt`, the ``minite`` variant). The export
holds the learner's packed NVFP4 bytes, never its BF16 master weights. :func:`learner_from_export`
builds the learner from ``config.json`` (its shapes, and the recipe it was exported under, from
``config.json["minite"]["recipe"]``) and gives every NVFP4 linear the BF16 weight
``bf16(e2m1(code) * weight_scale * weight_scale_2)``. Re-quantizing that weight gives the exported
bytes back: the tile that holds the amax keeps code 6 at scale 448, so the amax is the exported one
(the learner's amax was a BF16 value, within 3 fp32 roundings of ``2688 * weight_scale_2``), every
tile's scale rounds back to itself (a BF16 rounding moves it by 2^-9, an e4m3 step is >= 2^-4)
and every code lies a quarter step or more from a rounding boundary. The argument fails only for a
tile whose e4m3 scale is subnormal (its amax below 1/28672 of the tensor's), so it is not trusted:
the learner's own ``quantized_weight()`` of every module is compared with the export, bit for bit,
and a mismatch raises ValueError naming the tensor. The high-precision tensors (embeddings, norms,
router, LM head) are loaded as stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..nvfp4 import NVFP4Tensor
from ..testing import raw_bits

ARCHITECTURE = "Qwen3MoeForCausalLM"


@dataclass
class ExportLearner:
    """The learner of an export (:func:`learner_from_export`)."""

    model: torch.nn.Module
    recipe: object
    hf_config: dict
    quantized: int  # NVFP4 weights whose bytes the learner reproduces
    tensors: int  # high-precision tensors loaded as stored


def read_export_config(path: str | Path) -> dict:
    """``config.json`` of a ``minite`` export; ValueError (one line, naming the file) for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {path}: no such directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"--model {path}: no config.json: not an exported model (minite-export writes one)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {path}: config.json is not valid JSON ({e.msg} at line {e.lineno})") from None
    from ..export.modelopt import QUANT_METHOD

    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method != QUANT_METHOD or "minite" not in cfg:
        raise ValueError(f"--model {path}: quantization_config.quant_method is {method!r}, not {QUANT_METHOD!r}: not a "
                         "minite export (the learner's policy; minite-export --variant minite)")
    arch = (cfg.get("architectures") or [None])[0]
    if arch != ARCHITECTURE:
        raise ValueError(f"--model {path}: architecture {arch!r}; the minite-vllm model class serves {ARCHITECTURE}")
    return cfg


def _shape(cfg: dict) -> tuple[dict, dict]:
    """``build_gpt``-style shape and the ``TransformerConfig`` fields of an export's ``config.json``."""
    layers = int(cfg["num_hidden_layers"])
    shape = dict(layers=layers, hidden=int(cfg["hidden_size"]), heads=int(cfg["num_attention_heads"]),
                 groups=int(cfg["num_key_value_heads"]), head_dim=int(cfg["head_dim"]), experts=int(cfg["num_experts"]),
                 topk=int(cfg["num_experts_per_tok"]), moe_ffn=int(cfg["moe_intermediate_size"]),
                 vocab=int(cfg["vocab_size"]))
    dense = set(cfg.get("mlp_only_layers") or [])
    fields = dict(ffn_hidden_size=int(cfg["intermediate_size"]), layernorm_epsilon=float(cfg["rms_norm_eps"]),
                  moe_layer_freq=[0 if i in dense else 1 for i in range(layers)],
                  moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", True)))
    return shape, fields


def learner_from_export(path: str | Path, *, recipe_overrides: dict | None = None, device="cpu") -> ExportLearner:
    """The learner that computes the export at ``path`` (module docstring), BF16, eval mode.

    ``recipe_overrides``: recipe fields replaced for the learner (e.g. ``{"strict": false}`` to see
    what a non-strict learner differs in); the weights' bytes must still be the export's. Needs
    Megatron's parallel state (:func:`minite_megatron.training.presets.init_single_process`).
    Raises FileNotFoundError / ValueError (one line) for a directory that is not a minite export or
    whose bytes the learner does not reproduce.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    from ..export import load_modelopt
    from ..export.gather import learner_weights
    from ..model import finalize_gpt_model
    from ..recipe import Recipe
    from ..specs import get_gpt_decoder_block_minite_spec
    from ..training.presets import preset_config

    cfg = read_export_config(path)
    ck = load_modelopt(path)
    recipe = Recipe.from_dict({**ck.recipe, **(recipe_overrides or {})})
    shape, fields = _shape(cfg)
    config = preset_config(shape, device=device, dtype=torch.bfloat16, **fields)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_minite_spec(config, recipe),
                     vocab_size=shape["vocab"], max_sequence_length=int(cfg["max_position_embeddings"]),
                     position_embedding_type="rope", rotary_base=float(cfg["rope_theta"]),
                     share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)))
    finalize_gpt_model(model, recipe)
    model = model.to(device=torch.device(device)).eval()

    targets = ck.to_megatron()
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    loaded: set[int] = set()
    with torch.no_grad():
        for name, value in targets.items():
            if isinstance(value, NVFP4Tensor):
                module = modules.get(name.removesuffix(".weight"))
                if module is None:
                    raise ValueError(f"--model {path}: the export's {name} has no module in the learner built from config.json")
                dense = value.dequantize(torch.float32).to(torch.bfloat16)
                if hasattr(module, "num_gemms"):  # grouped experts: weight0 .. weight{G-1}
                    ws = [getattr(module, f"weight{g}") for g in range(module.num_gemms)]
                else:
                    ws, dense = [module.weight], dense.unsqueeze(0)
                if len(ws) != dense.shape[0] or tuple(ws[0].shape) != tuple(dense.shape[1:]):
                    raise ValueError(f"--model {path}: {name} {tuple(value.shape)} does not fit the learner's "
                                     f"{len(ws)} x {tuple(ws[0].shape)}")
                for w, d in zip(ws, dense):
                    w.copy_(d)
                    loaded.add(id(w))
            else:
                p = params.get(name)
                if p is None or tuple(p.shape) != tuple(value.shape):
                    raise ValueError(f"--model {path}: the export's {name} {tuple(value.shape)} does not fit the learner "
                                     f"({'no such parameter' if p is None else tuple(p.shape)})")
                p.copy_(value.to(p.dtype))
                loaded.add(id(p))
    missing = [n for n, p in params.items() if id(p) not in loaded]
    if missing:
        raise ValueError(f"--model {path}: the export has no tensor for the learner's {missing[0]} "
                         f"({len(missing)} parameters missing)")

    got = learner_weights(model)
    quantized = 0
    for name, want in targets.items():
        if not isinstance(want, NVFP4Tensor):
            continue
        have = got.get(name)
        if not isinstance(have, NVFP4Tensor):
            raise ValueError(f"--model {path}: {name} is NVFP4 in the export but not in the learner under its recipe")
        for part in ("codes", "block_scales", "global_decode"):
            a, b = getattr(have, part), getattr(want, part)
            if a.shape != b.shape or not torch.equal(raw_bits(a), raw_bits(b.to(a.device))):
                n = int((raw_bits(a) != raw_bits(b)).sum()) if a.shape == b.shape else a.numel()
                raise ValueError(f"--model {path}: the learner does not reproduce the exported {part} of {name} from "
                                 f"BF16 weights ({n} of {b.numel()} differ): diagnose needs the learner's checkpoint")
        quantized += 1
    return ExportLearner(model, recipe, cfg, quantized, len(targets) - quantized)


__all__ = ["ARCHITECTURE", "ExportLearner", "learner_from_export", "read_export_config"]
