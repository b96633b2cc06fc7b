"""NVFP4: the one numerical contract of miniTE (pure torch; imports nothing but torch).

The chain (see :mod:`.quantize` for the load-bearing details and the non-finite policy)::

    S_enc = min(2688 / A, FLT_MAX)   (S_enc = 1 if A == 0);   S_dec = fp32(1 / fp64(S_enc))
    sf    = e4m3_rne_satfinite(block_amax * (S_enc * RN(1/6)))          per 16 elements (or 16x16)
    enc   = min(1 / (fp32(sf) * S_dec), FLT_MAX)
    q     = e2m1_rne_satfinite(x * enc)        (or seeded stochastic rounding for gradients)
    x_hat = e2m1(q) * fp32(sf) * S_dec

GEMM (:mod:`.gemm`): ``out = round(fp32(S_dec_a[m] * S_dec_b[n]) * acc + bias)`` with ``acc``
the fp32 sum of exact 16-element block partials, in K order.

Public API::

    q = nvfp4.quantize(x, global_scale="row", tile=(1, 16), rounding="nearest")
    q.codes, q.block_scales, q.global_decode, q.dequantize()
    y = nvfp4.gemm(qa, qb, bias=None)               # qa @ qb.T
    nvfp4.swizzle_scales(q.block_scales.view(-1, K // 16)), nvfp4.unswizzle_scales(...)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends import (
    Backend,
    BackendUnavailable,
    OpNotSupported,
    ReferenceBackend,
    available_backends,
    backend_names,
    get_backend,
    register_backend,
)
from .formats import (
    BLOCK,
    E2M1_BIN_EDGES,
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode_nearest,
    e4m3_rne_satfinite,
    pack_e2m1,
    unpack_e2m1,
)
from .gemm import fp32_accumulation_bound, gemm_reference
from .grouped import (
    decode_grouped_gemm_reference,
    grouped_gemm_reference,
    grouped_wgrad_gemm_reference,
    grouped_wgrad_reference,
    pad_groups,
    padded_group_sizes,
    quantize_wgrad_operand,
    stack_expert_weights,
)
from .hadamard import hadamard_matrix, rht16, rht_signs
from .quantize import NonFiniteError, check_amax_override, global_scales, quantize_reference, validate_input
from .stochastic import DeviceSeed, sr_key
from .swizzle import swizzle_scales, swizzled_numel, unswizzle_scales
from .tensor import NVFP4Tensor


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A 31-bit seed for stochastic rounding drawn from ``generator`` (torch's default if None).

    A CUDA generator costs a host sync; modules keep a CPU generator for that reason.
    """
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=device).item())


def quantize(
    x: torch.Tensor,
    global_scale: str = "row",
    tile: tuple[int, int] = (1, BLOCK),
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    backend: str | None = None,
    *,
    seed: int | DeviceSeed | None = None,
    rht_seed: int | None = None,
    amax: torch.Tensor | None = None,
    with_image: bool = False,
    nonfinite: str = "propagate",
) -> NVFP4Tensor:
    """Quantize ``x`` ([..., K], bf16/fp32/fp16, K a multiple of 16) to NVFP4 along K.

    Args:
        global_scale: ``"row"`` (one S_dec per row: per token for activations), ``"tensor"``
            (one for the tensor) or ``"group"`` (one per leading matrix of ``[G, R, K]``).
        tile: ``(1, 16)`` blocks, or ``(16, 16)`` tiles (weights: the transpose is exact;
            needs rows a multiple of 16 and a ``"tensor"``/``"group"`` scale).
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (gradients), whose random
            bits come from ``seed`` (an int, or a :class:`DeviceSeed`: its key read on the device
            when the kernel runs, as CUDA-graph replays need) or, if None, a seed drawn from
            ``generator``.
        backend: ``"reference"``, ``"triton"``, ``"blackwell"``, or None for the best one for
            ``x.device``.
        rht_seed: apply the 16x16 random Hadamard transform first (``-1``: fixed signs).
        amax: a precomputed global amax (shape of ``global_decode``), e.g. reused from an
            earlier pass over the same tensor.
        with_image: also return the bf16 image (codes x block scales) for emulated GEMMs.
        nonfinite: ``"propagate"`` (NaN scales for any scale domain holding NaN/inf) or
            ``"raise"`` (ValueError naming the first non-finite element).

    Raises:
        TypeError for an input that is not a tensor or has an unsupported dtype, or an ``amax``
        that is not a tensor; ValueError for K not a multiple of 16, a bad tile/scale
        combination, an ``amax`` that is negative, NaN, infinite or of the wrong size, or
        (``nonfinite="raise"``, :class:`NonFiniteError`) non-finite input;
        BackendUnavailable if the named backend cannot run on ``x.device``.
    """
    validate_input(x, tile, global_scale)  # before anything reads x.device: a list is a TypeError
    if amax is not None:
        check_amax_override(amax, x, global_scale)
    if rounding == "stochastic" and seed is None:
        seed = draw_seed(generator)
    return get_backend(backend, x.device).quantize(
        x,
        global_scale=global_scale,
        tile=tile,
        rounding=rounding,
        seed=seed,
        rht_seed=rht_seed,
        amax=amax,
        with_image=with_image,
        nonfinite=nonfinite,
    )


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.dequantize(dtype)


