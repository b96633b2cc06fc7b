"""Strict (batch-invariant) variants of Megatron's local GPT specs.

:class:`StrictSpecProvider` follows Megatron's ``BackendSpecProvider`` protocol on top of its
``LocalSpecProvider`` and overrides what strict mode changes: the column/row-parallel linears
(batch-invariant GEMM and TP reductions), the norm (batch-invariant RMSNorm, sequence-parallel
capable), the core attention, the experts (``SequentialMLP`` of strict linears), and adds the
router and MoE layer. The builders below only ever call ``backend.X()``.

* :func:`get_gpt_layer_strict_local_spec`: one transformer layer (dense or MoE, optional
  qk-layernorm), the strict counterpart of ``get_gpt_layer_local_spec``.
* :func:`get_gpt_decoder_block_strict_spec`: the whole decoder block for a config (MoE layer
  pattern from ``moe_layer_freq``), including the strict final norm (a plain layer spec would
  get Megatron's default final norm).

The model's LM head is built by ``GPTModel`` itself, not by a spec: pass the model to
:func:`minite_megatron.model.finalize_gpt_model` with a strict recipe (FP32, batch-invariant
output layer). The config must pass :func:`minite_megatron.strict.config.check_strict_config`
(strict activation, no dropout, FP32 router, ...).
"""

from __future__ import annotations

from functools import partial

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ..modules.activation import MiniteActivation
from ..modules.norm import MiniteNorm
from ..specs import build_layer_spec, moe_layer_pattern, moe_module_spec
from .core_attention import StrictDotProductAttention
from .parallel_linear import StrictColumnParallelLinear, StrictRowParallelLinear
from .moe import StrictMoELayer
from .router import StrictTopKRouter

StrictRMSNorm = partial(MiniteNorm, batch_invariant=True)
"""Megatron ``LayerNormBuilder``: RMSNorm with :func:`minite_megatron.strict.rmsnorm.rms_norm`
(sequence-parallel capable; LayerNorm raises in strict mode)."""


class StrictSpecProvider(LocalSpecProvider):
    """Megatron's local provider with strict modules (see the module docstring)."""

    def linear(self):
        return StrictColumnParallelLinear

    def column_parallel_linear(self):
        return StrictColumnParallelLinear

    def row_parallel_linear(self):
        return StrictRowParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return StrictRMSNorm

    def core_attention(self):
        return StrictDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool = False):
        return partial(
            SequentialMLP,
            submodules=MLPSubmodules(linear_fc1=StrictColumnParallelLinear, linear_fc2=StrictRowParallelLinear,
                                     activation_func=MiniteActivation),
        )

    def activation_func(self):
        return MiniteActivation  # elementwise: batch invariant as it is

    def router(self):
        return StrictTopKRouter

    def moe_layer(self):
        return StrictMoELayer


def get_strict_moe_module_spec(backend: StrictSpecProvider | None = None):
    """MoE layer builder: strict router, ``SequentialMLP`` experts and shared experts, and the
    deterministic combine."""
    backend = backend if backend is not None else StrictSpecProvider()
    return moe_module_spec(backend, backend)


def get_gpt_layer_strict_local_spec(num_experts: int | None = None, qk_layernorm: bool = False) -> ModuleSpec:
    """One strict GPT layer: dense (``num_experts=None``) or MoE, optional qk-layernorm."""
    backend = StrictSpecProvider()
    return build_layer_spec(backend, backend, num_experts, qk_layernorm)


def get_gpt_decoder_block_strict_spec(config) -> TransformerBlockSubmodules:
    """The strict decoder block for ``config`` (all layers; MoE where ``moe_layer_freq`` says)."""
    if config.pipeline_model_parallel_size > 1:
        raise NotImplementedError("get_gpt_decoder_block_strict_spec builds single-stage blocks (no pipeline parallelism)")
    pattern = moe_layer_pattern(config)
    layers = [
        get_gpt_layer_strict_local_spec(config.num_moe_experts if moe else None, qk_layernorm=config.qk_layernorm)
        for moe in pattern
    ]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=StrictRMSNorm)
