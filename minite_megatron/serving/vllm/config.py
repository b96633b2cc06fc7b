"""``minite_nvfp4``: the vLLM quantization config of the export's default variant.

``config.json["quantization_config"]`` (written by :func:`minite_megatron.export.export_modelopt`,
``variant="minite"``) selects it; :meth:`MiniteNvfp4Config.get_quant_method` hands each vLLM layer
its method (:mod:`.methods`):

- quantized dense linears (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
  ...): :class:`~.methods.MiniteNvfp4LinearMethod`;
- the routed experts (vLLM's ``RoutedExperts`` inside ``FusedMoE``): :class:`~.methods.MiniteNvfp4MoEMethod`;
- the router (``*.mlp.gate``) and, with ``fp32_lm_head``, the LM head: FP32 logits
  (:class:`~.methods.MiniteFP32LinearMethod`); the BF16 LM head and the other high-precision
  linears (BF16 layers of the recipe): the learner's BF16 GEMM (:class:`~.methods.MiniteBF16LinearMethod`;
  batch invariant in strict mode), never vLLM's CPU repacking, so a refit updates them in place;
- everything else: vLLM's own layers; the model class of :mod:`.model` (registered for the
  export's architecture) puts the learner's norms, RoPE and attention backend into them.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from ...export.modelopt import FORMAT_VERSION, QUANT_METHOD
from ...nvfp4 import BLOCK

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class MiniteNvfp4Config(QuantizationConfig):
    """The learner's NVFP4 policy (per-token activations, 16x16 weight tiles, exact epilogue).

    Args:
        exclude: HF module names kept in high precision (the export's ``ignore`` list).
        strict: the recipe's strict mode (batch-invariant GEMMs, router and LM head).
        fp32_router / fp32_lm_head: the recipe's FP32 router / LM head.
        aligned_ops: the recipe's ``aligned_ops`` (default mode's router is strict routing's: the
            batch-invariant FP32 gating, stable top-k, fixed-order softmax; exports written before
            the field existed lack it and had Megatron's router: False).
        backend: NVFP4 backend name (None: the best for the device; ``MINITE_BACKEND`` overrides).
    """

    def __init__(self, exclude: list[str], *, strict: bool = False, fp32_router: bool = True,
                 fp32_lm_head: bool = False, backend: str | None = None, aligned_ops: bool = False,
                 aligned_attention: bool = False):
        super().__init__()
        self.exclude = list(exclude)
        self.strict = bool(strict)
        # the learner's router is strict routing's in strict mode and with aligned ops (FP32 router)
        self.invariant_routing = bool(strict or (aligned_ops and fp32_router))
        # the learner's norms (MiniteNorm) and core attention are strict mode's formulations in strict
        # mode and with aligned ops / aligned attention (the model class, :mod:`.model`)
        self.invariant_norm = bool(strict or aligned_ops)
        self.invariant_attention = bool(strict or aligned_attention)
        self.fp32_router = bool(fp32_router)
        self.fp32_lm_head = bool(fp32_lm_head)
        self.backend = backend

    # ---- vLLM's QuantizationConfig interface ---------------------------------------------------
    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # Triton emulation runs on any CUDA GPU vLLM supports; Blackwell uses native FP4

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # config.json's quantization_config is the whole configuration

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == QUANT_METHOD:
            return QUANT_METHOD
        return None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MiniteNvfp4Config":
        """Parse ``quantization_config``; raises ValueError naming the field that is not ours."""
        if config.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"minite-vllm: quantization_config.quant_method is {config.get('quant_method')!r}, "
                             f"not {QUANT_METHOD!r}")
        if config.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"minite-vllm: quantization_config.format_version {config.get('format_version')!r}, "
                             f"this plugin reads {FORMAT_VERSION}")
        if config.get("group_size") != BLOCK:
            raise ValueError(f"minite-vllm: quantization_config.group_size must be {BLOCK}")
        act = config.get("input_activations") or {}
        if act.get("global_scale") != "per_token":
            raise ValueError("minite-vllm: quantization_config.input_activations.global_scale must be 'per_token' "
                             f"(got {act.get('global_scale')!r}): the plugin serves the per-token recipe only")
        recipe = config.get("recipe") or {}
        return cls(config.get("ignore", []), strict=recipe.get("strict", False),
                   fp32_router=recipe.get("fp32_router", True), fp32_lm_head=recipe.get("fp32_lm_head", False),
                   backend=recipe.get("backend"), aligned_ops=recipe.get("aligned_ops", False),
                   aligned_attention=recipe.get("aligned_attention", False))

    def is_excluded(self, prefix: str) -> bool:
        """Whether the vLLM module ``prefix`` is high precision (fused modules: all pieces or none)."""
        if prefix in self.exclude:
            return True
        head, _, leaf = prefix.rpartition(".")
        if leaf in _FUSED:
            pieces = [f"{head}.{p}" in self.exclude for p in _FUSED[leaf]]
            if any(pieces) and not all(pieces):
                raise ValueError(f"minite-vllm: {prefix} fuses pieces of which only some are excluded")
            return all(pieces)
        return False

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from . import methods

        if isinstance(layer, ParallelLMHead):
            return methods.MiniteFP32LinearMethod(self) if self.fp32_lm_head else methods.MiniteBF16LinearMethod(self)
        if isinstance(layer, LinearBase):
            if prefix.endswith(".mlp.gate"):  # the MoE router
                if self.fp32_router:
                    return methods.MiniteFP32LinearMethod(self, invariant=self.invariant_routing)
                return methods.MiniteBF16LinearMethod(self)
            if self.is_excluded(prefix):
                return methods.MiniteBF16LinearMethod(self)
            return methods.MiniteNvfp4LinearMethod(self)
        if isinstance(layer, RoutedExperts):
            if self.is_excluded(prefix) or self.is_excluded(prefix.removesuffix(".routed_experts")):
                return None  # vLLM's unquantized fused MoE
            return methods.MiniteNvfp4MoEMethod(self, layer.moe_config)
        return None


__all__ = ["MiniteNvfp4Config"]
