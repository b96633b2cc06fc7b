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
def _compile(config, arch: str) -> tuple[str, str | None]:
    """(PTX, SASS or None when no nvdisasm here can decode ``arch``) of one kernel variant."""
    from minite_kernels.cute._blockscaled_gemm_impl import compile_artifacts

    ptx, cubin = compile_artifacts(config, arch)
    sass = None
    tool = nvdisasm_path()
    if tool is not None:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            run = subprocess.run([tool, "-c", f.name], capture_output=True, text=True)
        if run.returncode == 0:
            sass = run.stdout
    return ptx, sass


@pytest.fixture(scope="session")
def kernel_artifacts():
    """``kernel_artifacts(config, arch="sm_100a") -> (ptx, sass or None)``, compiled once per
    session; skips the test when the CUTLASS DSL is not importable."""
    reason = dsl_import_error()
    if reason is not None:
        pytest.skip(reason)

    def get(config, arch: str = "sm_100a"):
        return _compile(config, arch)

    return get
