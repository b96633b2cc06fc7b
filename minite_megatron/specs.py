"""Megatron-Core layer specs for miniTE: NVFP4 linears, grouped NVFP4 experts, BF16 overrides.

``MiniteSpecProvider`` follows Megatron's ``BackendSpecProvider`` protocol: it wraps a fallback
provider (Megatron's local one) and overrides only the linears, the grouped experts, the norm
(sequence-parallel capable; batch invariant in strict mode), the core attention (torch SDPA; batch
invariant in strict mode) and the router in strict mode. ``Recipe(precision="bf16")`` builds the
fair BF16 twin: the same modules with every linear in BF16. The builders below only ever call ``backend.X()``.

* :func:`get_gpt_layer_minite_spec`: one transformer layer (dense or MoE; qk-layernorm; per-layer
  BF16 override; in strict mode batch-invariant attention, norms, router and linears).
* :func:`get_gpt_decoder_block_minite_spec`: the decoder block for a config, with the recipe's BF16
  first/last layers, ``--moe-layer-freq`` and the layers of this pipeline stage.
"""

from __future__ import annotations

import logging
from functools import partial

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import _build_shared_experts
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from .modules.attention import MiniteDotProductAttention
from .modules.grouped_linear import NVFP4GroupedLinear
from .modules.grouped_mlp import MiniteGroupedMLP
from .modules.moe import MiniteMoELayer
from .modules.linear import MiniteConfigError, NVFP4ColumnParallelLinear, NVFP4RowParallelLinear, check_multiple_of_16
from .modules.activation import MiniteActivation
from .modules.norm import MiniteNorm
from .ops.handoff import Handoff
from .recipe import Recipe
from .settings import settings

log = logging.getLogger(__name__)


def _precision(recipe: Recipe, quantized: bool, layer_in_bf16: bool) -> str:
    return "nvfp4" if recipe.quantized and quantized and not layer_in_bf16 else "bf16"


