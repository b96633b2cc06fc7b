"""Trace comparison: statuses, alignment, and planted divergences found at the exact point.

The planted tests run a tiny W4A4 MoE (tests/diagnostics/tiny_moe.py) once as a learner
(whole sequences) and once as a rollout engine (prefill + one token per step, continuous
batching), change one thing in the rollout, and assert the tracer names that point first.
"""

import math

import pytest
import torch

from minite_megatron.diagnostics import Tracer, capture, capture_routed, compare_traces, gap_metrics, pad_sequences
from minite_megatron.diagnostics.compare import layer_of, point_label


def _trace(engine, **points):
    with Tracer(engine=engine) as tr:
        tr.set_tokens(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]))
        for n, v in points.items():
            capture(n, v)
    return tr.trace()


def test_statuses_bitwise_and_tolerance():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    b = a.clone()
    b[1, 1] = torch.nextafter(b[1, 1], torch.tensor(10.0))
    ref = _trace("l", eq=a, near=a, far=a, codes=torch.tensor([[1], [2], [3]], dtype=torch.uint8))
    oth = _trace("r", eq=a.clone(), near=b, far=a + 1, codes=torch.tensor([[1], [7], [3]], dtype=torch.uint8))
    c = compare_traces(ref, oth)
    st = {r.name: r.status for r in c.results}
    assert st == {"eq": "equal", "near": "diverged", "far": "diverged", "codes": "diverged"}
    assert c.first_divergence.name == "near"
    near = c.results[1]
    assert near.mismatched == 1 and near.max_abs == float(b[1, 1] - a[1, 1])
    assert near.worst_key == "seq 0 pos 1" and near.worst_element == [1]
    codes = c.results[3]
    assert not codes.numeric and math.isnan(codes.max_abs) and (codes.worst_ref, codes.worst_other) == (2, 7)
    tol = compare_traces(ref, oth, atol=1e-5)
    st = {r.name: r.status for r in tol.results}
    assert st == {"eq": "equal", "near": "within_tol", "far": "diverged", "codes": "diverged"}
    assert tol.first_divergence.name == "far"
    with pytest.raises(ValueError, match="atol"):
        compare_traces(ref, oth, atol=-1.0)


def test_nan_and_inf_handling():
    """Same NaN bits and same infinities are equal; NaN (or inf) on one side only diverges
    with an infinite error, never silently."""
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([[nan, 1.0], [inf, 2.0], [0.0, 3.0]])
    same = _trace("r", x=a.clone())
    c = compare_traces(_trace("l", x=a), same)
    assert c.results[0].status == "equal"
    b = a.clone()
    b[2, 0] = nan
    c = compare_traces(_trace("l", x=a), _trace("r", x=b), atol=1e30)
    r = c.results[0]
    assert r.status == "diverged" and r.max_abs == inf and r.worst_key == "seq 1 pos 0"


def test_only_common_keys_are_compared_and_missing_points_listed():
    with Tracer(engine="l") as a:
        a.set_tokens(torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]))
        capture("h", torch.tensor([1.0, 2.0, 3.0]))
        capture("only_ref", torch.zeros(3))
    with Tracer(engine="r") as b:
        b.set_tokens(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]))  # no (0, 2); extra (1, 0)
        capture("h", torch.tensor([1.0, 2.0, 99.0]))
        capture("only_other", torch.zeros(3))
    c = compare_traces(a.trace(), b.trace())
    st = {r.name: (r.status, r.rows_common) for r in c.results}
    assert st == {"h": ("equal", 2), "only_ref": ("missing_in_other", 0), "only_other": ("missing_in_ref", 0)}
    assert c.first_divergence is None


