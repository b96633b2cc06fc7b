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


def _unchunked(logits, tokens, strict, temperature):
    """The log-probs as one call over the whole ``[..., V]`` (what the chunked code replaces)."""
    if temperature != 1.0:
        logits = logits.to(torch.float32) / temperature
    if strict:
        from minite_megatron.invariant.softmax import log_softmax

        lp = log_softmax(logits, dim=-1)
    else:
        lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return torch.gather(lp, -1, tokens.long().unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs_in_row_chunks_have_the_bits_of_one_call(strict, temperature, dtype):
    """Scoring a prefill's ``[B, L, V]`` logits in blocks of rows (the fix of the batch-256 OOM:
    no ``[B, L, V]`` fp32 copy) gives the bits of one log-softmax over the whole, for every block
    size (several slices of dim 0 per block, part of one slice, one row), on the engine's
    non-contiguous ``logits[:, :-1]`` view, with hard rows (+-inf, huge, ties)."""
    g = torch.Generator().manual_seed(5)
    b, length, v = 5, 7, 97
    logits = (torch.randn(b, length, v, generator=g) * 6).to(dtype)
    logits[0, 1] = 0  # ties
    logits[1, 2, :5] = float("-inf")
    logits[2, 3, 7] = 3e4
    logits[3, 0, ::3] = -3e4
    view, tokens = logits[:, :-1], torch.randint(0, v, (b, length - 1), generator=g)
    want = _unchunked(view, tokens, strict, temperature)
    for rows in (1, 2, 3, length - 1, length, 2 * (length - 1) + 1, b * length):
        got = token_logprobs(view, tokens, strict, temperature, chunk_bytes=rows * 4 * v)
        assert_bitwise_equal(got, want)
    assert_bitwise_equal(token_logprobs(view[:, 0], tokens[:, 0], strict, temperature, chunk_bytes=4 * v),
                         _unchunked(view[:, 0], tokens[:, 0], strict, temperature))
