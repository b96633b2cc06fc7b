"""Faults during training: a save killed half-way, a NaN gradient, a non-finite activation.

The first three run ``examples/pretrain_gpt.py`` through the launcher on the real
``megatron.training`` loop, with one fault injected by ``tests/parallel/fault_script.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.megatron.test_launch import TINY
from tests.parallel.fault_script import KILLED_STATUS
from tests.parallel.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "parallel" / "fault_script.py"
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _launch(args: list, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "minite_megatron.launch", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _tail(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-4000:]}"


def _losses(path: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm loss"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.multiproc
def test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(tmp_path):
    """The save of iteration 4 dies after writing its tensors, before its metadata and Megatron's
    tracker file: the next run must resume from iteration 2 (the last complete checkpoint) and
    reproduce iterations 3-4 of the killed run bitwise."""
    ckpt, killed_log, resumed_log = tmp_path / "ckpt", tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    killed = _launch([SCRIPT, "--fault", "kill-in-save:4", *TINY, "--save", ckpt, "--save-interval", 2,
                      "--loss-log", killed_log])
    assert killed.returncode == KILLED_STATUS, _tail(killed)
    assert "killed while saving" in killed.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000004").is_dir() and not (ckpt / "iter_0000004" / "metadata.json").exists()
    losses = _losses(killed_log)
    assert sorted(losses) == [1, 2, 3, 4]

    resumed = _launch([ROOT / "examples" / "pretrain_gpt.py", *TINY, "--load", ckpt, "--loss-log", resumed_log])
    assert resumed.returncode == 0, _tail(resumed)
    assert "loading distributed checkpoint from" in resumed.stdout and "at iteration 2" in resumed.stdout
    assert _losses(resumed_log) == {3: losses[3], 4: losses[4]}


def _iteration_lines(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): line for line in stdout.splitlines() if (m := re.search(r"iteration\s+(\d+)/", line))}


def _model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint (read with torch.distributed.checkpoint)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.parent / (checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v) and not k.startswith("optimizer")
            and "_extra_state" not in k}


@pytest.mark.multiproc
def test_a_nan_gradient_is_skipped_and_counted_as_megatron_does(tmp_path):
    """fp16 with Megatron's loss scaler: a NaN gradient in iteration 2 (finite loss) flows through
    every NVFP4 backward (NaN scales, never finite garbage), the optimizer finds it, Megatron skips
    the update and counts it ("number of skipped iterations: 1"), the weights stay those of
    iteration 1, and training goes on."""
    ckpt = tmp_path / "ckpt"
    proc = _launch([SCRIPT, "--fault", "nan-grad:2", *TINY, "--fp16", "--initial-loss-scale", 1024,
                    "--no-check-for-nan-in-loss-and-grad", "--train-iters", 3, "--save", ckpt, "--save-interval", 1])
    assert proc.returncode == 0, _tail(proc)
    lines = _iteration_lines(proc.stdout)
    assert sorted(lines) == [1, 2, 3], proc.stdout[-3000:]
    for it, line in lines.items():
        assert f"number of skipped iterations:   {int(it == 2)}" in line, line
        assert "number of nan iterations:   0" in line, line
    w1, w2, w3 = (_model_weights(ckpt / f"iter_000000{i}") for i in (1, 2, 3))
    assert w1 and set(w1) == set(w2) == set(w3)
    assert all(torch.equal(w1[k], w2[k]) for k in w1), "the skipped iteration changed the weights"
    assert all(torch.isfinite(v.float()).all() for v in w3.values())
    assert any(not torch.equal(w2[k], w3[k]) for k in w1), "iteration 3 did not train"


@pytest.mark.multiproc
def test_a_nan_gradient_stops_the_run_under_megatron_s_check(tmp_path):
    """Megatron's default --check-for-nan-in-loss-and-grad: the NaN gradient is caught in the
    gradient buckets before the data-parallel reduction and the run stops naming it; the NaN
    never reaches the optimizer or a checkpoint."""
    ckpt = tmp_path / "ckpt"
    proc = _launch([SCRIPT, "--fault", "nan-grad:2", *TINY, "--save", ckpt, "--save-interval", 1])
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "found NaN in local grad norm for bucket #0" in out, _tail(proc)
    assert sorted(_iteration_lines(proc.stdout)) == [1]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_a_non_finite_activation_under_raise_names_the_layer():
    """Pins: ``nonfinite="raise"`` named the tensor index only; it now names the module too."""
    from minite_megatron.nvfp4 import NonFiniteError
    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import build_gpt, init_single_process

    device = init_single_process(seed=1)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)[None, None]
    for nonfinite in ("raise", "propagate"):
        model = build_gpt("tiny", Recipe(nonfinite=nonfinite), max_seq=16, device=device)
        with torch.no_grad():
            model.embedding.word_embeddings.weight[tokens[1, 5]] = float("nan")
        if nonfinite == "raise":
            with pytest.raises(NonFiniteError, match=r"^decoder\.layers\.0\.input_layernorm \(MiniteNorm\): .*"
                                                     r"first at index \(11, 0\)"):
                model(tokens, pos, mask, labels=tokens)
        else:  # the default policy: NaN reaches the loss of that sequence only
            loss = model(tokens, pos, mask, labels=tokens)
            assert torch.isfinite(loss[0]).all() and torch.isnan(loss[1]).any()


def test_module_names_use_global_layer_numbers():
    """Under pipeline parallelism a chunk's ``decoder.layers.0`` may be global layer 3."""
    from minite_megatron.modules.naming import name_modules
    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import build_gpt, init_single_process

    model = build_gpt("tiny", Recipe(), max_seq=16, device=init_single_process(seed=1))
    for layer in model.decoder.layers:
        layer.layer_number += 2  # as in the second stage of pp2 of a 4-layer model
    name_modules(model)
    assert model.decoder.layers[0].self_attention.linear_qkv.minite_name == "decoder.layers.2.self_attention.linear_qkv"
    assert model.decoder.layers[1].mlp.experts.linear_fc1.minite_name == "decoder.layers.3.mlp.experts.linear_fc1"
