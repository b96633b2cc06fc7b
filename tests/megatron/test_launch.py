"""``python -m minite_megatron.launch examples/pretrain_gpt.py --transformer-impl minite``: trains
with megatron.training's ``pretrain`` on CPU, checkpoints, resumes bitwise, and rejects bad
configurations naming the flag. Real megatron-core and megatron.training (the wheel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.parallel.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"

# A tiny Qwen3-MoE-shaped model; dropout stays on (0.1) so that the resume test also checks the
# RNG state that Megatron checkpoints.
TINY = [
    "--transformer-impl", "minite",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--ffn-hidden-size", "128",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01", "--qk-layernorm",
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-backend", "unfused",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--train-iters", "4", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-workers", "0",
]


def _launch(args: list, timeout: int = 420) -> subprocess.CompletedProcess:
    return _launch_together([args], timeout)[0]


def _launch_together(runs: list[list], timeout: int = 420) -> list[subprocess.CompletedProcess]:
    """The example script once per argument list, the processes side by side (one GPU holds them)."""
    # Megatron's GPTModel exports NVTE_*_ATTN for its attention backend; models built earlier in
    # this test process must not leak theirs into the script (it asserts they match its own).
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1")
    procs = []
    for args in runs:
        cmd = [sys.executable, "-m", "minite_megatron.launch", str(EXAMPLE), *map(str, args)]
        procs.append((cmd, subprocess.Popen(cmd, cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())},
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    done = []
    try:
        for cmd, proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["iteration"]: r["lm loss"] for r in rows}


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout tail\n{proc.stdout[-3000:]}\n--- stderr tail\n{proc.stderr[-5000:]}"


@pytest.mark.multiproc
def test_pretrain_checkpoints_and_a_resumed_run_reproduces_the_losses(tmp_path):
    """Pins: a run resumed from a CPU checkpoint must draw the same dropout and stochastic-rounding
    streams and read the same batches as the uninterrupted run (it drifted before the CPU layer
    kept the data loaders' seed draws off the generator that stands in for the device one)."""
    ckpt, full_log, resumed_log = tmp_path / "ckpt", tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    full = _launch(TINY + ["--save", ckpt, "--save-interval", 2, "--loss-log", full_log])
    _ok(full)
    output = full.stdout + full.stderr
    assert "model chunk(s) built with" in output and "NVFP4GroupedLinear[nvfp4]" in output, "minite specs not used"
    if not torch.cuda.is_available():
        assert "minite cpu_compat: no CUDA GPU" in output
    assert (ckpt / "iter_0000002").is_dir() and (ckpt / "iter_0000004").is_dir()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    losses = _losses(full_log)
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(0 < v < 10 for v in losses.values()), losses

    resumed = _launch(TINY + ["--load", ckpt, "--ckpt-step", 2, "--loss-log", resumed_log])
    _ok(resumed)
    again = _losses(resumed_log)
    assert sorted(again) == [3, 4], "the resumed run did not start from iteration 2"
    assert again == {3: losses[3], 4: losses[4]}, f"resumed {again} != uninterrupted {losses}"


def test_cli_rejects_a_bad_configuration_naming_the_flag():
    """Pins: bad sizes must stop the launcher before any model is built, with exit status 2."""
    bad = [a if a != "64" else "72" for a in TINY]  # --hidden-size 72 (and kv-channels 16 stays)
    proc = _launch(bad, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error:" in proc.stderr and "--hidden-size 72" in proc.stderr


def test_cli_usage_without_a_script():
    proc = subprocess.run([sys.executable, "-m", "minite_megatron.launch"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr
