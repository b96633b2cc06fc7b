"""Tile configuration of the Blackwell NVFP4 GEMMs, and the shape rules they impose.

Pure Python (no CUTLASS, no torch): the host-side code and the CPU tests import it freely.

One kernel serves the dense, the row-grouped (MoE fprop/dgrad) and the K-grouped (MoE wgrad)
GEMM (:mod:`._blockscaled_gemm_impl`): a CTA computes one ``128 x tile_n`` output tile with
1-SM ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`` instructions (M = 128,
N = ``tile_n``, K = 64 per instruction; four instructions per 256-wide K tile, or one per
64-wide K tile in the K-grouped variant, whose experts start at any multiple of 64). The
choice of ``tile_n`` depends on N only, never on M: a row's result does not depend on how
many rows share the call (strict mode).
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_M = 128
"""Rows per CTA tile (one 1-SM tcgen05 MMA)."""

MMA_K = 64
"""K of one ``kind::mxf4nvf4`` MMA instruction: every K must be a multiple of it."""

TILE_K = 4 * MMA_K
"""K consumed per pipeline stage (four MMA instructions)."""

TILE_N_CHOICES = (128, 256)
"""N tiles the kernel supports (multiples of 128 keep the SFB tensor-memory layout simple)."""

OUT_DTYPES = ("bfloat16", "float16", "float32")
"""Output dtypes (torch names) the epilogue can round to."""

SF_VEC = 16
"""Elements per block scale (NVFP4)."""


@dataclass(frozen=True)
class GemmConfig:
    """Compile-time configuration of one kernel instance (one cubin per distinct value).

    Attributes:
        tile_n: N of the CTA tile and of the MMA instruction (128 or 256).
        out_dtype: torch dtype name of the output (``"bfloat16"``, ``"float16"``, ``"float32"``).
        has_bias: the epilogue adds an fp32 bias after the scale.
        grouped: rows are split into groups by a device tensor of offsets and group g is
            multiplied by ``b[g]`` (MoE fprop/dgrad); otherwise one group covering every row.
        k_grouped: the reduction dimension is split into groups by a device tensor of offsets
            (in units of 64) and group g writes ``out[g]`` (MoE wgrad: K = tokens).
    """

    tile_n: int = 128
    out_dtype: str = "bfloat16"
    has_bias: bool = False
    grouped: bool = False
    k_grouped: bool = False

    def __post_init__(self):
        if self.tile_n not in TILE_N_CHOICES:
            raise ValueError(f"tile_n must be one of {TILE_N_CHOICES}, got {self.tile_n}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype!r}")
        if self.grouped and self.k_grouped:
            raise ValueError("a GEMM is grouped along rows (grouped) or along K (k_grouped), not both")
        if self.k_grouped and self.has_bias:
            raise ValueError("the K-grouped (wgrad) GEMM has no bias")

    @property
    def tile_k(self) -> int:
        """K per pipeline stage: 64 when experts split K (they start at multiples of 64)."""
        return MMA_K if self.k_grouped else TILE_K

    @property
    def name(self) -> str:
        parts = [f"n{self.tile_n}", self.out_dtype]
        if self.has_bias:
            parts.append("bias")
        if self.grouped:
            parts.append("grouped")
        if self.k_grouped:
            parts.append("kgrouped")
        return "_".join(parts)


def choose_tile_n(n: int) -> int:
    """The N tile for an output with ``n`` columns: 256 once there are at least two such
    tiles' worth of columns, else 128. Depends on N (the weight) only, never on M."""
    return 256 if n >= 512 else 128


def check_k(k: int) -> None:
    """Raise ``ValueError`` unless K is a positive multiple of the MMA K (64).

    The packed FP4 operands are read by TMA (rows must be 16-byte aligned: K % 32 == 0)
    and consumed 64 elements per MMA instruction; K % 64 == 0 covers both.
    """
    if k <= 0 or k % MMA_K:
        raise ValueError(
            f"blackwell NVFP4 GEMM: K={k} must be a positive multiple of {MMA_K} (the K of one "
            f"tcgen05 kind::mxf4nvf4 MMA); use the 'triton' or 'reference' backend for other K"
        )
