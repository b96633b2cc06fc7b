"""Assertion helpers for the numerical contract, shared by the test-suite and by anyone who
adds a backend: bitwise comparisons that say how many elements differ and where.
"""

from __future__ import annotations

import torch

from .nvfp4.tensor import NVFP4Tensor

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as an integer tensor of the same element size (contiguous)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def _first_mismatches(diff: torch.Tensor, a: torch.Tensor, b: torch.Tensor, limit: int = 5) -> str:
    idx = diff.nonzero()[:limit]
    parts = []
    for i in idx:
        key = tuple(int(v) for v in i)
        va, vb = a[key], b[key]
        if a.dtype.is_floating_point and a.element_size() == 1:
            va, vb = va.float(), vb.float()
        parts.append(f"{key}: {va.item()!r} vs {vb.item()!r}")
    return "; ".join(parts)


def assert_bitwise_equal(
    actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor", *, nan_equal: bool = False
) -> None:
    """``torch.equal`` on raw bits, with a report of how many elements differ and where.

    ``nan_equal``: a NaN matches any NaN (payloads and signs of NaN differ between torch's
    vectorised and scalar conversions, e.g. 0xFFFF vs 0x7FC0 in bf16)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != {expected.dtype}")
    ra, rb = raw_bits(actual.cpu()), raw_bits(expected.cpu())
    if torch.equal(ra, rb):
        return
    diff = ra != rb
    if nan_equal and actual.dtype.is_floating_point:
        diff &= ~(torch.isnan(actual.cpu().float()) & torch.isnan(expected.cpu().float()))
        if not bool(diff.any()):
            return
    n = int(diff.sum())
    raise AssertionError(
        f"{name}: {n} of {diff.numel()} elements ({100.0 * n / max(diff.numel(), 1):.4f}%) differ "
        f"bitwise; first: {_first_mismatches(diff, actual.cpu(), expected.cpu())}"
    )


def assert_nvfp4_equal(actual: NVFP4Tensor, expected: NVFP4Tensor, name: str = "q", *, image: bool = True) -> None:
    """Codes, block scales (linear layout), global scales and, where both carry one, the image.

    Codes of ``-0.0`` inputs may legitimately be 0 or 8 (implementations disagree on the sign
    of an exact negative zero); callers that feed -0.0 compare dequantized values there.
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: logical shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.global_scale != expected.global_scale or tuple(actual.tile) != tuple(expected.tile):
        raise AssertionError(
            f"{name}: ({actual.global_scale}, {actual.tile}) != ({expected.global_scale}, {expected.tile})"
        )
    assert_bitwise_equal(actual.codes, expected.codes, f"{name}.codes")
    assert_bitwise_equal(actual.linear_scales(), expected.linear_scales(), f"{name}.block_scales")
    assert_bitwise_equal(actual.global_decode.reshape(-1), expected.global_decode.reshape(-1), f"{name}.global_decode")
    if image and actual.image is not None:
        assert_bitwise_equal(actual.bf16_image(), expected.image_fp32().to(torch.bfloat16), f"{name}.image", nan_equal=True)


def assert_within(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, name: str = "tensor") -> None:
    """|actual - exact| <= bound element-wise (NaN never passes), with a report of the worst."""
    err = (actual.double().cpu() - exact.double().cpu()).abs()
    bad = ~(err <= bound.double().cpu())
    if bool(bad.any()):
        n = int(bad.sum())
        ratio = (err / bound.double().cpu().clamp_min(1e-300)).nan_to_num(float("inf"))
        worst = tuple(int(v) for v in torch.nonzero(ratio == ratio.max())[0])
        raise AssertionError(
            f"{name}: {n} of {err.numel()} elements outside the bound; worst at {worst}: "
            f"actual {actual[worst].item()!r}, exact {exact[worst].item()!r}, bound {bound[worst].item()!r}"
        )


def gemm_output_bound(exact: torch.Tensor, accumulation_bound: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Bound for a GEMM output rounded to ``out_dtype``: the fp32 accumulation bound plus one
    rounding of the output format (half an ulp relative, ``2^-p`` with p the significand bits)."""
    p = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[out_dtype]
    # one rounding of a value within the accumulation bound, plus a tiny-value floor for subnormals
    tiny = torch.finfo(out_dtype).tiny
    return accumulation_bound + 2.0**-p * (exact.abs() + accumulation_bound) + tiny
