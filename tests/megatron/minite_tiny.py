"""Tiny Qwen3-MoE-shaped GPT models on a single CPU process (gloo, world size 1) for tests."""

from __future__ import annotations

import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process() -> None:
    """torch.distributed (world 1) + Megatron model-parallel state, once per process."""
    from minite_megatron.training.presets import init_single_process as init

    init(seed=None)


def tiny_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2,
        normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.float32, moe_token_dispatcher_type="alltoall", bias_activation_fusion=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, hidden_dropout=0.0,
        attention_dropout=0.0, moe_router_dtype="fp32",
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(config, spec, vocab: int = 128, seq: int = 64, seed: int = 123, finalize_recipe=None):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
                     position_embedding_type="rope")
    if finalize_recipe is not None:
        from minite_megatron.model import finalize_gpt_model

        finalize_gpt_model(model, finalize_recipe)
    return model


def causal_mask(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)


def lm_batch(step: int, batch: int = 4, seq: int = 32, vocab: int = 128):
    """A learnable toy language: each sequence counts up modulo the vocab from a random start."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def train(model, steps: int, lr: float = 3e-3, batch: int = 4, seq: int = 32, vocab: int = 128) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    mask = causal_mask(seq)
    losses = []
    for step in range(steps):
        tokens, labels = lm_batch(step, batch, seq, vocab)
        loss = model(tokens, pos, mask, labels=labels).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
