"""Teacher-forced log-probs (the learner side) and the shared token log-prob function."""

import pytest
import torch

from minite_megatron.rollout.logprobs import (
    model_is_strict,
    pad_sequences,
    teacher_forced_logprobs,
    token_logprobs,
)
from minite_megatron.testing import assert_bitwise_equal


def test_teacher_forced_equals_the_models_own_log_softmax(tiny_gpt):
    model = tiny_gpt.build_gpt(False, seed=3)
    assert not model_is_strict(model)
    seqs = [[1, 5, 9, 2, 7], [3, 3, 8]]
    with torch.no_grad():
        got = teacher_forced_logprobs(model, seqs)
        for seq, lp in zip(seqs, got):
            t = torch.tensor([seq])
            mask = torch.ones(len(seq), len(seq), dtype=torch.bool).triu(1)[None, None]
            logits = model(t, torch.arange(len(seq))[None], mask, runtime_gather_output=True)[0, :-1]
            ref = torch.log_softmax(logits.float(), -1).gather(1, t[0, 1:, None]).squeeze(1)
            torch.testing.assert_close(lp, ref, rtol=0, atol=2e-6)  # alone vs in a batch: BLAS noise only


def test_strict_model_is_detected_and_uses_the_strict_log_softmax(strict_model):
    assert model_is_strict(strict_model)
    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(4, 7, 96, generator=g), torch.randint(0, 96, (4, 7), generator=g)
    from minite_megatron.invariant.softmax import token_log_probs

    assert_bitwise_equal(token_logprobs(logits, tokens, strict=True), token_log_probs(logits, tokens))
    torch.testing.assert_close(token_logprobs(logits, tokens, strict=False), token_log_probs(logits, tokens))


def test_input_checks():
    with pytest.raises(ValueError):
        pad_sequences([], 0)
    with pytest.raises(ValueError, match="at least 2"):
        pad_sequences([[1, 2], [3]], 0)
    tokens, lengths = pad_sequences([[1, 2, 3], [4, 5]], pad_id=9)
    assert tokens.tolist() == [[1, 2, 3], [4, 5, 9]] and lengths == [3, 2]
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs(torch.zeros(2, 5), torch.tensor([1, 5]), strict=False)
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(torch.zeros(2, 5), torch.tensor([1]), strict=True)


def test_token_logprobs_temperature_is_log_softmax_of_scaled_logits():
    """Temperature-scaled log-probs (the distribution a sampler draws from) equal
    ``log_softmax(logits / T)``, in default and strict mode; a bad temperature is refused."""
    from minite_megatron.rollout.logprobs import token_logprobs

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 17, generator=g)
    tokens = torch.randint(0, 17, (3, 5), generator=g)
    for strict in (False, True):
        got = token_logprobs(logits, tokens, strict, temperature=0.7)
        want = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
        assert not torch.equal(got, token_logprobs(logits, tokens, strict))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(logits, tokens, False, temperature=bad)
