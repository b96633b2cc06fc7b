"""Reports (markdown / JSON / PNG) and the ``minite-diagnose`` command line."""

import json
import os
import shutil
import subprocess
import sys

import matplotlib.image
import pytest
import torch

from minite_megatron.diagnostics import Tracer, capture, compare_traces, save_logprobs, write_report
from minite_megatron.diagnostics.cli import main, register_subcommand
from minite_megatron.diagnostics.report import group_results, markdown_report


def _pair(diverge: bool):
    torch.manual_seed(0)
    vals = {f"decoder.layers.{i}.{p}": torch.randn(4, 8) for i in range(3) for p in ("attn.out", "mlp.out")}
    vals["output_layer.output"] = torch.randn(4, 8)
    traces = []
    for eng in ("learner", "rollout"):
        with Tracer(engine=eng) as tr:
            tr.set_tokens(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]))
            for n, v in vals.items():
                v = v.clone()
                if diverge and eng == "rollout" and n >= "decoder.layers.1.mlp":
                    v = v + 1e-3 * (1 + int(n.split(".")[2]) if "layers" in n else 1)
                capture(n, v)
            for e in range(2):  # routed points of several experts collapse into one table row
                capture(f"decoder.layers.2.mlp.experts.local_experts.{e}.fc.output", vals["output_layer.output"])
        traces.append(tr.trace())
    return traces


def test_report_files_name_the_first_divergence(tmp_path):
    ref, other = _pair(diverge=True)
    cmp = compare_traces(ref, other)
    assert cmp.first_divergence.name == "decoder.layers.1.mlp.out"
    paths = write_report(cmp, tmp_path)
    md = paths["markdown"].read_text()
    assert "**First divergence: `decoder.layers.1.mlp.out`**" in md
    assert "**`decoder.layers.1.mlp.out` <- first divergence**" in md
    assert "`mlp.experts.local_experts.*.fc.output` (2 points)" in md
    js = json.loads(paths["json"].read_text())
    assert js["first_divergence"] == "decoder.layers.1.mlp.out" and js["mode"] == "bitwise"
    assert len(js["points"]) == len(cmp.results)
    img = matplotlib.image.imread(paths["png"])
    assert img.shape[0] > 400 and img.shape[1] > 600
    # the image is not blank: the heatmap and curve put several distinct colours on it
    assert len(torch.tensor(img[..., :3]).reshape(-1, 3).unique(dim=0)) > 20


def test_report_without_divergence(tmp_path):
    ref, other = _pair(diverge=False)
    cmp = compare_traces(ref, other)
    assert "**No divergence**" in markdown_report(cmp)
    assert all(g.status == "equal" for g in group_results(cmp))
    write_report(cmp, tmp_path)
    assert (tmp_path / "report.png").stat().st_size > 1000


def test_cli_compare(tmp_path, capsys):
    ref, other = _pair(diverge=True)
    a, b = ref.save(tmp_path / "l.pt"), other.save(tmp_path / "r.safetensors")
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "first divergence: decoder.layers.1.mlp.out" in out
    assert (tmp_path / "rep" / "report.png").exists()
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "rep2"), "--fail-on-divergence"]) == 1
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "rep3"), "--atol", "1", "--fail-on-divergence"]) == 0
    assert main(["compare", str(a), str(tmp_path / "missing.pt"), "--out", str(tmp_path)]) == 2
    assert "no trace file" in capsys.readouterr().err


def test_cli_gap_formats_and_outputs(tmp_path, capsys):
    torch.manual_seed(0)
    lp = -torch.rand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    topk = {0: torch.tensor([[0, 1]] * 15), 3: torch.tensor([[2, 3]] * 15)}
    save_logprobs(tmp_path / "l.pt", lp, mask, topk=topk)
    other = lp.clone()
    other[0, 0] += 1e-3
    topk_r = {0: topk[0].clone(), 3: topk[3].clone()}
    topk_r[3][4] = torch.tensor([2, 5])
    save_logprobs(tmp_path / "r.safetensors", other, mask, topk=topk_r)
    rc = main(["gap", str(tmp_path / "l.pt"), str(tmp_path / "r.safetensors"), "--json", str(tmp_path / "m.json"),
               "--curves", str(tmp_path / "c.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "rollout_corr/train_rollout_logprob_abs_diff" in out and "rollout_corr/token_mult_prob_error" in out
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["rollout_corr/num_tokens"] == 9
    assert m["rollout_corr/logprob_abs_diff_max"] == pytest.approx(1e-3, rel=1e-3)
    assert m["rollout_corr/router_topk_flip_rate/layer_3"] == pytest.approx(1 / 15)
    assert (tmp_path / "c.png").stat().st_size > 1000

    # ragged JSON (as a sampler would dump it) against the same values
    (tmp_path / "r.json").write_text(json.dumps({"logprobs": [other[i, mask[i]].tolist() for i in range(3)]}))
    (tmp_path / "l.jsonl").write_text("\n".join(json.dumps({"logprobs": lp[i, mask[i]].tolist()}) for i in range(3)))
    assert main(["gap", str(tmp_path / "l.jsonl"), str(tmp_path / "r.json"), "--json", str(tmp_path / "m2.json")]) == 0
    m2 = json.loads((tmp_path / "m2.json").read_text())
    assert m2["rollout_corr/num_tokens"] == 9
    assert m2["rollout_corr/logprob_abs_diff_max"] == pytest.approx(m["rollout_corr/logprob_abs_diff_max"], rel=1e-6)

    save_logprobs(tmp_path / "bad.pt", lp[:, :4])
    assert main(["gap", str(tmp_path / "l.pt"), str(tmp_path / "bad.pt")]) == 2
    assert "different token layouts" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "gap" in out and "compare" in out


def test_register_subcommand_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_subcommand("gap", "x", lambda p: None, lambda a: 0)


@pytest.mark.skipif(shutil.which("minite-diagnose", path=os.path.dirname(sys.executable)) is None,
                    reason="the package is not installed in this environment (pip install -e .)")
def test_console_script_entry_point(tmp_path):
    """setup.cfg's console_scripts entry runs main() and passes its exit status through."""
    exe = shutil.which("minite-diagnose", path=os.path.dirname(sys.executable))
    res = subprocess.run([exe, "gap", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no log-prob file" in res.stderr
