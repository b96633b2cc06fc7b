"""``python -m benchmarks.kernels`` on a CPU: its code path (speed is measured on a GPU only).

Pins: a section name or an option no section of the run takes is one error line, not a run of
something else; each family's record goes to ``--out`` with the command that reruns it; the
sections that run on a CPU (under the Triton interpreter) give their tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import kernels

ROOT = Path(__file__).resolve().parents[2]


def test_every_section_belongs_to_one_family_whose_module_runs_it():
    """The sections table of the package is the one each family module runs (no section that the
    CLI offers but its family would refuse), and the defaults are sections."""
    for fam, secs in kernels.FAMILIES.items():
        module = kernels._family(fam)
        assert set(getattr(module, "SECTIONS", secs)) == set(secs), fam
        assert callable(module.parser) and callable(module.main)
    assert set(kernels.DEFAULT) <= set(kernels.FAMILY_OF)


def test_unknown_section_and_stray_option_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(["--sections", "linear,no_such_section"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("python -m benchmarks.kernels: error: --sections: unknown no_such_section")
    assert err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        kernels.main(["--sections", "refit_bytes", "--decode-m", "1,8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--decode-m" in err and err.count("\n") == 1


def test_refit_bytes_section_records_its_command(tmp_path):
    records = kernels.main(["--sections", "refit_bytes", "--json-dir", str(tmp_path)])
    line = json.loads((tmp_path / "refit_bytes.jsonl").read_text().splitlines()[-1])
    assert line["command"] == f"python -m benchmarks.kernels --json-dir {tmp_path}"
    rows = records["refit_bytes"]["models"]["Qwen3-30B-A3B"]["rows"]
    assert all(0 < r["x BF16"] < 1 for r in rows)  # NVFP4 moves fewer bytes than BF16 in every layout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run (a GPU runs the real shapes)")
def test_attention_backward_smoke_records_both_paths(tmp_path):
    """Every case is timed, the direct backward is the op it names (CPU flash here), the record
    goes to ``--out``, and the attention module's switch is put back."""
    from minite_megatron.settings import settings

    before = settings()
    rec = kernels.main(["--sections", "attention_backward", "--smoke", "--out", str(tmp_path)])["attention_backward"]
    impls = [r["impl"] for r in rec["rows"]]
    assert "recompute: SDPA fwd + bwd (old)" in impls and "direct: flash_cpu (new)" in impls
    assert rec["summary"][0]["direct_op"] == "flash_cpu"
    assert settings() == before
    line = json.loads((tmp_path / "attention_backward.jsonl").read_text().splitlines()[-1])
    assert line["bench"] == "attention_backward" and line["smoke"] and "torch" in line
    assert line["command"] == f"python -m benchmarks.kernels --smoke --out {tmp_path}"


def test_decode_profile_records_each_engine(tmp_path):
    """The decode profile's CPU path: one record per engine (no CUDA kernel records on a CPU)."""
    rec = kernels.main(["--sections", "decode_profile", "--preset", "tiny", "--batch", "2", "--short", "1",
                        "--long", "3", "--json-dir", str(tmp_path)])["decode_profile"]
    assert [e["engine"] for e in rec["engines"]] == ["nvfp4", "bf16"]
    line = json.loads((tmp_path / "decode_profile.jsonl").read_text().splitlines()[-1])
    assert line["benchmark"] == "decode_profile" and line["batch"] == 2 and "torch" in line
    with pytest.raises(SystemExit) as e:
        kernels.main(["--sections", "decode_profile", "--short", "3", "--long", "3"])
    assert "--long (3) must exceed --short (3)" in str(e.value)


SMOKE = "quantize,memory,quantize_paths,producers,moe_activation,moe_combine,decode_grouped,decode_grouped_sweep"


def test_cpu_sections_run_under_the_interpreter_and_the_grouped_sweep_agrees_with_strict(tmp_path):
    """``--smoke`` of the kernel families that run on a CPU (Triton interpreter, one process of
    their own: the interpreter is chosen before the kernels are defined): each family's record
    comes back; every swept launch of the grouped decode kernel is within bf16 rounding of the
    strict fp32 result; the fused producers equal the unfused pair bit for bit (the smoke run
    exits otherwise)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    code = ("import json, sys; from benchmarks import kernels; "
            f"rec = kernels.main(['--sections', {SMOKE!r}, '--smoke', '--decode-tokens', '1,8', '--out', sys.argv[1]]); "
            "print('FAMILIES ' + json.dumps(sorted(rec))); "
            "print('ROWS ' + json.dumps(rec['decode_gemm']['grouped_sweep']))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
             if line.startswith(("FAMILIES ", "ROWS "))}
    assert lines["FAMILIES"] == ["decode_gemm", "moe_activation", "moe_combine", "nvfp4", "producers", "quantize"]
    rows = lines["ROWS"]
    assert len(rows) == 2 * 2 * 2  # fc1, fc2 x 1, 8 tokens x the two interpreter entries
    for r in rows:
        assert r["max_rel_err_vs_strict"] <= 2 ** -8, r  # bf16 rounding: at most 2^-8 of the value
    assert (tmp_path / "moe_combine.jsonl").exists() and (tmp_path / "producers_smoke.jsonl").exists()
