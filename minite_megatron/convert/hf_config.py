"""Hugging Face Qwen3 / Qwen3-MoE ``config.json`` -> Megatron ``TransformerConfig`` + ``GPTModel`` kwargs.

Every field of the config is either mapped, checked against the one value Megatron can express,
or known to be metadata (token ids, dtype, versions). Anything else -- an unknown model type, an
unknown field, a quantized checkpoint, sliding-window attention, a RoPE scaling, attention biases
-- raises :class:`~.errors.ConvertError` with one line naming the field, instead of building a
model that computes something else.

========================================  ==================================================
HF field                                  Megatron
========================================  ==================================================
``num_hidden_layers``                     ``num_layers``
``hidden_size``                           ``hidden_size``
``intermediate_size``                     ``ffn_hidden_size`` (dense layers)
``num_attention_heads``                   ``num_attention_heads``
``num_key_value_heads``                   ``num_query_groups`` (GQA)
``head_dim``                              ``kv_channels`` (default ``hidden_size // heads``)
``rms_norm_eps``                          ``layernorm_epsilon`` (``normalization="RMSNorm"``)
``hidden_act="silu"``                     ``gated_linear_unit=True``, ``activation_func=silu``
(always, Qwen3)                           ``qk_layernorm=True``, no biases
``attention_dropout``                     ``attention_dropout`` (``hidden_dropout=0``)
``initializer_range``                     ``init_method_std``
``num_experts``                           ``num_moe_experts``
``num_experts_per_tok``                   ``moe_router_topk``
``moe_intermediate_size``                 ``moe_ffn_hidden_size``
``norm_topk_prob``                        ``moe_router_pre_softmax = not norm_topk_prob``
``decoder_sparse_step``, ``mlp_only_layers``  ``moe_layer_freq``: 1 if all layers are MoE, else a 0/1 list
``router_aux_loss_coef``                  ``moe_aux_loss_coeff`` (``aux_loss`` balancing)
(router)                                  ``moe_router_dtype="fp32"``, alltoall dispatcher
``vocab_size``                            ``GPTModel(vocab_size=...)`` (padded, see below)
``max_position_embeddings``               ``GPTModel(max_sequence_length=...)``
``rope_theta`` / ``rope_parameters``      ``GPTModel(rotary_base=...)``, ``position_embedding_type="rope"``
``tie_word_embeddings``                   ``GPTModel(share_embeddings_and_output_weights=...)``
========================================  ==================================================

Softmax routing: HF takes the softmax over all experts, then the top-k, then (``norm_topk_prob``)
renormalises over the k; Megatron's default (top-k of the logits, softmax over the k) is the same
distribution, and ``moe_router_pre_softmax=True`` (softmax, then top-k, no renormalisation) is
HF's ``norm_topk_prob=False``. Qwen3-MoE has no shared experts and no expert bias.

Vocabulary padding: ``make_vocab_size_divisible_by`` (default 1 here, 128 in ``megatron.training``)
times the tensor-parallel size, as ``megatron.training`` pads; the extra embedding and output rows
are zero on import and dropped on export.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .errors import ConvertError

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# Fields that describe the checkpoint or inference, not the function the model computes.
_METADATA = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "_name_or_path",
    "_attn_implementation_autoset", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "pruned_heads", "tie_encoder_decoder", "is_decoder", "is_encoder_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "chunk_size_feed_forward", "finetuning_task",
    "id2label", "label2id", "tokenizer_class", "prefix", "task_specific_params", "problem_type",
    # generation defaults that transformers 4.x wrote into config.json
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # training-time only
    "output_router_logits",
}
_MODEL = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "attention_dropout",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
}
_MOE = {
    "decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok", "num_experts", "num_local_experts",
    "norm_topk_prob", "router_aux_loss_coef", "mlp_only_layers",
}


@dataclass(frozen=True)
class HFModelDims:
    """The sizes of a Qwen3 / Qwen3-MoE model, from its config (``experts == 0``: dense)."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    max_positions: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    attention_dropout: float
    init_std: float
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.0
    moe_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


