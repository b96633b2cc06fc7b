"""Gap metrics: every key against a hand-written per-token formula, masks, directions, errors."""

import math

import pytest
import torch

from minite_megatron.diagnostics.metrics import (
    DEFAULT_THRESHOLDS,
    gap_metrics,
    pad_sequences,
    per_sequence_metrics,
    position_curves,
    router_flip_rates,
    threshold_key,
    topk_from_routing_map,
)

P = "rollout_corr/"


def _random_batch(seed=0, b=4, t=11, scale=1e-3):
    g = torch.Generator().manual_seed(seed)
    learner = -torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    rollout = learner + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    lengths = [11, 3, 7, 1]
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    return learner, rollout, mask


def _hand(learner, rollout, mask):
    """The formulas of docs/diagnostics.md, written per token with math (float64)."""
    toks, seqs = [], []
    for i in range(learner.shape[0]):
        row = [(float(learner[i, j]), float(rollout[i, j])) for j in range(learner.shape[1]) if mask[i, j]]
        toks += row
        if row:
            seqs.append(row)
    n = len(toks)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {}
    out[P + "kl"] = mean([r - l for l, r in toks])
    out[P + "k3_kl"] = mean([math.exp(l - r) - (l - r) - 1 for l, r in toks])
    out[P + "k3_kl_reverse"] = mean([math.exp(r - l) - (r - l) - 1 for l, r in toks])
    ml = [mean([l for l, _ in s]) for s in seqs]
    mr = [mean([r for _, r in s]) for s in seqs]
    out[P + "training_ppl"] = mean([math.exp(-x) for x in ml])
    out[P + "training_log_ppl"] = mean([-x for x in ml])
    out[P + "rollout_ppl"] = mean([math.exp(-x) for x in mr])
    out[P + "rollout_log_ppl"] = mean([-x for x in mr])
    diffs = [b - a for a, b in zip(ml, mr)]
    out[P + "log_ppl_diff"] = mean(diffs)
    out[P + "log_ppl_abs_diff"] = mean([abs(x) for x in diffs])
    out[P + "log_ppl_diff_max"] = max(diffs)
    out[P + "log_ppl_diff_min"] = min(diffs)
    out[P + "ppl_ratio"] = mean([math.exp(x) for x in diffs])
    out[P + "chi2_token"] = mean([math.exp(2 * (l - r)) for l, r in toks]) - 1
    out[P + "chi2_seq"] = mean([math.exp(2 * sum(l - r for l, r in s)) for s in seqs]) - 1
    out[P + "logprob_abs_diff_mean"] = mean([abs(r - l) for l, r in toks])
    out[P + "logprob_abs_diff_max"] = max(abs(r - l) for l, r in toks)
    out[P + "train_rollout_logprob_abs_diff"] = mean([mean([abs(r - l) for l, r in s]) for s in seqs])
    out[P + "token_mult_prob_error"] = mean([math.exp(abs(r - l)) for l, r in toks])
    out[P + "logprob_mismatch_frac"] = mean([float(l != r) for l, r in toks])
    for t in DEFAULT_THRESHOLDS:
        out[threshold_key(t)] = mean([float(abs(r - l) > t) for l, r in toks])
    pd = [abs(math.exp(l) - math.exp(r)) for l, r in toks]
    out["training/rollout_probs_diff_mean"] = mean(pd)
    out["training/rollout_probs_diff_max"] = max(pd)
    mu = mean(pd)
    out["training/rollout_probs_diff_std"] = math.sqrt(sum((x - mu) ** 2 for x in pd) / (n - 1))
    pl, pr = [math.exp(l) for l, _ in toks], [math.exp(r) for _, r in toks]
    al, ar = mean(pl), mean(pr)
    cov = sum((a - al) * (b - ar) for a, b in zip(pl, pr))
    out["training/rollout_actor_probs_pearson_corr"] = cov / math.sqrt(
        sum((a - al) ** 2 for a in pl) * sum((b - ar) ** 2 for b in pr)
    )
    out[P + "num_tokens"] = float(n)
    out[P + "num_seqs"] = float(len(seqs))
    return out