def gemm(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``a @ b.T`` on NVFP4 operands: ``a`` [..., K], ``b`` [N, K] -> ``[..., N]`` in ``out_dtype``.

    ``batch_invariant=True`` asks for a kernel whose row results do not depend on how many rows
    share the call (strict mode); the reference always is.
    """
    return get_backend(backend, a.device).gemm(a, b, bias, out_dtype, batch_invariant)


def grouped_gemm(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    group_sizes: Sequence[int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """MoE GEMM: rows of ``a`` [M, K] sorted by group, ``b`` [G, N, K] (``"group"`` scales)."""
    return get_backend(backend, a.device).grouped_gemm(a, b, group_sizes, bias, out_dtype, batch_invariant)


def decode_grouped_gemm(
    a: NVFP4Tensor,
    w_stacked: NVFP4Tensor,
    expert_ids: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    batch_invariant: bool = False,
    *,
    num_experts: int | None = None,
) -> torch.Tensor:
    """MoE decode: ``out[r] = gemm(a[r], w_stacked[expert_ids[r]])`` -> ``[R, N]`` (see
    :func:`.grouped.decode_grouped_gemm_reference`; ``w_stacked`` from :func:`stack_expert_weights`)."""
    return get_backend(backend, a.device).decode_grouped_gemm(
        a, w_stacked, expert_ids, out_dtype, batch_invariant, num_experts=num_experts
    )


def grouped_wgrad(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    group_sizes: Sequence[int],
    *,
    global_scale: str = "tensor",
    grad_rounding: str = "nearest",
    grad_seed: int | None = None,
    rht_seed: int | None = None,
    out_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> torch.Tensor:
    """MoE wgrad ``dW[g] = dY_g^T @ X_g`` in NVFP4 (see :mod:`.grouped`) -> ``[G, N, K]``."""
    return get_backend(backend, x.device).grouped_wgrad(
        grad_out, x, group_sizes, global_scale=global_scale, grad_rounding=grad_rounding,
        grad_seed=grad_seed, rht_seed=rht_seed, out_dtype=out_dtype,
    )


__all__ = [
    "BLOCK",
    "E2M1_BIN_EDGES",
    "E2M1_MAGNITUDES",
    "E2M1_MAX",
    "E4M3_MAX",
    "NVFP4Tensor",
    "NonFiniteError",
    "Backend",
    "BackendUnavailable",
    "OpNotSupported",
    "ReferenceBackend",
    "available_backends",
    "backend_names",
    "dequantize",
    "decode_grouped_gemm",
    "decode_grouped_gemm_reference",
    "draw_seed",
    "DeviceSeed",
    "sr_key",
    "e2m1_decode",
    "e2m1_encode_nearest",
    "e4m3_rne_satfinite",
    "fp32_accumulation_bound",
    "gemm",
    "gemm_reference",
    "get_backend",
    "global_scales",
    "grouped_gemm",
    "grouped_gemm_reference",
    "grouped_wgrad",
    "grouped_wgrad_reference",
    "grouped_wgrad_gemm_reference",
    "quantize_wgrad_operand",
    "pad_groups",
    "padded_group_sizes",
    "hadamard_matrix",
    "pack_e2m1",
    "quantize",
    "quantize_reference",
    "register_backend",
    "rht16",
    "rht_signs",
    "stack_expert_weights",
    "swizzle_scales",
    "swizzled_numel",
    "unpack_e2m1",
    "unswizzle_scales",
]
