"""The quantized-tensor container every backend returns and every GEMM consumes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from .formats import BLOCK, decode_packed, pack_e2m1, unpack_e2m1
from .swizzle import swizzle_scales, unswizzle_scales

GlobalScale = Literal["tensor", "row", "group"]
Tile = tuple[int, int]


@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """An NVFP4-quantized tensor of logical shape ``shape = [..., K]``.

    Attributes:
        codes: uint8 ``[..., K/2]``, two E2M1 codes per byte, element 2i in the low nibble.
        block_scales: float8_e4m3fn; ``[..., K/16]`` in the linear layout, or the flat
            128x4 swizzled layout (``layout == "swizzled"``) of the ``[rows, K/16]`` matrix.
            With 16x16 tiles the scale of a tile is repeated on its 16 rows.
        global_decode: fp32 ``S_dec``: ``[1]`` (``"tensor"``), ``[rows]`` (``"row"``, rows =
            numel / K) or ``[G]`` (``"group"``: one per leading matrix of a ``[G, R, K]`` tensor).
        shape: the logical shape.
        global_scale: ``"tensor"`` | ``"row"`` | ``"group"``.
        tile: ``(1, 16)`` or ``(16, 16)`` (2D blocks, weights).
        layout: ``"linear"`` | ``"swizzled"`` (of ``block_scales``).
        image: optional bf16 ``[..., K]`` holding ``e2m1(code) * fp32(scale)`` (global scale
            left out; exact in bf16). Kernels that emit it in the quantize pass attach it so a
            BF16 tensor-core GEMM can consume it (exact NVFP4 emulation).
        rht_seed: the sign seed if the values were random-Hadamard transformed before
            quantization (``-1``: fixed all-ones signs), ``None`` if not.
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_decode: torch.Tensor
    shape: torch.Size
    global_scale: GlobalScale = "row"
    tile: Tile = (1, BLOCK)
    layout: str = "linear"
    image: torch.Tensor | None = None
    rht_seed: int | None = None

    # ---- geometry -------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def linear_scales(self) -> torch.Tensor:
        """Block scales in the linear layout, ``[rows, K/16]``."""
        if self.layout == "linear":
            return self.block_scales.reshape(self.rows, self.k // BLOCK)
        return unswizzle_scales(self.block_scales, self.rows, self.k // BLOCK)

    def row_global_decode(self) -> torch.Tensor:
        """fp32 ``[rows]``: the global decode scale of each row."""
        g = self.global_decode
        if self.global_scale == "row":
            return g
        if self.global_scale == "tensor":
            return g.expand(self.rows)
        return g.repeat_interleave(self.rows // g.numel())

    # ---- values ---------------------------------------------------------------------------
    def image_fp32(self) -> torch.Tensor:
        """fp32 ``[rows, K]``: ``e2m1(code) * fp32(block scale)``, exact."""
        vals = decode_packed(self.codes.reshape(self.rows, self.k // 2))
        sf = self.linear_scales().to(torch.float32)
        return (vals.view(self.rows, self.k // BLOCK, BLOCK) * sf.unsqueeze(-1)).view(self.rows, self.k)

    def bf16_image(self) -> torch.Tensor:
        """bf16 ``[rows, K]`` image (the attached one if a kernel emitted it)."""
        if self.image is not None:
            return self.image.reshape(self.rows, self.k)
        return self.image_fp32().to(torch.bfloat16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``x_hat = e2m1(q) * fp32(sf) * S_dec`` (fp32, one rounding), cast to ``dtype``."""
        x = self.image_fp32() * self.row_global_decode().unsqueeze(1)
        return x.to(dtype).reshape(self.shape)

    # ---- views and layouts ----------------------------------------------------------------
    def swizzled(self) -> "NVFP4Tensor":
        if self.layout == "swizzled":
            return self
        return replace(self, block_scales=swizzle_scales(self.linear_scales()), layout="swizzled")

    def linear(self) -> "NVFP4Tensor":
        if self.layout == "linear":
            return self
        scales = self.linear_scales().reshape(*self.shape[:-1], self.k // BLOCK)
        return replace(self, block_scales=scales, layout="linear")

    def matrix(self) -> "NVFP4Tensor":
        """The same tensor seen as a 2D ``[rows, K]`` matrix (``"group"`` becomes per-row)."""
        gs, g = self.global_scale, self.global_decode
        if gs == "group":
            gs, g = "row", self.row_global_decode()
        lin = self.linear()
        return replace(
            lin,
            codes=lin.codes.reshape(self.rows, self.k // 2),
            block_scales=lin.block_scales.reshape(self.rows, self.k // BLOCK),
            global_decode=g,
            shape=torch.Size([self.rows, self.k]),
            global_scale=gs,
            image=None if lin.image is None else lin.image.reshape(self.rows, self.k),
        )

    def row_slice(self, start: int, end: int) -> "NVFP4Tensor":
        """Rows ``[start, end)`` of the 2D matrix view."""
        m = self.matrix()
        g = m.global_decode[start:end] if m.global_scale == "row" else m.global_decode
        return replace(
            m,
            codes=m.codes[start:end],
            block_scales=m.block_scales[start:end],
            global_decode=g,
            shape=torch.Size([end - start, self.k]),
            image=None if m.image is None else m.image[start:end],
        )

    def group(self, g: int) -> "NVFP4Tensor":
        """Matrix ``g`` of a ``"group"`` tensor ``[G, R, K]``, with its own tensor scale."""
        if self.global_scale != "group":
            raise ValueError("group() needs a tensor quantized with global_scale='group'")
        lin = self.linear()
        return replace(
            lin,
            codes=lin.codes[g],
            block_scales=lin.block_scales[g],
            global_decode=lin.global_decode[g : g + 1],
            shape=torch.Size(self.shape[1:]),
            global_scale="tensor",
            image=None if lin.image is None else lin.image[g],
        )

    def transpose(self) -> "NVFP4Tensor":
        """The exact quantization of ``x.T`` (of each matrix for ``"group"``); 16x16 tiles only.

        With 16x16 tiles and one global scale per matrix, an element's code and scale do not
        depend on the direction of the blocks, so the transposed operand (dgrad) is a relayout
        of the bytes, never a re-quantization.
        """
        ok = (len(self.shape) == 2 and self.global_scale == "tensor") or (
            len(self.shape) == 3 and self.global_scale == "group"
        )
        if self.tile != (BLOCK, BLOCK) or not ok:
            raise ValueError(
                "transpose() needs 16x16 tiles and a [N, K] tensor with a tensor scale "
                "(or [G, N, K] with group scales)"
            )
        *lead, n, k = self.shape
        lin = self.linear()
        codes = pack_e2m1(unpack_e2m1(lin.codes).transpose(-1, -2).contiguous())
        tile_scales = lin.block_scales.reshape(*lead, n // BLOCK, BLOCK, k // BLOCK)[..., 0, :]
        scales = tile_scales.transpose(-1, -2).repeat_interleave(BLOCK, dim=-2).contiguous()
        image = None if lin.image is None else lin.image.transpose(-1, -2)
        return replace(
            lin, codes=codes, block_scales=scales, shape=torch.Size([*lead, k, n]), image=image
        )

    # ---- autograd saving (tensors only through save_for_backward, so saved-tensor hooks see them)
    def prepare_for_saving(self) -> tuple[list[torch.Tensor], "NVFP4Tensor"]:
        """``(tensors, meta)``: the tensors (codes, block scales, global decode, the image if any)
        for ``ctx.save_for_backward`` and a tensor-free copy holding the rest, for ``ctx``."""
        tensors = [self.codes, self.block_scales, self.global_decode] + ([self.image] if self.image is not None else [])
        empty = torch.empty(0)
        return tensors, replace(self, codes=empty, block_scales=empty, global_decode=empty,
                                image=empty if self.image is not None else None)

    def restore_from_saved(self, tensors) -> "NVFP4Tensor":
        """The tensor :meth:`prepare_for_saving` flattened, from this meta and its saved tensors."""
        codes, scales, gdec, *image = tensors
        return replace(self, codes=codes, block_scales=scales, global_decode=gdec, image=image[0] if image else None)

    def __repr__(self) -> str:
        return (
            f"NVFP4Tensor(shape={tuple(self.shape)}, global_scale={self.global_scale!r}, "
            f"tile={self.tile}, layout={self.layout!r}, device={self.device}, "
            f"image={'yes' if self.image is not None else 'no'})"
        )
