"""``train_grpo.py --cuda-graph-impl full_iteration``: the PPO updates replay one CUDA graph (the
minite full-iteration graph around Megatron's schedule) and give the eager updates' numbers, bit
for bit, on the GPU.

The eager twin is the same command with more warm-up updates than the run has
(``--cuda-graph-warmup-steps 1000``): the same padded micro-batches and the same DDP, never
captured. Every step's rollouts depend on the weights the updates before it left, so equal records
over 3 RL steps (12 updates: 2 eager, the capture, 9 replays) pin the graphed forward, backward,
stochastic-rounding seeds and metrics."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "rl"))
sys.path.insert(0, str(ROOT / "examples"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RUN = ["--digits", "2", "--no-progress", "--seed", "5", "--eval-interval", "0", "--sft-steps", "0", "--steps", "3",
       "--rollout-batch-size", "8", "--mini-batch-size", "4", "--ppo-epochs", "2", "--no-tensorboard", "--no-plot",
       "--cuda-graph-impl", "full_iteration"]


def _main(argv):
    import train_grpo

    return train_grpo.main([str(a) for a in argv])


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("mode", [[], ["--strict"]], ids=["default", "strict"])
def test_graphed_ppo_updates_give_the_eager_updates_numbers(tmp_path, mode):
    eager = _main(RUN + mode + ["--cuda-graph-warmup-steps", "1000", "--log-dir", tmp_path / "eager"])["history"]
    graphed = _main(RUN + mode + ["--cuda-graph-warmup-steps", "2", "--log-dir", tmp_path / "graphed"])["history"]
    rl = [(e, g) for e, g in zip(eager, graphed) if e.get("phase") == "rl"]
    assert len(rl) == 3 and len(eager) == len(graphed)
    for e, g in rl:
        assert {"actor/pg_loss", "actor/grad_norm", "actor/entropy"} <= set(e)
        differ = {k: (e[k], g.get(k)) for k in e if not k.startswith(("perf/", "timing_s/")) and not _same(e[k], g.get(k))}
        assert not differ, f"step {e['step']}: eager vs graphed {differ}"
