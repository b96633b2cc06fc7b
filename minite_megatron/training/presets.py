"""Ready-made Megatron GPT models on miniTE's specs, for tools that need one in a single process
(the alignment benchmark, ``minite-diagnose run``, the RL example).

``tiny``: a Qwen3-MoE-shaped toy that runs on a CPU. ``qwen3-moe``: Qwen3-30B-A3B's layer shapes
(hidden 2048, 32 heads / 4 KV groups of 128, 128 experts top-8 with FFN 768, qk-layernorm,
RMSNorm, SwiGLU, RoPE 1e6) with 4 layers and a 32k vocabulary, for one GPU. ``qwen3-30b-a3b``:
the whole model (48 layers, the 151,936-token vocabulary, untied LM head; 30.5e9 parameters, 61 GB
in BF16): build it for rollout with :func:`minite_megatron.rollout.resident.build_resident_gpt`
on :func:`unallocated_gpt` (NVFP4 weights only, 17 GB, made layer by layer), not with :func:`build_gpt`.
"""

from __future__ import annotations

import socket

import torch

PRESETS = {
    "tiny": dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, experts=4, topk=2, moe_ffn=32, vocab=256),
    "qwen3-moe": dict(layers=4, hidden=2048, heads=32, groups=4, head_dim=128, experts=128, topk=8, moe_ffn=768,
                      vocab=32768),
    "qwen3-30b-a3b": dict(layers=48, hidden=2048, heads=32, groups=4, head_dim=128, experts=128, topk=8, moe_ffn=768,
                          vocab=151936),
}


def init_single_process(seed: int | None = 1) -> torch.device:
    """torch.distributed (NCCL on a GPU, gloo on CPU, world size 1) and Megatron's parallel
    state (each once per process); the CPU compatibility layer when there is no GPU. Seeds torch
    and Megatron's RNG tracker with ``seed`` unless it is None. Returns the device to use."""
    from .. import cpu_compat

    cpu_compat.activate()  # a no-op with a GPU
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        # a fresh local port: an inherited MASTER_PORT may belong to a parent process's store
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if seed is not None:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def preset_config(preset: str | dict, *, device, dtype: torch.dtype = torch.float32, **overrides):
    """The ``TransformerConfig`` of ``preset`` (bf16 flags from ``dtype``, CPU initialization on a
    CPU ``device``); ``overrides``: further fields or replaced ones (e.g. the parallel layout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    p = PRESETS[preset] if isinstance(preset, str) else preset
    fields = dict(
        num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"], num_query_groups=p["groups"],
        kv_channels=p["head_dim"], ffn_hidden_size=4 * p["hidden"], moe_ffn_hidden_size=p["moe_ffn"],
        num_moe_experts=p["experts"], moe_router_topk=p["topk"], normalization="RMSNorm", qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3, bias_activation_fusion=False,
        use_cpu_initialization=torch.device(device).type == "cpu", params_dtype=dtype, bf16=dtype == torch.bfloat16,
        init_method_std=0.02,
    )
    return TransformerConfig(**(fields | overrides))


def gpt_from_config(preset: str | dict, config, spec, *, max_seq: int):
    """Megatron's ``GPTModel`` of ``preset``'s vocabulary on ``config`` and the layer ``spec``
    (RoPE base 1e6, untied LM head), weights as ``config`` initializes them."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    p = PRESETS[preset] if isinstance(preset, str) else preset
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=p["vocab"], max_sequence_length=max_seq,
                    position_embedding_type="rope", rotary_base=1_000_000, share_embeddings_and_output_weights=False)


def _gpt(preset, config, spec, *, max_seq: int, device, seed: int):
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)  # CPU initialization
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # GPU initialization (Megatron's RNG tracker)
    return gpt_from_config(preset, config, spec, max_seq=max_seq)


def unallocated_gpt(preset: str | dict, recipe, *, max_seq: int, num_layers: int | None = None):
    """``preset``'s ``GPTModel`` on the minite specs under ``recipe`` (BF16) with its parameters
    made on the host and never initialized (untouched pages: no memory) -- the input of
    :func:`minite_megatron.rollout.resident.build_resident_gpt`. ``num_layers``: a cut."""
    from ..model import finalize_gpt_model
    from ..specs import get_gpt_decoder_block_minite_spec

    p = dict(PRESETS[preset] if isinstance(preset, str) else preset)
    if num_layers is not None:
        p["layers"] = int(num_layers)
    config = preset_config(p, device="cpu", dtype=torch.bfloat16, perform_initialization=False)
    gpt = gpt_from_config(p, config, get_gpt_decoder_block_minite_spec(config, recipe), max_seq=max_seq)
    return finalize_gpt_model(gpt, recipe)


def build_gpt(preset: str | dict, recipe, *, max_seq: int, device, dtype: torch.dtype = torch.float32, seed: int = 0,
              **config_overrides):
    """A ``GPTModel`` of ``preset`` on the minite specs under ``recipe``, weights from ``seed``.

    ``config_overrides``: further ``TransformerConfig`` fields (e.g. the parallel layout:
    ``tensor_model_parallel_size``, ``sequence_parallel``, ``expert_model_parallel_size``)."""
    from ..model import finalize_gpt_model
    from ..specs import get_gpt_decoder_block_minite_spec

    config = preset_config(preset, device=device, dtype=dtype, **config_overrides)
    model = _gpt(preset, config, get_gpt_decoder_block_minite_spec(config, recipe), max_seq=max_seq, device=device,
                 seed=seed)
    finalize_gpt_model(model, recipe)
    return model.to(device=torch.device(device))


def build_local_gpt(preset: str | dict, *, max_seq: int, device, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The same model on Megatron's local spec (``SequentialMLP`` experts, Megatron's norms and
    unfused attention; its fusions off: they need apex / TE): the baseline the benchmarks compare."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    p = PRESETS[preset] if isinstance(preset, str) else preset
    config = preset_config(p, device=device, dtype=dtype, masked_softmax_fusion=False, bias_dropout_fusion=False,
                           apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(num_experts=p["experts"], moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    return _gpt(p, config, spec, max_seq=max_seq, device=device, seed=seed).to(device=torch.device(device))
