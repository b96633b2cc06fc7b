"""Shared by ``test_hf_stream.py`` (CPU) and ``test_hf_stream_gpu.py``: a tiny sharded Qwen3-MoE
checkpoint, the importer's path to the same resident model, and the bitwise comparison."""

from __future__ import annotations

import dataclasses
import weakref

import torch

from minite_megatron.testing import assert_bitwise_equal

from .conftest import make_hf_model, save_hf

TINY = dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, experts=8, topk=2, moe_ffn=32, vocab=256)
"""The preset the tiny checkpoint has the shapes of (every layer MoE: 8 experts top-2, qk-norm)."""


def save_tiny(path, seed: int = 5, layers: int = 2):
    """``TINY`` (``layers`` deep) as a random ``Qwen3MoeForCausalLM`` in BF16, sharded into files
    of <= 40 KB (~5 a layer: a layer's tensors spread over several shards)."""
    model = make_hf_model("moe", seed=seed, mlp_only_layers=[], num_experts=8, vocab_size=256, num_hidden_layers=layers)
    return save_hf(model, path, max_shard_size="40KB")


def importer_resident(path, recipe, device):
    """The importer's path: the whole checkpoint loaded (``build_gpt_from_hf``), then every layer
    quantized and its BF16 weights dropped as the resident builder does."""
    from minite_megatron.convert import build_gpt_from_hf
    from minite_megatron.rollout.resident import freeze_nvfp4

    ref = build_gpt_from_hf(path, impl="minite", recipe=recipe, device=device, dtype=torch.bfloat16).eval()
    for layer in ref.decoder.layers:
        freeze_nvfp4(layer)
    return ref


def quantized_modules(gpt) -> dict:
    from minite_megatron.modules.grouped_linear import NVFP4GroupedLinear
    from minite_megatron.rollout.support import is_nvfp4_linear

    return {n: m for n, m in gpt.named_modules()
            if (isinstance(m, NVFP4GroupedLinear) and m.precision == "nvfp4") or is_nvfp4_linear(m)}


def assert_same_resident(a, b) -> int:
    """Every BF16 parameter and every field of every pinned quantized weight (codes, block scales,
    global decode scales, images) equal in raw bits; the dropped weights placeholders in both.
    Returns the number of quantized weights compared."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, x in pa.items():
        y = pb[name]
        dropped = x.stride() == (0,) * x.dim() and x.numel() > 1
        assert dropped == (y.stride() == (0,) * y.dim() and y.numel() > 1), name
        if dropped:
            assert torch.isnan(x).all() and torch.isnan(y).all(), name
        else:
            assert_bitwise_equal(x, y, name)
    qa, qb = quantized_modules(a), quantized_modules(b)
    assert qa.keys() == qb.keys() and qa
    for name, m in qa.items():
        x, y = m.quantized_weight(), qb[name].quantized_weight()
        for f in dataclasses.fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                assert isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor), f"{name}.{f.name}"
                assert_bitwise_equal(u, v, f"{name}.{f.name}")
            else:
                assert u == v, f"{name}.{f.name}"
    return len(qa)


class LiveBytes:
    """``on_tensor`` hook: the bytes of the tensors read that are still alive (each one's
    ``weakref.finalize`` subtracts it when it is freed), and their peak."""

    def __init__(self):
        self.now = self.peak = self.count = 0

    def __call__(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.now += n
        self.count += 1
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._freed, n)

    def _freed(self, n: int) -> None:
        self.now -= n


def assert_same_rollouts(res, ref, strict: bool) -> None:
    """The two models score and sample alike, bit for bit: teacher-forced log-probs and the engine's
    rollouts (tokens and log-probs); in strict mode the learner's log-probs of ``res``'s rollouts
    are the sampler's (gap 0)."""
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    seqs = [[1, 5, 7, 9, 11, 3, 2], [4, 4, 2, 8, 200]]
    a, b = teacher_forced_logprobs(res, seqs), teacher_forced_logprobs(ref, seqs)
    assert a[0].std() > 0.05
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    outs = [RolloutEngine(m, eod_id=0, max_batch_size=2).generate(seqs, 4, seed=1, stop_at_eod=False) for m in (res, ref)]
    for r1, r2 in zip(*outs):
        assert r1.generated_tokens == r2.generated_tokens
        assert torch.equal(r1.generated_log_probs, r2.generated_log_probs)
    if strict:  # the learner/rollout gap on the checkpoint's weights: 0
        learner = teacher_forced_logprobs(res, [r.tokens for r in outs[0]])
        for r, lp in zip(outs[0], learner):
            assert torch.equal(lp[len(r.prompt_tokens) - 1:].float().cpu(), r.generated_log_probs.float().cpu())
