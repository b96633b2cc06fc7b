"""Tiny Megatron GPT models (dense or MoE) on one CPU process, default or strict, for the strict
alignment and rollout tests. Loaded by tests/strict/conftest.py and tests/rollout/conftest.py."""

from __future__ import annotations


import torch

VOCAB = 96
EOD = 0


def init_single_process() -> None:
    """cpu_compat + torch.distributed (world 1) + Megatron model-parallel state, once."""
    from megatron.core import parallel_state

    from minite_megatron.training.presets import init_single_process as init

    first = not parallel_state.model_parallel_is_initialized()
    init(seed=1 if first else None)


def tiny_config(strict: bool, dtype=torch.float32, **overrides):
    """A 2-layer GQA MoE (8 experts, top-2, qk-layernorm, RoPE, SwiGLU); ``strict`` applies
    :func:`minite_megatron.strict_config.strict_config_overrides`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, moe_ffn_hidden_size=32, num_moe_experts=8, moe_router_topk=2,
        normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, moe_token_dispatcher_type="alltoall",
        bias_activation_fusion=False, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        hidden_dropout=0.0, attention_dropout=0.0, moe_router_dtype="fp32", init_method_std=0.05,
    )
    if strict:
        from minite_megatron.strict_config import strict_config_overrides

        kw.update(strict_config_overrides())
    kw.update(overrides)
    return TransformerConfig(**kw)


def strict_block_spec(config):
    """The strict BF16 decoder block: the one spec provider with ``Recipe(precision="bf16",
    strict=True)`` and Megatron's ``SequentialMLP`` experts (batch-invariant linears, norms,
    attention, router and combine)."""
    from minite_megatron.recipe import Recipe
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    return get_gpt_decoder_block_minite_spec(config, Recipe(precision="bf16", strict=True), moe_grouped_gemm=False)


def build_gpt(strict: bool, dtype=torch.float32, seed: int = 7, max_seq: int = 64, device=None, **overrides):
    """The tiny GPT: Megatron's local spec (default) or the strict spec + FP32 strict LM head,
    built on the CPU and moved to ``device`` (default: stays on the CPU)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = tiny_config(strict, dtype, **overrides)
    if strict:
        from minite_megatron.strict_config import check_strict_config

        check_strict_config(config)
        spec = strict_block_spec(config)
    else:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=True, normalization="RMSNorm")
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=max_seq,
                     position_embedding_type="rope")
    if strict:
        from minite_megatron.model import finalize_gpt_model
        from minite_megatron.recipe import Recipe

        finalize_gpt_model(model, Recipe(strict=True))
    model = model.to(dtype).eval()
    return model.to(device) if device is not None else model


def copy_weights(dst, src) -> None:
    """Load ``src``'s parameters into ``dst`` (same architecture, possibly other modules)."""
    with torch.no_grad():
        dst_params = dict(dst.named_parameters())
        for name, p in src.named_parameters():
            dst_params[name].copy_(p)


PROMPTS = [
    [5, 17, 33, 2, 71, 9, 12, 40, 41, 3, 88],
    [64, 7],
    [11, 22, 33, 44, 55],
    [90, 1, 4, 9, 16, 25, 36, 49],
    [3],
]
