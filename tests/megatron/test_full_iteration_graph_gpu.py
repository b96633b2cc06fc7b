"""``--cuda-graph-impl full_iteration`` with ``--transformer-impl minite``: Megatron's own
full-iteration graph (``FullCudaGraphWrapper``, through ``training.full_iteration_graph``) trains
the tiny Qwen3-MoE model with the losses of the eager run, bit for bit, on the GPU.

Every iteration's loss depends on the gradients and optimizer steps of the ones before it, so
equal losses over the warm-up, the capture iteration (captured, then replayed once) and later
replays pin the forward, the backward and the stochastic-rounding seeds of each replay (the
default recipe rounds its gradients stochastically; strict keeps its token counts and its
routing NaN check on the device)."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.test_launch import TINY, _launch_together, _losses, _ok

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = [*TINY, "--bf16", "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "6",
       "--no-check-for-nan-in-loss-and-grad"]
GRAPHED = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2"]


@pytest.mark.parametrize("recipe", [[], ["--minite-strict"]], ids=["default", "strict"])
def test_full_iteration_graph_trains_with_the_eager_losses(tmp_path, recipe):
    eager_log, graphed_log = tmp_path / "eager.jsonl", tmp_path / "graphed.jsonl"
    for run in _launch_together([GPU + recipe + ["--loss-log", eager_log],
                                 GPU + recipe + GRAPHED + ["--loss-log", graphed_log]]):
        _ok(run)
    eager, replayed = _losses(eager_log), _losses(graphed_log)
    assert sorted(eager) == list(range(1, 7)), eager
    assert replayed == eager, f"graphed {replayed} != eager {eager}"
