"""RolloutEngine: Megatron's static inference engine with raw per-token log-probs -- shapes,
seeding, samplers (greedy / temperature / top-k / top-p), EOD, batching and argument checks."""

import pytest
import torch

from minite_megatron.rollout.engine import RolloutEngine
from minite_megatron.rollout.logprobs import teacher_forced_logprobs
from minite_megatron.testing import assert_bitwise_equal


def _full_log_probs(model, tokens):
    """fp32 [len(tokens) - 1, V]: the model's log-softmax at every position (teacher forcing)."""
    t = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    mask = torch.ones(len(tokens), len(tokens), dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        logits = model(t, pos, mask, runtime_gather_output=True)[0, :-1]
    return torch.log_softmax(logits.double(), -1)


def test_rollout_structure_and_mixed_prompt_lengths(strict_model, tiny_gpt):
    from megatron.core.inference.utils import InferenceMode

    rollouts = RolloutEngine(strict_model, eod_id=tiny_gpt.EOD).generate(tiny_gpt.PROMPTS, max_new_tokens=4, seed=1)
    assert not InferenceMode.is_active()  # the learner can use the model right away
    assert [r.prompt_tokens for r in rollouts] == tiny_gpt.PROMPTS
    for r in rollouts:
        assert 1 <= len(r.generated_tokens) <= 4 + 1
        assert r.prompt_log_probs.shape == (len(r.prompt_tokens) - 1,)
        assert r.generated_log_probs.shape == (len(r.generated_tokens),)
        assert r.log_probs.dtype == torch.float32 and bool((r.log_probs <= 0).all())
        assert r.tokens == r.prompt_tokens + r.generated_tokens
        assert all(0 <= t < tiny_gpt.VOCAB for t in r.generated_tokens)


def test_seed_makes_rollouts_reproducible(strict_model, tiny_gpt):
    engine = RolloutEngine(strict_model, eod_id=tiny_gpt.EOD)
    a = engine.generate(tiny_gpt.PROMPTS[:3], 6, temperature=1.5, seed=7)
    b = engine.generate(tiny_gpt.PROMPTS[:3], 6, temperature=1.5, seed=7)
    c = engine.generate(tiny_gpt.PROMPTS[:3], 6, temperature=1.5, seed=8)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        assert_bitwise_equal(x.log_probs, y.log_probs)
    assert [x.tokens for x in a] != [z.tokens for z in c]


def test_greedy_takes_the_argmax_and_log_probs_are_raw(strict_model, tiny_gpt):
    """Raw log-probs: temperature and top-k change what is sampled, never the reported
    log-probability (log-softmax of the unscaled logits)."""
    engine = RolloutEngine(strict_model, eod_id=tiny_gpt.EOD)
    greedy = engine.generate(tiny_gpt.PROMPTS[:3], 5, temperature=0.0)
    cold = engine.generate(tiny_gpt.PROMPTS[:3], 5, temperature=0.25, top_k=1, seed=3)
    for g, c in zip(greedy, cold):
        assert g.tokens == c.tokens
        assert_bitwise_equal(g.log_probs, c.log_probs)
        full = _full_log_probs(strict_model, g.tokens)
        start = len(g.prompt_tokens) - 1
        for i, tok in enumerate(g.generated_tokens):
            if tok != tiny_gpt.EOD or i < len(g.generated_tokens) - 1:
                assert tok == int(full[start + i].argmax())
        torch.testing.assert_close(g.generated_log_probs.double(), full[start:].gather(1, torch.tensor(g.generated_tokens)[:, None]).squeeze(1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampler", [dict(top_k=3), dict(top_p=0.5)], ids=["top_k", "top_p"])
def test_filters_restrict_the_samples(strict_model, tiny_gpt, sampler):
    """top-k / top-p act on the temperature-scaled distribution (Megatron's sampler)."""
    rollouts = RolloutEngine(strict_model, eod_id=tiny_gpt.EOD).generate(
        tiny_gpt.PROMPTS, 6, temperature=2.0, seed=4, stop_at_eod=False, **sampler
    )
    for r in rollouts:
        full = _full_log_probs(strict_model, r.tokens)
        for i, tok in enumerate(r.generated_tokens):
            row = torch.log_softmax(full[len(r.prompt_tokens) - 1 + i] / 2.0, -1)  # the tempered distribution
            higher = row > row[tok]
            if "top_k" in sampler:
                assert int(higher.sum()) < 3
            else:
                assert float(row[higher].exp().sum()) < 0.5 + 1e-6  # inside the nucleus


def test_eod_stops_a_sequence_and_keeps_its_log_prob(strict_model, tiny_gpt):
    prompts = tiny_gpt.PROMPTS[:3]
    first = RolloutEngine(strict_model, eod_id=tiny_gpt.EOD).generate(prompts, 1, temperature=0.0)
    eod = first[0].generated_tokens[0]
    stopped = RolloutEngine(strict_model, eod_id=eod).generate(prompts, 6, temperature=0.0)
    assert stopped[0].generated_tokens == [eod] and stopped[0].finished_by_eod
    assert_bitwise_equal(stopped[0].generated_log_probs, first[0].generated_log_probs)
    running = RolloutEngine(strict_model, eod_id=eod).generate(prompts, 6, temperature=0.0, stop_at_eod=False)
    assert len(running[0].generated_tokens) == 6 and not running[0].finished_by_eod
    for r in stopped[1:]:
        assert eod not in r.generated_tokens[:-1]


def test_more_prompts_than_the_batch_size(strict_model, tiny_gpt):
    prompts = tiny_gpt.PROMPTS + [[4, 4, 4], [8]]
    rollouts = RolloutEngine(strict_model, eod_id=tiny_gpt.EOD, max_batch_size=3).generate(prompts, 3, temperature=0.0)
    assert [r.prompt_tokens for r in rollouts] == prompts
    with torch.no_grad():
        learner = teacher_forced_logprobs(strict_model, [r.tokens for r in rollouts])
    for r, lp in zip(rollouts, learner):
        assert_bitwise_equal(r.log_probs, lp)


def test_bad_arguments_raise(strict_model, tiny_gpt):
    engine = RolloutEngine(strict_model, eod_id=tiny_gpt.EOD, max_sequence_length=20)
    good = [[1, 2, 3]]
    for kwargs, match in [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=2, temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=2, top_k=2, top_p=0.5), "not both"),
        (dict(max_new_tokens=2, top_p=1.5), "top_p"),
        (dict(max_new_tokens=2, top_k=tiny_gpt.VOCAB), "top_k"),
        (dict(max_new_tokens=18), "max_sequence_length"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.generate(good, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 2)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, tiny_gpt.VOCAB]], 2)
    with pytest.raises(ValueError, match="eod_id"):
        RolloutEngine(strict_model, eod_id=tiny_gpt.VOCAB)


def test_sampled_log_probs_match_the_learner_at_the_sampling_temperature(strict_model, tiny_gpt):
    """``logprobs="sampled"``: the rollout's log-probs are those of ``softmax(logits / T)``, the
    distribution the tokens were drawn from, and equal the learner's teacher-forced log-probs
    at the same temperature bit for bit (strict model); raw ones are unchanged by it."""
    engine = RolloutEngine(strict_model, eod_id=tiny_gpt.EOD)
    sampled = engine.generate(tiny_gpt.PROMPTS[:3], 5, temperature=0.6, seed=5, logprobs="sampled")
    raw = engine.generate(tiny_gpt.PROMPTS[:3], 5, temperature=0.6, seed=5)
    learner = teacher_forced_logprobs(strict_model, [r.tokens for r in sampled], temperature=0.6)
    for s, r, lp in zip(sampled, raw, learner):
        assert s.tokens == r.tokens
        assert_bitwise_equal(s.log_probs, lp.detach())
        assert not torch.equal(s.log_probs, r.log_probs)
    with pytest.raises(ValueError, match="logprobs"):
        engine.generate(tiny_gpt.PROMPTS[:1], 2, logprobs="processed")
