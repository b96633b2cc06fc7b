"""vLLM's own Qwen3-MoE blocks on the CPU, built from an export and loaded as vLLM loads them.

``Qwen3MoeForCausalLM`` itself cannot be built here: its attention layer asks the platform for a
backend and the CUDA wheel on a machine without a GPU has none (``docs/serving.md``). So the
pieces are built one by one with the export's ``VllmConfig``: vLLM's ``Qwen3MoeSparseMoeBlock``
(router gate + ``FusedMoE``) and ``Qwen3MoeMLP`` (gate_up / ``SiluAndMul`` / down), the
attention's ``QKVParallelLinear`` / ``RowParallelLinear`` as ``Qwen3MoeAttention`` builds them,
vLLM's ``RMSNorm`` and the ``ParallelLMHead``, under the HF module names of the checkpoint.
:func:`load` is ``Qwen3MoeModel.load_weights`` for these modules (stacked q/k/v and gate/up,
vLLM's expert mapping, each parameter's own ``weight_loader``).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch


def vllm_config(export_dir: str | Path, eager: bool = True):
    """The ``VllmConfig`` of an export (vLLM parses its config.json: quantization included).

    ``eager`` (default): compilation mode NONE with vLLM's custom ops off, so the ops that run
    outside the quant methods (``SiluAndMul``, ``RMSNorm``) run their PyTorch-native forward
    eagerly (the CUDA wheel has no CPU kernels for the custom ops). vLLM's default instead
    compiles ``SiluAndMul``'s native forward with Inductor, which fuses ``silu(gate) * up``
    without the learner's bf16 rounding in between (``docs/serving.md``)."""
    from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(export_dir), skip_tokenizer_init=True, dtype="bfloat16")
    cc = CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]) if eager else CompilationConfig()
    return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(),
                      compilation_config=cc)


@contextmanager
def running(vc):
    """vLLM's current config and forward context for calling the blocks."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(vc), set_forward_context(None, vc), torch.inference_mode():
        yield


def build(vc, *, attention_layer: int = 1, dense_layer: int = 0, moe_layer: int = 1) -> torch.nn.Module:
    """A module tree named as the checkpoint: ``model.layers.{i}.self_attn.{qkv_proj,o_proj}``,
    ``.input_layernorm``, ``.mlp`` (vLLM's sparse MoE block or dense MLP), ``lm_head``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

    cfg, qc = vc.model_config.hf_text_config, vc.quant_config
    hd = cfg.head_dim
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vc):
            root = torch.nn.Module()
            root.model = torch.nn.Module()
            root.model.layers = torch.nn.ModuleDict()
            layers = root.model.layers
            for i in sorted({attention_layer, dense_layer, moe_layer}):
                layers[str(i)] = torch.nn.Module()
            att = layers[str(attention_layer)]
            p = f"model.layers.{attention_layer}"
            att.self_attn = torch.nn.Module()
            att.self_attn.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads,
                                                       cfg.num_key_value_heads, bias=False, quant_config=qc,
                                                       prefix=f"{p}.self_attn.qkv_proj")
            att.self_attn.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False,
                                                     quant_config=qc, prefix=f"{p}.self_attn.o_proj")
            att.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            layers[str(dense_layer)].mlp = Qwen3MoeMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                                                       quant_config=qc, prefix=f"model.layers.{dense_layer}.mlp")
            layers[str(moe_layer)].mlp = Qwen3MoeSparseMoeBlock(vc, prefix=f"model.layers.{moe_layer}.mlp")
            root.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config=qc, prefix="lm_head")
    finally:
        torch.set_default_dtype(torch.float32)
    root.moe = layers[str(moe_layer)].mlp
    return root


def vc_experts(root) -> int:
    return int(root.moe.n_routed_experts)


_STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


def load(root: torch.nn.Module, tensors) -> set[str]:
    """``Qwen3MoeModel.load_weights`` for the modules of :func:`build` (tensors it has no module
    for are skipped). Returns the parameter names loaded."""
    from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(root.named_parameters())
    moe = root.moe.experts
    experts = fused_moe_make_expert_params_mapping(moe, "gate_proj", "down_proj", "up_proj",
                                                   vc_experts(root))
    loaded = set()
    for name, t in tensors:
        if ".mlp.experts." in name:
            for param_name, weight_name, expert_id, shard_id in experts:
                if weight_name in name and name.replace(weight_name, param_name) in params:
                    n = name.replace(weight_name, param_name)
                    params[n].weight_loader(params[n], t, n, shard_id=shard_id, expert_id=expert_id)
                    loaded.add(n)
                    break
            continue
        for param_name, weight_name, shard in _STACKED:
            if weight_name in name:
                n = name.replace(weight_name, param_name)
                if n in params:
                    params[n].weight_loader(params[n], t, shard)
                    loaded.add(n)
                break
        else:
            if name in params:
                getattr(params[name], "weight_loader", default_weight_loader)(params[name], t)
                loaded.add(name)
    return loaded


def finish_loading(root: torch.nn.Module) -> None:
    """``process_weights_after_loading`` of every quantized layer (vLLM's loader does it)."""
    for mod in root.modules():
        method = getattr(mod, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(mod)
