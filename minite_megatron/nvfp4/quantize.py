"""The NVFP4 quantization chain in pure torch: the oracle every backend equals bit for bit.

Quantizing ``x`` (bf16 or fp32, last dimension K a multiple of 16) with global amax ``A``
(per tensor, per row, or per leading matrix), in this order, all in fp32 unless stated:

1. ``S_enc = min(2688 / A, FLT_MAX)`` (2688 = 448 * 6, IEEE division; ``inf -> FLT_MAX``);
   ``S_enc = 1`` if ``A == 0``.
2. ``S_dec = fp32(1.0 / fp64(S_enc))``.
3. per block (16 consecutive elements along K, or a 16x16 tile for weights):
   ``sf = e4m3_rne_satfinite(block_amax * (S_enc * RN_fp32(1/6)))`` (the product in brackets
   first; e4m3 subnormals are kept; finite values saturate at 448).
4. ``enc = min(1 / (fp32(sf) * S_dec), FLT_MAX)`` (IEEE division; a zero scale gives FLT_MAX).
5. ``q = e2m1_rne_satfinite(x * enc)``: nearest E2M1, ties to the even code, ``|v| > 6 -> 6``,
   sign kept (a negative value that rounds to zero is code 8); or stochastic rounding
   (:mod:`.stochastic`) for gradients.
6. ``x_hat = e2m1(q) * fp32(sf) * S_dec``.

Load-bearing details: ``RN_fp32(1/6)`` is multiplied into ``S_enc`` *before* the block amax
(the other association flips scales); the reciprocal in step 4 is a true division, not an
approximate ``rcp`` (vLLM's default quantizer differs from this chain in ~0.2% of codes for
that reason); step 2 goes through fp64.

Non-finite input (policy): a scale domain (row, tensor or group) that holds a NaN or an
infinity gets ``S_enc = S_dec = NaN``: its block scales are NaN (e4m3 0x7F), its codes are 0,
and everything computed from it (dequantized values, GEMM outputs) is NaN. Finite garbage is
never produced. (TE's chain would give ``S_enc = 1`` for an infinite amax and quantize the
finite values of the domain to zero.) With ``nonfinite="raise"`` the input is checked first
and a ``ValueError`` names the first bad element instead.

Optional random Hadamard transform (:mod:`.hadamard`, wgrad operands): applied to ``x`` first;
the amax and every step above then see the transformed values.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

import torch

from .formats import (
    BLOCK,
    E4M3_MAX,
    FLT_MAX,
    GLOBAL_ENCODE_NUMERATOR,
    e2m1_encode_nearest,
    e4m3_rne_satfinite,
    pack_e2m1,
)
from .hadamard import rht16, rht_signs
from .stochastic import DeviceSeed, check_seed, e2m1_encode_stochastic, random_bits, uniform_from_bits
from .tensor import NVFP4Tensor

Rounding = Literal["nearest", "stochastic"]
NonFinite = Literal["propagate", "raise"]

_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32)  # RN_fp32(1/6)
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2: fp32 amax -> (S_enc, S_dec), same shape; NaN for a non-finite amax."""
    amax = amax.to(torch.float32)
    s_enc = torch.div(torch.full_like(amax, GLOBAL_ENCODE_NUMERATOR), amax).clamp(max=FLT_MAX)
    s_enc = torch.where(amax == 0, torch.ones_like(s_enc), s_enc)
    s_enc = torch.where(torch.isfinite(amax), s_enc, torch.full_like(s_enc, float("nan")))
    s_dec = torch.div(1.0, s_enc.to(torch.float64)).to(torch.float32)
    return s_enc, s_dec


