"""The ``triton`` backend object: where it runs, why not elsewhere, and the dispatcher."""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4 import BackendUnavailable
from minite_megatron.testing import assert_nvfp4_equal

from minite_kernels.triton._testing import DEVICE, HAS_CUDA, INTERPRETING, kernels_runnable, randn


def test_backend_base_class_and_registry_entry():
    """The Triton backend runs every op of the base class (a dropped kernel would silently send
    callers to the slower composition) and states its kernels' operand limits."""
    backend = nvfp4.backends._load("triton")
    assert backend.name == "triton" and isinstance(backend, nvfp4.Backend)
    assert {op: backend.supports(op) for op in nvfp4.backends.OPS} == {op: None for op in nvfp4.backends.OPS}
    assert "16x16 tiles" in backend.supports("gemm_nt", tile=(1, 16))
    assert backend.supports("grouped_gemm_nt", tile=(16, 16)) is None
    row = dict(dtype=torch.bfloat16, global_scale="row")
    assert backend.supports("rmsnorm_quantize", width=48, **row) is None
    assert "multiple of 16" in backend.supports("rmsnorm_quantize", width=40, **row)
    assert "multiple of 32" in backend.supports("swiglu_quantize", width=48, **row)
    assert "per-token" in backend.supports("swiglu_quantize", width=64, dtype=torch.bfloat16, global_scale="tensor")
    assert "bf16 / fp16" in backend.supports("rmsnorm_quantize", width=64, dtype=torch.float32, global_scale="row")


def test_cpu_availability_follows_the_interpreter(monkeypatch):
    from minite_kernels.triton.backend import BACKEND

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not BACKEND.available("cpu")
    assert "TRITON_INTERPRET=1" in BACKEND.why_not("cpu")
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET"):
        BACKEND.quantize(randn(4, 16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert BACKEND.available("cpu") and BACKEND.why_not("cpu") is None
    assert "unsupported device type" in BACKEND.why_not("meta")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_cuda_unavailable_says_why():
    from minite_kernels.triton.backend import BACKEND

    assert "no CUDA device" in BACKEND.why_not("cuda")


@pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")
def test_dispatcher_by_name_runs_the_kernels():
    x = randn(16, 64, seed=1, dtype=torch.bfloat16).to(DEVICE)
    got = nvfp4.quantize(x, backend="triton", rounding="stochastic", seed=3, with_image=True)
    ref = nvfp4.quantize_reference(x.cpu(), rounding="stochastic", seed=3, with_image=True)
    from dataclasses import replace

    assert_nvfp4_equal(replace(got, codes=got.codes.cpu(), block_scales=got.block_scales.cpu(),
                               global_decode=got.global_decode.cpu(), image=got.image.cpu()), ref)


@pytest.mark.skipif(not (INTERPRETING and not HAS_CUDA), reason="CPU dispatcher default")
def test_cpu_default_stays_the_reference():
    assert nvfp4.get_backend(None, "cpu").name == "reference"


def test_kernel_switches_are_backend_options_not_module_globals():
    """Benchmarks compared settings by flipping module globals with setattr (issue 11); now each
    setting is a backend object, registered for a block with ``nvfp4.backends.registered``."""
    from minite_kernels.triton.backend import BACKEND, TritonBackend, TritonOptions

    cpu = torch.device("cpu")
    assert BACKEND.options == TritonOptions()
    off = TritonBackend(TritonOptions(decode_kernels=False))
    assert not off.decode_ok(cpu) and not off.strict_decode_ok(64, cpu)
    no_strict = TritonBackend(TritonOptions(strict_decode=False))
    assert no_strict.decode_ok(cpu) and not no_strict.strict_decode_ok(64, cpu)
    with nvfp4.backends.registered(off):
        assert nvfp4.get_backend("triton", DEVICE) is off
    assert nvfp4.backends._load("triton") is BACKEND
