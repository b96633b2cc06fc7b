"""``why_not_graphable`` names, on a CPU, why a step cannot be captured as a CUDA graph: a graph
would need host token counts, EP's host split sizes, a CPU device (stochastic rounding and
strict mode are graphed: seeds read from device memory, device token counts, NaN flags); the
GPU twin (``test_cuda_graph_step_gpu.py``) checks the graphed bits."""

import types

import torch

from minite_megatron.recipe import Recipe
from minite_megatron.training.cuda_graphs import why_not_graphable


def _model(ep=1):
    m = torch.nn.Linear(2, 2)
    m.config = types.SimpleNamespace(expert_model_parallel_size=ep, params_dtype=torch.bfloat16)
    return m


def test_a_cpu_device_is_refused():
    assert "CUDA device" in why_not_graphable(_model(), Recipe(precision="bf16"), "cpu")


def test_stochastic_rounding_and_round_to_nearest_are_graphable():
    assert why_not_graphable(_model(), Recipe(), "cuda") is None
    assert why_not_graphable(_model(), Recipe(grad_stochastic_rounding=False), "cuda") is None
    assert why_not_graphable(_model(), Recipe(precision="bf16"), "cuda") is None


def test_expert_parallelism_is_refused_and_strict_is_not():
    assert why_not_graphable(_model(), Recipe(strict=True), "cuda") is None
    assert "expert parallelism" in why_not_graphable(_model(ep=2), Recipe(precision="bf16"), "cuda")


def test_a_dispatcher_with_host_counts_is_refused():
    m = _model()
    m.dispatcher = torch.nn.Module()
    m.dispatcher.dispatch_preprocess = lambda *a: None
    m.dispatcher.why_host_counts = lambda dtype, device: "counts_on_device is off"
    assert "counts_on_device is off" in why_not_graphable(m, Recipe(precision="bf16"), "cuda")