def block_scales_from_amax(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """Step 3: fp32 block amax and broadcastable S_enc -> float8_e4m3fn block scales."""
    return e4m3_rne_satfinite(block_amax * (s_enc * _ONE_SIXTH.to(s_enc.device)))


def encode_scales(sf: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """Step 4: ``min(1 / (fp32(sf) * S_dec), FLT_MAX)``."""
    denom = sf.to(torch.float32) * s_dec
    return torch.div(torch.ones_like(denom), denom).clamp(max=FLT_MAX)


def validate_input(x: torch.Tensor, tile: tuple[int, int], global_scale: str) -> None:
    """Raise a clear error for inputs the contract does not define."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"nvfp4.quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"nvfp4.quantize supports bfloat16/float32/float16 input, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("nvfp4.quantize needs at least one dimension (K is the last one)")
    if x.shape[-1] % BLOCK:
        raise ValueError(
            f"nvfp4.quantize: the last dimension (K={x.shape[-1]}) must be a multiple of {BLOCK}"
        )
    if tuple(tile) not in ((1, BLOCK), (BLOCK, BLOCK)):
        raise ValueError(f"nvfp4.quantize: tile must be (1, 16) or (16, 16), got {tile}")
    if global_scale not in ("tensor", "row", "group"):
        raise ValueError(f"nvfp4.quantize: global_scale must be 'tensor', 'row' or 'group', got {global_scale!r}")
    if global_scale == "group" and x.dim() != 3:
        raise ValueError("nvfp4.quantize: global_scale='group' needs a [G, R, K] tensor")
    if tuple(tile) == (BLOCK, BLOCK):
        if global_scale == "row":
            raise ValueError(
                "nvfp4.quantize: 16x16 tiles need one global scale per tile row group; "
                "use global_scale='tensor' (or 'group'), not 'row'"
            )
        if x.dim() < 2 or x.shape[-2] % BLOCK:
            raise ValueError(
                f"nvfp4.quantize: 16x16 tiles need the second-to-last dimension to be a multiple "
                f"of {BLOCK}, got shape {tuple(x.shape)}"
            )


class NonFiniteError(ValueError):
    """Non-finite input under ``nonfinite="raise"``; the message names the first bad element
    (and, raised through a minite module, that module: :mod:`minite_megatron.modules.naming`)."""


def check_amax_override(amax, x: torch.Tensor, global_scale: str) -> None:
    """A caller's ``amax`` override must be a tensor of finite, non-negative values, one per
    scale domain of ``x``; raise a one-line TypeError/ValueError otherwise.

    (A negative amax would give negative scales and clip the values silently; a NaN one would
    give NaN scales to finite data. For non-finite *input*, leave ``amax=None``: the policy
    ``nonfinite="propagate"`` then gives its domain NaN scales, ``"raise"`` names the element.)
    Reads the values back to the host: public API only (the ops pass amaxes they computed).
    """
    if not isinstance(amax, torch.Tensor):
        raise TypeError(f"nvfp4.quantize: amax must be a torch.Tensor (fp32, one per scale domain), got {type(amax).__name__}")
    rows = math.prod(x.shape[:-1])
    domains = {"row": rows, "tensor": 1, "group": x.shape[0] if x.dim() else 1}[global_scale]
    if amax.numel() != domains:
        raise ValueError(f"nvfp4.quantize: amax has {amax.numel()} value(s), global_scale={global_scale!r} on shape "
                         f"{tuple(x.shape)} needs {domains}")
    a = amax.detach().float()
    bad = ~torch.isfinite(a) | (a < 0)
    if bool(bad.any()):
        first = a.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item()
        raise ValueError(f"nvfp4.quantize: amax must be finite and >= 0, got {int(bad.sum())} bad value(s), first {first} "
                         "(for non-finite input leave amax=None: nonfinite='propagate' gives NaN scales)")


def check_finite(x: torch.Tensor) -> None:
    """The checked mode of the non-finite policy: raise :class:`NonFiniteError` naming the first
    bad element."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise NonFiniteError(
            f"nvfp4.quantize: input has {int(bad.sum())} non-finite value(s); first at index "
            f"{idx} = {x[idx].item()} (nonfinite='raise')"
        )


def quantize_reference(
    x: torch.Tensor,
    *,
    global_scale: str = "row",
    tile: tuple[int, int] = (1, BLOCK),
    rounding: Rounding = "nearest",
    seed: int | DeviceSeed | None = None,
    rht_seed: int | None = None,
    amax: torch.Tensor | None = None,
    with_image: bool = False,
    nonfinite: NonFinite = "propagate",
) -> NVFP4Tensor:
    """Quantize ``x`` exactly as the module docstring states. See :func:`nvfp4.quantize`."""
    validate_input(x, tile, global_scale)
    if nonfinite == "raise":
        check_finite(x)
    elif nonfinite != "propagate":
        raise ValueError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")
    if rounding == "stochastic" and seed is None:
        raise ValueError("stochastic rounding needs a seed (nvfp4.quantize draws one from `generator`)")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic":
        check_seed(seed, x.device)
    if rht_seed is not None and tuple(tile) != (1, BLOCK):
        raise ValueError("the random Hadamard transform applies to 1x16 blocks only")

    shape = x.shape
    k = shape[-1]
    rows = math.prod(shape[:-1])
    if rht_seed is not None and x.numel():
        signs = rht_signs(None if rht_seed < 0 else rht_seed, device=x.device)
        xf = rht16(x, signs).reshape(rows, k)
    else:
        xf = x.reshape(rows, k).to(torch.float32)

    # Steps 1-2: global scales, one per scale domain, expanded to one per row.
    absx = xf.abs()
    if amax is None and k == 0:  # nothing to scale: every domain is empty (amax 0)
        amax = absx.new_zeros(rows if global_scale == "row" else (shape[0] if global_scale == "group" else 1))
    elif amax is None:
        if global_scale == "row":
            amax = absx.amax(dim=1) if rows else absx.new_zeros(0)
        elif global_scale == "tensor":
            amax = absx.amax().reshape(1) if xf.numel() else absx.new_zeros(1)
        else:
            amax = absx.reshape(shape[0], -1).amax(dim=1)
        # torch.amax ignores NaN on some paths: the policy needs NaN to win.
        nan_rows = torch.isnan(xf).any(dim=1)
        if global_scale == "row":
            amax = torch.where(nan_rows, float("nan"), amax)
        elif global_scale == "tensor":
            amax = torch.where(nan_rows.any(), float("nan"), amax)
        else:
            amax = torch.where(nan_rows.reshape(shape[0], -1).any(dim=1), float("nan"), amax)
    amax = amax.to(torch.float32).reshape(-1)
    s_enc, s_dec = global_scales(amax)
    if global_scale == "row":
        row_enc, row_dec = s_enc, s_dec
    elif global_scale == "tensor":
        row_enc, row_dec = s_enc.expand(rows), s_dec.expand(rows)
    else:
        rep = rows // shape[0]
        row_enc, row_dec = s_enc.repeat_interleave(rep), s_dec.repeat_interleave(rep)

    # Step 3: block scales (1x16, or 16x16 tiles repeated on their 16 rows).
    blocks = absx.view(rows, k // BLOCK, BLOCK)
    if tuple(tile) == (BLOCK, BLOCK):
        block_amax = blocks.amax(dim=2).view(rows // BLOCK, BLOCK, k // BLOCK).amax(dim=1)
        block_amax = block_amax.repeat_interleave(BLOCK, dim=0)
    else:
        block_amax = blocks.amax(dim=2)
    sf = block_scales_from_amax(block_amax, row_enc.unsqueeze(1))

    # Steps 4-5: per-block encode scale, then E2M1 rounding.
    enc = encode_scales(sf, row_dec.unsqueeze(1))
    v = (xf.view(rows, k // BLOCK, BLOCK) * enc.unsqueeze(2)).view(rows, k)
    if rounding == "nearest":
        codes = e2m1_encode_nearest(v)
    else:
        r = torch.arange(rows, device=x.device).unsqueeze(1)
        c = torch.arange(k, device=x.device).unsqueeze(0)
        codes = e2m1_encode_stochastic(v, uniform_from_bits(random_bits(seed, r, c)))

    q = NVFP4Tensor(
        codes=pack_e2m1(codes).reshape(*shape[:-1], k // 2),
        block_scales=sf.reshape(*shape[:-1], k // BLOCK),
        global_decode=s_dec if global_scale != "tensor" else s_dec.reshape(1),
        shape=shape,
        global_scale=global_scale,
        tile=tuple(tile),
        rht_seed=rht_seed,
    )
    if with_image:
        q = replace(q, image=q.image_fp32().to(torch.bfloat16).reshape(shape))
    return q


__all__ = [
    "global_scales",
    "block_scales_from_amax",
    "encode_scales",
    "quantize_reference",
    "validate_input",
    "check_finite",
    "check_amax_override",
    "NonFiniteError",
    "E4M3_MAX",
]