def read_hf_config(source: Any) -> dict:
    """The config as a dict: from a checkpoint directory, a ``config.json`` path, a dict, or a
    ``transformers`` config object. Raises ConvertError for a missing or unreadable file."""
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_dict") and not isinstance(source, (str, Path)):
        return dict(source.to_dict())
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConvertError(f"convert: {path} does not exist (a Hugging Face checkpoint needs its config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"convert: {path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"convert: {path} does not hold a JSON object")
    return cfg


def _int(cfg: dict, name: str, default: Any = None) -> int:
    v = cfg.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConvertError(f"convert: config field {name}={v!r} must be a positive integer")
    return v


def _rope_theta(cfg: dict) -> float:
    """``rope_theta`` (transformers 4.x) or ``rope_parameters.rope_theta`` (5.x); plain RoPE only."""
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ConvertError(f"convert: config field rope_parameters={params!r} must be an object")
        for key, value in params.items():
            if key == "rope_type" and value != "default":
                raise ConvertError(f"convert: config field rope_parameters.rope_type={value!r} is not supported "
                                   "(Megatron's GPTModel here runs plain RoPE only)")
            if key not in ("rope_type", "rope_theta"):
                raise ConvertError(f"convert: config field rope_parameters.{key} is not supported (plain RoPE only)")
        theta = params.get("rope_theta", theta)
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type"))
                                    == "default" and set(scaling) <= {"rope_type", "type", "rope_theta"}):
        raise ConvertError(f"convert: config field rope_scaling={scaling!r} is not supported (plain RoPE only)")
    if theta is None:
        theta = 10000.0
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ConvertError(f"convert: config field rope_theta={theta!r} must be a positive number")
    return float(theta)


def check_hf_config(cfg: dict) -> None:
    """Raise ConvertError (one line, naming the field) unless Megatron can express ``cfg`` exactly."""
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConvertError(f"convert: config field model_type={model_type!r} is not supported "
                           f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    arch = cfg.get("architectures")
    if arch is not None and list(arch) != [ARCHITECTURES[model_type]]:
        raise ConvertError(f"convert: config field architectures={arch!r} is not supported "
                           f"(expected [{ARCHITECTURES[model_type]!r}])")
    if "quantization_config" in cfg:
        raise ConvertError("convert: config field quantization_config: quantized Hugging Face checkpoints are not "
                           "supported (convert the BF16 checkpoint)")
    known = _METADATA | _MODEL | (_MOE if model_type == "qwen3_moe" else set())
    for name in cfg:
        if name not in known:
            raise ConvertError(f"convert: config field {name!r} is not supported for model_type={model_type!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"convert: config field hidden_act={cfg['hidden_act']!r} is not supported (Qwen3: 'silu')")
    if cfg.get("attention_bias", False):
        raise ConvertError("convert: config field attention_bias=true is not supported (Megatron has q/k/v biases "
                           "only together with every other linear's bias)")
    if cfg.get("use_sliding_window", False):
        raise ConvertError("convert: config field use_sliding_window=true is not supported (full attention only)")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ConvertError("convert: config field layer_types holds layers other than 'full_attention' "
                           "(sliding-window layers are not supported)")
    if not isinstance(cfg.get("tie_word_embeddings", False), bool):
        raise ConvertError(f"convert: config field tie_word_embeddings={cfg['tie_word_embeddings']!r} must be a boolean")
    _rope_theta(cfg)
    for name in ("attention_dropout", "rms_norm_eps", "initializer_range", "router_aux_loss_coef"):
        v = cfg.get(name, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConvertError(f"convert: config field {name}={v!r} must be a finite number >= 0")


def hf_dims(source: Any) -> HFModelDims:
    """Check the config (:func:`check_hf_config`) and return its :class:`HFModelDims`."""
    cfg = read_hf_config(source)
    check_hf_config(cfg)
    layers = _int(cfg, "num_hidden_layers")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    groups = _int(cfg, "num_key_value_heads", heads)
    if heads % groups:
        raise ConvertError(f"convert: config field num_key_value_heads={groups} must divide num_attention_heads={heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim")
    common = dict(
        model_type=cfg["model_type"], layers=layers, hidden=hidden, heads=heads, groups=groups, head_dim=head_dim,
        ffn=_int(cfg, "intermediate_size"), vocab=_int(cfg, "vocab_size"),
        max_positions=_int(cfg, "max_position_embeddings"), rope_theta=_rope_theta(cfg),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)), init_std=float(cfg.get("initializer_range", 0.02)),
    )
    if cfg["model_type"] == "qwen3":
        return HFModelDims(**common)
    if "num_experts" in cfg and "num_local_experts" in cfg and cfg["num_experts"] != cfg["num_local_experts"]:
        raise ConvertError("convert: config fields num_experts and num_local_experts disagree")
    experts = _int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts")
    topk = _int(cfg, "num_experts_per_tok")
    if topk > experts:
        raise ConvertError(f"convert: config field num_experts_per_tok={topk} exceeds num_experts={experts}")
    step = _int(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                          for i in dense):
        raise ConvertError(f"convert: config field mlp_only_layers={dense!r} must list layer indices in [0, {layers})")
    norm_topk = cfg.get("norm_topk_prob", False)
    if not isinstance(norm_topk, bool):
        raise ConvertError(f"convert: config field norm_topk_prob={norm_topk!r} must be a boolean")
    # transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % step == 0
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return HFModelDims(
        **common, experts=experts, topk=topk, moe_ffn=_int(cfg, "moe_intermediate_size"), norm_topk_prob=norm_topk,
        aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)), moe_layers=moe_layers,
    )


