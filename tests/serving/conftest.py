"""Fixtures of the serving tests (vLLM itself is imported only inside them: the main .venv has none)."""

import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


@pytest.fixture(scope="session")
def vllm_env():
    """One vLLM process state for the session: a CPU config, a gloo world of 1, TP = EP = 1, the
    general plugins loaded (minite-vllm among them), and Megatron's parallel state on the same
    world (the learner's modules are built in this process too)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh runs this in .venv-vllm")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.plugins import load_general_plugins

    from tests.megatron._dist import free_port

    ctx = set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
    ctx.__enter__()
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    load_general_plugins()
    yield
    ctx.__exit__(None, None, None)


@pytest.fixture(scope="session")
def megatron_env(vllm_env):
    """Megatron's parallel state (TP = EP = 1) on vLLM's gloo world, with the CPU layer."""
    from minite_megatron.training.presets import init_single_process

    init_single_process(seed=None)