@pytest.mark.parametrize("scale", [1e-8, 1e-3, 0.3])
def test_every_key_matches_the_hand_formula(scale):
    learner, rollout, mask = _random_batch(scale=scale)
    got = gap_metrics(learner, rollout, mask)
    want = _hand(learner, rollout, mask)
    assert set(got) == set(want)
    for k, v in want.items():
        # float64 sums in another order: a few ulps of the terms' magnitude (1 + |x|).
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12 * (1 + abs(v))), k


def test_identical_logprobs_give_an_exact_zero_gap():
    learner, _, mask = _random_batch()
    m = gap_metrics(learner, learner.clone(), mask)
    for k in ("kl", "k3_kl", "k3_kl_reverse", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq",
              "logprob_abs_diff_mean", "logprob_abs_diff_max", "train_rollout_logprob_abs_diff", "logprob_mismatch_frac"):
        assert m[P + k] == 0.0, k
    assert m[P + "token_mult_prob_error"] == 1.0
    assert m[P + "ppl_ratio"] == 1.0
    assert m["training/rollout_probs_diff_max"] == 0.0
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0, abs=1e-12)


def test_padding_content_is_ignored():
    """Padding holding NaN / -inf (as engines emit) must not leak into any metric."""
    learner, rollout, mask = _random_batch()
    clean = gap_metrics(learner, rollout, mask)
    dirty_l = learner.masked_fill(~mask, float("nan"))
    dirty_r = rollout.masked_fill(~mask, float("-inf"))
    assert gap_metrics(dirty_l, dirty_r, mask.to(torch.int64)) == clean


def test_fp32_inputs_and_1d_input():
    learner, rollout, mask = _random_batch()
    one = gap_metrics(learner[0].float(), rollout[0].float())
    want = _hand(learner[0:1].float().double(), rollout[0:1].float().double(), torch.ones(1, 11, dtype=torch.bool))
    assert one[P + "logprob_abs_diff_max"] == pytest.approx(want[P + "logprob_abs_diff_max"], rel=1e-12)
    assert one[P + "num_seqs"] == 1.0


def test_k3_direction_is_kl_rollout_to_learner():
    """On tokens drawn exactly in proportion to pi_rollout, verl's k1 and k3 equal
    KL(pi_rollout || pi_learner); the reverse k3 on tokens drawn from pi_learner equals
    KL(pi_learner || pi_rollout). Pins the sign convention of both keys."""
    p_r = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    p_l = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    kl_rl = float((p_r * (p_r / p_l).log()).sum())
    kl_lr = float((p_l * (p_l / p_r).log()).sum())
    toks = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3])  # multiplicities 4:2:1:1 = 8 * p_r
    m = gap_metrics(p_l.log()[toks], p_r.log()[toks])
    assert m[P + "kl"] == pytest.approx(kl_rl, rel=1e-12)
    assert m[P + "k3_kl"] == pytest.approx(kl_rl, rel=1e-12)
    toks_l = torch.tensor([0, 1, 2, 3])  # uniform = pi_learner
    m2 = gap_metrics(p_l.log()[toks_l], p_r.log()[toks_l])
    assert m2[P + "k3_kl_reverse"] == pytest.approx(kl_lr, rel=1e-12)


def test_threshold_fractions_are_strict():
    """A token exactly at a threshold does not count (|d| > t); dyadic values keep d exact."""
    t1, t2 = 2.0**-20, 2.0**-10
    d = torch.tensor([0.0, t1, 2 * t1, t2, 0.5], dtype=torch.float64)
    learner = torch.full((5,), -1.0, dtype=torch.float64)
    assert torch.equal((learner + d) - learner, d)
    m = gap_metrics(learner, learner + d, thresholds=(t1, t2))
    assert m[threshold_key(t1)] == 3 / 5
    assert m[threshold_key(t2)] == 1 / 5
    assert threshold_key(1e-6) == "rollout_corr/logprob_abs_diff_frac_gt_1e-06"


