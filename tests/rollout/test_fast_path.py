"""The rollout engine's fast path (prefill on the learner's forward, decode runner on the learner's
modules, device-side sampling): equal to Megatron's path, exactly 0 learner/sampler gap in strict
mode over many steps and mixed prompt lengths (dense and MoE, Megatron's local strict spec and
miniTE's NVFP4 spec), weight refresh after an optimizer step, the sampler, the MoE decode pieces,
path selection and bad options. On a GPU: CUDA graphs against eager steps."""

import logging

import pytest
import torch

from minite_megatron.rollout.engine import RolloutEngine
from minite_megatron.rollout.logprobs import teacher_forced_logprobs
from minite_megatron.testing import assert_bitwise_equal

PROMPTS = [[5, 17, 33, 2, 71, 9, 12, 40, 41, 3, 88], [64, 7], [11, 22, 33, 44, 55], [90, 1, 4, 9, 16, 25, 36, 49], [3]]


def _nvfp4_tiny(strict: bool, num_experts: int | None = 4, device="cpu", dtype=torch.float32, seed=3):
    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import PRESETS, build_gpt

    preset = dict(PRESETS["tiny"], vocab=96)
    if num_experts is None:
        preset = dict(preset, experts=None, moe_ffn=None)
    return build_gpt(preset, Recipe(strict=strict), max_seq=48, device=device, dtype=dtype, seed=seed).eval()


@pytest.fixture(scope="module")
def models(tiny_gpt):
    """name -> (model, strict): the five kinds of models the fast path walks."""
    return {
        "strict-local-moe": (tiny_gpt.build_gpt(True, seed=21), True),
        "strict-local-dense": (tiny_gpt.build_gpt(True, seed=22, num_moe_experts=None, moe_ffn_hidden_size=None), True),
        "strict-nvfp4-moe": (_nvfp4_tiny(True), True),
        "default-local-moe": (tiny_gpt.build_gpt(False, seed=23), False),
        "default-nvfp4-moe": (_nvfp4_tiny(False), False),
    }


@pytest.mark.parametrize("name", ["strict-local-moe", "strict-local-dense", "strict-nvfp4-moe", "default-local-moe",
                                  "default-nvfp4-moe"])
def test_fast_path_equals_megatrons(models, name):
    """Greedy rollouts of mixed prompt lengths: the same tokens as Megatron's static engine, and
    log-probs bitwise equal in strict mode (close in default mode, where BLAS sums by shape)."""
    model, strict = models[name]
    fast_engine = RolloutEngine(model, eod_id=0)
    assert fast_engine.path == "fast"
    fast = fast_engine.generate(PROMPTS, 6, temperature=0.0, stop_at_eod=False)
    megatron = RolloutEngine(model, eod_id=0, fast=False).generate(PROMPTS, 6, temperature=0.0, stop_at_eod=False)
    for f, m in zip(fast, megatron):
        assert f.tokens == m.tokens
        if strict:
            assert_bitwise_equal(f.log_probs, m.log_probs, name)
        else:
            torch.testing.assert_close(f.log_probs, m.log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["strict-local-moe", "strict-local-dense", "strict-nvfp4-moe"])
def test_strict_gap_is_exactly_zero_over_many_steps(models, name):
    """Sampled rollouts (temperature 1, 20 new tokens, mixed prompt lengths, more prompts than the
    batch, EOD stopping) score exactly the learner's teacher-forced log-probs, raw and sampled."""
    model, _ = models[name]
    engine = RolloutEngine(model, eod_id=0, max_batch_size=3)
    for logprobs, temperature in (("raw", 1.0), ("sampled", 0.7)):
        rollouts = engine.generate(PROMPTS, 20, temperature=temperature, seed=11, logprobs=logprobs)
        assert max(len(r.generated_tokens) for r in rollouts) > 10
        with torch.no_grad():
            learner = teacher_forced_logprobs(model, [r.tokens for r in rollouts],
                                              temperature=temperature if logprobs == "sampled" else 1.0)
        for r, lp in zip(rollouts, learner):
            assert_bitwise_equal(r.log_probs, lp, f"{name} {logprobs}")


def test_weights_refresh_after_an_optimizer_step():
    """The fast path reads the learner's new quantized weights after an optimizer step with no call
    from the trainer: the same seed's rollouts are then scored by the updated model, bitwise."""
    model = _nvfp4_tiny(True, seed=5)
    engine = RolloutEngine(model, eod_id=0)
    before = engine.generate(PROMPTS[:3], 5, temperature=1.0, seed=2, stop_at_eod=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    lps = teacher_forced_logprobs(model, [r.tokens for r in before])
    (-torch.stack([lp.sum() for lp in lps]).sum()).backward()
    opt.step()
    after = engine.generate(PROMPTS[:3], 5, temperature=1.0, seed=2, stop_at_eod=False)
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, [r.tokens for r in after])
    for b, a, lp in zip(before, after, learner):
        assert_bitwise_equal(a.log_probs, lp)
    assert any(not torch.equal(b.prompt_log_probs, a.prompt_log_probs) for b, a in zip(before, after))
    assert sum(w.refresh() for w in engine._fast.runner.weights) == 0  # nothing new since


@pytest.mark.parametrize("sampler", [dict(temperature=1.3), dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.6),
                                     dict(temperature=0.5, top_k=1)], ids=["temperature", "top_k", "top_p", "top_k1"])