class MiniteSpecProvider(BackendSpecProvider):
    """miniTE's backend: NVFP4 linears under ``recipe``; everything else from ``fallback``."""

    def __init__(
        self,
        recipe: Recipe | None = None,
        *,
        linear_precision: str = "nvfp4",
        expert_precision: str = "nvfp4",
        fallback: BackendSpecProvider | None = None,
    ):
        self.recipe = recipe if recipe is not None else Recipe()
        self.linear_precision = linear_precision
        self.expert_precision = expert_precision
        self.fallback = fallback if fallback is not None else LocalSpecProvider()

    # ---- linears ------------------------------------------------------------------------------
    def linear(self):
        return self.column_parallel_linear()

    def column_parallel_linear(self, handoff: Handoff | None = None):
        return partial(NVFP4ColumnParallelLinear, recipe=self.recipe, precision=self.linear_precision, handoff=handoff)

    def row_parallel_linear(self, handoff: Handoff | None = None):
        return partial(NVFP4RowParallelLinear, recipe=self.recipe, precision=self.linear_precision, handoff=handoff)

    def handoff(self) -> Handoff | None:
        """A producer -> NVFP4 linear slot for this provider's linears (None in BF16), passed to both."""
        return Handoff(self.recipe) if self.linear_precision == "nvfp4" else None

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self):
        return None

    # ---- experts --------------------------------------------------------------------------------
    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool = True):
        """All local experts in one grouped NVFP4 op behind Megatron's grouped-MLP module (its
        activation times the routing probabilities fused, handing an NVFP4 fc2 its quantized
        input: :class:`~.modules.grouped_mlp.MiniteGroupedMLP`); with
        ``moe_use_grouped_gemm=False`` Megatron's ``SequentialMLP`` of NVFP4 column/row linears
        (one expert MLP after the other, as Megatron's local provider builds them). Both write
        the same checkpoint keys (``NVFP4GroupedLinear.sharded_state_dict``)."""
        if not moe_use_grouped_gemm:
            return partial(
                SequentialMLP,
                submodules=MLPSubmodules(
                    linear_fc1=partial(NVFP4ColumnParallelLinear, recipe=self.recipe, precision=self.expert_precision),
                    linear_fc2=partial(NVFP4RowParallelLinear, recipe=self.recipe, precision=self.expert_precision),
                    activation_func=MiniteActivation,  # no handoff: the router probabilities come first
                ),
            )
        # the fused activation x routing probability hands an NVFP4 fc2 its quantization (modules.grouped_mlp)
        fc2 = Handoff(self.recipe) if self.expert_precision == "nvfp4" else None
        return partial(
            MiniteGroupedMLP,
            submodules=GroupedMLPSubmodules(
                linear_fc1=partial(NVFP4GroupedLinear, recipe=self.recipe, parallel_mode="column", precision=self.expert_precision),
                linear_fc2=partial(NVFP4GroupedLinear, recipe=self.recipe, parallel_mode="row", precision=self.expert_precision,
                                   handoff=fc2),
                activation_func=MiniteActivation,
            ),
            recipe=self.recipe,
            offer_to=fc2,
        )

    # ---- the rest: fallback, or the strict (batch-invariant) modules -----------------------------
    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        """RMSNorm batch invariant in strict mode, and in default mode with ``recipe.aligned_ops``."""
        return partial(MiniteNorm, batch_invariant=self.recipe.strict, aligned=self.recipe.aligned_ops)

    def input_norm(self, offer_to: Handoff | None = None):
        """The norm in front of this provider's column-parallel linear (qkv, dense fc1): it hands
        an NVFP4 linear its quantized output through ``offer_to`` (fused on the GPU: ``ops.producers``)."""
        return partial(MiniteNorm, batch_invariant=self.recipe.strict, aligned=self.recipe.aligned_ops, offer_to=offer_to)

    def core_attention(self):
        """Strict mode: the batch-invariant attention; default mode: the same forward with
        ``recipe.aligned_attention`` (training with attention dropout falls back to SDPA), else
        torch SDPA (flash / cuDNN kernels)."""
        if self.recipe.strict:
            from .modules.core_attention import StrictDotProductAttention

            return StrictDotProductAttention
        if self.recipe.aligned_attention:
            from .modules.core_attention import AlignedDotProductAttention

            return AlignedDotProductAttention
        return MiniteDotProductAttention

    def router(self):
        """Strict mode: FP32 batch-invariant gating and stable top-k (refusing what it cannot make
        deterministic); default mode: the same with ``recipe.aligned_ops`` where the config allows
        it (else Megatron's ``TopKRouter``)."""
        if self.recipe.strict:
            from .modules.router import StrictTopKRouter

            return StrictTopKRouter
        if self.recipe.aligned_ops:
            from .modules.router import AlignedTopKRouter

            return AlignedTopKRouter
        return TopKRouter

    def moe_layer(self):
        """The MoE layer class: Megatron's with a deterministic combine in both modes
        (:mod:`minite_megatron.modules.deterministic_moe`: the learner and the rollout engine add a token's
        expert outputs in the same order; strict mode also refuses what it cannot make
        deterministic). ``MINITE_MEGATRON_COMBINE=1`` keeps Megatron's atomic combine in default
        mode (the benchmark's before/after comparison)."""
        if self.recipe.strict:
            from .modules.deterministic_moe import StrictMoELayer

            return StrictMoELayer
        if settings().megatron_combine:
            return MiniteMoELayer
        from .modules.deterministic_moe import DeterministicMoELayer

        return DeterministicMoELayer

    def activation_func(self, offer_to: Handoff | None = None):
        """The MLP activation module (used where ``config.use_te_activation_func``): it hands an
        NVFP4 ``linear_fc2`` its quantized output through ``offer_to`` (fused SwiGLU -> NVFP4 on the GPU)."""
        return partial(MiniteActivation, offer_to=offer_to)


