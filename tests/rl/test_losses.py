"""PPO clipped loss, TIS, k3 KL, entropy and token-level aggregation against hand-computed values
(values and gradients)."""

import math

import pytest
import torch

from minite_megatron.rl import MetricSums, aggregate, entropy_from_logits, k3_kl, ppo_clip_token_loss, tis_weights


def _loss_and_grad(ratio, adv, **kw):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, clipped, lower = ppo_clip_token_loss(logp, old, torch.tensor([adv], dtype=torch.float64), **kw)
    loss.sum().backward()
    return loss.item(), bool(clipped), bool(lower), logp.grad.item()


@pytest.mark.parametrize(
    "ratio, adv, loss, clipped, grad",
    [
        (1.1, 1.0, -1.1, False, -1.1),  # inside the trust region: -A * ratio, d/dlogp = -A * ratio
        (1.5, 1.0, -1.2, True, 0.0),  # A > 0, ratio above 1 + eps: clipped, no gradient
        (0.5, 1.0, -0.5, False, -0.5),  # A > 0, ratio below 1 - eps: the unclipped branch is larger
        (0.5, -1.0, 0.8, True, 0.0),  # A < 0, ratio below 1 - eps: clipped
        (1.5, -1.0, 1.5, False, 1.5),  # A < 0, ratio above 1 + eps: not clipped (pessimistic bound)
    ],
)
def test_ppo_clip_by_hand(ratio, adv, loss, clipped, grad):
    got_loss, got_clipped, lower, got_grad = _loss_and_grad(ratio, adv, eps_low=0.2, eps_high=0.2)
    assert got_loss == pytest.approx(loss, abs=1e-12)
    assert got_clipped is clipped and lower is False
    assert got_grad == pytest.approx(grad, abs=1e-12)


def test_clip_higher_widens_only_the_upper_bound():
    # DAPO: eps_high 0.28 lets a positive-advantage token's ratio reach 1.28
    assert _loss_and_grad(1.25, 1.0, eps_low=0.2, eps_high=0.28)[:2] == (pytest.approx(-1.25), False)
    assert _loss_and_grad(1.25, 1.0, eps_low=0.2, eps_high=0.2)[:2] == (pytest.approx(-1.2), True)
    assert _loss_and_grad(0.75, -1.0, eps_low=0.2, eps_high=0.28)[:2] == (pytest.approx(0.8), True)


def test_dual_clip_caps_negative_advantage_tokens():
    loss, clipped, lower, grad = _loss_and_grad(4.0, -1.0, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert (loss, lower, grad) == (pytest.approx(3.0), True, 0.0)
    assert _loss_and_grad(2.0, -1.0, dual_clip=3.0)[0] == pytest.approx(2.0)  # below the cap: unchanged


def test_clip_arguments_are_checked():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="eps_low must be < 1"):
        ppo_clip_token_loss(z, z, torch.zeros(1), eps_low=1.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_token_loss(z, z, torch.zeros(1), dual_clip=1.0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_token_loss(z, z, torch.zeros(3))


def test_tis_weight_is_truncated_and_detached():
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]], requires_grad=True)
    rollout = torch.zeros(1, 3)
    w = tis_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0]]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(old, rollout, cap=0.0)


def test_k3_kl_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.25)], dtype=torch.float64)
    kl = k3_kl(logp, ref)
    r = math.log(0.5)  # ref - logp for the first token
    assert kl[0].item() == pytest.approx(math.exp(r) - r - 1.0, abs=1e-12)  # 0.1931...
    assert kl[1].item() == 0.0
    kl.sum().backward()
    # d/dlogp (exp(ref - logp) - (ref - logp) - 1) = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, torch.tensor([0.5, 0.0], dtype=torch.float64))


def test_entropy_from_logits_by_hand():
    v = 16
    assert entropy_from_logits(torch.zeros(2, v)).tolist() == pytest.approx([math.log(v)] * 2, abs=1e-6)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    want = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(logits).item() == pytest.approx(want, abs=1e-6)
    # temperature 2 on logits [0, 2 ln 3] is the same distribution as temperature 1 on [0, ln 3]
    assert entropy_from_logits(logits * 2, temperature=2.0).item() == pytest.approx(want, abs=1e-6)


def test_token_mean_ignores_padding_even_when_it_is_nan():
    nan = float("nan")
    values = torch.tensor([[1.0, 2.0, nan], [3.0, nan, nan]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss = aggregate(values, mask, "token-mean")
    assert loss.item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3 tokens
    loss.backward()
    assert torch.isfinite(values.grad).all()
    torch.testing.assert_close(values.grad, mask.float() / 3)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3.0) / 2)


def test_token_mean_over_micro_batches_with_the_global_denominator():
    """Micro-batch losses with the mini-batch's token count add up to the mini-batch token mean
    (sequences of different lengths weigh by their tokens: DAPO / verl token-mean)."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.4
    whole = aggregate(values, mask, "token-mean")
    n = mask.sum()
    parts = aggregate(values[:2], mask[:2], denominator=n) + aggregate(values[2:], mask[2:], denominator=n)
    torch.testing.assert_close(parts, whole)
    seqs = (mask.sum(1) > 0).sum()
    whole_seq = aggregate(values, mask, "seq-mean-token-mean")
    parts_seq = sum(aggregate(values[i : i + 3], mask[i : i + 3], "seq-mean-token-mean", seqs) for i in (0, 3))
    torch.testing.assert_close(parts_seq, whole_seq)


def test_aggregate_refuses_bad_modes_and_empty_masks():
    with pytest.raises(ValueError, match="loss aggregation must be one of"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "sum")
    with pytest.raises(ValueError, match="selects no token"):
        aggregate(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool))


def test_metric_sums_weight_by_count():
    s = MetricSums()
    s.add("actor/entropy", torch.tensor(3.0), 2)
    s.add("actor/entropy", 1.0, 2)
    s.add("never", 0.0, 0)
    m = s.means()
    assert m["actor/entropy"] == 1.0 and math.isnan(m["never"])
