"""Tile configuration of the Blackwell NVFP4 GEMMs, and the shape rules they impose.

Pure Python (no CUTLASS, no torch): the host-side code and the CPU tests import it freely.

One kernel serves the dense, the row-grouped (MoE fprop/dgrad) and the K-grouped (MoE wgrad)
GEMM (:mod:`._blockscaled_gemm_impl`): a CTA computes one ``128 x tile_n`` output tile with
1-SM ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`` instructions (M = 128,
N = ``tile_n``, K = 64 per instruction; four instructions per 256-wide K tile, or one per
64-wide K tile in the K-grouped variant, whose experts start at any multiple of 64). The
choice of ``tile_n`` depends on N only, never on M: a row's result does not depend on how
many rows share the call (strict mode).

On sm_103a (B300) the dense and row-grouped GEMMs use B300's K = 96 form of the same
instruction instead (``mma_k=96``, :func:`choose_mma_k`): eight MMAs per 768-wide K tile,
read from three 256-wide shared-memory buffers (:data:`K96_SCHEDULE`). Which form runs
depends on the GPU and K's kind only, never on M (batch invariant on each GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from minite_megatron.settings import settings

TILE_M = 128
"""Rows per CTA tile (one 1-SM tcgen05 MMA)."""

MMA_K = 64
"""K of one sm_100a ``kind::mxf4nvf4`` MMA instruction: K must be a multiple of it for the
K = 64 kernel."""

TILE_K = 4 * MMA_K
"""K consumed per pipeline stage (four MMA instructions)."""

TILE_N_CHOICES = (128, 256)
"""N tiles the kernel supports (multiples of 128 keep the SFB tensor-memory layout simple)."""

OUT_DTYPES = ("bfloat16", "float16", "float32")
"""Output dtypes (torch names) the epilogue can round to."""

SF_VEC = 16
"""Elements per block scale (NVFP4)."""

MMA_K_SM103 = 96
"""K of one sm_103a ``kind::mxf4nvf4`` MMA (``SM103MmaMXF4NVF4Op``; bit 31 of its instruction
descriptor, the K-size bit, set)."""

TILE_K_SM103 = 768
"""K per k-tile of the K = 96 kernel: lcm(96, 256), eight MMAs over three 256-wide buffers."""

SMEM_BUFFER_K = 256
"""FP4 elements in one 128-byte row of a shared-memory buffer (one 128B swizzle atom in K)."""

SF_TILE_K_SM103 = 192
"""K covered by one scale-factor stage of the K = 96 kernel (two MMAs; 12 scale columns)."""

K_ALIGN_SM103 = 32
"""The K = 96 kernel takes any K that is a multiple of 32 (16-byte rows for TMA): K-tile tails
are zero-filled by TMA (codes and scales), and MMAs that would start at or past K are skipped."""

MMA_K_ENV = "MINITE_BLACKWELL_MMA_K"
"""Environment override of :func:`choose_mma_k`: ``64`` runs the K = 64 kernel on sm_103a too
(a fallback and a bring-up comparison); ``96`` is valid on sm_103a only; unset = automatic."""


@dataclass(frozen=True)
class K96Mma:
    """One of the eight K = 96 MMAs of a 768-wide k-tile (all offsets static).

    Attributes:
        index: 0..7, the issue order.
        k_start: first K element (within the k-tile) it reduces over; it covers 96.
        buffer: the shared-memory buffer (0..2, 256 K elements each) holding its first element.
        chunk: the 16-byte chunk (32 elements) of that buffer's rows where it starts (0..7).
        next_buffer: the buffer its descriptor continues into once it passes chunk 7 (the
            "circular" sm_103 descriptor); equal to ``buffer`` when it does not wrap.
        sf_stage: which 192-wide scale-factor stage (0..3) holds its scales.
        sf_column: the first of its six scale columns within that stage (0 or 6).
        waits: buffers first read by this MMA (the MMA warp waits for them just before).
        releases: buffers last read by this MMA (released to the producer right after).
        loads_scales: the first MMA of its scale stage (the stage is copied to tensor memory
            just before it).
    """

    index: int
    k_start: int
    buffer: int
    chunk: int
    next_buffer: int
    sf_stage: int
    sf_column: int
    waits: tuple[int, ...]
    releases: tuple[int, ...]
    loads_scales: bool


def k96_schedule() -> tuple[K96Mma, ...]:
    """The static issue plan of one 768-wide k-tile of the K = 96 kernel (see :class:`K96Mma`).

    A K = 96 MMA reads 48 bytes of each row: MMA j starts at byte 48 j of the tile's 384, i.e.
    chunk (3 j) % 8 of buffer (3 j) // 8, and MMAs 2 and 5 run past the end of a buffer's
    128-byte rows into the next buffer. Its scales are columns 6 j .. 6 j + 5 of the tile's 48,
    i.e. stage j // 2, column 6 (j % 2)."""
    chunk_elems = SMEM_BUFFER_K // 8
    mmas = TILE_K_SM103 // MMA_K_SM103
    first_use: dict[int, int] = {}
    last_use: dict[int, int] = {}
    spans = []
    for j in range(mmas):
        start = j * MMA_K_SM103
        first_chunk, last_chunk = start // chunk_elems, (start + MMA_K_SM103 - 1) // chunk_elems
        buffers = (first_chunk // 8, last_chunk // 8)
        spans.append((start, first_chunk, buffers))
        for b in buffers:
            first_use.setdefault(b, j)
            last_use[b] = j
    plan = []
    for j, (start, first_chunk, (buffer, next_buffer)) in enumerate(spans):
        sf_stage, sf_column = divmod(start // SF_VEC, SF_TILE_K_SM103 // SF_VEC)
        plan.append(
            K96Mma(
                index=j,
                k_start=start,
                buffer=buffer,
                chunk=first_chunk % 8,
                next_buffer=next_buffer,
                sf_stage=sf_stage,
                sf_column=sf_column,
                waits=tuple(sorted(b for b, f in first_use.items() if f == j)),
                releases=tuple(sorted(b for b, last in last_use.items() if last == j)),
                loads_scales=start % SF_TILE_K_SM103 == 0,
            )
        )
    return tuple(plan)


K96_SCHEDULE = k96_schedule()
"""The plan the K = 96 kernel unrolls (static; :func:`k96_schedule`)."""


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
        mma_k: K of the MMA instruction: 64 (sm_100a and sm_103a) or 96 (sm_103a only; not
            with ``k_grouped``, whose experts start at multiples of 64).
    """

    tile_n: int = 128
    out_dtype: str = "bfloat16"
    has_bias: bool = False
    grouped: bool = False
    k_grouped: bool = False
    mma_k: int = MMA_K

    def __post_init__(self):
        if self.tile_n not in TILE_N_CHOICES:
            raise ValueError(f"tile_n must be one of {TILE_N_CHOICES}, got {self.tile_n}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype!r}")
        if self.grouped and self.k_grouped:
            raise ValueError("a GEMM is grouped along rows (grouped) or along K (k_grouped), not both")
        if self.k_grouped and self.has_bias:
            raise ValueError("the K-grouped (wgrad) GEMM has no bias")
        if self.mma_k not in (MMA_K, MMA_K_SM103):
            raise ValueError(f"mma_k must be {MMA_K} or {MMA_K_SM103}, got {self.mma_k}")
        if self.mma_k == MMA_K_SM103 and self.k_grouped:
            raise ValueError("the K-grouped (wgrad) GEMM runs the K = 64 MMA only (experts start at multiples of 64)")

    @property
    def tile_k(self) -> int:
        """K per k-tile: 256 (four K = 64 MMAs), 64 when experts split K (they start at
        multiples of 64), 768 for the K = 96 kernel (eight MMAs over three 256-wide buffers)."""
        if self.mma_k == MMA_K_SM103:
            return TILE_K_SM103
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
        if self.mma_k != MMA_K:
            parts.append(f"k{self.mma_k}")
        return "_".join(parts)


def choose_tile_n(n: int) -> int:
    """The N tile for an output with ``n`` columns: 256 once there are at least two such
    tiles' worth of columns, else 128. Depends on N (the weight) only, never on M."""
    return 256 if n >= 512 else 128


def choose_mma_k(arch: str | None, k_grouped: bool = False) -> int:
    """The MMA K of the kernel that runs on ``arch``: 96 on sm_103a (B300) for the dense and
    row-grouped GEMMs, 64 otherwise (sm_100a, the K-grouped wgrad, or no Blackwell device).
    ``MINITE_BLACKWELL_MMA_K=64`` forces the K = 64 kernel on sm_103a; ``=96`` elsewhere is an
    error (only sm_103a has the K = 96 MMA). Never depends on M."""
    forced = settings().blackwell_mma_k  # None, MMA_K or MMA_K_SM103 (settings checks the value)
    if forced == MMA_K_SM103 and arch != "sm_103a" and arch is not None:
        raise ValueError(f"{MMA_K_ENV}={forced}: the K = 96 MMA exists on sm_103a (B300) only, this GPU is {arch}")
    if k_grouped or arch != "sm_103a" or forced == MMA_K:
        return MMA_K
    return MMA_K_SM103


def check_k(k: int, mma_k: int = MMA_K) -> None:
    """Raise ``ValueError`` unless the kernel with MMA K ``mma_k`` takes this K.

    K = 64 kernel: K a positive multiple of 64 (the packed FP4 rows are read by TMA, 16-byte
    aligned, and consumed 64 elements per MMA). K = 96 kernel (sm_103a): K a positive multiple
    of 32 (16-byte rows); it needs no multiple of 96 or 768, since the tail of the last
    768-wide k-tile is zero-filled by TMA and its MMAs past K are skipped.
    """
    multiple = K_ALIGN_SM103 if mma_k == MMA_K_SM103 else MMA_K
    if k <= 0 or k % multiple:
        if mma_k == MMA_K_SM103:
            why = f"a positive multiple of {K_ALIGN_SM103} (16-byte rows for the TMA of sm_103a's K = 96 kernel)"
        else:
            why = (
                f"a positive multiple of {MMA_K} (the K of one tcgen05 kind::mxf4nvf4 MMA; sm_103a's "
                f"K = 96 kernel also takes multiples of {K_ALIGN_SM103})"
            )
        raise ValueError(
            f"blackwell NVFP4 GEMM: K={k} must be {why}; use the 'triton' or 'reference' backend for other K"
        )
