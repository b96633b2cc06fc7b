"""Test-suite set-up shared by every test.

Without a GPU, Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1): it must be
set before any kernel module is imported, which is why it happens here.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # tiny models are dominated by per-op overhead: one intra-op thread avoids thread-pool
    # contention on the 2-core CI machine (measured ~10x faster tiny-model rollouts under load)
    torch.set_num_threads(1)
    # Triton 3.6's interpreter calls int() on 1-element arrays, which NumPy 2.5 rejects
    from minite_kernels.triton._build._interpreter_compat import install as _install_interpreter_compat

    _install_interpreter_compat()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "multiproc: spawns several processes (gloo)")
    config.addinivalue_line("markers", "kernels: a test under tests/kernels (set by this conftest)")
    config.addinivalue_line("markers", "aot: compiles kernels for sm_90a ahead of time and reads their machine code "
                            "(the same on any machine: CI runs it, the GPU set leaves it out)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Before `-m` deselects: `-m "(gpu or kernels) and not aot"` is the whole GPU set in one pytest run
    # (benchmarks/device.sh gpu_set), the -m gpu tests and the kernel tests compiled for the GPU.
    kernels_dir = os.path.join(os.path.dirname(__file__), "kernels") + os.sep
    for item in items:
        if str(item.path).startswith(kernels_dir):
            item.add_marker(pytest.mark.kernels)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _settings_read_again():
    """Each test reads the environment afresh after it (``minite_megatron.settings`` reads it once per
    process): a test that set a variable through ``monkeypatch`` leaves no stale settings behind.
    Torn down after the test's own ``monkeypatch`` (set up first), so it sees the restored variables."""
    yield
    from minite_megatron.settings import settings

    settings.cache_clear()


@pytest.fixture
def seed_all():
    torch.manual_seed(1234)
    return 1234


@pytest.fixture(autouse=True, scope="module")
def _megatron_moe_aux_loss_scale_reset():
    """Megatron keeps the MoE aux-loss scale in a class attribute (``MoEAuxLossAutoScaler``): a
    backward outside its schedule makes it a 0-d tensor, and a later module's schedule then copies
    a ``[1]`` scale into it and fails (``output with shape [] doesn't match the broadcast shape
    [1]``). Each test module starts without it, as a fresh process does."""
    yield
    try:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    except Exception:  # megatron-core not installed: nothing to reset
        return
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
