"""The vLLM layer methods of ``minite_nvfp4`` (see :mod:`.config` for which layer gets which).

The parameters hold the export's tensors exactly as stored (``weight`` uint8 ``[N, K/2]``,
``weight_scale`` e4m3 ``[N, K/16]``, ``weight_scale_2`` fp32 per fused piece; experts
``w13_*`` / ``w2_*`` stacked ``[E, ...]``): ``process_weights_after_loading`` checks that every
one was loaded (they start as NaN) and builds :class:`~minite_megatron.nvfp4.NVFP4Tensor` *views*
of them, so nothing is re-laid-out or re-quantized and a refit (:mod:`minite_megatron.serving.refit`)
that copies new bytes into the parameters is seen by the next forward. ``apply`` runs
:mod:`minite_megatron.serving.numerics` on the NVFP4 backend of the device (reference on CPU,
Triton on Hopper, CuTe DSL on Blackwell).

Limits (each raises at model build, naming the setting): tensor parallelism and expert
parallelism > 1 (a row-parallel GEMM's partial sums would be rounded on each rank, outside the
contract's single rounding); expert-parallel load balancing; gate and up projections of an expert
with different ``weight_scale_2`` (the learner's fused fc1 never has them).
"""

from __future__ import annotations

import torch
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter
from vllm.model_executor.utils import set_weight_attrs

from ... import nvfp4
from ...nvfp4 import BLOCK, NVFP4Tensor
from .. import numerics


def _nan(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32).to(dtype)


