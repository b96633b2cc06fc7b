"""Which rollout path can run a model: the CUDA-graph decode path or Megatron's static engine.

:func:`fast_path_refusal` walks a ``GPTModel`` (unwrapping ``Float16Module`` / DDP) and returns
the first reason the decode runner (:mod:`.decode_step`) cannot run it, or None. The runner
knows: one pipeline stage and tensor/context/expert parallelism of 1; RoPE, learned absolute or
no position embedding; Megatron's ``TransformerLayer`` with ``SelfAttention`` (any core
attention module: it is called as the learner calls it), no cross attention; dense ``MLP`` or an
``MoELayer`` (any subclass: the minite/strict deterministic ones, Megatron's) with a
``TopKRouter``, experts of ``TEGroupedMLP`` over miniTE's ``NVFP4GroupedLinear`` or Megatron's
``SequentialMLP``, optional shared experts without a gate; linears that are Megatron's
column/row-parallel linears or subclasses (miniTE's NVFP4 ones run on their quantized bytes).

:func:`graph_refusal` says why the decode step of a runnable model cannot be captured in a CUDA
graph (it then runs eagerly: a CPU, ``nonfinite="raise"`` recipes, strict BF16 experts that
need a per-expert host loop).
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..modules.grouped_linear import NVFP4GroupedLinear


def unwrap_gpt(model: torch.nn.Module) -> GPTModel | None:
    """The ``GPTModel`` inside ``model`` (through ``.module`` wrappers), or None."""
    m = model
    for _ in range(8):
        if isinstance(m, GPTModel):
            return m
        m = getattr(m, "module", None)
        if m is None:
            return None
    return None


def is_nvfp4_linear(module) -> bool:
    """A miniTE NVFP4 dense linear running in NVFP4 (not its BF16 precision)."""
    from ..modules.linear import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear

    return isinstance(module, (NVFP4ColumnParallelLinear, NVFP4RowParallelLinear)) and module.precision == "nvfp4"


def _linear_refusal(name: str, module) -> str | None:
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return f"{name} is a {type(module).__name__} (not a Megatron column/row-parallel linear)"
    return None


def _mlp_refusal(name: str, mlp, config) -> str | None:
    for sub in ("linear_fc1", "linear_fc2"):
        why = _linear_refusal(f"{name}.{sub}", getattr(mlp, sub))
        if why:
            return why
    if not config.use_te_activation_func and config.bias_activation_fusion:
        if not (config.gated_linear_unit and config.activation_func is torch.nn.functional.silu):
            return f"{name}: bias_activation_fusion other than SwiGLU"
    if getattr(mlp, "use_shared_expert_gate", False):
        return f"{name}: a shared-expert gate"
    return None


def _experts_refusal(name: str, experts, config) -> str | None:
    if isinstance(experts, TEGroupedMLP):
        for sub in ("linear_fc1", "linear_fc2"):
            if not isinstance(getattr(experts, sub), NVFP4GroupedLinear):
                return f"{name}.{sub} is a {type(getattr(experts, sub)).__name__} (not miniTE's NVFP4GroupedLinear)"
        if experts.linear_fc1.use_bias or experts.linear_fc2.use_bias:
            return f"{name}: expert biases"
        if not config.use_te_activation_func and config.bias_activation_fusion:
            return f"{name}: bias_activation_fusion in grouped experts"
        return None
    if isinstance(experts, SequentialMLP):
        for i, e in enumerate(experts.local_experts):
            why = _mlp_refusal(f"{name}.local_experts.{i}", e, config)
            if why:
                return why
        return None
    return f"{name} is a {type(experts).__name__} (not TEGroupedMLP or SequentialMLP)"


def _layer_refusal(i: int, layer) -> str | None:
    name = f"decoder.layers.{i}"
    if type(layer) is not TransformerLayer:
        return f"{name} is a {type(layer).__name__}"
    config = layer.config
    attn = layer.self_attention
    if not isinstance(attn, SelfAttention):
        return f"{name}.self_attention is a {type(attn).__name__} (not SelfAttention)"
    if not isinstance(layer.cross_attention, IdentityOp):
        return f"{name} has cross attention"
    for sub in ("linear_qkv", "linear_proj"):
        why = _linear_refusal(f"{name}.self_attention.{sub}", getattr(attn, sub))
        if why:
            return why
    mlp = layer.mlp
    if isinstance(mlp, MoELayer):
        if not isinstance(mlp.router, TopKRouter):
            return f"{name}.mlp.router is a {type(mlp.router).__name__}"
        if getattr(mlp, "_inference_token_dispatcher", None) is not None:
            return f"{name}: the inference-optimized MoE dispatcher"
        why = _experts_refusal(f"{name}.mlp.experts", mlp.experts, config)
        if why:
            return why
        if mlp.use_shared_expert:
            return _mlp_refusal(f"{name}.mlp.shared_experts", mlp.shared_experts, config)
        return None
    if isinstance(mlp, MLP):
        return _mlp_refusal(f"{name}.mlp", mlp, config)
    return f"{name}.mlp is a {type(mlp).__name__}"


def fast_path_refusal(model: torch.nn.Module) -> str | None:
    """Why the CUDA-graph decode runner cannot run ``model`` (None: it can). See the module docstring."""
    gpt = unwrap_gpt(model)
    if gpt is None:
        return f"{type(model).__name__} is not (a wrapper of) a Megatron GPTModel"
    c = gpt.config
    for flag, value in (
        ("tensor_model_parallel_size", c.tensor_model_parallel_size),
        ("pipeline_model_parallel_size", c.pipeline_model_parallel_size),
        ("context_parallel_size", c.context_parallel_size),
        ("expert_model_parallel_size", c.expert_model_parallel_size),
    ):
        if value and value > 1:
            return f"{flag}={value}"
    if c.sequence_parallel:
        return "sequence_parallel"
    if not (gpt.pre_process and gpt.post_process):
        return "a pipeline stage without the embedding or the output layer"
    if getattr(c, "mtp_num_layers", None):
        return "multi-token prediction layers"
    if gpt.position_embedding_type not in ("rope", "learned_absolute", "none"):
        return f"position_embedding_type={gpt.position_embedding_type!r}"
    if c.multi_latent_attention:
        return "multi-latent attention"
    if c.window_size is not None:
        return "sliding-window attention"
    if getattr(c, "attention_output_gate", False):
        return "a gated attention output"
    if c.fp32_residual_connection:
        return "fp32_residual_connection"
    if c.num_moe_experts and (
        c.moe_expert_capacity_factor is not None or c.moe_apply_probs_on_input or getattr(c, "moe_latent_size", None)
        or getattr(c, "moe_mlp_glu_interleave_size", None)
    ):
        return "MoE token dropping, probabilities on the input, latent MoE or interleaved GLU weights"
    if c.flash_decode:
        return "flash_decode"
    if gpt.decoder.final_layernorm is None and gpt.decoder.post_layer_norm:
        return "a decoder without its final norm"
    for i, layer in enumerate(gpt.decoder.layers):
        why = _layer_refusal(i, layer)
        if why:
            return why
    return None


def graph_refusal(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why the decode step of a fast-path model runs eagerly instead of in CUDA graphs (None: graphs)."""
    if device.type != "cuda":
        return f"the model is on {device.type} (CUDA graphs need a GPU)"
    gpt = unwrap_gpt(model)
    if gpt.training and (gpt.config.attention_dropout or gpt.config.hidden_dropout):
        return "the model is in training mode with dropout (a captured step cannot fork the RNG tracker)"
    for m in gpt.modules():
        recipe = getattr(m, "recipe", None)
        if recipe is not None and getattr(recipe, "nonfinite", "propagate") == "raise":
            return "recipe.nonfinite='raise' checks activations on the host"
        strict = recipe is not None and recipe.strict
        if isinstance(m, NVFP4GroupedLinear) and m.precision != "nvfp4" and strict:
            return "strict BF16 grouped experts run one batch-invariant GEMM per expert (host loop)"
        if isinstance(m, SequentialMLP) and any(getattr(getattr(x, "recipe", None), "strict", False) for x in m.modules()):
            return "strict SequentialMLP experts run one batch-invariant GEMM per expert (host loop)"
    return None