def moe_module_spec(experts_backend, shared_backend, moe_grouped_gemm: bool = True):
    """MoE layer from two providers: ``experts_backend`` gives the MoE layer class, the router and
    the experts (grouped, or sequential with ``moe_grouped_gemm=False``); ``shared_backend`` the
    shared experts' linears."""
    fc2 = shared_backend.handoff()
    return partial(
        experts_backend.moe_layer(),
        submodules=MoESubmodules(
            experts=experts_backend.grouped_mlp_modules(moe_grouped_gemm),
            shared_experts=partial(
                _build_shared_experts,
                submodules=MLPSubmodules(
                    linear_fc1=shared_backend.column_parallel_linear(),
                    linear_fc2=shared_backend.row_parallel_linear(fc2),
                    activation_func=shared_backend.activation_func(fc2),
                ),
            ),
            router=experts_backend.router(),
        ),
    )


def build_layer_spec(attn, mlp, num_experts: int | None, qk_layernorm: bool, experts=None, shared=None,
                     moe_grouped_gemm: bool = True) -> ModuleSpec:
    """One GPT layer from providers: ``attn`` (norms, qkv/proj linears, core attention), ``mlp``
    (dense MLP linears) and, for an MoE layer, ``experts`` and ``shared`` (default: ``mlp``)."""
    norm = attn.layer_norm(rms_norm=True)
    qkv, fc1, fc2 = attn.handoff(), mlp.handoff(), mlp.handoff()
    if num_experts is None:
        mlp_spec = partial(
            MLP.as_mlp_submodule,
            submodules=MLPSubmodules(linear_fc1=mlp.column_parallel_linear(fc1), linear_fc2=mlp.row_parallel_linear(fc2),
                                     activation_func=mlp.activation_func(fc2)),
        )
    else:
        mlp_spec = moe_module_spec(experts or mlp, shared or mlp, moe_grouped_gemm)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=attn.input_norm(qkv),
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=attn.column_parallel_linear(qkv),
                    core_attention=attn.core_attention(),
                    linear_proj=attn.row_parallel_linear(),
                    q_layernorm=norm if qk_layernorm else IdentityOp,
                    k_layernorm=norm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=mlp.input_norm(fc1) if num_experts is None else norm,
            mlp=mlp_spec,
            mlp_bda=get_bias_dropout_add,
            # the same checkpoint keys as Megatron's local and TE specs
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def get_gpt_layer_minite_spec(
    recipe: Recipe | None = None,
    num_experts: int | None = None,
    qk_layernorm: bool = False,
    layer_in_bf16: bool = False,
    moe_grouped_gemm: bool = True,
) -> ModuleSpec:
    """One GPT transformer layer with miniTE's NVFP4 modules.

    Args:
        recipe: the scaling recipe (defaults: :class:`Recipe`).
        num_experts: None for a dense layer, else the MoE layer's global expert count.
        qk_layernorm: normalise queries and keys (Qwen3).
        layer_in_bf16: keep every linear of this layer in BF16 (a recipe's first/last layers).
        moe_grouped_gemm: the experts in one grouped op (``NVFP4GroupedLinear``, the default),
            or ``False``: Megatron's ``SequentialMLP`` of NVFP4 linears. The default is True,
            unlike Megatron's config field, because grouped experts are what miniTE is for
            (Megatron's ``--moe-grouped-gemm`` also asks for bf16 and a GPU).
    """
    recipe = recipe if recipe is not None else Recipe()
    return build_layer_spec(
        attn=MiniteSpecProvider(recipe, linear_precision=_precision(recipe, recipe.quantize_attention, layer_in_bf16)),
        mlp=MiniteSpecProvider(recipe, linear_precision=_precision(recipe, recipe.quantize_dense_mlp, layer_in_bf16)),
        num_experts=num_experts,
        qk_layernorm=qk_layernorm,
        experts=MiniteSpecProvider(recipe, expert_precision=_precision(recipe, recipe.quantize_experts, layer_in_bf16)),
        shared=MiniteSpecProvider(recipe, linear_precision=_precision(recipe, recipe.quantize_shared_experts, layer_in_bf16)),
        moe_grouped_gemm=moe_grouped_gemm,
    )


