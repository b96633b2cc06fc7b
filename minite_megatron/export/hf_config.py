"""The Hugging Face ``config.json`` of an exported model (Qwen3 dense or Qwen3-MoE names).

Input: a Megatron ``TransformerConfig`` (or any object / dict with its field names) plus the
values that live outside it (``vocab_size``, ``rope_theta``, ``max_position_embeddings``, tied
embeddings, which layers are MoE). Megatron settings the Qwen3 layout cannot express raise
ValueError instead of being exported as a different model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

_MISSING = object()


def cfg_get(cfg: Any, name: str, default: Any = _MISSING) -> Any:
    """``cfg.name`` or ``cfg[name]``; ``default`` if absent (ValueError if no default)."""
    if isinstance(cfg, Mapping):
        if name in cfg:
            return cfg[name]
    elif hasattr(cfg, name):
        return getattr(cfg, name)
    if default is _MISSING:
        raise ValueError(f"export: the model config has no {name!r}")
    return default


def _is_silu(act: Any) -> bool:
    if act is None:
        return False
    if isinstance(act, str):
        return act in ("silu", "swish")
    return act in (torch.nn.functional.silu,) or getattr(act, "__name__", "") == "silu"


def _first(v: Any) -> float:
    """Megatron allows a list of aux-loss coefficients (one per loss type): HF has one."""
    if isinstance(v, (list, tuple)):
        v = v[0] if v else 0.0
    return float(v or 0.0)


def dims(cfg: Any) -> dict[str, int]:
    """hidden, heads, groups, head_dim, ffn, moe_ffn, experts, topk, layers from a Megatron config."""
    heads = int(cfg_get(cfg, "num_attention_heads"))
    hidden = int(cfg_get(cfg, "hidden_size"))
    groups = cfg_get(cfg, "num_query_groups", None) or heads
    head_dim = cfg_get(cfg, "kv_channels", None) or hidden // heads
    experts = cfg_get(cfg, "num_moe_experts", None) or 0
    return {
        "layers": int(cfg_get(cfg, "num_layers")),
        "hidden": hidden,
        "heads": heads,
        "groups": int(groups),
        "head_dim": int(head_dim),
        "ffn": int(cfg_get(cfg, "ffn_hidden_size", None) or 4 * hidden),
        "moe_ffn": int(cfg_get(cfg, "moe_ffn_hidden_size", None) or 0),
        "experts": int(experts),
        "topk": int(cfg_get(cfg, "moe_router_topk", 0) or 0),
    }


def check_supported(cfg: Any) -> None:
    """Raise ValueError for Megatron settings the Qwen3 / Qwen3-MoE layout cannot express."""
    problems = []
    if cfg_get(cfg, "normalization", "RMSNorm") != "RMSNorm":
        problems.append(f"normalization={cfg_get(cfg, 'normalization')!r} (Qwen3 uses RMSNorm)")
    if not cfg_get(cfg, "gated_linear_unit", False):
        problems.append("gated_linear_unit=False (Qwen3 MLPs are gated: gate/up/down)")
    act = cfg_get(cfg, "activation_func", "silu")
    if not _is_silu(act):
        problems.append(f"activation_func={getattr(act, '__name__', act)!r} (Qwen3 uses silu)")
    for flag in ("add_bias_linear", "add_qkv_bias", "attention_output_gate"):
        if cfg_get(cfg, flag, False):
            problems.append(f"{flag}=True")
    if cfg_get(cfg, "moe_shared_expert_intermediate_size", None):
        problems.append("shared experts (Qwen3-MoE has none)")
    if (cfg_get(cfg, "num_moe_experts", None) or 0) > 0:
        if cfg_get(cfg, "moe_router_score_function", "softmax") != "softmax":
            problems.append(f"moe_router_score_function={cfg_get(cfg, 'moe_router_score_function')!r}")
        if cfg_get(cfg, "moe_router_topk_scaling_factor", None) not in (None, 1, 1.0):
            problems.append("moe_router_topk_scaling_factor")
        if cfg_get(cfg, "moe_router_enable_expert_bias", False):
            problems.append("moe_router_enable_expert_bias (aux-loss-free expert bias)")
        if (cfg_get(cfg, "moe_router_num_groups", None) or 1) > 1:
            problems.append("grouped routing (moe_router_num_groups)")
    if problems:
        raise ValueError("export: not representable as Qwen3/Qwen3-MoE: " + "; ".join(problems))


def build_hf_config(
    cfg: Any,
    *,
    vocab_size: int,
    rope_theta: float,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    moe_layers: Sequence[int],
    torch_dtype: torch.dtype,
) -> dict[str, Any]:
    """The HF config dict (without ``quantization_config``)."""
    check_supported(cfg)
    d = dims(cfg)
    out: dict[str, Any] = {
        "vocab_size": int(vocab_size),
        "hidden_size": d["hidden"],
        "intermediate_size": d["ffn"],
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["groups"],
        "head_dim": d["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": int(max_position_embeddings),
        "rms_norm_eps": float(cfg_get(cfg, "layernorm_epsilon", 1e-5)),
        "rope_theta": float(rope_theta),
        "rope_scaling": None,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": str(torch_dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if d["experts"]:
        out.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=d["experts"],
            num_experts_per_tok=d["topk"],
            moe_intermediate_size=d["moe_ffn"],
            # Megatron applies the softmax after the top-k (renormalised over the k) unless
            # moe_router_pre_softmax: that is HF's norm_topk_prob.
            norm_topk_prob=not bool(cfg_get(cfg, "moe_router_pre_softmax", False)),
            decoder_sparse_step=1,
            mlp_only_layers=sorted(set(range(d["layers"])) - set(moe_layers)),
            output_router_logits=False,
            router_aux_loss_coef=_first(cfg_get(cfg, "moe_aux_loss_coeff", 0.0)),
        )
    else:
        if moe_layers:
            raise ValueError("export: router weights given for a config without num_moe_experts")
        out.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    return out


__all__ = ["build_hf_config", "cfg_get", "check_supported", "dims"]
