"""The decode benchmarks run on the CPU (their code path; speed is measured on a GPU only):
``benchmarks/decode_profile.py`` records per-engine kernel tables and takes a grouped decode entry,
``benchmarks/decode_gemm.py --smoke --sections grouped_sweep`` runs every swept launch of the
grouped decode kernel (under the Triton interpreter) and each agrees with the strict result."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_decode_profile_records_engines_and_the_grouped_entry(tmp_path):
    from benchmarks import decode_profile
    from minite_kernels.triton.decode import decode_grouped_gemm as tg

    before = dict(tg.GPU_GROUPED_DECODE)
    try:
        res = decode_profile.main(["--preset", "tiny", "--batch", "2", "--short", "1", "--long", "3",
                                   "--json-dir", str(tmp_path), "--grouped-config", "32,128,4,4,16"])
    finally:
        tg.GPU_GROUPED_DECODE = before
    assert res["strict_grouped_entry"] == tg.strict_grouped_entry()  # the verified strict launch
    assert [e["engine"] for e in res["engines"]] == ["nvfp4", "bf16"]
    assert res["grouped_decode_entry"] == dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, DEPTH=4, MAX_CHUNKS=16)
    line = json.loads((tmp_path / "decode_profile.jsonl").read_text().splitlines()[-1])
    assert line["benchmark"] == "decode_profile" and line["batch"] == 2 and "torch" in line


def test_decode_profile_refuses_a_bad_grouped_entry(capsys):
    from benchmarks import decode_profile

    with pytest.raises(SystemExit):
        decode_profile.main(["--preset", "tiny", "--grouped-config", "32,128"])
    assert "--grouped-config" in capsys.readouterr().err


def test_grouped_sweep_entries_agree_with_strict(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    code = ("import json, sys; from benchmarks import decode_gemm as d; res = {}; d.SMOKE = True; "
            "d.DEV = __import__('torch').device('cpu'); d.GROUPED_TOKENS = (1, 8); d.sec_grouped_sweep(res); "
            "print('ROWS ' + json.dumps(res['grouped_sweep']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("ROWS "))[5:])
    assert len(rows) == 2 * 2 * 2  # fc1, fc2 x 1, 8 tokens x the two interpreter entries
    for r in rows:  # bf16 output of each launch vs the strict fp32 result: its rounding, never more
        assert r["max_rel_err_vs_strict"] <= 2 ** -8, r  # bf16 rounding: at most 2^-8 of the value
