"""``why_not_graphable`` names, on a CPU, why a step cannot be captured as a CUDA graph: a graph
would need host token counts, EP's host split sizes, a CPU device (stochastic rounding and
strict mode are graphed: seeds read from device memory, device token counts, NaN flags); the
GPU twin (``test_cuda_graph_step_gpu.py``) checks the graphed bits."""

import types

import pytest
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


def _moe_model(**overrides):
    """A real minite MoE layer (its token dispatcher is a plain attribute, not a submodule) in a
    model-like module with a ``config``."""
    from .test_moe_device_counts import build_moe_layer

    layer = build_moe_layer(Recipe(precision="bf16"), **overrides)
    model = torch.nn.Module()
    model.config, model.mlp = layer.config, layer
    return model


def test_a_real_dispatcher_that_takes_host_counts_is_refused_by_its_name():
    """Regression (H100, 2026-12-07): the check walked ``named_modules`` for dispatchers, which are
    not modules, so a dispatcher that copied its counts to the host was never asked and Megatron's
    full-iteration capture died on ``d2h_event.synchronize`` (cudaErrorCapturedEvent)."""
    model = _moe_model()
    assert why_not_graphable(model, None, "cpu") is not None  # (a CPU device is refused first)
    assert model.mlp.token_dispatcher.why_host_counts(torch.bfloat16, "cpu") is None
    model.mlp.token_dispatcher.counts_on_device = False
    why = why_not_graphable(model, None, "cuda")
    assert why is not None and why.startswith("mlp.token_dispatcher:") and "counts_on_device is off" in why, why


def test_an_all_gather_dispatcher_is_refused():
    """(Megatron's all-gather dispatcher, and strict's subclass of it, copy the counts with ``.cpu()``.)"""
    model = _moe_model(moe_token_dispatcher_type="allgather")
    why = why_not_graphable(model, None, "cuda")
    assert why is not None and "AllGatherTokenDispatcher takes the MoE token counts to the host" in why, why


def test_full_iteration_keeps_the_counts_on_the_device():
    """``--cuda-graph-impl full_iteration`` moves Megatron's copy point (``cuda_dtoh_point``) to
    before the all-to-all; with one EP rank the counts still stay on the device (no copy to
    capture); per-layer graphs of the MoE preprocessing are another matter."""
    model = _moe_model(cuda_graph_impl="full_iteration")
    dispatcher = model.mlp.token_dispatcher
    assert dispatcher.cuda_dtoh_point != "before_permutation_1"
    assert dispatcher.why_host_counts(torch.bfloat16, "cpu") is None
    dispatcher.config.cuda_graph_impl = "local"
    assert "per-layer CUDA graphs" in dispatcher.why_host_counts(torch.bfloat16, "cpu")


def test_a_capture_that_reaches_the_host_copy_is_named(monkeypatch):
    model = _moe_model()
    dispatcher = model.mlp.token_dispatcher
    dispatcher.counts_on_device = False
    dispatcher._why_host = dispatcher.why_host_counts(torch.bfloat16, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph capture reached the MoE token dispatcher's host copy.*"
                                           "counts_on_device is off"):
        dispatcher._maybe_dtoh_and_synchronize("before_permutation_2", torch.ones(4, dtype=torch.long))
