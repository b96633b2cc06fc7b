"""What a ``TransformerConfig`` must say for strict mode, and how to get there.

:func:`strict_config_errors` lists every setting that would break bitwise alignment between
the learner and the rollout engine (or that the strict modules do not implement), naming the
field and the reason; :func:`check_strict_config` raises with that list;
:func:`strict_config_overrides` gives the field values that fix the fixable ones (a dict for
``TransformerConfig(**base, **overrides)`` or ``dataclasses.replace``).
"""

from __future__ import annotations

import torch.nn.functional as F

from .invariant.activations import gelu_tanh, silu

STRICT_ACTIVATIONS = (silu, gelu_tanh)


class StrictConfigError(ValueError):
    """A config setting strict mode cannot honour; the message names the fields."""


def strict_config_errors(config) -> list[str]:
    """Human-readable problems of ``config`` for strict mode (empty when it is fine)."""
    errors = []
    if config.normalization != "RMSNorm":
        errors.append("normalization must be 'RMSNorm' (the strict norm)")
    if config.activation_func not in STRICT_ACTIVATIONS:
        hint = " (use minite_megatron.invariant.activations.silu)" if config.activation_func is F.silu else ""
        errors.append(
            f"activation_func {getattr(config.activation_func, '__name__', config.activation_func)!r} is not a "
            f"strict activation{hint}: torch's silu/sigmoid round by element position on CPU"
        )
    if config.bias_activation_fusion:
        errors.append("bias_activation_fusion must be False (the fused kernels call torch's own activation)")
    if config.attention_dropout or config.hidden_dropout:
        errors.append("attention_dropout and hidden_dropout must be 0 (dropout differs between learner and sampler)")
    if config.apply_rope_fusion:
        errors.append("apply_rope_fusion must be False (TE's fused RoPE)")
    if config.flash_decode:
        errors.append("flash_decode must be False (it bypasses the core attention)")
    if config.multi_latent_attention:
        errors.append("multi_latent_attention is not supported in strict mode")
    if config.window_size is not None:
        errors.append("window_size (sliding-window attention) is not supported in strict mode")
    if config.softmax_type != "vanilla":
        errors.append("softmax_type must be 'vanilla'")
    if getattr(config, "cuda_graph_impl", "none") in ("local", "transformer_engine"):
        errors.append("cuda_graph_impl must be 'none' or 'full_iteration' (per-layer graph managers are not "
                      "wired to the minite layers)")
    if config.num_moe_experts:
        if config.moe_router_dtype != "fp32":
            errors.append("moe_router_dtype must be 'fp32' (FP32 router logits)")
        if config.moe_expert_capacity_factor is not None:
            errors.append("moe_expert_capacity_factor must be None (token dropping depends on the batch)")
        if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            errors.append("moe_token_dispatcher_type must be 'allgather' or 'alltoall'")
        if config.moe_permute_fusion or config.moe_router_fusion:
            errors.append("moe_permute_fusion and moe_router_fusion must be False (TE kernels)")
        if config.moe_router_load_balancing_type in ("sinkhorn", "quantile_balancing"):
            errors.append(f"moe_router_load_balancing_type {config.moe_router_load_balancing_type!r} is not supported")
        if config.moe_grouped_gemm:
            errors.append("moe_grouped_gemm must be False for the strict local spec (SequentialMLP experts)")
    return errors


def check_strict_config(config) -> None:
    """Raise :class:`StrictConfigError` listing every problem of ``config`` for strict mode."""
    errors = strict_config_errors(config)
    if errors:
        raise StrictConfigError("config not usable in strict mode:\n  - " + "\n  - ".join(errors))


def strict_config_overrides(config=None) -> dict:
    """Field values that make a config strict-compatible where that is a choice, not a model
    change: the strict silu (for a silu/swiglu model), no bias-activation fusion, no dropout,
    FP32 router logits, unfused RoPE/permute/router. Pass the current config to keep a
    ``gelu_tanh`` activation."""
    overrides = dict(
        bias_activation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        apply_rope_fusion=False,
        moe_router_dtype="fp32",
        moe_permute_fusion=False,
        moe_router_fusion=False,
        masked_softmax_fusion=False,
    )
    if config is None or config.activation_func not in STRICT_ACTIVATIONS:
        overrides["activation_func"] = silu
    return overrides
