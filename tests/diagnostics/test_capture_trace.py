"""Capture API, token keying, trace files."""

import pytest
import torch

from minite_megatron.diagnostics import (
    Tracer,
    active_tracer,
    capture,
    capture_routed,
    capture_static,
    load_trace,
    pack_keys,
    unpack_keys,
)
from minite_megatron.diagnostics.trace import MAX_POS, Trace, TracePoint
from minite_megatron.testing import assert_bitwise_equal


def test_capture_is_a_noop_without_a_tracer():
    assert active_tracer() is None
    capture("anything", torch.zeros(3))  # no grid, no tracer: nothing happens, no error
    capture_routed("r", torch.zeros(2, 4), torch.tensor([0, 1]), torch.tensor([0, 0]))
    capture_static("s", torch.zeros(3))


def test_keys_roundtrip_and_ranges():
    seq = torch.tensor([0, 5, 2**26 - 1])
    pos = torch.tensor([0, 17, MAX_POS - 1])
    exp = torch.tensor([-1, 3, 8190])
    s, p, e = unpack_keys(pack_keys(seq, pos, exp))
    assert s.tolist() == seq.tolist() and p.tolist() == pos.tolist() and e.tolist() == exp.tolist()
    with pytest.raises(ValueError, match="positions"):
        pack_keys(torch.tensor([0]), torch.tensor([MAX_POS]))
    with pytest.raises(ValueError, match="sequence ids"):
        pack_keys(torch.tensor([-1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="expert"):
        pack_keys(torch.tensor([0]), torch.tensor([0]), torch.tensor([8191]))


def _grid_learner(x):
    """x: [s, b, h] values; learner layout."""
    s, b = x.shape[:2]
    return torch.arange(b).view(1, b).expand(s, b), torch.arange(s).view(s, 1).expand(s, b)


def test_grid_and_flat_layouts_give_the_same_rows():
    """A [s, b, h] capture and a flattened, reordered [tokens, h] capture of the same values
    produce identical traces: rows are keyed by (seq, pos), not by layout."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8)
    with Tracer() as a:
        a.set_tokens(*_grid_learner(x))
        capture("p", x)
        capture("flat", x.reshape(15, 8))  # [s*b, h] in grid order (Megatron router style)
    perm = torch.randperm(15)
    seq, pos = _grid_learner(x)
    with Tracer() as b:
        b.set_tokens(seq.reshape(-1)[perm], pos.reshape(-1)[perm])
        capture("p", x.reshape(15, 8)[perm])
        capture("flat", x.reshape(15, 8)[perm])
    ta, tb = a.trace(), b.trace()
    for n in ("p", "flat"):
        assert_bitwise_equal(ta[n].keys, tb[n].keys, n)
        assert_bitwise_equal(ta[n].values, tb[n].values, n)
    assert ta["p"].values.shape == (15, 8)


def test_incremental_decode_matches_one_shot():
    """Prefill + one token per step (changing batches) yields the rows of one whole-sequence pass."""
    x = torch.randn(6, 2, 4)
    with Tracer() as whole:
        whole.set_tokens(*_grid_learner(x))
        capture("h", x)
    with Tracer() as steps:
        steps.set_tokens(torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]))  # prefill seq 1
        capture("h", x[0:3, 1])
        for p in range(3, 6):
            steps.set_tokens(torch.tensor([1]), torch.tensor([p]))
            capture("h", x[p, 1].unsqueeze(0))
        steps.set_tokens(torch.tensor([0] * 6), torch.arange(6))  # seq 0 later, all at once
        capture("h", x[:, 0])
    assert_bitwise_equal(whole.trace()["h"].values, steps.trace()["h"].values)


def test_routed_rows_are_keyed_by_token_and_expert():
    with Tracer() as tr:
        tr.set_tokens(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]))
        capture_routed("r", torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([2, 0, 2]), torch.tensor([0, 1, 1]))
    p = tr.trace()["r"]
    assert p.kind == "routed"
    s, pos, e = unpack_keys(p.keys)
    assert list(zip(s.tolist(), pos.tolist(), e.tolist(), p.values[:, 0].tolist())) == [
        (0, 0, 1, 2.0),
        (1, 0, 0, 1.0),
        (1, 0, 1, 3.0),
    ]


def test_duplicates_keep_the_first_and_are_counted():
    with Tracer() as tr:
        tr.set_tokens(torch.tensor([0, 0]), torch.tensor([0, 1]))
        capture("h", torch.tensor([1.0, 2.0]))
        capture("h", torch.tensor([9.0, 9.0]))  # recomputation: same keys again
    p = tr.trace()["h"]
    assert p.values.tolist() == [1.0, 2.0] and p.duplicates == 2


def test_static_points_are_keyed_by_call():
    with Tracer() as tr:
        capture_static("w", torch.ones(2, 2))
        capture_static("w", torch.zeros(2, 2))
    p = tr.trace()["w"]
    assert p.kind == "static" and p.keys.tolist() == [0, 1] and p.values.shape == (2, 2, 2)


def test_include_exclude_and_order():
    with Tracer(include=["*.keep*"], exclude=["*.keep_not"]) as tr:
        tr.set_tokens(torch.tensor([0]), torch.tensor([0]))
        for n in ("b.keep", "a.drop", "c.keep_not", "a.keep2"):
            capture(n, torch.zeros(1, 2))
    assert tr.trace().order == ["b.keep", "a.keep2"]


def test_nested_tracers_record_in_the_innermost_only():
    with Tracer() as outer:
        outer.set_tokens(torch.tensor([0]), torch.tensor([0]))
        with Tracer() as inner:
            inner.set_tokens(torch.tensor([0]), torch.tensor([0]))
            capture("x", torch.zeros(1))
        capture("y", torch.zeros(1))
    assert inner.trace().order == ["x"] and outer.trace().order == ["y"]
    assert active_tracer() is None


def test_capture_errors_are_clear():
    with Tracer() as tr:
        with pytest.raises(ValueError, match="set_tokens"):
            capture("x", torch.zeros(2))
        tr.set_tokens(torch.arange(2).view(1, 2), torch.arange(3).view(3, 1))  # grid [3, 2]
        with pytest.raises(ValueError, match=r"does not match the token grid \(3, 2\)"):
            capture("x", torch.zeros(2, 3, 4))
        capture("x", torch.zeros(3, 2, 4))
        with pytest.raises(ValueError, match="row shape"):
            capture("x", torch.zeros(3, 2, 5))
        with pytest.raises(ValueError, match="dtype"):
            capture("x", torch.zeros(3, 2, 4, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="occurs twice"):
            tr.set_tokens(torch.tensor([0, 0]), torch.tensor([1, 1]))
        with pytest.raises(ValueError, match="integers"):
            tr.set_tokens(torch.tensor([0.0]), torch.tensor([1]))
        with pytest.raises(ValueError, match="token index outside"):
            capture_routed("r", torch.zeros(1, 2), torch.tensor([6]), torch.tensor([0]))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_trace_files_roundtrip_bitwise(tmp_path, suffix):
    """Every dtype a trace holds (fp32, bf16, e4m3 scales, packed uint8 codes, bool maps)
    survives a save/load bit for bit, with order, kinds and duplicates."""
    torch.manual_seed(0)
    with Tracer(engine="learner", meta={"model": "tiny"}) as tr:
        tr.set_tokens(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]))
        capture("z.f32", torch.randn(3, 4))
        capture("a.bf16", torch.randn(3, 4).bfloat16())
        capture("m.e4m3", (torch.rand(3, 2) * 100).to(torch.float8_e4m3fn))
        capture("m.codes", torch.randint(0, 256, (3, 8), dtype=torch.uint8))
        capture("m.map", torch.rand(3, 4) > 0.5)
        capture("z.f32", torch.randn(3, 4))  # duplicates
        capture_routed("r", torch.randn(2, 4), torch.tensor([0, 2]), torch.tensor([3, 1]))
        capture_static("w", torch.randn(2, 2))
    t = tr.trace()
    path = t.save(tmp_path / f"trace{suffix}")
    back = load_trace(path)
    assert back.order == t.order and back.engine == "learner" and back.meta == {"model": "tiny"}
    for n in t.order:
        assert back[n].kind == t[n].kind and back[n].duplicates == t[n].duplicates
        assert_bitwise_equal(back[n].keys, t[n].keys, n)
        assert_bitwise_equal(back[n].values, t[n].values, n)


def test_trace_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "none.pt")
    torch.save({"format": "other"}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a miniTE trace"):
        load_trace(tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"\.pt or \.safetensors"):
        Trace().save(tmp_path / "x.npz")
    with pytest.raises(ValueError, match="kind"):
        TracePoint("p", "weird", torch.zeros(1, dtype=torch.long), torch.zeros(1))