def test_routing_difference_is_a_divergence():
    with Tracer(engine="l") as a:
        a.set_tokens(torch.tensor([0, 0]), torch.tensor([0, 1]))
        capture_routed("e", torch.ones(2, 2), torch.tensor([0, 1]), torch.tensor([0, 0]))
    with Tracer(engine="r") as b:
        b.set_tokens(torch.tensor([0, 0]), torch.tensor([0, 1]))
        capture_routed("e", torch.ones(2, 2), torch.tensor([0, 1]), torch.tensor([0, 3]))
    r = compare_traces(a.trace(), b.trace()).results[0]
    assert r.status == "diverged" and r.routing_mismatch_tokens == 1 and r.rows_common == 1


def test_shape_and_dtype_differences_diverge():
    c = compare_traces(_trace("l", x=torch.zeros(3, 2), y=torch.zeros(3, 2)), _trace("r", x=torch.zeros(3, 4), y=torch.zeros(3, 2).double()))
    assert [r.status for r in c.results] == ["diverged", "diverged"]
    assert "row shape" in c.results[0].note and "dtype" in c.results[1].note


def test_labels_and_layers():
    n = "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.output"
    assert layer_of(n) == 3 and point_label(n) == "mlp.experts.local_experts.*.linear_fc2.output"
    assert layer_of("output_layer.output") is None and point_label("output_layer.output") == "output_layer.output"


# ---- planted divergences on the tiny two-mode engine --------------------------------------
@pytest.fixture(scope="module")
def setup(tiny_moe):
    cfg = tiny_moe.TinyConfig()
    weights = tiny_moe.make_weights(cfg)
    seqs = tiny_moe.make_sequences(cfg)
    with Tracer(engine="learner") as tr:
        logp = tiny_moe.run_learner(tiny_moe.TinyMoE(cfg, weights), seqs, tr)
    return cfg, weights, seqs, tr.trace(), logp


def _rollout(tiny_moe, setup, knobs):
    cfg, weights, seqs, _, _ = setup
    with Tracer(engine="rollout") as tr:
        logp = tiny_moe.run_rollout(tiny_moe.TinyMoE(cfg, weights, knobs), seqs, prompt_len=3, tracer=tr)
    return tr.trace(), logp


def _gap(a, b):
    la, m = pad_sequences(a)
    lb, _ = pad_sequences(b)
    return gap_metrics(la, lb, m)


def test_aligned_engines_have_no_divergence(tiny_moe, setup):
    """Learner and continuous-batching rollout on the same contract: every point bitwise equal
    on every common (seq, pos[, expert]) key, and an exactly zero log-prob gap."""
    ref, lp_ref = setup[3], setup[4]
    other, lp = _rollout(tiny_moe, setup, tiny_moe.Knobs())
    c = compare_traces(ref, other)
    assert c.first_divergence is None
    assert {r.status for r in c.results} == {"equal"}
    # the learner also ran each sequence's last token, which the rollout never fed back
    assert all(r.rows_common < r.rows_ref for r in c.results if r.kind == "token")
    assert _gap(lp_ref, lp)["rollout_corr/logprob_mismatch_frac"] == 0.0


@pytest.mark.parametrize(
    "knob, first",
    [
        ({"sr_fc2_layer": 1}, "decoder.layers.1.mlp.experts.linear_fc2.input_codes"),
        ({"router_dtype": torch.bfloat16}, "decoder.layers.0.mlp.router.logits"),
        ({"attn_reverse": True}, "decoder.layers.0.self_attention.core_attention.output"),
    ],
    ids=["fc2-quantizer-rounding-layer1", "bf16-router", "attention-reduction-order"],
)
def test_planted_divergence_is_named_first(tiny_moe, setup, knob, first):
    """Regression: the tracer must name the planted point as the first divergence (not a
    later consequence, not an earlier unrelated point), and the log-prob gap must show it."""
    other, lp = _rollout(tiny_moe, setup, tiny_moe.Knobs(**knob))
    c = compare_traces(setup[3], other)
    assert c.first_divergence is not None and c.first_divergence.name == first
    before = [r for r in c.results if r.index < c.first_divergence.index]
    assert before and all(r.status == "equal" for r in before)
    assert _gap(setup[4], lp)["rollout_corr/logprob_abs_diff_max"] > 0