def test_device_sampler_draws_megatrons_tokens(sampler):
    """``sample_tokens`` (exponential race, no host check) draws the tokens Megatron's
    ``TorchSampling.sample_from_logits`` (``torch.multinomial``) draws from the same generator."""
    from megatron.core.inference.sampling.torch_sampling import TorchSampling

    from minite_megatron.rollout.sampling import SamplingConfig, sample_tokens

    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(1)) * 3
    cfg = SamplingConfig(sampler["temperature"], sampler.get("top_k", 0), sampler.get("top_p", 0.0), 1.0, True)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(4):
        want = TorchSampling.sample_from_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p, generator=g1, vocab_size=97)
        assert torch.equal(sample_tokens(logits, cfg, g2, 97), want)


def test_routed_experts_and_ordered_sum_are_the_learners_combine():
    """The decode MoE's expert order (increasing index) and ``ordered_sum`` give the bits of
    ``deterministic_unpermute`` over Megatron's expert-major permutation (bf16, top-3 of 6)."""
    from minite_megatron.rollout.decode_step import routed_experts
    from minite_megatron.modules.deterministic_moe import deterministic_unpermute, ordered_sum

    g = torch.Generator().manual_seed(4)
    t, e, k, h = 9, 6, 3, 32
    scores = torch.randn(t, e, generator=g)
    top = torch.topk(scores, k).indices
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(t, e).scatter(1, top, torch.rand(t, k, generator=g))
    experts, weights = routed_experts(routing_map, probs, k)
    assert torch.equal(experts, top.sort(1).values) and torch.equal(weights, probs.gather(1, experts))
    out = (torch.randn(t, k, h, generator=g) * 10).to(torch.bfloat16)  # row (t, j): token t, its j-th expert
    pairs = routing_map.t().nonzero()  # Megatron's permutation: expert-major, tokens ascending
    slot = (experts[pairs[:, 1]] == pairs[:, 0:1]).int().argmax(1)
    permuted = out[pairs[:, 1], slot]
    assert_bitwise_equal(ordered_sum(out), deterministic_unpermute(permuted, pairs[:, 1], t))


def test_default_minite_spec_uses_the_deterministic_combine(models):
    from minite_megatron.rollout.logprobs import model_is_strict
    from minite_megatron.modules.deterministic_moe import DeterministicMoELayer, StrictAlltoAllTokenDispatcher

    model, _ = models["default-nvfp4-moe"]
    moe = model.decoder.layers[0].mlp
    assert type(moe) is DeterministicMoELayer and moe.deterministic_combine
    assert isinstance(moe.token_dispatcher, StrictAlltoAllTokenDispatcher) and not model_is_strict(model)


def test_path_selection_and_bad_options(models, caplog):
    from minite_megatron.rollout import support

    model, _ = models["strict-nvfp4-moe"]
    assert support.fast_path_refusal(model) is None
    assert "not (a wrapper of) a Megatron GPTModel" in support.fast_path_refusal(torch.nn.Linear(2, 2))
    moe = model.decoder.layers[1].mlp
    router = moe.router
    moe.router = torch.nn.Identity()
    try:
        assert support.fast_path_refusal(model) == "decoder.layers.1.mlp.router is a Identity"
        with pytest.raises(ValueError, match="fast path cannot run this model: decoder.layers.1.mlp.router"):
            RolloutEngine(model, eod_id=0, fast=True)
        with caplog.at_level(logging.INFO, logger="minite_megatron.rollout.engine"):
            engine = RolloutEngine(model, eod_id=0)
        assert engine.path == "megatron"
        assert "Megatron's static inference engine (decoder.layers.1.mlp.router" in caplog.text
    finally:
        moe.router = router
    with pytest.raises(ValueError, match="sdpa"):
        RolloutEngine(model, eod_id=0, attention="sdpa")
    with pytest.raises(ValueError, match="attention must be"):
        RolloutEngine(model, eod_id=0, attention="flash")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs=True"):
            RolloutEngine(model, eod_id=0, cuda_graphs=True)


def test_buckets():
    from minite_megatron.rollout.fast_path import buckets_for

    assert buckets_for(1) == [1] and buckets_for(8) == [1, 2, 4, 8] and buckets_for(12) == [1, 2, 4, 8, 12]


@pytest.mark.gpu
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "default"])
def test_cuda_graphs_equal_eager_steps_and_strict_gap_is_zero(strict):
    """On the GPU: captured decode steps give the eager steps' tokens and log-probs bit for bit
    (greedy at every batch size, sampled where the batch fills its bucket: the noise has the
    bucket's shape), a graph's first call draws what later calls draw, graphs are reused per
    bucket, and in strict mode the log-probs are the learner's teacher-forced ones."""
    from minite_megatron.training.presets import init_single_process

    init_single_process()
    model = _nvfp4_tiny(strict, device="cuda", dtype=torch.bfloat16)
    graphed = RolloutEngine(model, eod_id=0, max_batch_size=4)
    eager = RolloutEngine(model, eod_id=0, max_batch_size=4, cuda_graphs=False)
    assert graphed._fast.use_graphs and not eager._fast.use_graphs
    for n, temperature in ((1, 1.0), (3, 0.0), (4, 1.0), (5, 0.0), (4, 1.0)):
        a = graphed.generate(PROMPTS[:n], 12, temperature=temperature, seed=n)
        b = eager.generate(PROMPTS[:n], 12, temperature=temperature, seed=n)
        for x, y in zip(a, b):
            assert x.tokens == y.tokens
            assert_bitwise_equal(x.log_probs, y.log_probs)
        if strict:
            with torch.no_grad():
                learner = teacher_forced_logprobs(model, [r.tokens for r in a])
            for x, lp in zip(a, learner):
                assert_bitwise_equal(x.log_probs, lp)
    assert len(graphed._fast.graphs) == 4  # (bucket, sampler): (1, T=1), (4, greedy), (4, T=1), (1, greedy)