def _check_loaded(name: str, layer_name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if bool(torch.isnan(t.float()).any()):
            raise RuntimeError(f"minite-vllm: {layer_name}: {name} was not (fully) loaded from the checkpoint "
                               "(still NaN): the export lacks this tensor")


def _refuse_parallel(what: str) -> None:
    tp = get_tensor_model_parallel_world_size()
    if tp > 1:
        raise NotImplementedError(
            f"minite-vllm: {what} with tensor_parallel_size={tp}: a row-parallel GEMM's partial sums would be "
            "rounded on each rank, outside the contract's one rounding; serve with tensor_parallel_size=1 "
            "(scale out with data-parallel replicas)"
        )


@register_weight_loader_v2_supported_method
class MiniteNvfp4LinearMethod(LinearMethodBase):
    """A quantized dense linear: the exported bytes, per-token activation quantization, the contract's GEMM."""

    def __init__(self, quant_config):
        self.quant_config = quant_config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        _refuse_parallel(f"linear {getattr(layer, 'prefix', '')}")
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if k % BLOCK:
            raise ValueError(f"minite-vllm: input size {k} is not a multiple of {BLOCK}")
        wl = extra_weight_attrs.get("weight_loader")
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.zeros(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0, weight_loader=wl))
        layer.register_parameter("weight_scale", ModelWeightParameter(
            data=_nan((n, k // BLOCK), torch.float8_e4m3fn), input_dim=1, output_dim=0, weight_loader=wl))
        layer.register_parameter("weight_scale_2", PerTensorScaleParameter(
            data=_nan((len(output_partition_sizes),), torch.float32), weight_loader=wl))
        layer.minite_pieces = list(output_partition_sizes)

    def process_weights_after_loading(self, layer) -> None:
        name = getattr(layer, "prefix", type(layer).__name__)
        _check_loaded("weight_scale / weight_scale_2", name, layer.weight_scale.data, layer.weight_scale_2.data)
        self.refresh(layer)

    @staticmethod
    def refresh(layer) -> None:
        """(Re)build the NVFP4 view of the parameters (after loading or a refit that changed scales)."""
        layer.minite_weight = numerics.weight_view(
            layer.weight.data, layer.weight_scale.data, layer.weight_scale_2.data, layer.minite_pieces)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.quant_config
        return numerics.nvfp4_linear(x, layer.minite_weight, bias, backend=cfg.backend, strict=cfg.strict)


@register_weight_loader_v2_supported_method
class MiniteFP32LinearMethod(UnquantizedLinearMethod):
    """The router / LM head: BF16 weights, FP32 logits as the learner computes them (``invariant``:
    the batch-invariant GEMM, as the strict / aligned router's gating; else strict mode's choice)."""

    def __init__(self, quant_config, invariant: bool | None = None):
        super().__init__()
        self.quant_config = quant_config
        self.invariant = quant_config.strict if invariant is None else bool(invariant)

    def process_weights_after_loading(self, layer) -> None:
        pass  # keep the weight as loaded (vLLM's CPU path would repack it into oneDNN's layout and drop it)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return numerics.high_precision_linear(x, layer.weight, bias, strict=self.invariant, out_dtype=torch.float32)


@register_weight_loader_v2_supported_method
class MiniteBF16LinearMethod(MiniteFP32LinearMethod):
    """A linear the recipe keeps in BF16 (the BF16 LM head, BF16 layers): the learner's GEMM
    (``F.linear`` in BF16, as Megatron's linears; strict mode: the batch-invariant GEMM)."""

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return numerics.high_precision_linear(x, layer.weight, bias, strict=self.quant_config.strict, out_dtype=x.dtype)


class MiniteNvfp4MoEMethod(FusedMoEMethodBase):
    """vLLM's routed experts with the learner's MoE block (:func:`~minite_megatron.serving.numerics.moe_forward`).

    Monolithic: vLLM hands over the router logits (FP32 from :class:`MiniteFP32LinearMethod`) and
    the method routes (deterministic top-k), runs both expert GEMMs and combines in a fixed order.
    """

    def __init__(self, quant_config, moe_config):
        super().__init__(moe_config)
        self.quant_config = quant_config

    @property
    def is_monolithic(self) -> bool:
        return True

    def uses_weight_scale_2_pattern(self) -> bool:
        return True

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        par = self.moe.moe_parallel_config
        if par.tp_size > 1 or par.ep_size > 1 or getattr(par, "enable_eplb", False):
            raise NotImplementedError(
                f"minite-vllm: routed experts with tp_size={par.tp_size}, ep_size={par.ep_size}: the learner's "
                "MoE block is served at tensor/expert parallel size 1 only (see docs/serving.md)")
        if not self.moe.is_act_and_mul:
            raise NotImplementedError("minite-vllm: only gated (SwiGLU) experts, as the Qwen3 export writes")
        h, f, e = hidden_size, intermediate_size_per_partition, num_experts
        if h % BLOCK or f % BLOCK:
            raise ValueError(f"minite-vllm: hidden {h} and expert ffn {f} must be multiples of {BLOCK}")
        block = {"quant_method": FusedMoeWeightScaleSupported.BLOCK.value}
        tensor = {"quant_method": FusedMoeWeightScaleSupported.TENSOR.value}
        for name, data, attrs in (
            ("w13_weight", torch.zeros(e, 2 * f, h // 2, dtype=torch.uint8), {}),
            ("w2_weight", torch.zeros(e, h, f // 2, dtype=torch.uint8), {}),
            ("w13_weight_scale", _nan((e, 2 * f, h // BLOCK), torch.float8_e4m3fn), block),
            ("w2_weight_scale", _nan((e, h, f // BLOCK), torch.float8_e4m3fn), block),
            ("w13_weight_scale_2", _nan((e, 2), torch.float32), tensor),
            ("w2_weight_scale_2", _nan((e,), torch.float32), tensor),
        ):
            p = torch.nn.Parameter(data, requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, {**extra_weight_attrs, **attrs})

    def process_weights_after_loading(self, layer) -> None:
        name = getattr(layer, "layer_name", "routed experts")
        _check_loaded("expert weight scales", name, layer.w13_weight_scale.data, layer.w2_weight_scale.data,
                      layer.w13_weight_scale_2.data, layer.w2_weight_scale_2.data)
        self.refresh(layer)

    @staticmethod
    def refresh(layer) -> None:
        """Check gate == up global scales and (re)build the ``[E, N, K]`` group views."""
        s2 = layer.w13_weight_scale_2.data
        bad = (s2[:, 0] != s2[:, 1]).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"minite-vllm: experts {bad[:8]} have different gate and up weight_scale_2: their "
                             "fc1 was not quantized as one tensor (the learner's fused fc1 always is)")
        e, two_f, half_h = layer.w13_weight.shape
        h, half_f = layer.w2_weight.shape[1:]
        layer.minite_w13 = NVFP4Tensor(layer.w13_weight.data, layer.w13_weight_scale.data, s2[:, 0],
                                       torch.Size([e, two_f, 2 * half_h]), "group", (BLOCK, BLOCK))
        layer.minite_w2 = NVFP4Tensor(layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_weight_scale_2.data,
                                      torch.Size([e, h, 2 * half_f]), "group", (BLOCK, BLOCK))

    def get_fused_moe_quant_config(self, layer):
        return None  # no vLLM fused-MoE kernel is used

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor, input_ids=None) -> torch.Tensor:
        cfg = self.quant_config
        return numerics.moe_forward(x, router_logits, layer.minite_w13, layer.minite_w2, topk=layer.top_k,
                                    renormalize=bool(layer.renormalize), strict=cfg.strict,
                                    invariant_routing=cfg.invariant_routing,
                                    backend=nvfp4.get_backend(cfg.backend, x.device))

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        raise NotImplementedError("minite-vllm routes inside apply_monolithic (the learner's deterministic top-k)")


__all__ = ["MiniteBF16LinearMethod", "MiniteFP32LinearMethod", "MiniteNvfp4LinearMethod", "MiniteNvfp4MoEMethod"]
