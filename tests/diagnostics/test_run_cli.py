"""``minite-diagnose run``: a real sampler (Megatron's static engine, KV cache) against a real
teacher-forced learner on the same NVFP4 weights, traced and compared.

Default mode on CPU: the first divergence is layer 0's core attention (prefill vs KV-cache
decode reduce in another order -- exactly what strict mode's attention fixes); strict mode: no
divergence and a gap of exactly 0."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU expectations (the GPU path is the same code)")


def _run(tmp_path, *extra):
    out = tmp_path / "diag"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-m", "minite_megatron.diagnostics.cli", "run", "--out", str(out), *extra],
                         capture_output=True, text=True, timeout=900, env=env)
    return res, out


def test_default_mode_names_the_attention_as_first_divergence(tmp_path):
    """With torch SDPA in both engines (``aligned_attention`` off: the learner's causal kernel vs
    the decode step's masked one), the report names the attention output first. (With the
    default recipe the CPU engines agree bitwise: tests/rollout/test_fast_path.py.)"""
    sdpa = '{"aligned_attention": false}'
    res, out = _run(tmp_path, "--learner-recipe", sdpa, "--rollout-recipe", sdpa)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["first_divergence"] == "decoder.layers.0.self_attention.core_attention.output"
    gap = json.loads((out / "gap.json").read_text())
    assert gap["rollout_corr/logprob_abs_diff_max"] > 0
    assert (out / "report.png").stat().st_size > 10_000 and (out / "learner.pt").exists()


def test_strict_mode_has_no_divergence_and_zero_gap(tmp_path):
    res, out = _run(tmp_path, "--strict", "--fail-on-divergence")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert json.loads((out / "report.json").read_text())["first_divergence"] is None
    gap = json.loads((out / "gap.json").read_text())
    assert gap["rollout_corr/logprob_abs_diff_max"] == 0.0 and gap["rollout_corr/k3_kl"] == 0.0
