"""Strict alignment end to end, on CPU, with real Megatron-Core: the learner's teacher-forced
log-probs of generated sequences equal the rollout engine's bitwise (gap exactly 0.0), for a
batch of mixed prompt lengths (1 to 11 tokens) and several decode steps; without the strict
modules the same comparison shows a gap (the test can fail).

The model: a 2-layer GQA MoE GPT (8 experts, top-2, qk-layernorm, RoPE, SwiGLU, hidden 64).
Rollouts: Megatron's static engine (prefill to the shortest prompt, then KV-cache decode steps,
longer prompts fed during decode). Learner: one full forward over the padded sequences.
"""

import pytest
import torch

from minite_megatron.rollout.engine import RolloutEngine
from minite_megatron.rollout.logprobs import teacher_forced_logprobs
from minite_megatron.testing import assert_bitwise_equal

NEW = 10


def _gaps(rollouts, learner):
    return [float((r.log_probs - lp.detach()).abs().max()) for r, lp in zip(rollouts, learner)]


def _assert_gap_zero(rollouts, learner):
    for i, (r, lp) in enumerate(zip(rollouts, learner)):
        assert r.log_probs.shape == lp.shape
        assert_bitwise_equal(r.log_probs, lp.detach(), f"sequence {i} (prompt {len(r.prompt_tokens)}, new {len(r.generated_tokens)})")


@pytest.fixture(scope="module")
def models(tiny_gpt):
    strict32 = tiny_gpt.build_gpt(True, torch.float32)
    default32 = tiny_gpt.build_gpt(False, torch.float32)
    tiny_gpt.copy_weights(default32, strict32)
    return {"strict32": strict32, "default32": default32}


@pytest.fixture(scope="module")
def strict_rollouts(models, tiny_gpt):
    engine = RolloutEngine(models["strict32"], eod_id=tiny_gpt.EOD)
    return engine.generate(tiny_gpt.PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=11)


def test_strict_gap_is_exactly_zero(models, strict_rollouts, tiny_gpt):
    assert sorted({len(p) for p in tiny_gpt.PROMPTS}) == [1, 2, 5, 8, 11]  # mixed lengths
    assert all(len(r.generated_tokens) >= 2 for r in strict_rollouts)  # several decode steps
    with torch.no_grad():
        learner = teacher_forced_logprobs(models["strict32"], [r.tokens for r in strict_rollouts])
    _assert_gap_zero(strict_rollouts, learner)


@pytest.mark.parametrize(
    "dtype,sampling",
    [
        (torch.float32, dict(temperature=0.0)),
        (torch.float32, dict(temperature=0.7, top_k=5)),
        (torch.bfloat16, dict(temperature=1.3, top_p=0.9)),
    ],
    ids=["fp32-greedy", "fp32-topk", "bf16-topp"],
)
def test_strict_gap_is_exactly_zero_for_each_sampler_and_dtype(tiny_gpt, dtype, sampling):
    model = tiny_gpt.build_gpt(True, dtype, seed=5)
    rollouts = RolloutEngine(model, eod_id=tiny_gpt.EOD).generate(tiny_gpt.PROMPTS, max_new_tokens=6, seed=2, **sampling)
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, [r.tokens for r in rollouts])
    _assert_gap_zero(rollouts, learner)


def test_strict_gap_zero_for_the_training_forward_with_gradients(models, strict_rollouts):
    """The learner's policy-gradient forward (train mode, autograd on) sees the same log-probs,
    and its backward runs."""
    model = models["strict32"]
    model.train()
    try:
        learner = teacher_forced_logprobs(model, [r.tokens for r in strict_rollouts])
        _assert_gap_zero(strict_rollouts, learner)
        loss = -torch.cat(learner).sum()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_default_mode_gap_is_positive(models, strict_rollouts):
    """Proves the test can fail: Megatron's local modules (BLAS GEMMs, ATen softmax, torch top-k,
    bf16/fp32 torch attention over the KV cache) on the same weights and the same tokens give
    rollout log-probs that differ from the teacher-forced ones (fp32 CPU BLAS picks another
    kernel for one decode row than for the whole sequence), while staying close."""
    model = models["default32"]
    engine = RolloutEngine(model, eod_id=0)
    assert engine.strict is False
    rollouts = engine.generate([r.prompt_tokens for r in strict_rollouts], max_new_tokens=NEW, temperature=1.0, seed=11)
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, [r.tokens for r in rollouts])
    gaps = _gaps(rollouts, learner)
    assert max(gaps) > 0.0, "the default engines agreed bitwise: this test could not detect a gap"
    assert max(gaps) < 1e-3


