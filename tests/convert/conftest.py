"""Tiny random Qwen3 / Qwen3-MoE checkpoints written with ``transformers`` (no downloads), shared
by the converter's tests, and the single-process Megatron state they run under."""

from __future__ import annotations

import pytest
import torch

VOCAB, SEQ = 128, 16

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6,
              initializer_range=0.1)
MOE = dict(COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
           mlp_only_layers=[0])
"""Layer 0 dense, layer 1 MoE (4 experts, top-2), GQA 4/2 heads of 16, untied head."""
DENSE = dict(COMMON, tie_word_embeddings=True)
"""Qwen3-0.6B-style: tied embeddings."""


def make_hf_model(kind: str, seed: int = 0, **overrides):
    """A random ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` (norm weights perturbed away from 1,
    so that a swapped norm cannot pass), in eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE, **overrides}))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**{**DENSE, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def save_hf(model, path, *, dtype=torch.bfloat16, max_shard_size="5GB"):
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    return path


@pytest.fixture(scope="session")
def hf_moe_dir(tmp_path_factory):
    """The MoE model in BF16, sharded into several files with ``model.safetensors.index.json``."""
    return save_hf(make_hf_model("moe"), tmp_path_factory.mktemp("hf_moe"), max_shard_size="60KB")


@pytest.fixture(scope="session")
def hf_dense_dir(tmp_path_factory):
    """The dense, tied model in BF16, one ``model.safetensors``."""
    return save_hf(make_hf_model("dense"), tmp_path_factory.mktemp("hf_dense"))


def load_hf(path):
    """The HF oracle in FP32 (its BF16 weights upcast exactly)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokens(seed: int = 1, batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def megatron_logits(model, toks: torch.Tensor) -> torch.Tensor:
    """``model(tokens)`` with positions and a causal mask: ``[b, s, V]`` FP32."""
    b, s = toks.shape
    pos = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(toks, pos, mask).float()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="session")
def single_process():
    """torch.distributed (gloo, world 1) and Megatron's parallel state TP=PP=EP=1."""
    from tests.megatron._dist import init_single_process

    init_single_process()
