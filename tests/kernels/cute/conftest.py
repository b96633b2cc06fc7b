"""Shared set-up of the Blackwell (CuTe DSL) kernel tests.

Kernels are compiled for sm_100a / sm_103a on this CPU machine (no GPU needed) once per test
session: :func:`kernel_artifacts` caches PTX and SASS per (config, arch).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile

import pytest

from minite_kernels.cute._host import dsl_import_error


def nvdisasm_path() -> str | None:
    """An nvdisasm binary: on PATH, or the one Triton ships (CUDA 12.8: decodes sm_100a)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    except Exception:
        return None
    return path if os.access(path, os.X_OK) else None


@functools.lru_cache(maxsize=None)
def _compile(config, arch: str) -> tuple[str, str | None, dict]:
    """(PTX, SASS or None when no nvdisasm here can decode ``arch``, static plan) of one
    kernel variant."""
    from minite_kernels.cute._blockscaled_gemm_impl import compile_artifacts

    plan: dict = {}
    ptx, cubin = compile_artifacts(config, arch, plan=plan)
    sass = None
    tool = nvdisasm_path()
    if tool is not None:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            run = subprocess.run([tool, "-c", f.name], capture_output=True, text=True)
        if run.returncode == 0:
            sass = run.stdout
    return ptx, sass, plan


@pytest.fixture(scope="session")
def kernel_artifacts():
    """``kernel_artifacts(config, arch="sm_100a") -> (ptx, sass or None)``, compiled once per
    session; skips the test when the CUTLASS DSL is not importable."""
    reason = dsl_import_error()
    if reason is not None:
        pytest.skip(reason)

    def get(config, arch: str = "sm_100a"):
        return _compile(config, arch)[:2]

    return get


@pytest.fixture(scope="session")
def kernel_plan():
    """``kernel_plan(config, arch="sm_100a") -> dict``: the static choices of a compiled variant
    (smem stages, accumulator stages, tensor-memory columns, MMA K), same cache as above."""
    reason = dsl_import_error()
    if reason is not None:
        pytest.skip(reason)

    def get(config, arch: str = "sm_100a"):
        return _compile(config, arch)[2]

    return get


def _exact_operand(rows: int, k: int, gen, *, lead=None, device="cpu"):
    """An NVFP4 operand whose GEMM partial sums are exact in fp32 in any order: random codes,
    block scales in {0.5, 1, 2}, random positive global scales (per row, or per group with
    ``lead=(G,)``). With K <= 1024 every partial sum is a multiple of 2^-4 below 2^18."""
    from dataclasses import replace

    import torch

    from minite_megatron.nvfp4 import NVFP4Tensor

    shape = (*(lead or ()), rows, k)
    codes = torch.randint(0, 256, (*shape[:-1], k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (*shape[:-1], k // 16), generator=gen)]
    global_decode = torch.rand(shape[0] if lead else rows, generator=gen) * 1e-2 + 1e-4
    q = NVFP4Tensor(
        codes=codes,
        block_scales=scales.to(torch.float8_e4m3fn),
        global_decode=global_decode,
        shape=torch.Size(shape),
        global_scale="group" if lead else "row",
    )
    return replace(
        q, codes=codes.to(device), block_scales=q.block_scales.to(device), global_decode=global_decode.to(device)
    )


@pytest.fixture(scope="session")
def exact_operand():
    """Factory of exact-sum NVFP4 operands (see :func:`_exact_operand`)."""
    return _exact_operand
