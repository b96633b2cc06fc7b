"""Divergences ranked by consequence: an absorbed 1-ulp difference that comes first in execution
order (layer 0's attention output, whose quantized codes stay equal) is named as absorbed, and
the first divergence that flips downstream codes (layer 0's MoE output -> layer 1's qkv codes)
is the first *consequential* one -- the failure the plain "first divergence" rule hid (issue 15:
the report named the attention while the MoE combine was what spread)."""

import json

import torch

from minite_megatron.diagnostics.compare import compare_traces, rank_by_consequence
from minite_megatron.diagnostics.report import markdown_report, write_report
from minite_megatron.diagnostics.trace import Trace, TracePoint, pack_keys


def _traces():
    g = torch.Generator().manual_seed(0)
    keys = pack_keys(torch.zeros(6, dtype=torch.long), torch.arange(6))
    names = [
        ("decoder.layers.0.self_attention.core_attention.output", "f"),
        ("decoder.layers.0.self_attention.linear_proj.input_codes", "u8"),
        ("decoder.layers.0.self_attention.linear_proj.output", "f"),
        ("decoder.layers.0.mlp.router.routing_map", "b"),
        ("decoder.layers.0.mlp.output", "f"),
        ("decoder.layers.1.input_layernorm.output", "f"),
        ("decoder.layers.1.self_attention.linear_qkv.input_codes", "u8"),
        ("decoder.layers.1.self_attention.linear_qkv.output", "f"),
    ]
    ref, other = Trace(engine="learner"), Trace(engine="rollout")
    for name, kind in names:
        if kind == "f":
            v = torch.randn(6, 16, generator=g).to(torch.bfloat16)
        elif kind == "u8":
            v = torch.randint(0, 256, (6, 8), generator=g, dtype=torch.uint8)
        else:
            v = torch.rand(6, 4, generator=g) > 0.5
        w = v.clone()
        if name.endswith("core_attention.output"):  # one bf16 ulp in one element: absorbed
            w.view(torch.int16)[2, 3] += 1
        if name.endswith("mlp.output") or ".layers.1." in name:  # the combine: spreads
            w = (v.float() * 1.01).to(torch.bfloat16) if v.is_floating_point() else v ^ 1
        for t, val in ((ref, v), (other, w)):
            t.points[name] = TracePoint(name, "token", keys, val)
            t.order.append(name)
    return ref, other


def test_absorbed_ulp_first_then_the_consequential_divergence(tmp_path):
    cmp = compare_traces(*_traces())
    first, fc = cmp.first_divergence, cmp.first_consequential
    assert first.name == "decoder.layers.0.self_attention.core_attention.output" and first.mismatched == 1
    assert first.consequence is None and first.absorbed_at == "decoder.layers.0.self_attention.linear_proj.output"
    assert fc.name == "decoder.layers.0.mlp.output"
    assert fc.consequence == "decoder.layers.1.self_attention.linear_qkv.input_codes"
    ranked = [r.name for r in rank_by_consequence(cmp)]
    assert ranked[0] == fc.name and ranked.index(first.name) > ranked.index(fc.consequence)
    md = markdown_report(cmp)
    assert "**absorbed**" in md and "**First consequential divergence: `decoder.layers.0.mlp.output`**" in md
    assert "## Divergences ranked by consequence" in md
    paths = write_report(cmp, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["first_divergence"] == first.name and data["first_consequential"] == fc.name
    assert paths["png"].stat().st_size > 10_000


def test_a_discrete_first_divergence_is_its_own_consequence():
    ref, other = _traces()
    name = "decoder.layers.0.self_attention.linear_proj.input_codes"
    other.points[name].values[0, 0] ^= 1
    cmp = compare_traces(ref, other)
    assert cmp.first_divergence.name == "decoder.layers.0.self_attention.core_attention.output"
    assert cmp.first_divergence.consequence == name and cmp.first_consequential.name == cmp.first_divergence.name
