"""The CPU compatibility layer (minite_megatron.cpu_compat) against the installed megatron-core.

Activation tests run in this process and always deactivate afterwards; model and multi-process
tests live in test_cpu_compat_models.py / test_parallel*.py.
"""

import logging

import pytest
import torch

from minite_megatron import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer never activates with a GPU")


@pytest.fixture
def active(caplog):
    """The layer active during the test; afterwards as it was before (other test modules in this
    process may have activated it and rely on it staying active)."""
    was_active = cpu_compat.is_active()
    caplog.set_level(logging.INFO, logger="minite_megatron.cpu_compat")
    if was_active:  # re-activate so that the activation line is logged inside this test
        cpu_compat.deactivate()
    assert cpu_compat.activate() is True
    try:
        yield caplog
    finally:
        if not was_active:
            cpu_compat.deactivate()


def test_redirect_targets_exist_in_installed_megatron():
    """Pins: a Megatron upgrade that moves or removes a patched attribute must fail here, loudly,
    instead of letting CUDA-only code run (and crash somewhere deep) on a CPU."""
    assert cpu_compat.check_redirect_targets() == []


def test_checked_version_matches_installed():
    """Pins: the redirect table was read from megatron-core 0.19.2; a different version needs a re-check."""
    from megatron.core import package_info

    assert str(package_info.__version__).startswith(cpu_compat.CHECKED_MEGATRON_CORE)


def test_does_nothing_when_a_gpu_is_present(monkeypatch):
    """Pins: GPU runs are never touched (activate returns False and patches nothing)."""
    was_active = cpu_compat.is_active()
    if was_active:
        cpu_compat.deactivate()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        before = torch.cuda.current_device
        assert cpu_compat.activate() is False
        assert not cpu_compat.is_active()
        assert torch.cuda.current_device is before
    finally:
        monkeypatch.undo()
        if was_active:
            cpu_compat.activate()


def test_activate_is_idempotent_and_logs_once(active):
    assert cpu_compat.is_active()
    assert cpu_compat.activate() is True
    records = active.get_records("setup") + active.records
    lines = [r for r in records if r.name == "minite_megatron.cpu_compat"]
    assert len(lines) == 1 and "running megatron-core" in lines[0].getMessage()


def test_deactivate_restores_every_attribute():
    import importlib

    was_active = cpu_compat.is_active()
    if was_active:
        cpu_compat.deactivate()
    try:
        _check_deactivate_restores(importlib)
    finally:
        if was_active:
            cpu_compat.activate()


def _check_deactivate_restores(importlib):
    before = {(r.target, r.attr): getattr(importlib.import_module(r.target), r.attr) for r in cpu_compat.REDIRECTS}
    cpu_compat.activate()
    changed = [k for k, v in before.items() if getattr(importlib.import_module(k[0]), k[1]) is v]
    cpu_compat.deactivate()
    assert changed == [], f"not redirected while active: {changed}"
    after = {(r.target, r.attr): getattr(importlib.import_module(r.target), r.attr) for r in cpu_compat.REDIRECTS}
    assert after == before
    with pytest.raises(RuntimeError):
        torch.cuda.current_device()


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 1), 0])
def test_cuda_device_arguments_land_on_cpu(active, device):
    x = torch.zeros(3, device=device)
    assert x.device.type == "cpu"
    assert torch.empty(2, 2, device=device).device.type == "cpu"
    assert x.to(device).device.type == "cpu"
    assert x.to(device, torch.float64).dtype == torch.float64
    assert x.cuda() is x and x.pin_memory() is x
    assert torch.ones(2, pin_memory=True).device.type == "cpu"
    assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"


def test_torch_cuda_stand_ins(active):
    assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.is_available() is False  # never faked
    s = torch.cuda.Stream(device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ev = s.record_event()
    ev.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())


def test_timing_events_measure_wall_clock_like_cuda_events(active):
    """Pins: Megatron's static generation loop calls Event(enable_timing=True).elapsed_time."""
    import time

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    assert 15.0 <= start.elapsed_time(end) < 2000.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.cuda.Event().elapsed_time(end)
    with pytest.raises(RuntimeError, match="recorded"):
        torch.cuda.Event(enable_timing=True).elapsed_time(end)


def test_rng_tracker_fork_uses_seeded_cpu_streams(active):
    """Pins: the model-parallel tracker on CPU draws the stream of its own seed (bitwise equal to a
    torch.Generator seeded the same), continues it across forks, and restores the default stream."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(7)
    mrandom.get_cuda_rng_tracker().reset()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", 1234)
    default_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(5)
    with tracker.fork():
        b = torch.rand(5)
    assert torch.equal(torch.get_rng_state(), default_before)
    g = torch.Generator().manual_seed(1234)
    ref = torch.rand(10, generator=g)
    assert torch.equal(torch.cat([a, b]), ref)
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("nope"):
            pass


def test_model_parallel_seed_builds_cpu_tracker(active):
    """Pins: megatron's model_parallel_cuda_manual_seed works on CPU (it raised before the layer)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    states = mrandom.get_cuda_rng_tracker().get_states()
    assert set(states) >= {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
    g = torch.Generator().manual_seed(5 + 2718)
    with mrandom.get_cuda_rng_tracker().fork():
        x = torch.rand(4)
    assert torch.equal(x, torch.rand(4, generator=g))


def test_split_sizes_become_host_arrays(active):
    """Pins: gloo's all_to_all_single rejects tensor split sizes; on CPU the dispatcher's D2H copy
    must still turn them into numpy arrays (the GPU path does this in maybe_move_tensor_to_cpu)."""
    from megatron.core.transformer.moe import token_dispatcher as td

    out = td.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert out.tolist() == [3, 1] and not torch.is_tensor(out)
    t = torch.tensor([2])
    assert td.maybe_move_tensor_to_cpu(t) is t


def test_jit_fusions_run_eagerly(active):
    """Pins: Megatron's torch.compile'd fusions must run eagerly on CPU (~20 s compile each)."""
    import megatron.core.jit as jit
    from megatron.core.fusions import fused_bias_swiglu

    assert not hasattr(fused_bias_swiglu.bias_swiglu, "_torchdynamo_orig_callable")
    assert jit.jit_fuser is jit.noop_decorator
