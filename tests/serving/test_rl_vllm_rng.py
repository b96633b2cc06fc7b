"""``--rollout-engine vllm`` leaves the trainer's global RNGs alone (issue 28), in ``.venv-vllm``.

vLLM seeds python's, numpy's and torch's global generators when an ``LLM`` is built (its ``seed=``);
``examples/rl/rl_vllm.py`` saves and restores them around the construction and around sampling, so the
learner's draws (initialization, dropout, anything the trainer takes from the global generators) do not
shift because a vLLM engine exists. ``_rl_rng_job`` (a fresh process) builds the engine and samples
with it; the failures pinned: any of the three states changed by either, and, without the guard, vLLM
leaving them unchanged (then the guard would guard nothing and this test would prove nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh runs this in .venv-vllm")

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_engine_preserves_the_trainers_rng_states(tmp_path):
    out = tmp_path / "rng.pt"
    r = subprocess.run([sys.executable, "-m", "tests.serving._rl_rng_job", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and out.exists(), r.stderr[-2000:]
    res = torch.load(out, weights_only=False)
    assert res["generated"] == [5, 5]
    assert res["construct"] == {"torch": True, "numpy": True, "python": True}, res
    assert res["generate"] == {"torch": True, "numpy": True, "python": True}, res
    assert not any(res["unguarded_construct"].values()), res  # vLLM reseeds all three
