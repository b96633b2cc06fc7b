"""``python -m benchmarks.blackwell_bringup`` on a CPU: the plan (dry run), the refusal off
Blackwell, the probes' expected values (computed by the contract's reference, checked against
what each probe says a reader should see), and the harness itself: run against the
reference it passes, run against deliberately broken backends the probe of the broken part
fails and names where."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from benchmarks import blackwell_bringup as bu
from minite_megatron.settings import settings
from minite_megatron.nvfp4 import ReferenceBackend


@pytest.fixture(scope="module")
def quick_plan():
    return bu.build_plan(quick=True)


def test_dry_run_lists_every_stage_and_needs_no_gpu(capsys):
    assert bu.main(["--dry-run", "--quick"]) == 0
    out = capsys.readouterr().out
    for stage in ("tile", "k", "k96", "scale_a", "scale_b", "nibble", "epilogue", "grouped", "suite", "repeat"):
        assert f"  {stage} " in out
    assert "k96[k=864]" in out and "[sm_103a only]" in out
    for probe in ("tile_all_ones", "k320", "scale_a[r=127,kb=15]", "scale_b[n=256,r=200,kb=0]",
                  "scale_b[n=512,r=511,kb=15]", "nibble[a=high,b=low]", "position[k=17]", "grouped[G=8,n=96]"):
        assert probe in out
    assert "1000 launches" in out and "compute-sanitizer" not in out
    assert bu.main(["--dry-run", "--quick", "--sanitizer"]) == 0
    assert "compute-sanitizer" in capsys.readouterr().out


def test_full_plan_covers_every_row_and_k_block():
    """The full plan probes every (row, K block) of A (128 x 16) and of B at N = 256 (rows
    128-255 live in the second N tile), and every row of B at N = 512 (tile_n = 256)."""
    plan = bu.build_plan(quick=False)
    names = {p.name for p in plan}
    assert all(f"scale_a[r={r},kb={j}]" in names for r in range(128) for j in range(16))
    assert all(f"scale_b[n=256,r={r},kb={j}]" in names for r in range(256) for j in range(16))
    assert all(f"scale_b[n=512,r={r},kb=7]" in names for r in range(512))
    assert len(names) == len(plan)  # unique names: a failure is identifiable


def test_refuses_cleanly_without_blackwell(capsys, tmp_path):
    """On this CPU machine: exit 2, one line with the reason, no report written."""
    report = tmp_path / "r.json"
    assert bu.main(["--quick", "--device", "cpu", "--json", str(report), "--no-save"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("blackwell_bringup: refused:") and "CUDA" in out[0]
    assert not report.exists()


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        bu.main(["--stages", "tile,warp"])
    assert "--stages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bu.main(["--repeats", "1"])
    assert "--repeats" in capsys.readouterr().err


def _expected(probe):
    return bu.reference(probe, probe.make()).float()


def test_expected_values_are_what_each_probe_announces(quick_plan):
    """The reference's results for the structured probes equal the values the plan announces
    (a reader of a failure compares against these)."""
    by_name = {p.name: p for p in quick_plan}
    assert torch.equal(_expected(by_name["tile_all_ones"]), torch.full((128, 128), 64.0))
    got = _expected(by_name["scale_a[r=63,kb=4]"])
    want = torch.full((128, 128), 256.0)
    want[63] = 272.0
    assert torch.equal(got, want)
    got = _expected(by_name["scale_b[n=256,r=200,kb=15]"])
    want = torch.full((128, 256), 256.0)
    want[:, 200] = 272.0
    assert torch.equal(got, want)
    for name, value in (("nibble[a=low,b=low]", 128.0), ("nibble[a=high,b=low]", 0.0), ("nibble[a=high,b=high]", 128.0),
                        ("nibble[a=low,b=high]", 0.0)):
        assert torch.equal(_expected(by_name[name]), torch.full((128, 128), value)), name
    for pos in (0, 1, 17, 64, 255):
        assert torch.equal(_expected(by_name[f"position[k={pos}]"]), torch.full((128, 128), bu.E2M1[1 + pos % 7]))
        assert by_name[f"position[k={pos}]"].expect == f"every output {bu.E2M1[1 + pos % 7]}"


def test_epilogue_probe_data_has_distinct_scales_and_exact_sums(quick_plan):
    """The epilogue probes use distinct per-row and per-column global scales and a bias, on
    data whose partial sums are exact (so the kernel must match bit for bit)."""
    probe = next(p for p in quick_plan if p.name.startswith("epilogue[m=300,n=200,bfloat16"))
    args = probe.make()
    a, b = args["a"], args["b"]
    assert a.global_decode.unique().numel() == 300 and b.global_decode.unique().numel() == 200
    assert args["bias"].unique().numel() == 200
    exact = a.image_fp32().double() @ b.image_fp32().double().t()
    assert torch.equal(exact.float().double(), exact)


def test_harness_passes_on_the_reference(quick_plan):
    outcomes = bu.run_probes(quick_plan, ReferenceBackend(), "cpu")
    assert [o for o in outcomes if not o.ok] == []
    rows = bu.stage_table(outcomes)
    assert [r["stage"] for r in rows] == ["tile", "k", "k96", "scale_a", "scale_b", "nibble", "epilogue", "grouped"]
    assert all(r["result"] == "PASS" for r in rows)


class _Broken(ReferenceBackend):
    """The reference with one deliberate kernel bug."""

    def __init__(self, bug: str):
        self.bug = bug

    def gemm(self, a, b, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        a = self._k96_tail(a)
        if self.bug == "nibbles":  # A's two elements of a byte read the other way round
            a = replace(a, codes=(a.codes >> 4) | (a.codes << 4))
        if self.bug == "sfa_rows" and a.rows >= 64:  # SFA rows 32-63 read from rows 0-31
            s = a.linear_scales().clone()
            s[32:64] = s[0:32].clone()
            a = replace(a, block_scales=s, layout="linear")
        if self.bug == "sfb_second_tile" and b.rows > 128:  # second N tile reads the first's scales
            s = b.linear_scales().clone()
            s[128:256] = s[0:128].clone()
            b = replace(b, block_scales=s, layout="linear")
        out = super().gemm(a, b, bias, out_dtype)
        if self.bug == "tail_unwritten" and out.shape[0] > 256:  # the last M tile never stored
            out[256:] = float("nan")
        return out

    def grouped_gemm(self, a, b, group_sizes, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        return super().grouped_gemm(self._k96_tail(a), b, group_sizes, bias, out_dtype)

    def _k96_tail(self, a):
        if self.bug == "k96_tail" and a.k > 768 and a.k % 768:  # a partial second k-tile is dropped
            keep = a.k // 768 * 768 // 2
            codes = a.codes.clone()
            codes[..., keep:] = 0
            a = replace(a, codes=codes)
        return a


@pytest.mark.parametrize(
    "bug,failing_stage,failing,where",
    [
        ("nibbles", "nibble", {"k", "k96", "nibble", "epilogue"}, None),
        ("sfa_rows", "scale_a", {"k", "k96", "scale_a", "epilogue"}, ("rows", [32])),
        ("sfb_second_tile", "scale_b", {"k96", "scale_b", "epilogue"}, ("cols", [128])),
        ("tail_unwritten", "epilogue", {"epilogue", "k96"}, ("rows", [256, 257])),
        ("k96_tail", "k96", {"k96"}, None),
    ],
)
def test_harness_catches_a_broken_kernel_and_says_where(quick_plan, bug, failing_stage, failing, where):
    """Each bug fails the stage built for it (and the random-data stages that also see it),
    never the all-ones tile, and the failure report locates it: the one-hot probe of row 32
    of A (not row 0) for a scale-row mix-up, column 128 for the second N tile, NaN rows from
    256 for an unwritten tail."""
    plan = [p for p in quick_plan if p.op == "gemm"]
    outcomes = bu.run_probes(plan, _Broken(bug), "cpu")
    failed = [o for o in outcomes if not o.ok and o.stage == failing_stage]
    assert {o.stage for o in outcomes if not o.ok} == failing, [(o.name, o.detail) for o in outcomes if not o.ok][:4]
    if where is not None:
        key, prefix = where
        assert any(o.detail[key][: len(prefix)] == prefix for o in failed), [o.detail for o in failed][:3]
    if bug == "tail_unwritten":
        assert all(o.detail["nan"] > 0 for o in failed)
    table = bu.stage_table(outcomes)
    row = next(r for r in table if r["stage"] == failing_stage)
    assert row["result"] == "FAIL" and row["first failure"].startswith(failed[0].name)


def test_k96_stage_sits_on_the_k96_kernels_boundaries():
    """The k96 stage: every K of ``K96_KS`` (one MMA up to three 768-wide k-tiles, tails), the
    one-hot probes at the MMA / scale-stage / buffer / k-tile boundaries of
    ``tiles.K96_SCHEDULE`` (so a wrong scale column, stage or circular descriptor moves a
    one-hot value to another row, column or K position), all sm_103a-only. Their data are
    exact up to K = 2304 (any accumulation order gives the reference's bits)."""
    from minite_kernels.cute.tiles import K96_SCHEDULE

    plan = [p for p in bu.build_plan(quick=False) if p.stage == "k96"]
    assert plan and all(p.arch == "sm_103a" for p in plan)
    names = {p.name for p in plan}
    assert {f"k96[k={k}]" for k in bu.K96_KS} <= names
    starts = {s.k_start // 16 for s in K96_SCHEDULE}  # first scale column of each MMA
    for j in (5, 6, 11, 12, 47, 48):
        assert f"k96_scale_a[r=37,kb={j}]" in names and f"k96_scale_b[r=128,kb={j}]" in names
    assert {6, 12} <= starts  # the probed columns are where MMAs' scales start
    for pos in (95, 96, 255, 256, 767, 768):
        assert f"k96_position[k={pos}]" in names
    probe = next(p for p in plan if p.name == "k96[k=2304]")
    args = probe.make()
    exact = args["a"].image_fp32().double() @ args["b"].image_fp32().double().t()
    assert torch.equal(exact.float().double(), exact)
    by_name = {p.name: p for p in plan}
    got = _expected(by_name["k96_scale_a[r=37,kb=6]"])
    want = torch.full((128, 128), 864.0)
    want[37] = 880.0
    assert torch.equal(got, want)
    assert torch.equal(_expected(by_name["k96_position[k=767]"]), torch.full((128, 128), bu.E2M1[1 + 767 % 7]))


def test_k96_stage_is_skipped_off_b300_with_the_reason(monkeypatch):
    """The k96 stage tests the kernel sm_103a selects: off a B300, or with
    MINITE_BLACKWELL_MMA_K=64, it is skipped (the report says why); the self-test backend runs
    it."""
    from minite_kernels.cute import _host

    monkeypatch.delenv("MINITE_BLACKWELL_MMA_K", raising=False)
    settings.cache_clear()  # (read once per process: the variable changed)
    assert bu.k96_skip_reason("reference", "cpu") is None
    assert "sm_103a" in bu.k96_skip_reason("blackwell", "cpu")
    monkeypatch.setattr(_host, "blackwell_arch", lambda device: "sm_100a")
    assert bu.k96_skip_reason("blackwell", "cuda:0").startswith("sm_100a has no K = 96 MMA")
    monkeypatch.setattr(_host, "blackwell_arch", lambda device: "sm_103a")
    assert bu.k96_skip_reason("blackwell", "cuda:0") is None
    monkeypatch.setenv("MINITE_BLACKWELL_MMA_K", "64")
    settings.cache_clear()  # (read once per process: the variable changed)
    assert "MINITE_BLACKWELL_MMA_K=64" in bu.k96_skip_reason("blackwell", "cuda:0")


def test_a_crashing_probe_is_recorded_and_the_run_goes_on(quick_plan):
    class Crashing(ReferenceBackend):
        def gemm(self, a, b, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
            if a.k == 320:
                raise RuntimeError("CUDA error: misaligned address\nsecond line")
            return super().gemm(a, b, bias, out_dtype)

    plan = [p for p in quick_plan if p.stage in ("tile", "k")]
    outcomes = bu.run_probes(plan, Crashing(), "cpu")
    bad = [o for o in outcomes if not o.ok]
    assert [o.name for o in bad] == ["k320"] and bad[0].detail["error"] == "RuntimeError: CUDA error: misaligned address"
    assert len(outcomes) == len(plan)


def test_self_test_run_writes_a_report(tmp_path, capsys):
    """End to end through main() against the reference on the CPU (stages tile and k): the
    table, the JSON report, and the JSON line appended to the results file."""
    report = tmp_path / "report.json"
    code = bu.main(["--backend", "reference", "--device", "cpu", "--stages", "tile,k,repeat", "--repeats", "3",
                    "--json", str(report), "--no-save"])
    out = capsys.readouterr().out
    assert code == 0 and "ALL PASSED" in out and "| PASS" in out
    data = json.loads(report.read_text())
    assert data["passed"] and data["failures"] == [] and data["environment"]["device"]
    assert [r["stage"] for r in data["stages"]] == ["tile", "k", "repeat"]
    assert "repeat x3" in data["passed_checks"]
