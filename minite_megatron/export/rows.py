"""Exact row selection and concatenation of NVFP4 weights (fused Megatron linears <-> HF linears).

A weight quantized with 16x16 tiles (or 1x16 blocks) and one global scale per tensor stores, per
row, its packed codes and its block scales (a tile's scale repeated on its 16 rows), plus one
shared fp32 decode scale. Taking whole 16-row tiles out of it, or putting tensors with the *same*
decode scale side by side, moves bytes only: every element keeps its code, its block scale and
its global scale, so the dequantized values are bitwise those of the source. No re-quantization.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..nvfp4 import BLOCK, NVFP4Tensor
from ..testing import raw_bits


def check_weight(q: NVFP4Tensor, name: str) -> NVFP4Tensor:
    """Validate an exportable 2-D weight and return it in the linear scale layout.

    Raises TypeError for a non-NVFP4Tensor, ValueError for a per-row global scale (ModelOpt
    has one ``weight_scale_2`` per tensor), a non-2-D shape or an unsupported tile.
    """
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"{name}: expected an NVFP4Tensor, got {type(q).__name__}")
    if len(q.shape) != 2:
        raise ValueError(f"{name}: expected a 2-D [N, K] weight, got shape {tuple(q.shape)}")
    if q.global_scale != "tensor" or q.global_decode.numel() != 1:
        raise ValueError(
            f"{name}: ModelOpt NVFP4 stores one global scale per weight (weight_scale_2); this weight has "
            f"global_scale={q.global_scale!r} with {q.global_decode.numel()} value(s)"
        )
    if tuple(q.tile) not in ((1, BLOCK), (BLOCK, BLOCK)):
        raise ValueError(f"{name}: unsupported tile {q.tile}")
    if q.rht_seed is not None:
        raise ValueError(f"{name}: a Hadamard-transformed weight is not a servable weight")
    return q.linear()


def take_rows(q: NVFP4Tensor, ranges: Sequence[tuple[int, int]], name: str = "weight") -> NVFP4Tensor:
    """Rows ``[a0, b0) + [a1, b1) + ...`` of a 2-D weight, concatenated, bytes unchanged.

    With 16x16 tiles every range bound must be a multiple of 16 (a tile is never cut).
    Raises ValueError for out-of-range or tile-cutting bounds.
    """
    q = check_weight(q, name)
    n = q.shape[0]
    step = q.tile[0]
    for a, b in ranges:
        if not (0 <= a < b <= n):
            raise ValueError(f"{name}: row range [{a}, {b}) outside [0, {n})")
        if a % step or b % step:
            raise ValueError(
                f"{name}: row range [{a}, {b}) cuts a {step}x16 tile; the split needs boundaries at "
                f"multiples of {step} (head_dim and ffn sizes must be multiples of 16)"
            )
    idx = torch.cat([torch.arange(a, b) for a, b in ranges]).to(q.codes.device)
    rows = int(idx.numel())
    return NVFP4Tensor(
        codes=q.codes.index_select(0, idx),
        block_scales=q.block_scales.view(torch.uint8).index_select(0, idx).view(q.block_scales.dtype),
        global_decode=q.global_decode.reshape(1).clone(),
        shape=torch.Size([rows, q.shape[1]]),
        global_scale="tensor",
        tile=tuple(q.tile),
    )


def concat_rows(parts: Sequence[NVFP4Tensor], name: str = "weight") -> NVFP4Tensor:
    """Stack 2-D weights along rows; they must share K, tile and the *bitwise same* global scale
    (else merging them would need a re-quantization: ValueError)."""
    if not parts:
        raise ValueError(f"{name}: nothing to concatenate")
    parts = [check_weight(p, f"{name}[{i}]") for i, p in enumerate(parts)]
    p0 = parts[0]
    for i, p in enumerate(parts[1:], 1):
        if p.shape[1] != p0.shape[1] or tuple(p.tile) != tuple(p0.tile):
            raise ValueError(f"{name}: part {i} has K={p.shape[1]}, tile {p.tile}; part 0 has K={p0.shape[1]}, tile {p0.tile}")
        if not torch.equal(raw_bits(p.global_decode.reshape(1)), raw_bits(p0.global_decode.reshape(1))):
            raise ValueError(
                f"{name}: part {i} has global decode scale {float(p.global_decode)!r}, part 0 "
                f"{float(p0.global_decode)!r}; fusing them would need a re-quantization"
            )
        if p.shape[0] % p.tile[0]:
            raise ValueError(f"{name}: part {i} has {p.shape[0]} rows, not whole tiles")
    return NVFP4Tensor(
        codes=torch.cat([p.codes for p in parts]),
        block_scales=torch.cat([p.block_scales.view(torch.uint8) for p in parts]).view(p0.block_scales.dtype),
        global_decode=p0.global_decode.reshape(1).clone(),
        shape=torch.Size([sum(p.shape[0] for p in parts), p0.shape[1]]),
        global_scale="tensor",
        tile=tuple(p0.tile),
    )


def split_groups(q: NVFP4Tensor, name: str = "experts") -> list[NVFP4Tensor]:
    """A ``[G, N, K]`` weight with one global scale per group (``"group"``) -> G 2-D weights."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"{name}: expected an NVFP4Tensor, got {type(q).__name__}")
    if len(q.shape) != 3 or q.global_scale != "group":
        raise ValueError(f"{name}: expected a [G, N, K] weight with global_scale='group', got {tuple(q.shape)}, {q.global_scale!r}")
    return [q.group(g) for g in range(q.shape[0])]