def moe_layer_freq(d: HFModelDims) -> int | list[int]:
    """Megatron's ``moe_layer_freq``: ``1`` when every layer is MoE (what ``--moe-layer-freq``
    defaults to: the checkpoint keys then stack the layers, as a run with the default expects),
    else the 0/1 list (per-layer keys)."""
    pattern = [1 if d.is_moe_layer(i) else 0 for i in range(d.layers)]
    return 1 if all(pattern) else pattern


def padded_vocab_size(vocab: int, divisible_by: int = 1, tensor_parallel: int = 1) -> int:
    """``vocab`` rounded up to a multiple of ``divisible_by * tensor_parallel`` (megatron.training's rule)."""
    multiple = max(1, int(divisible_by)) * max(1, int(tensor_parallel))
    return -(-vocab // multiple) * multiple


def _parallel_sizes() -> dict[str, int]:
    """The sizes of Megatron's current parallel state (all 1 when it is not initialized)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                    expert_tensor_parallel_size=1)
    return dict(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
    )


_GPT_KWARGS = {"vocab_size", "max_sequence_length", "position_embedding_type", "rotary_base", "rotary_percent",
               "share_embeddings_and_output_weights", "parallel_output", "pre_process", "post_process"}


def transformer_config_from_hf(source: Any, **overrides: Any):
    """``(TransformerConfig, GPTModel kwargs)`` for a Qwen3 / Qwen3-MoE config (module docstring).

    Args:
        source: a checkpoint directory, a ``config.json`` path, a dict or a ``transformers`` config.
        overrides: ``TransformerConfig`` fields (e.g. ``params_dtype``, ``sequence_parallel``,
            ``use_cpu_initialization``) or ``GPTModel`` kwargs (e.g. ``max_sequence_length``) that
            replace the derived values, and ``make_vocab_size_divisible_by`` (default 1). The
            parallel sizes default to Megatron's current parallel state (1 when uninitialized);
            ``sequence_parallel`` defaults to ``tensor_model_parallel_size > 1`` (Megatron needs it
            for MoE under TP).

    Returns:
        ``(config, model_kwargs)``: ``GPTModel(config, spec, **model_kwargs)`` builds the model.

    Raises:
        ConvertError: an unsupported config (one line naming the field) or an unknown override.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    d = hf_dims(source)
    overrides = dict(overrides)
    divisible_by = overrides.pop("make_vocab_size_divisible_by", 1)
    model_over = {k: overrides.pop(k) for k in list(overrides) if k in _GPT_KWARGS}
    tc_fields = {f.name for f in fields(TransformerConfig)}
    unknown = sorted(set(overrides) - tc_fields)
    if unknown:
        raise ConvertError(f"convert: {unknown[0]!r} is neither a TransformerConfig field nor a GPTModel argument")
    sizes = _parallel_sizes()
    sizes.update({k: overrides.pop(k) for k in list(overrides) if k in sizes})
    kw: dict[str, Any] = dict(
        num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn, num_attention_heads=d.heads,
        num_query_groups=d.groups, kv_channels=d.head_dim, normalization="RMSNorm", layernorm_epsilon=d.rms_eps,
        qk_layernorm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=d.attention_dropout, attention_softmax_in_fp32=True,
        init_method_std=d.init_std, bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        sequence_parallel=sizes["tensor_model_parallel_size"] > 1, **sizes,
    )
    if d.experts:
        kw.update(
            num_moe_experts=d.experts, moe_router_topk=d.topk, moe_ffn_hidden_size=d.moe_ffn,
            moe_router_pre_softmax=not d.norm_topk_prob, moe_router_dtype="fp32",
            moe_layer_freq=moe_layer_freq(d),
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=d.aux_loss_coef,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        )
    kw.update(overrides)
    if kw["pipeline_model_parallel_size"] > 1:
        kw.setdefault("pipeline_dtype", kw.get("params_dtype", torch.float32))  # the activations sent between stages
    try:
        config = TransformerConfig(**kw)
    except (AssertionError, ValueError) as e:
        raise ConvertError(f"convert: Megatron refuses the configuration: {str(e).splitlines()[0] if str(e) else e!r}") from None
    model_kwargs = dict(
        vocab_size=padded_vocab_size(d.vocab, divisible_by, config.tensor_model_parallel_size),
        max_sequence_length=d.max_positions, position_embedding_type="rope", rotary_base=d.rope_theta,
        rotary_percent=1.0, share_embeddings_and_output_weights=d.tie_embeddings,
    )
    model_kwargs.update(model_over)
    return config, model_kwargs


__all__ = ["HFModelDims", "check_hf_config", "hf_dims", "moe_layer_freq", "padded_vocab_size", "read_hf_config",
           "transformer_config_from_hf"]
