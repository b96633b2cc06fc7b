"""The operand-role rule: how each operand of the three GEMMs of a linear is quantized.

One table, read by the NVFP4 linears (:mod:`.linear`, :mod:`.grouped_linear`) and by Transformer
Engine's quantizer factory (:mod:`minite_megatron.te.quantizer_factory`), so both paths quantize
every operand the same way, TP amax sync and token padding included::

    GEMM   operand  quantized     blocks        global scale      rounding      RHT  amax rows / K split under
    fprop  input    x    [T, K]   1x16          activation_scale  nearest       -    - / row
    fprop  weight   W    [N, K]   weight_tile   tensor (group)    nearest       -    column / row
    dgrad  grad     dy   [T, N]   1x16          grad_scale        grad_rounding -    - / column
    dgrad  weight   W^T  [K, N]   relayout of fprop's 16x16 W, else 1x16 tensor     column / row (amax of W)
    wgrad  grad     dy^T [N, T']  1x16          grad_scale        grad_rounding wgrad column / -
    wgrad  input    x^T  [K, T']  1x16          grad_scale        nearest       wgrad row / -

``T'``: tokens along K, each group's (expert's) tokens zero-padded to a multiple of 16 (dW
unchanged). "amax rows / K split under": the parallel mode under which the amax source's rows or
K are split across tensor-parallel ranks, so its amax is max-reduced first (:mod:`.amax_sync`).
Stochastic rounding draws one seed per quantization from :mod:`.seeds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..nvfp4.group_sizes import DeviceGroupSizes, GroupSizes
from ..nvfp4.grouped import quantize_wgrad_operand
from ..nvfp4.tensor import NVFP4Tensor
from ..recipe import Recipe
from .amax_sync import needs_sync, synced_amax
from .seeds import next_sr_seed

GEMMS = ("fprop", "dgrad", "wgrad")

# (gemm, operand) -> (blocks, global scale, rounding, RHT, transposed, rows split, K split); recipe
# fields by name ("weight_tile", "activation_scale", "grad_scale", "grad_rounding"), None = none
_TABLE = {
    ("fprop", "input"): ("1x16", "activation_scale", "nearest", False, False, None, "row"),
    ("fprop", "weight"): ("weight_tile", "tensor", "nearest", False, False, "column", "row"),
    ("dgrad", "grad"): ("1x16", "grad_scale", "grad_rounding", False, False, None, "column"),
    ("dgrad", "weight"): ("1x16", "tensor", "nearest", False, True, "column", "row"),
    ("wgrad", "grad"): ("1x16", "grad_scale", "grad_rounding", True, True, "column", None),
    ("wgrad", "input"): ("1x16", "grad_scale", "nearest", True, True, "row", None),
}


@dataclass(frozen=True)
class GEMMRole:
    """How one GEMM operand is quantized under a recipe (a row of the module docstring's table).

    ``transposed``: the quantized matrix is the source's transpose (dgrad's ``W^T``; wgrad's
    operands along tokens, each group's tokens padded to 16). ``rows_split`` / ``k_split``: the
    parallel mode (``"column"`` / ``"row"``) under which the amax source's rows / K are sharded.
    """

    gemm: str
    operand: str
    tile: tuple[int, int]
    global_scale: str
    rounding: str
    rht_seed: int | None
    transposed: bool
    rows_split: str | None
    k_split: str | None

    @property
    def relayout_of_fprop(self) -> bool:
        """dgrad's weight is an exact relayout of fprop's when that one has 16x16 tiles."""
        return (self.gemm, self.operand) == ("dgrad", "weight")


def gemm_role(recipe: Recipe, gemm: str, operand: str, *, grouped: bool = False) -> GEMMRole:
    """The rule for ``operand`` (``"input"``, ``"weight"``, ``"grad"``) of ``gemm`` (``"fprop"``,
    ``"dgrad"``, ``"wgrad"``) under ``recipe``; ``grouped``: expert weights, one global scale per
    expert. Raises ValueError for a pair the linear has no operand for (e.g. fprop's grad)."""
    try:
        blocks, scale, rounding, rht, transposed, rows, k = _TABLE[(gemm, operand)]
    except KeyError:
        raise ValueError(f"no NVFP4 operand {operand!r} in the {gemm!r} GEMM; known: {sorted(_TABLE)}") from None
    tile = recipe.weight_tile_shape if blocks == "weight_tile" else (1, 16)
    if scale == "tensor" and grouped and operand == "weight":
        scale = "group"
    return GEMMRole(
        gemm, operand, tile,
        getattr(recipe, scale) if scale in ("activation_scale", "grad_scale") else scale,
        recipe.grad_rounding if rounding == "grad_rounding" else rounding,
        recipe.wgrad_rht_seed if rht else None, transposed, rows, k,
    )


def domain_split(role: GEMMRole, parallel_mode: str | None) -> tuple[bool, bool]:
    """``(rows_sharded, k_sharded)``: is the amax source's row / K dimension of ``role`` split
    across tensor-parallel ranks under ``parallel_mode`` (``"column"``, ``"row"`` or None)?"""
    if parallel_mode is None:
        return False, False
    return role.rows_split == parallel_mode, role.k_split == parallel_mode


def quantize_role(
    role: GEMMRole,
    t: torch.Tensor,
    recipe: Recipe,
    backend,
    *,
    tp_group=None,
    parallel_mode: str | None = None,
    group_sizes: Sequence[int] | None = None,
    with_image: bool = True,
    fprop_weight: NVFP4Tensor | None = None,
    wgrad_image: bool = False,
    amax: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """The NVFP4 operand of ``role`` from its source ``t`` (``[T, K]`` tokens x features, or the
    weight ``[N, K]`` / ``[G, N, K]``): the amax max-reduced over ``tp_group`` where the role's
    domain is split under ``parallel_mode``, one SR seed where it rounds stochastically, tokens
    padded per group (``group_sizes``, default one group) for the wgrad operands. dgrad's weight
    is ``fprop_weight.transpose()`` when that has 16x16 tiles. ``with_image`` does not apply to
    the wgrad operands: they carry their BF16 image only with ``wgrad_image`` (an operand the wgrad
    GEMM reads right away, written by the quantize pass itself; else the GEMM builds the image it
    needs, e.g. from codes saved for the backward). ``amax``: the domain's fp32 amax when the caller
    already has it (a tensor scale whose domain is not split across ranks: ``dy_amaxes``' shared
    pass), instead of the quantizer's own amax pass."""
    if role.relayout_of_fprop and fprop_weight is not None and fprop_weight.tile == (16, 16):
        return fprop_weight.transpose()
    rows, k = domain_split(role, parallel_mode)
    seed = next_sr_seed(recipe.seed) if role.rounding == "stochastic" else None
    common = dict(global_scale=role.global_scale, rounding=role.rounding, seed=seed, nonfinite=recipe.nonfinite)
    if role.transposed and role.gemm == "wgrad":
        sizes = GroupSizes.of(group_sizes if group_sizes is not None else [t.shape[0]])
        on_device = isinstance(sizes, DeviceGroupSizes)  # counts left on the device: the gather always
        if ((on_device or any(s % 16 for s in sizes)) and backend.supports("quantize_wgrad_operand") is None
                and not needs_sync(role.global_scale, tp_group, rows_sharded=rows, k_sharded=False)):
            # the backend pads each group's tokens through a gather (no padded copy); same bits
            return backend.quantize_wgrad_operand(t, sizes, rht_seed=role.rht_seed, with_image=wgrad_image, amax=amax,
                                                  **common)
        if on_device:
            raise ValueError(f"quantize_role: {sizes} need the {backend.name} backend's quantize_wgrad_operand "
                             "on an amax that is not reduced across ranks (pass host sizes)")
        return quantize_wgrad_operand(
            t, sizes, rht_seed=role.rht_seed, quantize=backend.quantize, with_image=wgrad_image, **common,
            amax_fn=lambda tt: amax if amax is not None else synced_amax(
                tt, role.global_scale, tp_group, rows_sharded=rows, k_sharded=False, rht_seed=role.rht_seed),
        )
    if amax is None:
        amax = synced_amax(t, role.global_scale, tp_group, rows_sharded=rows, k_sharded=k)
    source = t.t() if role.transposed else t
    return backend.quantize(source, tile=role.tile, amax=amax, with_image=with_image, **common)