def stack_groups(parts: Sequence[NVFP4Tensor], name: str = "experts") -> NVFP4Tensor:
    """G 2-D weights of one shape and tile -> a ``[G, N, K]`` ``"group"`` weight (bytes unchanged)."""
    parts = [check_weight(p, f"{name}[{i}]") for i, p in enumerate(parts)]
    p0 = parts[0]
    for i, p in enumerate(parts):
        if tuple(p.shape) != tuple(p0.shape) or tuple(p.tile) != tuple(p0.tile):
            raise ValueError(f"{name}: expert {i} has shape {tuple(p.shape)}, tile {p.tile}; expert 0 {tuple(p0.shape)}, {p0.tile}")
    return NVFP4Tensor(
        codes=torch.stack([p.codes for p in parts]),
        block_scales=torch.stack([p.block_scales.view(torch.uint8) for p in parts]).view(p0.block_scales.dtype),
        global_decode=torch.cat([p.global_decode.reshape(1) for p in parts]),
        shape=torch.Size([len(parts), *p0.shape]),
        global_scale="group",
        tile=tuple(p0.tile),
    )


# ---- Megatron fused layouts ------------------------------------------------------------------
def qkv_row_ranges(num_heads: int, num_groups: int, head_dim: int) -> dict[str, list[tuple[int, int]]]:
    """Rows of q, k and v inside Megatron's fused ``linear_qkv`` weight.

    Megatron interleaves per query group: for group g, ``heads/groups`` query heads, then one key
    head, then one value head, each ``head_dim`` rows (``SelfAttention.get_query_key_value_tensors``:
    ``[ng, (np/ng + 2) * hn]``). HF keeps q_proj (heads in order), k_proj and v_proj apart.
    """
    if num_heads % num_groups:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_query_groups ({num_groups})")
    hpg = num_heads // num_groups
    block = (hpg + 2) * head_dim
    out: dict[str, list[tuple[int, int]]] = {"q": [], "k": [], "v": []}
    for g in range(num_groups):
        base = g * block
        out["q"].append((base, base + hpg * head_dim))
        out["k"].append((base + hpg * head_dim, base + (hpg + 1) * head_dim))
        out["v"].append((base + (hpg + 1) * head_dim, base + block))
    return out


def fc1_row_ranges(ffn: int) -> dict[str, list[tuple[int, int]]]:
    """Megatron's gated fc1 stacks ``[gate; up]`` (``glu``: ``act(x[..., :F]) * x[..., F:]``)."""
    return {"gate": [(0, ffn)], "up": [(ffn, 2 * ffn)]}


def interleave_qkv_order(num_heads: int, num_groups: int, head_dim: int) -> list[tuple[str, int, int]]:
    """The inverse map: Megatron's row blocks in order as (part, start, end) of the HF tensors."""
    hpg = num_heads // num_groups
    order = []
    for g in range(num_groups):
        order.append(("q", g * hpg * head_dim, (g + 1) * hpg * head_dim))
        order.append(("k", g * head_dim, (g + 1) * head_dim))
        order.append(("v", g * head_dim, (g + 1) * head_dim))
    return order


__all__ = [
    "check_weight",
    "concat_rows",
    "fc1_row_ranges",
    "interleave_qkv_order",
    "qkv_row_ranges",
    "split_groups",
    "stack_groups",
    "take_rows",
]