def test_strict_and_default_models_compute_the_same_function(models, strict_rollouts):
    """Strict mode changes reduction orders, not the model: log-probs agree to fp32 noise."""
    seqs = [r.tokens for r in strict_rollouts]
    with torch.no_grad():
        strict = teacher_forced_logprobs(models["strict32"], seqs)
        default = teacher_forced_logprobs(models["default32"], seqs)
    assert max(float((a - b).abs().max()) for a, b in zip(strict, default)) < 1e-4


def test_strict_learner_is_batch_invariant(models, strict_rollouts):
    seqs = [r.tokens for r in strict_rollouts]
    with torch.no_grad():
        batch = teacher_forced_logprobs(models["strict32"], seqs)
        alone = teacher_forced_logprobs(models["strict32"], [seqs[2]])
        padded = teacher_forced_logprobs(models["strict32"], [seqs[2], seqs[2] + [7] * 9])
    assert_bitwise_equal(alone[0], batch[2])
    assert_bitwise_equal(padded[0], batch[2])
    assert_bitwise_equal(padded[1][: len(seqs[2]) - 1], batch[2])


def test_strict_greedy_rollouts_do_not_depend_on_the_batch_size(models, tiny_gpt):
    model = models["strict32"]
    big = RolloutEngine(model, eod_id=tiny_gpt.EOD, max_batch_size=8).generate(tiny_gpt.PROMPTS, 5, temperature=0.0)
    small = RolloutEngine(model, eod_id=tiny_gpt.EOD, max_batch_size=2).generate(tiny_gpt.PROMPTS, 5, temperature=0.0)
    for a, b in zip(big, small):
        assert a.tokens == b.tokens
        assert_bitwise_equal(a.log_probs, b.log_probs)


def test_nvfp4_model_in_strict_mode_has_zero_gap(tiny_gpt):
    """miniTE's own NVFP4 spec with ``Recipe(strict=True)`` (NVFP4 reference GEMMs + the strict
    attention, norms, router and FP32 LM head): gap exactly 0.0 too."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    from minite_megatron.model import finalize_gpt_model
    from minite_megatron.recipe import Recipe
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    recipe = Recipe(strict=True)
    config = tiny_gpt.tiny_config(True, torch.bfloat16)
    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_minite_spec(config, recipe),
                     vocab_size=tiny_gpt.VOCAB, max_sequence_length=64, position_embedding_type="rope")
    model = finalize_gpt_model(model, recipe).to(torch.bfloat16).eval()
    rollouts = RolloutEngine(model, eod_id=tiny_gpt.EOD).generate(tiny_gpt.PROMPTS[:4], max_new_tokens=5, seed=1)
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, [r.tokens for r in rollouts])
    _assert_gap_zero(rollouts, learner)


def test_strict_gap_zero_with_the_triton_kernels(tiny_gpt):
    """The strict modules on the ``bi_*`` Triton kernels (under the interpreter on CPU: a 1-layer
    model and a few tokens; on a GPU this is the real kernel path)."""
    from minite_megatron.settings import overridden

    model = tiny_gpt.build_gpt(True, num_layers=1, num_moe_experts=4, seed=9)
    with overridden(strict_backend="triton"):
        rollouts = RolloutEngine(model, eod_id=tiny_gpt.EOD).generate([[5, 6, 7], [9]], max_new_tokens=3, seed=1)
        with torch.no_grad():
            learner = teacher_forced_logprobs(model, [r.tokens for r in rollouts])
    _assert_gap_zero(rollouts, learner)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        pytest.param(
            torch.float32,
            marks=pytest.mark.xfail(
                reason="fp32 strict on the H200 (2026-11-30, benchmarks/device_session.sh tests): 3 of 20 "
                "log-probs of one sequence 1 fp32 ulp apart (|d| 4.8e-7); root cause not found (suspect: the "
                "TF32 tensor-core path of the fp32 bi_* kernels is not row-slot invariant). bf16, the "
                "training dtype, is exact",
                strict=False,
            ),
        ),
    ],
)
def test_gpu_strict_gap_is_exactly_zero_with_triton_kernels(tiny_gpt, dtype):
    """On the GPU the strict ops dispatch to the batch-invariant Triton kernels by default."""
    from minite_megatron.nvfp4.backends import invariant_backend

    assert invariant_backend("cuda").name == "triton" and invariant_backend("cuda").supports("bi_matmul") is None
    model = tiny_gpt.build_gpt(True, dtype, seed=5, device="cuda")
    prompts = tiny_gpt.PROMPTS
    rollouts = RolloutEngine(model, eod_id=tiny_gpt.EOD).generate(prompts, max_new_tokens=NEW, temperature=1.0, seed=3)
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, [r.tokens for r in rollouts])
    _assert_gap_zero(rollouts, learner)