def test_bad_inputs_raise_clear_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        gap_metrics(x, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="floating-point"):
        gap_metrics(torch.zeros(2, 3, dtype=torch.long), x)
    with pytest.raises(ValueError, match="selects no token"):
        gap_metrics(x, x, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"non-finite .* first at \[seq, pos\] = \[1, 2\]"):
        gap_metrics(x, x.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(float("-inf"))))
    with pytest.raises(ValueError, match="0 and 1"):
        gap_metrics(x, x, torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="both"):
        gap_metrics(x, x, learner_topk={0: torch.zeros(6, 2, dtype=torch.long)})


def test_per_sequence_and_position_curves():
    learner, rollout, mask = _random_batch(scale=1e-2)
    ps = per_sequence_metrics(learner, rollout, mask)
    for i in range(4):
        sel = mask[i]
        d = (rollout[i, sel] - learner[i, sel]).abs()
        assert ps["num_tokens"][i] == sel.sum()
        assert float(ps["logprob_abs_diff_mean"][i]) == pytest.approx(float(d.mean()), rel=1e-12)
        assert float(ps["logprob_abs_diff_max"][i]) == float(d.max())
    pc = position_curves(learner, rollout, mask)
    assert pc["count"].tolist() == mask.sum(0).double().tolist()
    for t in range(11):
        sel = mask[:, t]
        d = (rollout[sel, t] - learner[sel, t]).abs()
        assert float(pc["logprob_abs_diff_max"][t]) == float(d.max())
        assert float(pc["logprob_abs_diff_mean"][t]) == pytest.approx(float(d.mean()), rel=1e-12)
    assert float(pc["mismatch_frac"][0]) == 1.0


def test_position_curve_is_nan_where_no_token():
    learner, rollout, mask = _random_batch()
    mask[:, -1] = False
    pc = position_curves(learner, rollout, mask)
    assert math.isnan(float(pc["logprob_abs_diff_mean"][-1])) and pc["count"][-1] == 0


def test_pad_sequences():
    lp, m = pad_sequences([[-1.0, -2.0], [-0.5]])
    assert lp.tolist() == [[-1.0, -2.0], [-0.5, 0.0]]
    assert m.tolist() == [[True, True], [True, False]]


def test_router_flip_rates_by_hand():
    a0 = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2]])
    b0 = torch.tensor([[1, 0], [2, 3], [1, 3], [0, 2]])  # same sets, order differs: no flip
    a1 = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2]])
    b1 = torch.tensor([[0, 1], [2, 1], [0, 2], [0, 2]])  # token 1 one expert differs, token 2 both
    m = router_flip_rates({0: a0, 1: a1}, {0: b0, 1: b1})
    assert m[P + "router_topk_flip_rate/layer_0"] == 0.0
    assert m[P + "router_topk_flip_rate/layer_1"] == 0.5
    assert m[P + "router_topk_expert_miss/layer_1"] == (0.5 + 1.0) / 4
    assert m[P + "router_topk_flip_rate"] == 0.25
    masked = router_flip_rates({1: a1}, {1: b1}, token_mask=torch.tensor([True, False, False, True]))
    assert masked[P + "router_topk_flip_rate"] == 0.0
    full = gap_metrics(torch.zeros(4), torch.zeros(4), learner_topk={1: a1}, rollout_topk={1: b1})
    assert full[P + "router_topk_flip_rate/layer_1"] == 0.5


def test_router_flip_rates_errors():
    a = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="layers differ"):
        router_flip_rates({0: a}, {1: a})
    with pytest.raises(ValueError, match="repeated expert"):
        router_flip_rates({0: a}, {0: torch.tensor([[1, 1]])})
    with pytest.raises(ValueError, match="integers"):
        router_flip_rates({0: a.float()}, {0: a.float()})
    with pytest.raises(ValueError, match="shapes differ"):
        router_flip_rates({0: a}, {0: torch.tensor([[0, 1, 2]])})


def test_topk_from_routing_map():
    rm = torch.tensor([[True, False, True, False], [False, True, True, False]])
    assert topk_from_routing_map(rm).tolist() == [[0, 2], [1, 2]]
    with pytest.raises(ValueError, match="expected 2 each"):
        topk_from_routing_map(torch.tensor([[True, True], [True, False]]))
