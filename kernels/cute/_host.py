"""Host-side helpers shared by the Blackwell ops: can this machine run them, and on which
architecture; operand preparation for TMA. Imports torch only (CUTLASS is probed lazily)."""

from __future__ import annotations

import functools

import torch

from minite_megatron.nvfp4 import BackendUnavailable

# compute capability -> the CuTe DSL --gpu-arch target (the "a" variants expose tcgen05)
_ARCH_BY_CAPABILITY = {(10, 0): "sm_100a", (10, 3): "sm_103a"}


@functools.lru_cache(maxsize=1)
def dsl_import_error() -> str | None:
    """None if the CUTLASS Python DSL imports here, else why not (one line)."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # missing wheel, or a broken install: report it, never hide it
        return (
            f"the CUTLASS Python DSL is not importable ({type(e).__name__}: {e}); "
            f"install it with: pip install 'nvidia-cutlass-dsl>=4.8'"
        )
    return None


def device_arch(device: torch.device | str | None) -> str:
    """The ``--gpu-arch`` of ``device`` (``sm_100a`` / ``sm_103a``); raises BackendUnavailable."""
    reason = why_not(device)
    if reason is not None:
        raise BackendUnavailable(f"blackwell NVFP4 kernels cannot run on {device}: {reason}")
    return _ARCH_BY_CAPABILITY[torch.cuda.get_device_capability(torch.device(device))]


def blackwell_arch(device: torch.device | str | None) -> str | None:
    """The ``--gpu-arch`` of ``device`` if it is a CUDA GPU these kernels target, else None
    (never raises, imports no DSL): what decides which kernel variant's rules apply."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _ARCH_BY_CAPABILITY.get(torch.cuda.get_device_capability(device))


def why_not(device: torch.device | str | None) -> str | None:
    """None if the Blackwell kernels can run on ``device``, else the reason."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return f"needs a CUDA device (got {device if device is not None else 'no device'})"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    cap = torch.cuda.get_device_capability(device)
    if cap not in _ARCH_BY_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"needs compute capability 10.0 (sm_100a: B200/GB200) or 10.3 (sm_103a: B300/GB300) for "
            f"tcgen05 FP4 tensor cores; {name} is {cap[0]}.{cap[1]}"
        )
    return dsl_import_error()


def new_output(*shape: int, dtype: torch.dtype, device: torch.device, fill: float | None = None) -> torch.Tensor:
    """The output buffer of an op: ``torch.empty``, or filled with ``fill`` (the backend's
    ``output_fill``: NaN in ``benchmarks.blackwell_bringup``, so a cell the kernel fails to write
    shows up; None, the default, costs nothing)."""
    if fill is None:
        return torch.empty(*shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device)


def tma_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned base (TMA requirement); copies only if needed."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t