def moe_layer_pattern(config) -> list[int]:
    """1 for an MoE layer, 0 for a dense one (``--moe-layer-freq``: an int N or a list)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if isinstance(freq, list) and len(freq) == config.num_layers:
        return list(freq)
    raise MiniteConfigError(f"--moe-layer-freq must be an int or a list of {config.num_layers} entries, got {freq!r}")


def validate_config_for_minite(config, recipe: Recipe) -> None:
    """Fail fast, naming the flag, on model settings the recipe cannot run."""
    if recipe.quantized:
        check_multiple_of_16(config.hidden_size, "the hidden size", "--hidden-size")
    if config.multi_latent_attention:
        raise MiniteConfigError("--multi-latent-attention is not supported by the minite specs yet")
    if getattr(config, "mtp_num_layers", None):
        raise MiniteConfigError("--mtp-num-layers (multi-token prediction) is not supported by the minite specs yet")
    if recipe.strict and config.normalization != "RMSNorm":
        raise MiniteConfigError("strict mode needs --normalization RMSNorm")
    if getattr(config, "fp4", None) or getattr(config, "fp8", None):
        raise MiniteConfigError(
            "--transformer-impl minite replaces TE's FP4/FP8 recipes: drop --fp4-format/--fp8-format "
            "(or use TE with --fp4-recipe custom and miniTE's quantizer factory)"
        )
    if recipe.bf16_first_layers + recipe.bf16_last_layers > config.num_layers:
        raise MiniteConfigError(
            f"--minite-bf16-first-layers {recipe.bf16_first_layers} + --minite-bf16-last-layers "
            f"{recipe.bf16_last_layers} exceeds --num-layers {config.num_layers}"
        )


def get_gpt_decoder_layer_minite_specs(config, recipe: Recipe | None = None, moe_grouped_gemm: bool = True) -> list[ModuleSpec]:
    """One layer spec per global layer (BF16 first/last layers and the MoE pattern applied)."""
    recipe = recipe if recipe is not None else Recipe()
    validate_config_for_minite(config, recipe)
    if config.num_moe_experts and recipe.fp32_router and config.moe_router_dtype != "fp32":
        log.info("miniTE recipe.fp32_router: computing router logits in fp32 (config.moe_router_dtype='fp32')")
        config.moe_router_dtype = "fp32"
    pattern = moe_layer_pattern(config)
    return [
        get_gpt_layer_minite_spec(
            recipe,
            num_experts=config.num_moe_experts if pattern[i] else None,
            qk_layernorm=config.qk_layernorm,
            layer_in_bf16=recipe.layer_in_bf16(i + 1, config.num_layers),
            moe_grouped_gemm=moe_grouped_gemm,
        )
        for i in range(config.num_layers)
    ]


def get_gpt_decoder_block_minite_spec(
    config, recipe: Recipe | None = None, vp_stage: int | None = None, pp_rank: int | None = None,
    *, moe_grouped_gemm: bool = True,
) -> TransformerBlockSubmodules:
    """The decoder block spec of this pipeline stage (Megatron's ``transformer_layer_spec``);
    ``moe_grouped_gemm=False``: sequential experts (:func:`get_gpt_layer_minite_spec`)."""
    recipe = recipe if recipe is not None else Recipe()
    layer_specs = get_gpt_decoder_layer_minite_specs(config, recipe, moe_grouped_gemm)
    if config.pipeline_model_parallel_layout is not None:
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
        local = [layer_specs[i] for i in ids]
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local = layer_specs[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)]
    final_norm = MiniteSpecProvider(recipe).layer_norm(rms_norm=True)
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=final_norm)
