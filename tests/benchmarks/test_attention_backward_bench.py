"""``benchmarks/attention_backward.py --smoke`` runs on the CPU (its code path; speed is measured on
a GPU only): every case is timed, the direct backward is the op it names (CPU flash here), and the
JSON line goes to ``--out``."""

from __future__ import annotations

import json

import pytest
import torch

from minite_megatron.invariant import attention as attention_module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run (a GPU runs the real shapes)")
def test_attention_backward_smoke_records_both_paths(tmp_path):
    from benchmarks import attention_backward

    before = attention_module.DIRECT_BACKWARD
    rec = attention_backward.main(["--smoke", "--out", str(tmp_path)])
    impls = [r["impl"] for r in rec["rows"]]
    assert "recompute: SDPA fwd + bwd (old)" in impls and "direct: flash_cpu (new)" in impls
    assert rec["summary"][0]["direct_op"] == "flash_cpu"
    assert attention_module.DIRECT_BACKWARD == before  # put back
    line = json.loads((tmp_path / "attention_backward.jsonl").read_text().splitlines()[-1])
    assert line["bench"] == "attention_backward" and line["smoke"] and "torch" in line
