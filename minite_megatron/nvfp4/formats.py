"""The two element formats of NVFP4, as data: E2M1 codes and UE4M3 block scales.

E2M1 (the 4-bit element): codes 0..7 are the magnitudes below, bit 3 is the sign, so code 8
is -0. Two codes share a byte, the even element in the low nibble.

The E2M1 rounding is written as visible bin edges (``E2M1_BIN_EDGES``): for each edge, the
tie goes to the neighbour whose code is even, so every tie can be read off the table and a
test walks every code and every midpoint.

UE4M3 (the block scale) is ``torch.float8_e4m3fn``; its cast is round-to-nearest-even but not
saturating (out-of-range values become NaN), so :func:`e4m3_rne_satfinite` clamps to +-448
first. NaN stays NaN (0x7F).
"""

from __future__ import annotations

import torch

BLOCK = 16
"""Elements per block scale, along the GEMM's K dimension."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
GLOBAL_ENCODE_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688: S_enc = 2688 / amax

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Value of codes 0..7; code c + 8 is the same magnitude, negative."""

# (edge, tie_goes_up): |v| above the edge moves to the next code; |v| == edge moves up only
# when the upper neighbour's code is even (round half to even on the code).
E2M1_BIN_EDGES = (
    (0.25, False),  # 0 (code 0) | 0.5 (code 1)
    (0.75, True),  # 0.5 (code 1) | 1.0 (code 2)
    (1.25, False),  # 1.0 (code 2) | 1.5 (code 3)
    (1.75, True),  # 1.5 (code 3) | 2.0 (code 4)
    (2.5, False),  # 2.0 (code 4) | 3.0 (code 5)
    (3.5, True),  # 3.0 (code 5) | 4.0 (code 6)
    (5.0, False),  # 4.0 (code 6) | 6.0 (code 7)
)

SIGN_BIT = 8


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device) -> torch.Tensor:
    device = torch.device(device if device is not None else "cpu")
    key = (name, device)
    t = _TABLES.get(key)
    if t is None:
        if name == "values":
            mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
            t = torch.cat([mags, -mags])
        elif name == "bytes":  # [256, 2]: the two values of a packed byte (low nibble first)
            vals = _table("values", "cpu")
            b = torch.arange(256)
            t = torch.stack([vals[b & 0xF], vals[b >> 4]], dim=1)
        else:  # "edges": every edge as a strict threshold (|v| > e' moves up): a tie that goes
            # up compares against the largest fp32 below the edge, so ">" means ">=" there
            e = torch.tensor([edge for edge, _ in E2M1_BIN_EDGES], dtype=torch.float32)
            up = torch.tensor([tie_up for _, tie_up in E2M1_BIN_EDGES])
            t = torch.where(up, torch.nextafter(e, torch.zeros_like(e)), e)
        t = _TABLES[key] = t.to(device)
    return t


def e2m1_values(device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [16]: the value of every code (code 8 is -0.0)."""
    return _table("values", device)


def e2m1_encode_nearest(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``v`` to the nearest E2M1 code, ties to the even code, |v| > 6 saturating to 6.

    Negative values (and -0.0) keep the sign bit, so a negative value that rounds to zero is
    code 8. NaN encodes as code 0 (callers mark non-finite groups through their scales).
    Returns uint8 codes of ``v``'s shape.
    """
    if v.dtype != torch.float32:
        raise TypeError(f"e2m1_encode_nearest expects float32, got {v.dtype}")
    # magnitude code = number of edges passed (bucketize: count of thresholds strictly below |v|)
    mag = torch.bucketize(v.abs().contiguous(), _table("edges", v.device), out_int32=True).to(torch.uint8)
    return _with_sign(mag, v)


def _with_sign(mag: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    nan = torch.isnan(v)
    codes = mag | (torch.signbit(v).to(torch.uint8) << 3)
    return torch.where(nan, torch.zeros_like(codes), codes)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (one per element, 0..15) -> fp32 values."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"e2m1_decode expects uint8 codes, got {codes.dtype}")
    return e2m1_values(codes.device)[codes.long()]


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] packed codes -> fp32 [..., K] values (one table lookup per byte)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"decode_packed expects uint8, got {packed.dtype}")
    vals = _table("bytes", packed.device)[packed.long()]
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes (0..15) -> uint8 [..., K/2]; element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] codes; inverse of :func:`pack_e2m1`."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1 expects uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e4m3_rne_satfinite(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, finite values saturate at +-448, NaN stays NaN."""
    if v.dtype != torch.float32:
        raise TypeError(f"e4m3_rne_satfinite expects float32, got {v.dtype}")
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
