"""The NVFP4 block-scaled GEMM kernel for Blackwell (sm_100a / sm_103a), in the CuTe DSL.

Private and heavy: imported lazily by :mod:`.gemm`, :mod:`.grouped_gemm` and
:mod:`.grouped_wgrad_gemm` (it imports CUTLASS). One kernel serves the three ops;
:class:`~.tiles.GemmConfig` picks the variant.

What one launch computes (row groups ``G``; the dense GEMM is ``G == 1``)::

    for every group g and every row m with offs[g] <= m < offs[g + 1]:
        acc[m, n]  = sum_k e2m1(A[m, k]) * sfa[m, k // 16] * e2m1(B[g, n, k]) * sfb[g, n, k // 16]
        alpha      = fp32(sa[m] * sb[g, n])                      (mul.rn.f32)
        out[m, n]  = round_out(fp32(acc * alpha) (+ bias[g, n]))  (mul.rn.f32, add.rn.f32, cvt.rn)

Operands (all device pointers; shapes are runtime values):
    A    uint8 ``[M, K/2]`` E2M1 codes, two per byte, element 2i in the low nibble (K-major).
    B    uint8 ``[G, N, K/2]`` (the dense GEMM: ``[N, K/2]``), K-major.
    SFA  float8_e4m3fn, the 128x4 swizzled layout of the ``[M, K/16]`` scale matrix.
    SFB  float8_e4m3fn, ``G`` swizzled ``[N, K/16]`` matrices back to back.
    sa   fp32 ``[M]`` (stride 1); sb fp32 ``[N, G]`` with runtime strides (0 broadcasts).
    bias fp32 ``[G, N]`` (contiguous), read only when ``config.has_bias``.
    offs int32 ``[G + 1]`` group row offsets (``offs[0] == 0``, ``offs[G] == M``, non-
         decreasing), read only when ``config.grouped``.
    sched int32 ``[G + 1]`` the (tile, expert) pair schedule of the grouped variant
         (``grouped_gemm.pair_schedule``), read only when ``config.grouped``.
    out  ``[M, N]`` row-major in ``config.out_dtype``.

K-grouped variant (``config.k_grouped``, MoE wgrad): A ``[M, K/2]``, B ``[N, K/2]``, and
``offs`` splits K instead, in units of 64: CTA z = g reduces over k-tiles
``[offs[g], offs[g+1])`` (64 wide) and writes ``out[g]`` of ``[G, M, N]``; sb is ``[N]``
(per row or broadcast); a group without tokens stores exact zeros.

Kernel design (one CTA per 128 x tile_n output tile, 6 warps, warp specialized):
    warp 5     TMA producer: A, B, SFA, SFB k-tiles (256 wide; 64 when K-grouped) into a
               multi-stage smem ring.
    warp 4     MMA issuer: copies the k-tile's scales smem -> tensor memory (``tcgen05.cp``),
               then ``tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16`` (K = 64
               each, four per 256-wide k-tile) into an fp32 accumulator in tensor memory.
    warps 0-3  epilogue: ``tcgen05.ld`` (32 lanes x 32 bit: thread t owns row t of the tile),
               the contract's epilogue in fp32 with explicitly rounded ``mul.rn.f32`` /
               ``add.rn.f32`` (no FMA contraction may merge the scale and the bias), one
               rounding to the output dtype; each warp transposes its 32 x 32 subtile through
               shared memory and stores whole row segments (coalesced, predicated).
Grouped (MoE) rows: M tiles are aligned to the whole row range, so a tile may straddle
experts. The grid has one CTA per (tile, expert) pair (``ceil(M / 128) + G - 1`` bounds
their number; spare CTAs do nothing): CTA p finds its pair by a binary search in ``sched``
(:func:`pair_of_cta`) and runs one *pass* (the full K loop with ``B[g]``), storing only its
expert's rows of its tile. A tile straddling k experts is thus reduced by k CTAs side by
side, not by k passes in a row in one CTA. No host sync, no padding of the token dimension,
one launch.

sm_103a K = 96 variant (``config.mma_k == 96``; dense and row-grouped only), 7 warps:
    warp 5     TMA: A and B in 256-wide buffers (each one K = 64 stage: same boxes, same layout),
               three per 768-wide k-tile.
    warp 6     TMA: the scales, in their own ring of 192-wide stages (sm_103 scale smem layouts).
    warp 4     per k-tile, the eight ``SM103MmaMXF4NVF4Op`` MMAs of :data:`.tiles.K96_SCHEDULE`
               (K = 96 each; bit 31 of the instruction descriptor): MMA j reads bytes 48 j ..
               48 j + 47 of each row of the tile's 384 through a byte view of the buffers and
               sm_103 circular descriptors (MMAs 2 and 5 continue into the next buffer); a
               scale stage is copied to tensor memory before its first of two MMAs, whose
               scales start at column 0 or 6 of it. MMAs starting at or past K are skipped
               (:func:`k96_issues`); the buffers past K are zero-filled by TMA.
    warps 0-3  the same epilogue.
K rule: a multiple of 32 (16-byte TMA rows). Global layouts, scales included, are those of the
K = 64 kernel.

Tail handling: TMA zero-fills A/B/scale reads beyond M, N, K; the swizzled scale layout is
padded to 128 rows and 4 columns (zeros), so padded K contributes exact zeros; stores are
predicated on ``m < M``, ``n < N`` and the pass's rows (:func:`stores_element`).

Never run on hardware here (no Blackwell GPU was available); compiled and PTX-checked only.
"""

from __future__ import annotations

import functools
from typing import Tuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.runtime import make_ptr
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator, TmemAllocator, get_smem_capacity_in_bytes
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .tiles import (
    K96_SCHEDULE,
    K_ALIGN_SM103,
    MMA_K,
    MMA_K_SM103,
    SF_TILE_K_SM103,
    SF_VEC,
    SMEM_BUFFER_K,
    TILE_K_SM103,
    TILE_M,
    GemmConfig,
)

_OUT_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
}

_EPI_N = 32
"""Accumulator columns the epilogue loads per ``tcgen05.ld`` (32 lanes x 32 bit x 32)."""


# ---------------------------------------------------------------------------------------------
# Explicitly rounded fp32 arithmetic: PTX ``mul.rn`` / ``add.rn`` are never contracted into an
# FMA by ptxas (plain ``mul.f32`` + ``add.f32`` may be), which the contract's epilogue needs.
# ---------------------------------------------------------------------------------------------
@dsl_user_op
def mul_rn_f32(a, b, *, loc=None, ip=None) -> cutlass.Float32:
    """fp32 ``a * b`` rounded to nearest even, as its own instruction."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(a).ir_value(loc=loc, ip=ip), cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
            "mul.rn.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def add_rn_f32(a, b, *, loc=None, ip=None) -> cutlass.Float32:
    """fp32 ``a + b`` rounded to nearest even, as its own instruction."""
    return cutlass.Float32(
        llvm.inline_asm(
            T.f32(),
            [cutlass.Float32(a).ir_value(loc=loc, ip=ip), cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
            "add.rn.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def pair_of_cta(mSched: cute.Tensor, mOffs: cute.Tensor, num_groups: cutlass.Int32, p: cutlass.Int32):
    """(group, m_tile, has_pair): the (128-row tile, expert) pair that grouped CTA ``p`` runs.

    A grouped GEMM runs one CTA per (tile, expert) pair, not one per tile: a tile straddling
    k experts is split over k CTAs that each reduce the full K once, instead of one CTA
    running k full-K passes one after another. ``mSched`` (int32 ``[G + 1]``, from
    :func:`minite_kernels.cute.grouped_gemm.pair_schedule`) holds the first pair of each
    expert, ``sched[G]`` the number of pairs; pairs are numbered expert by expert, tile by
    tile. ``group`` is the largest g with ``sched[g] <= p`` (binary search; an empty expert
    owns no pair, so it is never chosen), and its pairs cover tiles
    ``offs[g] // 128, offs[g] // 128 + 1, ...``. CTAs with ``p >= sched[G]`` (the grid is an
    upper bound, ``ceil(M / 128) + G - 1``) have no pair and do nothing. Device code; the CPU
    tests run this same function on the host.
    """
    lo = cutlass.Int32(0)
    hi = num_groups - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mSched[mid] <= p:
            lo = mid
        else:
            hi = mid - 1
    has_pair = cutlass.Int32(0)
    if p < mSched[num_groups]:
        has_pair = cutlass.Int32(1)
    m_tile = mOffs[lo] // TILE_M + (p - mSched[lo])
    return lo, m_tile * has_pair, has_pair


@cute.jit
def stores_element(row, col, rows_lo, rows_hi, m, n):
    """Whether the epilogue writes output element (row, col): inside the pass's rows, inside
    the output (``row < m`` even when bad offsets claim more rows), inside N."""
    return (row >= rows_lo) & (row < rows_hi) & (row < m) & (col < n)


@cute.jit
def pass_extent(
    mOffs: cute.Tensor,
    gi: cutlass.Int32,
    m: cutlass.Int32,
    k_tiles: cutlass.Int32,
    grouped: cutlass.Constexpr,
    k_grouped: cutlass.Constexpr,
):
    """(rows_lo, rows_hi, kt_lo, kt_hi): the rows a pass for group ``gi`` stores and the k-tiles
    it reduces over (all rows / all k-tiles unless grouped that way). A pass runs only when
    both ranges are non-empty. Device code; the CPU tests run it on the host."""
    rows_lo = cutlass.Int32(0)
    rows_hi = m
    kt_lo = cutlass.Int32(0)
    kt_hi = k_tiles
    if cutlass.const_expr(grouped):
        rows_lo = mOffs[gi]
        rows_hi = mOffs[gi + 1]
    if cutlass.const_expr(k_grouped):
        kt_lo = mOffs[gi]
        kt_hi = mOffs[gi + 1]
    return rows_lo, rows_hi, kt_lo, kt_hi


@cute.jit
def k96_tiles(k: cutlass.Int32):
    """768-wide k-tiles of the K = 96 kernel for a reduction of ``k``: ``ceil(k / 768)``; TMA
    zero-fills the codes and scales of the last tile past K. Device code; the CPU tests run it
    on the host."""
    return (k + TILE_K_SM103 - 1) // TILE_K_SM103


@cute.jit
def k96_issues(kt: cutlass.Int32, k_start: cutlass.Constexpr, k: cutlass.Int32):
    """Whether the K = 96 MMA of k-tile ``kt`` that starts ``k_start`` elements into it is
    issued: iff it starts before K. An MMA reaching past K reads zeros there (TMA fill); one
    starting at or past K would add only zeros and is skipped. The first MMA of every k-tile
    starts before K. Device code; the CPU tests run it on the host."""
    return kt * TILE_K_SM103 + k_start < k


def epilogue_partition(tiled_mma, tCtAcc, c_shape, tile_mn, m_tile, n_tile, tidx):
    """The epilogue's view of one output tile, split into 128 x 32 subtiles.

    Returns ``(t2r, tTR_tAcc, tTR_cC)``: the 32 x 32-bit (x32) TMEM-load copy, thread
    ``tidx``'s accumulator fragments ``(T2R, T2R_M, T2R_N, EPI_M, EPI_N, STAGE)`` and the
    global ``(row, col)`` of each of its registers ``(T2R, T2R_M, T2R_N, EPI_M, EPI_N)``.
    Thread t gets row ``128 * m_tile + t`` and, in subtile s, register i holds column
    ``tile_n * n_tile + 32 * s + i`` (the staging transpose relies on it; a CPU test checks
    it by running this function on the host).
    """
    epi_tile = (TILE_M, _EPI_N)
    tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0, None)], epi_tile)
    t2r = tcgen05.make_tmem_copy(
        cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), cutlass.Float32),
        tAcc_epi[(None, None, 0, 0, 0)],
    )
    thr_t2r = t2r.get_slice(tidx)
    cC = cute.local_tile(cute.make_identity_tensor(c_shape), tile_mn, (m_tile, n_tile))
    cC_epi = cute.flat_divide(tiled_mma.get_slice(0).partition_C(cC)[((None, None), 0, 0)], epi_tile)
    return t2r, thr_t2r.partition_S(tAcc_epi), thr_t2r.partition_D(cC_epi)


def k96_byte_view_layout(rows: int, num_stages: int):
    """The K = 96 MMAs' view of a ring of A or B buffers: bytes ``((rows, 16), 1, 8, stages)``
    (16-byte chunks of 128-byte rows), K-major with the 128B swizzle: the same memory, byte
    for byte, as the K = 64 kernel's FP4 layout of the ring that TMA fills (a CPU test checks
    it). Slicing chunk c of a stage gives the start of a K = 96 MMA's operand."""
    return tcgen05.tile_to_mma_shape(
        tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, cutlass.Uint8),
        ((rows, 16), 1, 8, num_stages),
        order=(0, 1, 2),
    )


def sf_tma_box(sf_smem_one: cute.Layout) -> cute.Layout:
    """One stage of the sm_103 scale-factor smem layout ``((atom_mn, atom_k), 1, k_atoms)`` seen
    as the 2D (rows, K) box a tiled TMA copy fills: ``(rows, (16, 4, k_atoms))``."""
    rows = cute.coalesce(cute.append(sf_smem_one[0][0], sf_smem_one[1]))
    cols = cute.coalesce(cute.append(sf_smem_one[0][1], sf_smem_one[2]))
    return cute.append(cute.group_modes(rows, 0, cute.rank(rows)), cols)


def sf_column_view(rows: int) -> cute.Layout:
    """A 192-wide scale stage of ``rows`` rows seen one scale column (16 K elements) at a time:
    ``((((32, 4), rows / 128), (16, 1)), 1, 12)``. Mapped to tensor memory by
    ``make_tmem_layout_sfa/sfb``, column c's address is where an MMA whose scales start at
    column c of the stage reads them (c = 0 or 6: the tensor-memory column plus the byte
    offset the instruction descriptor's scale-factor ID selects)."""
    return cute.make_layout(((((32, 4), rows // 128), (SF_VEC, 1)), 1, SF_TILE_K_SM103 // SF_VEC))


def k96_mma(mma96, acc, a_cur, a_next, b_cur, b_next) -> None:
    """One K = 96 ``tcgen05.mma`` into ``acc``: A and B described by sm_103 circular smem
    descriptors that start at ``*_cur`` (a chunk of one buffer) and continue at ``*_next``
    (the start of the following buffer) past the end of the 128-byte rows. The scale
    addresses and the accumulate flag are fields of ``mma96`` set by the caller."""
    a_desc = tcgen05.make_umma_smem_desc(a_cur.iterator, a_cur.layout, "k", next_src=a_next.iterator)
    b_desc = tcgen05.make_umma_smem_desc(b_cur.iterator, b_cur.layout, "k", next_src=b_next.iterator)
    one = cute.make_layout(1, stride=0)
    cute.mma_atom_call(mma96, acc, cute.make_tensor(a_desc, one), cute.make_tensor(b_desc, one), acc)


class Nvfp4BlockScaledGemmKernel:
    """NVFP4 x NVFP4 -> bf16/fp16/fp32 GEMM with the contract's epilogue (see module docstring).

    Heuristics fixed at construction (never depending on M): CTA tile ``128 x tile_n x tile_k``
    (``tile_k`` 256, or 64 when K is grouped), 1-SM MMA, no cluster, as many smem stages as
    fit beside the epilogue's staging tiles (at most 16), two accumulator stages when the
    tensor memory holds them (``tile_n == 128``; every CTA now runs at most one pass, so the
    second is idle until a persistent schedule overlaps tiles). Tensor memory: accumulators, then one k-tile of SFA and of SFB columns.
    ``config.mma_k == 96`` (sm_103a): 768-wide k-tiles of eight K = 96 MMAs, a second TMA warp
    and ring for the scales (see the module docstring and :meth:`_setup_k96`).
    """

    arch = "sm_100"
    epilogue_warps = (0, 1, 2, 3)
    mma_warp = 4
    tma_warp = 5
    sf_warp = 6
    """The K = 96 kernel's second TMA warp (scale factors; its own pipeline of 192-wide stages)."""

    def __init__(self, config: GemmConfig):
        self.config = config
        self.tile_n = config.tile_n
        self.c_dtype = _OUT_DTYPES[config.out_dtype]
        self.has_bias = config.has_bias
        self.grouped = config.grouped
        self.k_grouped = config.k_grouped
        self.k96 = config.mma_k == MMA_K_SM103
        self.threads_per_cta = 32 * (7 if self.k96 else 6)
        self.ab_dtype = cutlass.Float4E2M1FN
        self.sf_dtype = cutlass.Float8E4M3FN
        self.acc_dtype = cutlass.Float32
        self.mma_inst_mn = (TILE_M, self.tile_n)
        self.num_acc_stage = 2 if self.tile_n == 128 else 1
        self.smem_capacity = get_smem_capacity_in_bytes(self.arch)
        self.num_tmem_alloc_cols = cute.arch.get_max_tmem_alloc_cols(self.arch)
        self.epilogue_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(self.epilogue_warps))
        self.tmem_alloc_sync = pipeline.NamedBarrier(
            barrier_id=2, num_threads=32 * (1 + len(self.epilogue_warps))
        )

    # ---- heuristics / static layouts ----------------------------------------------------------
    def _make_tiled_mma(self):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            self.sf_dtype,
            SF_VEC,
            tcgen05.CtaGroup.ONE,
            self.mma_inst_mn,
        )

    def _make_tiled_mma_k96(self):
        """sm_103a's K = 96 block-scaled MMA (``SM103MmaMXF4NVF4Op``, UE4M3 scales per 16)."""
        return sm100_utils.sm103_make_blockscaled_trivial_tiled_mma(
            self.sf_dtype, SF_VEC, tcgen05.CtaGroup.ONE, self.mma_inst_mn
        )

    def _setup(self, tiled_mma, mma96=None):
        if self.k96:
            self._setup_k96(tiled_mma, mma96)
            return
        mma_k = cute.size(tiled_mma.shape_mnk, mode=[2])
        assert mma_k == MMA_K, f"unexpected MMA K {mma_k}"
        self.kblocks_per_tile = self.config.tile_k // mma_k
        self.mma_tiler = (TILE_M, self.tile_n, mma_k * self.kblocks_per_tile)

        def staged(num_stages):
            return (
                sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, num_stages),
                sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, num_stages),
                blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, SF_VEC, num_stages),
                blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, SF_VEC, num_stages),
            )

        a1, b1, sfa1, sfb1 = staged(1)
        stage_bytes = (
            cute.size_in_bytes(self.ab_dtype, a1)
            + cute.size_in_bytes(self.ab_dtype, b1)
            + cute.size_in_bytes(self.sf_dtype, sfa1)
            + cute.size_in_bytes(self.sf_dtype, sfb1)
        )
        reserved = self._reserve_epilogue_staging()
        self.num_ab_stage = min((self.smem_capacity - reserved) // stage_bytes, 16)
        self.num_sf_stage = 0  # the scales travel with A and B
        (
            self.a_smem_layout,
            self.b_smem_layout,
            self.sfa_smem_layout,
            self.sfb_smem_layout,
        ) = staged(self.num_ab_stage)

        # Tensor memory: accumulator stages, then the SFA and SFB columns of one k-tile.
        sf_atom_rows = 32
        self.num_acc_cols = self.tile_n * self.num_acc_stage
        self.num_sfa_cols = (TILE_M // sf_atom_rows) * self.kblocks_per_tile
        self.num_sfb_cols = (self.tile_n // sf_atom_rows) * self.kblocks_per_tile
        assert self.num_acc_cols + self.num_sfa_cols + self.num_sfb_cols <= self.num_tmem_alloc_cols

    def _reserve_epilogue_staging(self) -> int:
        """Sets the epilogue's staging geometry; returns the smem bytes kept from the ring.

        Per epilogue warp, a 32 x 32 tile of outputs (rows padded so that the row-wise writes
        and the column-wise reads are both free of bank conflicts)."""
        elem_bytes = self.c_dtype.width // 8
        self.stage_pitch = _EPI_N + 4 // elem_bytes
        self.staging_elems = len(self.epilogue_warps) * 32 * self.stage_pitch
        staging_bytes = -(-self.staging_elems * elem_bytes // 1024) * 1024
        return 1024 + staging_bytes  # mbarriers, tensor-memory pointer, alignment, staging

    def _setup_k96(self, tiled_mma, mma96):
        """Static layouts of the sm_103a K = 96 kernel.

        A and B: a ring of 256-wide buffers, each exactly one stage of the K = 64 kernel (same
        TMA boxes, same 128B-swizzled K-major smem layout, built with the K = 64 MMA's
        helpers); the K = 96 MMAs read them through a byte view of the same memory
        (``((rows, 16 bytes), 1, 8 chunks)``, :func:`k96_byte_view_layout`) with circular
        descriptors, three buffers per 768-wide k-tile (:data:`.tiles.K96_SCHEDULE`).
        Scales: their own ring of 192-wide stages in the sm_103 block-scaled smem layout
        (``blockscaled_layout.sm103_make_smem_layout_sfa/sfb``), filled by a second TMA warp;
        one stage serves two MMAs and is copied to tensor memory before the first.
        """
        mma_k = cute.size(mma96.shape_mnk, mode=[2])
        assert mma_k == MMA_K_SM103, f"unexpected MMA K {mma_k}"
        self.kblocks_per_tile = SMEM_BUFFER_K // MMA_K  # K = 64 partitions of one buffer (layouts only)
        self.mma_tiler = (TILE_M, self.tile_n, SMEM_BUFFER_K)  # one A/B buffer
        self.sf_tiler = (TILE_M, self.tile_n, TILE_K_SM103)

        def ab_staged(num_stages):
            return (
                sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, num_stages),
                sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, num_stages),
            )

        def sf_staged(num_stages):
            return (
                blockscaled_utils.sm103_make_smem_layout_sfa(mma96, self.sf_tiler, SF_VEC, num_stages),
                blockscaled_utils.sm103_make_smem_layout_sfb(mma96, self.sf_tiler, SF_VEC, num_stages),
            )

        a1, b1 = ab_staged(1)
        sfa1, sfb1 = sf_staged(1)
        ab_bytes = cute.size_in_bytes(self.ab_dtype, a1) + cute.size_in_bytes(self.ab_dtype, b1)
        sf_bytes = cute.size_in_bytes(self.sf_dtype, sfa1) + cute.size_in_bytes(self.sf_dtype, sfb1)
        reserved = self._reserve_epilogue_staging()
        # at least two scale stages (the copy of one overlaps the TMA of the next), then as many
        # A/B buffers as fit (an MMA may read two at once: at least two), then the rest to scales
        self.num_ab_stage = min((self.smem_capacity - reserved - 2 * sf_bytes) // ab_bytes, 16)
        self.num_sf_stage = min((self.smem_capacity - reserved - self.num_ab_stage * ab_bytes) // sf_bytes, 8)
        assert self.num_ab_stage >= 2 and self.num_sf_stage >= 2, (self.num_ab_stage, self.num_sf_stage)
        self.a_smem_layout, self.b_smem_layout = ab_staged(self.num_ab_stage)
        self.sfa_smem_layout, self.sfb_smem_layout = sf_staged(self.num_sf_stage)
        self.a_byte_layout = k96_byte_view_layout(TILE_M, self.num_ab_stage)
        self.b_byte_layout = k96_byte_view_layout(self.tile_n, self.num_ab_stage)

        # Tensor memory: accumulators, then one scale stage of SFA and of SFB (4 columns per
        # 32 x 4 scale atom: 12 for 128 rows x 12 scale columns).
        self.num_acc_cols = self.tile_n * self.num_acc_stage
        self.num_sfa_cols = (TILE_M // 32) * (SF_TILE_K_SM103 // (4 * SF_VEC))
        self.num_sfb_cols = (self.tile_n // 32) * (SF_TILE_K_SM103 // (4 * SF_VEC))
        assert self.num_acc_cols + self.num_sfa_cols + self.num_sfb_cols <= self.num_tmem_alloc_cols

    @staticmethod
    def _cluster_layout_vmnk(tiled_mma):
        """A 1x1x1 cluster seen as (atom thread, M, N, K) (built where used: host and device
        values must not cross the launch boundary)."""
        return cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))

    # ---- launch ---------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        sa_ptr: cute.Pointer,
        sb_ptr: cute.Pointer,
        bias_ptr: cute.Pointer,
        offs_ptr: cute.Pointer,
        sched_ptr: cute.Pointer,
        mnkg: Tuple[cutlass.Int32, cutlass.Int32, cutlass.Int32, cutlass.Int32],
        sb_strides: Tuple[cutlass.Int32, cutlass.Int32],
        stream: cuda.CUstream,
    ):
        m, n, k, g = mnkg
        tiled_mma = self._make_tiled_mma()
        mma96 = self._make_tiled_mma_k96() if cutlass.const_expr(self.k96) else None
        self._setup(tiled_mma, mma96)
        k_align = K_ALIGN_SM103 if cutlass.const_expr(self.k96) else MMA_K

        # Global tensors, K-major. A: (M, K, 1); B: (N, K, G) when rows are grouped, else
        # (N, K, 1); C: (M, N, G) when K is grouped (one output matrix per group), else (M, N, 1).
        b_batch = g if cutlass.const_expr(self.grouped) else 1
        c_batch = g if cutlass.const_expr(self.k_grouped) else 1
        mA = cute.make_tensor(a_ptr, cute.make_ordered_layout((m, cute.assume(k, k_align), 1), order=(1, 0, 2)))
        mB = cute.make_tensor(b_ptr, cute.make_ordered_layout((n, cute.assume(k, k_align), b_batch), order=(1, 0, 2)))
        # The swizzled scale layout is CUTLASS's block-scaled atom ((32, 4), (16, 4)) tiled
        # over (rows, K) with K tiles fastest: byte (r % 32) * 16 + (r // 32) * 4 + c per atom.
        mSFA = cute.make_tensor(sfa_ptr, blockscaled_utils.tile_atom_to_shape_SF(mA.shape, SF_VEC))
        mSFB = cute.make_tensor(sfb_ptr, blockscaled_utils.tile_atom_to_shape_SF(mB.shape, SF_VEC))
        mC = cute.make_tensor(c_ptr, cute.make_ordered_layout((m, n, c_batch), order=(1, 0, 2)))
        mSA = cute.make_tensor(sa_ptr, cute.make_layout(m))
        mSB = cute.make_tensor(sb_ptr, cute.make_layout((n, g), stride=sb_strides))
        mBias = cute.make_tensor(bias_ptr, cute.make_layout((n, g), stride=(1, n)))
        mOffs = cute.make_tensor(offs_ptr, cute.make_layout(g + 1))
        mSched = cute.make_tensor(sched_ptr, cute.make_layout(g + 1))

        # TMA loads (no cluster, no multicast).
        tma_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        cluster_shape = self._cluster_layout_vmnk(tiled_mma).shape
        a_smem_one = cute.slice_(self.a_smem_layout, (None, None, None, 0))
        b_smem_one = cute.slice_(self.b_smem_layout, (None, None, None, 0))
        sfa_smem_one = cute.slice_(self.sfa_smem_layout, (None, None, None, 0))
        sfb_smem_one = cute.slice_(self.sfb_smem_layout, (None, None, None, 0))
        tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
            tma_op, mA, a_smem_one, self.mma_tiler, tiled_mma, cluster_shape
        )
        tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op, mB, b_smem_one, self.mma_tiler, tiled_mma, cluster_shape
        )
        ab_bytes = cute.size_in_bytes(self.ab_dtype, a_smem_one) + cute.size_in_bytes(self.ab_dtype, b_smem_one)
        sf_bytes = cute.size_in_bytes(self.sf_dtype, sfa_smem_one) + cute.size_in_bytes(self.sf_dtype, sfb_smem_one)
        if cutlass.const_expr(self.k96):
            # The scales' own ring (192-wide stages in the sm_103 layout): plain tiled TMA boxes
            # of (rows, 192) over the same swizzled global layout as the K = 64 kernel's.
            tma_atom_sfa, tma_sfa = cpasync.make_tiled_tma_atom(
                tma_op, mSFA, sf_tma_box(sfa_smem_one), (TILE_M, SF_TILE_K_SM103), internal_type=cutlass.Uint8
            )
            tma_atom_sfb, tma_sfb = cpasync.make_tiled_tma_atom(
                tma_op, mSFB, sf_tma_box(sfb_smem_one), (self.tile_n, SF_TILE_K_SM103), internal_type=cutlass.Uint8
            )
            self.tma_bytes_per_stage = ab_bytes
            self.sf_bytes_per_stage = sf_bytes
        else:
            tma_atom_sfa, tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
                tma_op, mSFA, sfa_smem_one, self.mma_tiler, tiled_mma, cluster_shape, internal_type=cutlass.Int16
            )
            tma_atom_sfb, tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
                tma_op, mSFB, sfb_smem_one, self.mma_tiler, tiled_mma, cluster_shape, internal_type=cutlass.Int16
            )
            self.tma_bytes_per_stage = ab_bytes + sf_bytes
            self.sf_bytes_per_stage = 0

        align = 1024

        @cute.struct
        class SharedStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage]
            ab_empty: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage]
            acc_full: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage]
            acc_empty: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage]
            sf_full: cute.struct.MemRange[cutlass.Int64, max(self.num_sf_stage, 1)]  # K = 96 only
            sf_empty: cute.struct.MemRange[cutlass.Int64, max(self.num_sf_stage, 1)]
            tmem_base: cutlass.Int32
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout.outer)], align]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout.outer)], align]
            sSFA: cute.struct.Align[cute.struct.MemRange[self.sf_dtype, cute.cosize(self.sfa_smem_layout)], align]
            sSFB: cute.struct.Align[cute.struct.MemRange[self.sf_dtype, cute.cosize(self.sfb_smem_layout)], align]
            sStage: cute.struct.Align[cute.struct.MemRange[self.c_dtype, self.staging_elems], 128]

        self.shared_storage = SharedStorage

        # Grouped rows: one CTA per (tile, expert) pair; ceil(M / 128) + G - 1 bounds their number.
        grid_m = (m + TILE_M - 1) // TILE_M
        if cutlass.const_expr(self.grouped):
            grid_m = grid_m + g - 1
        grid = (grid_m, (n + self.tile_n - 1) // self.tile_n, c_batch)
        self.kernel(
            tiled_mma,
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_sfa,
            tma_sfa,
            tma_atom_sfb,
            tma_sfb,
            mC,
            mSA,
            mSB,
            mBias,
            mOffs,
            mSched,
            self.a_smem_layout,
            self.b_smem_layout,
            self.sfa_smem_layout,
            self.sfb_smem_layout,
            mma96,
            self.a_byte_layout if cutlass.const_expr(self.k96) else None,
            self.b_byte_layout if cutlass.const_expr(self.k96) else None,
        ).launch(grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(1, 1, 1), stream=stream)

    # ---- kernel ---------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_atom_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        mC: cute.Tensor,
        mSA: cute.Tensor,
        mSB: cute.Tensor,
        mBias: cute.Tensor,
        mOffs: cute.Tensor,
        mSched: cute.Tensor,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        sfa_smem_layout: cute.Layout,
        sfb_smem_layout: cute.Layout,
        mma96: cute.TiledMma,
        a_byte_layout: cute.ComposedLayout,
        b_byte_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta_m, n_tile, out_batch = cute.arch.block_idx()
        m = cute.size(mC, mode=[0])
        n = cute.size(mC, mode=[1])
        num_groups = cute.size(mSB, mode=[1])
        # The groups this CTA runs a pass for: every role skips the empty ones alike. Dense: one
        # pass. K grouped: the group of CTA z (one output matrix each). Rows grouped: the one
        # (tile, expert) pair of this CTA, or none (see pair_of_cta).
        m_tile = cta_m
        g_first = cutlass.Int32(0)
        g_last = cutlass.Int32(0)
        if cutlass.const_expr(self.k_grouped):
            g_first = out_batch
            g_last = out_batch
        if cutlass.const_expr(self.grouped):
            g_first, m_tile, has_pair = pair_of_cta(mSched, mOffs, num_groups, cta_m)
            g_last = g_first + has_pair - 1
        m0 = m_tile * TILE_M
        cluster_layout_vmnk = self._cluster_layout_vmnk(tiled_mma)

        sf_loader = self.sf_warp if cutlass.const_expr(self.k96) else self.tma_warp
        if warp_idx == self.tma_warp:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
        if warp_idx == sf_loader:
            cpasync.prefetch_descriptor(tma_atom_sfa)
            cpasync.prefetch_descriptor(tma_atom_sfb)

        # ---- shared memory, pipelines, tensor-memory allocator ----
        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(),
            num_stages=self.num_ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tma_bytes_per_stage,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(),
            num_stages=self.num_acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(self.epilogue_warps)),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        sf_pipeline = None
        if cutlass.const_expr(self.k96):
            sf_pipeline = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.sf_full.data_ptr(),
                num_stages=self.num_sf_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=self.sf_bytes_per_stage,
                cta_layout_vmnk=cluster_layout_vmnk,
                defer_sync=True,
            )
        tmem = TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=self.tmem_alloc_sync,
            allocator_warp_id=self.epilogue_warps[0],
        )
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sSFA = storage.sSFA.get_tensor(sfa_smem_layout)
        sSFB = storage.sSFB.get_tensor(sfb_smem_layout)

        # ---- per-CTA tiles of the global tensors, partitioned for the MMA and the TMA ----
        # (bM, bK, RestM, RestK, RestL) / (bN, bK, RestN, RestK, RestL)
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])
        k = cute.size(mA, mode=[1])
        if cutlass.const_expr(self.k96):
            k_tiles = k96_tiles(k)

        thr_mma = tiled_mma.get_slice(0)
        one_cta = cute.make_layout(1)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, 0, one_cta, cute.group_modes(sA, 0, 3), cute.group_modes(thr_mma.partition_A(gA), 0, 3)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, 0, one_cta, cute.group_modes(sB, 0, 3), cute.group_modes(thr_mma.partition_B(gB), 0, 3)
        )
        if cutlass.const_expr(self.k96):
            # (rows, 192, RestM/N, Rest192, RestL): one scale stage per 192-wide K slice
            gSFA = cute.local_tile(mSFA, (TILE_M, SF_TILE_K_SM103), (None, None, None))
            gSFB = cute.local_tile(mSFB, (self.tile_n, SF_TILE_K_SM103), (None, None, None))
            tAsSFA, tAgSFA = cpasync.tma_partition(
                tma_atom_sfa, 0, one_cta, cute.group_modes(sSFA, 0, 3), cute.group_modes(gSFA, 0, 2)
            )
            tBsSFB, tBgSFB = cpasync.tma_partition(
                tma_atom_sfb, 0, one_cta, cute.group_modes(sSFB, 0, 3), cute.group_modes(gSFB, 0, 2)
            )
        else:
            gSFA = cute.local_tile(mSFA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
            gSFB = cute.local_tile(mSFB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
            tAsSFA, tAgSFA = cpasync.tma_partition(
                tma_atom_sfa, 0, one_cta, cute.group_modes(sSFA, 0, 3), cute.group_modes(thr_mma.partition_A(gSFA), 0, 3)
            )
            tBsSFB, tBgSFB = cpasync.tma_partition(
                tma_atom_sfb, 0, one_cta, cute.group_modes(sSFB, 0, 3), cute.group_modes(thr_mma.partition_B(gSFB), 0, 3)
            )
        tAsSFA = cute.filter_zeros(tAsSFA)
        tAgSFA = cute.filter_zeros(tAgSFA)
        tBsSFB = cute.filter_zeros(tBsSFB)
        tBgSFB = cute.filter_zeros(tBgSFB)

        # MMA operand fragments (smem descriptors) and the accumulator's layout in tensor memory.
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_layout = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage)).layout

        pipeline_init_wait(cluster_shape_mn=(1, 1))

        # ======================= TMA producer warp =======================
        if warp_idx == self.tma_warp:
            ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_ab_stage)
            for gi in cutlass.range(g_first, g_last + 1, unroll=1):
                rows_lo, rows_hi, kt_lo, kt_hi = pass_extent(mOffs, gi, m, k_tiles, self.grouped, self.k_grouped)
                if (rows_hi > rows_lo) & (kt_hi > kt_lo):
                    tAgA_t = tAgA[(None, m_tile, None, 0)]
                    b_batch = gi if cutlass.const_expr(self.grouped) else 0
                    tBgB_t = tBgB[(None, n_tile, None, b_batch)]
                    tAgSFA_t = tAgSFA[(None, m_tile, None, 0)]
                    tBgSFB_t = tBgSFB[(None, n_tile, None, b_batch)]
                    for kt in cutlass.range(kt_lo, kt_hi, unroll=1):
                        if cutlass.const_expr(self.k96):
                            # three 256-wide A/B buffers per 768-wide k-tile (past K: zero-filled)
                            for b in cutlass.range_constexpr(TILE_K_SM103 // SMEM_BUFFER_K):
                                ab_pipeline.producer_acquire(ab_state)
                                bar = ab_pipeline.producer_get_barrier(ab_state)
                                stage = ab_state.index
                                buf = kt * (TILE_K_SM103 // SMEM_BUFFER_K) + b
                                cute.copy(tma_atom_a, tAgA_t[(None, buf)], tAsA[(None, stage)], tma_bar_ptr=bar)
                                cute.copy(tma_atom_b, tBgB_t[(None, buf)], tBsB[(None, stage)], tma_bar_ptr=bar)
                                ab_state.advance()
                        else:
                            ab_pipeline.producer_acquire(ab_state)
                            bar = ab_pipeline.producer_get_barrier(ab_state)
                            stage = ab_state.index
                            cute.copy(tma_atom_a, tAgA_t[(None, kt)], tAsA[(None, stage)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_b, tBgB_t[(None, kt)], tBsB[(None, stage)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_sfa, tAgSFA_t[(None, kt)], tAsSFA[(None, stage)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_sfb, tBgSFB_t[(None, kt)], tBsSFB[(None, stage)], tma_bar_ptr=bar)
                            ab_state.advance()
            ab_pipeline.producer_tail(ab_state)

        # ======================= scale-factor TMA warp (K = 96 kernel) =======================
        if cutlass.const_expr(self.k96):
            if warp_idx == self.sf_warp:
                sf_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_sf_stage)
                for gi in cutlass.range(g_first, g_last + 1, unroll=1):
                    rows_lo, rows_hi, kt_lo, kt_hi = pass_extent(mOffs, gi, m, k_tiles, self.grouped, self.k_grouped)
                    if (rows_hi > rows_lo) & (kt_hi > kt_lo):
                        b_batch = gi if cutlass.const_expr(self.grouped) else 0
                        tAgSFA_t = tAgSFA[(None, m_tile, None, 0)]
                        tBgSFB_t = tBgSFB[(None, n_tile, None, b_batch)]
                        for kt in cutlass.range(kt_lo, kt_hi, unroll=1):
                            for s in cutlass.range_constexpr(TILE_K_SM103 // SF_TILE_K_SM103):
                                sf_pipeline.producer_acquire(sf_state)
                                bar = sf_pipeline.producer_get_barrier(sf_state)
                                stage = sf_state.index
                                piece = kt * (TILE_K_SM103 // SF_TILE_K_SM103) + s
                                cute.copy(tma_atom_sfa, tAgSFA_t[(None, piece)], tAsSFA[(None, stage)], tma_bar_ptr=bar)
                                cute.copy(tma_atom_sfb, tBgSFB_t[(None, piece)], tBsSFB[(None, stage)], tma_bar_ptr=bar)
                                sf_state.advance()
                sf_pipeline.producer_tail(sf_state)

        # ======================= MMA warp, K = 96 (sm_103a) =======================
        if cutlass.const_expr(self.k96):
            if warp_idx == self.mma_warp:
                self._mma_role_k96(
                    mma96, tmem, tCtAcc_layout, storage, a_byte_layout, b_byte_layout, sSFA, sSFB,
                    sfa_smem_layout, sfb_smem_layout, ab_pipeline, sf_pipeline, acc_pipeline,
                    mOffs, g_first, g_last, m, k, k_tiles,
                )
        else:  # ======================= MMA warp, K = 64 =======================
            if warp_idx == self.mma_warp:
                tmem.wait_for_alloc()
                acc_base = tmem.retrieve_ptr(self.acc_dtype)
                tCtAcc_all = cute.make_tensor(acc_base, tCtAcc_layout)
                sfa_tmem = cute.recast_ptr(acc_base + self.num_acc_cols, dtype=self.sf_dtype)
                tCtSFA = cute.make_tensor(
                    sfa_tmem,
                    blockscaled_utils.make_tmem_layout_sfa(
                        tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_smem_layout, (None, None, None, 0))
                    ),
                )
                sfb_tmem = cute.recast_ptr(acc_base + self.num_acc_cols + self.num_sfa_cols, dtype=self.sf_dtype)
                tCtSFB = cute.make_tensor(
                    sfb_tmem,
                    blockscaled_utils.make_tmem_layout_sfb(
                        tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfb_smem_layout, (None, None, None, 0))
                    ),
                )
                s2t_sfa, tCsSFA_s2t, tCtSFA_s2t = self._scales_smem_to_tmem(sSFA, tCtSFA)
                s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = self._scales_smem_to_tmem(sSFB, tCtSFB)

                ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_ab_stage)
                acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
                for gi in cutlass.range(g_first, g_last + 1, unroll=1):
                    rows_lo, rows_hi, kt_lo, kt_hi = pass_extent(mOffs, gi, m, k_tiles, self.grouped, self.k_grouped)
                    if (rows_hi > rows_lo) & (kt_hi > kt_lo):
                        acc_pipeline.producer_acquire(acc_state)
                        tCtAcc = tCtAcc_all[(None, None, None, acc_state.index)]
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                        for kt in cutlass.range(kt_lo, kt_hi, unroll=1):
                            ab_pipeline.consumer_wait(ab_state)
                            stage = ab_state.index
                            cute.copy(s2t_sfa, tCsSFA_s2t[(None, None, None, None, stage)], tCtSFA_s2t)
                            cute.copy(s2t_sfb, tCsSFB_s2t[(None, None, None, None, stage)], tCtSFB_s2t)
                            for kb in cutlass.range_constexpr(self.kblocks_per_tile):
                                cute.gemm(
                                    tiled_mma,
                                    tCtAcc,
                                    [tCrA[(None, None, kb, stage)], tCtSFA[(None, None, kb)]],
                                    [tCrB[(None, None, kb, stage)], tCtSFB[(None, None, kb)]],
                                    tCtAcc,
                                )
                                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                            ab_pipeline.consumer_release(ab_state)
                            ab_state.advance()
                        acc_pipeline.producer_commit(acc_state)
                        acc_state.advance()
                acc_pipeline.producer_tail(acc_state)

        # ======================= epilogue warps =======================
        if warp_idx < self.mma_warp:
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            acc_base = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_all = cute.make_tensor(acc_base, tCtAcc_layout)

            mC_out = mC[(None, None, out_batch)]
            tile_mn = cute.slice_(self.mma_tiler, (None, None, 0))
            t2r, tTR_tAcc, tTR_cC = epilogue_partition(tiled_mma, tCtAcc_all, mC_out.shape, tile_mn, m_tile, n_tile, tidx)
            tTR_rAcc = cute.make_rmem_tensor(tTR_cC[(None, None, None, 0, 0)].shape, self.acc_dtype)
            num_subtiles = cute.size(tTR_tAcc, mode=[4])

            # A 32 x 32 bit TMEM load gives thread t of warp w row 32 w + t of the tile, 32
            # consecutive columns: rows are transposed through shared memory so that a warp
            # stores 32 consecutive columns of one row per instruction (coalesced).
            sStage = storage.sStage.get_tensor(
                cute.make_layout((32, _EPI_N, len(self.epilogue_warps)), stride=(self.stage_pitch, 1, 32 * self.stage_pitch))
            )
            warp_stage = sStage[(None, None, warp_idx)]
            lane = cute.arch.lane_idx()
            row_base = m0 + 32 * warp_idx

            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_acc_stage)
            for gi in cutlass.range(g_first, g_last + 1, unroll=1):
                rows_lo, rows_hi, kt_lo, kt_hi = pass_extent(mOffs, gi, m, k_tiles, self.grouped, self.k_grouped)
                if (rows_hi > rows_lo) & (kt_hi > kt_lo):
                    acc_pipeline.consumer_wait(acc_state)
                    for sub in cutlass.range(num_subtiles, unroll=1):
                        cute.copy(t2r, tTR_tAcc[(None, None, None, 0, sub, acc_state.index)], tTR_rAcc)
                        # tcgen05.ld is asynchronous: wait before the registers are read.
                        cute.arch.fence_view_async_tmem_load()
                        tTR_cC_sub = tTR_cC[(None, None, None, 0, sub)]
                        col_base = n_tile * self.tile_n + sub * _EPI_N
                        for i in cutlass.range_constexpr(cute.size(tTR_rAcc)):
                            row, col = tTR_cC_sub[i]
                            # Clamped indices keep the vector loads in bounds; tails are not stored.
                            row_c = cutlass.min(row, m - 1)
                            col_c = cutlass.min(col, n - 1)
                            alpha = mul_rn_f32(mSA[row_c], mSB[(col_c, gi)])
                            value = mul_rn_f32(tTR_rAcc[i], alpha)
                            if cutlass.const_expr(self.has_bias):
                                value = add_rn_f32(value, mBias[(col_c, gi)])
                            warp_stage[(row - row_base, col - col_base)] = value.to(self.c_dtype)
                        cute.arch.sync_warp()
                        for r in cutlass.range_constexpr(32):
                            row = row_base + r
                            col = col_base + lane
                            if stores_element(row, col, rows_lo, rows_hi, m, n):
                                mC_out[(row, col)] = warp_stage[(r, lane)]
                        cute.arch.sync_warp()  # the next subtile reuses the staging tile
                    acc_pipeline.consumer_release(acc_state)
                    acc_state.advance()
                if cutlass.const_expr(self.k_grouped):
                    if kt_hi <= kt_lo:
                        # An expert without tokens: its weight gradient is exactly zero.
                        for sub in cutlass.range(num_subtiles, unroll=1):
                            col = n_tile * self.tile_n + sub * _EPI_N + lane
                            for r in cutlass.range_constexpr(32):
                                row = row_base + r
                                if (row < m) & (col < n):
                                    mC_out[(row, col)] = cutlass.Float32(0.0).to(self.c_dtype)

            tmem.relinquish_alloc_permit()
            self.epilogue_sync.arrive_and_wait()
            tmem.free(acc_base)

    @cute.jit
    def _mma_role_k96(
        self,
        mma96: cute.TiledMma,
        tmem,
        tCtAcc_layout,
        storage,
        a_byte_layout: cute.ComposedLayout,
        b_byte_layout: cute.ComposedLayout,
        sSFA: cute.Tensor,
        sSFB: cute.Tensor,
        sfa_smem_layout: cute.Layout,
        sfb_smem_layout: cute.Layout,
        ab_pipeline,
        sf_pipeline,
        acc_pipeline,
        mOffs: cute.Tensor,
        g_first: cutlass.Int32,
        g_last: cutlass.Int32,
        m: cutlass.Int32,
        k: cutlass.Int32,
        k_tiles: cutlass.Int32,
    ):
        """The MMA warp of the sm_103a kernel: per 768-wide k-tile, the eight K = 96 MMAs of
        :data:`.tiles.K96_SCHEDULE` (static), each reading 48 bytes of every row of A and B from
        a buffer of the A/B ring and, for MMAs 2 and 5, the start of the next one (circular
        smem descriptors), with its six scale columns addressed in tensor memory; a scale stage
        (two MMAs) is copied smem -> tensor memory (``tcgen05.cp``) before its first MMA. MMAs
        that would start at or past K (the last k-tile's tail) are not issued; the buffers and
        scale stages are still consumed in order, so both rings stay in step with their TMA
        warps. ``tcgen05.cp`` and ``tcgen05.mma`` from one thread run in issue order, which
        makes reusing the scale columns of tensor memory for the next stage safe."""
        tmem.wait_for_alloc()
        acc_base = tmem.retrieve_ptr(self.acc_dtype)
        tCtAcc_all = cute.make_tensor(acc_base, tCtAcc_layout)
        sfa_tmem = cute.recast_ptr(acc_base + self.num_acc_cols, dtype=self.sf_dtype)
        sfb_tmem = cute.recast_ptr(acc_base + self.num_acc_cols + self.num_sfa_cols, dtype=self.sf_dtype)
        sfa_one = cute.slice_(sfa_smem_layout, (None, None, None, 0))
        sfb_one = cute.slice_(sfb_smem_layout, (None, None, None, 0))
        # one scale stage in tensor memory (the tcgen05.cp destination) ...
        tCtSFA = cute.make_tensor(sfa_tmem, blockscaled_utils.make_tmem_layout_sfa(mma96, self.sf_tiler, SF_VEC, sfa_one))
        tCtSFB = cute.make_tensor(sfb_tmem, blockscaled_utils.make_tmem_layout_sfb(mma96, self.sf_tiler, SF_VEC, sfb_one))
        # ... and the same columns seen one 16-wide scale column at a time (an MMA's first)
        tCtSFA_col = cute.make_tensor(
            sfa_tmem, blockscaled_utils.make_tmem_layout_sfa(mma96, self.sf_tiler, SF_VEC, sf_column_view(TILE_M))
        )
        tCtSFB_col = cute.make_tensor(
            sfb_tmem, blockscaled_utils.make_tmem_layout_sfb(mma96, self.sf_tiler, SF_VEC, sf_column_view(self.tile_n))
        )
        s2t_sfa, tCsSFA_s2t, tCtSFA_s2t = self._scales_smem_to_tmem(sSFA, tCtSFA, one_atom_tiler=True)
        s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = self._scales_smem_to_tmem(sSFB, tCtSFB, one_atom_tiler=True)
        # byte views of the A/B ring (same memory as the FP4 view TMA fills)
        sA_bytes = storage.sA.get_tensor(a_byte_layout.outer, swizzle=a_byte_layout.inner, dtype=cutlass.Uint8)
        sB_bytes = storage.sB.get_tensor(b_byte_layout.outer, swizzle=b_byte_layout.inner, dtype=cutlass.Uint8)

        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_ab_stage)
        sf_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_sf_stage)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
        for gi in cutlass.range(g_first, g_last + 1, unroll=1):
            rows_lo, rows_hi, kt_lo, kt_hi = pass_extent(mOffs, gi, m, k_tiles, self.grouped, self.k_grouped)
            if (rows_hi > rows_lo) & (kt_hi > kt_lo):
                acc_pipeline.producer_acquire(acc_state)
                tCtAcc = tCtAcc_all[(None, 0, 0, acc_state.index)]
                mma96.set(tcgen05.Field.ACCUMULATE, False)
                for kt in cutlass.range(kt_lo, kt_hi, unroll=1):
                    held = [None] * (TILE_K_SM103 // SMEM_BUFFER_K)  # ring state of this tile's buffers
                    for j in cutlass.range_constexpr(len(K96_SCHEDULE)):
                        step = K96_SCHEDULE[j]
                        if cutlass.const_expr(step.loads_scales):
                            sf_pipeline.consumer_wait(sf_state)
                            cute.copy(s2t_sfa, tCsSFA_s2t[(None, None, None, None, sf_state.index)], tCtSFA_s2t)
                            cute.copy(s2t_sfb, tCsSFB_s2t[(None, None, None, None, sf_state.index)], tCtSFB_s2t)
                            sf_pipeline.consumer_release(sf_state)  # freed once the copies complete
                            sf_state.advance()
                        for w in cutlass.range_constexpr(len(step.waits)):
                            ab_pipeline.consumer_wait(ab_state)
                            held[step.waits[w]] = ab_state.clone()
                            ab_state.advance()
                        a_cur = sA_bytes[(None, 0, step.chunk, held[step.buffer].index)]
                        a_next = sA_bytes[(None, 0, 0, held[step.next_buffer].index)]
                        b_cur = sB_bytes[(None, 0, step.chunk, held[step.buffer].index)]
                        b_next = sB_bytes[(None, 0, 0, held[step.next_buffer].index)]
                        mma96.set(tcgen05.Field.SFA, tCtSFA_col[(None, None, step.sf_column)].iterator)
                        mma96.set(tcgen05.Field.SFB, tCtSFB_col[(None, None, step.sf_column)].iterator)
                        if cutlass.const_expr(j == 0):
                            k96_mma(mma96, tCtAcc, a_cur, a_next, b_cur, b_next)
                            mma96.set(tcgen05.Field.ACCUMULATE, True)
                        else:
                            if k96_issues(kt, step.k_start, k):  # past K: the tail MMAs are skipped
                                k96_mma(mma96, tCtAcc, a_cur, a_next, b_cur, b_next)
                        for r in cutlass.range_constexpr(len(step.releases)):
                            ab_pipeline.consumer_release(held[step.releases[r]])
                acc_pipeline.producer_commit(acc_state)
                acc_state.advance()
        acc_pipeline.producer_tail(acc_state)

    def _scales_smem_to_tmem(self, sSF: cute.Tensor, tSF: cute.Tensor, one_atom_tiler: bool = False):
        """``tcgen05.cp`` (4 x 32 x 128 bit) copy of one k-tile's scales, smem -> tensor memory.
        ``one_atom_tiler``: the tiled copy is built on one (MN, K) atom of the tensor-memory
        layout and then partitions the whole stage (the sm_103 scale layouts)."""
        sSF_compact = cute.filter_zeros(sSF)
        tSF_compact = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.sf_dtype)
        tiler = tSF_compact
        if one_atom_tiler:
            one = cute.append(cute.append(tSF_compact[(None, 0, 0)].layout, cute.make_layout(1)), cute.make_layout(1))
            tiler = cute.make_tensor(tSF_compact.iterator, one)
        s2t = tcgen05.make_s2t_copy(atom, tiler)
        thr = s2t.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(s2t, thr.partition_S(sSF_compact))
        dst = thr.partition_D(tSF_compact)
        return s2t, src, dst


# ---------------------------------------------------------------------------------------------
# Cached compilation
# ---------------------------------------------------------------------------------------------
def _placeholder_args(config: GemmConfig):
    """Compile-time stand-ins: null pointers with the alignments the launches guarantee."""
    gmem = cute.AddressSpace.gmem
    return (
        make_ptr(cutlass.Float4E2M1FN, 0, gmem, assumed_align=16),
        make_ptr(cutlass.Float4E2M1FN, 0, gmem, assumed_align=16),
        make_ptr(cutlass.Float8E4M3FN, 0, gmem, assumed_align=16),
        make_ptr(cutlass.Float8E4M3FN, 0, gmem, assumed_align=16),
        make_ptr(_OUT_DTYPES[config.out_dtype], 0, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),
        (cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(MMA_K), cutlass.Int32(1)),
        (cutlass.Int32(1), cutlass.Int32(1)),
        cuda.CUstream(0),
    )


def _check_arch(config: GemmConfig, arch: str) -> None:
    if config.mma_k == MMA_K_SM103 and arch != "sm_103a":
        raise ValueError(f"the K = 96 NVFP4 MMA (config {config.name}) exists on sm_103a only, not on {arch}")


@functools.lru_cache(maxsize=None)
def compile_gemm(config: GemmConfig, arch: str = "sm_100a"):
    """Compile the kernel for ``config`` (cached per process). Works without a GPU.

    ``arch`` is the ``--gpu-arch`` target: ``sm_100a`` (B200/GB200) or ``sm_103a`` (B300/GB300).
    The result is not bound to a device yet: :func:`executor` loads it onto one.
    Raises ValueError for a K = 96 config on another arch (only sm_103a has that MMA).
    """
    _check_arch(config, arch)
    return cute.compile(
        Nvfp4BlockScaledGemmKernel(config), *_placeholder_args(config), options=f"--gpu-arch {arch}"
    )


@functools.lru_cache(maxsize=None)
def executor(config: GemmConfig, arch: str, device_index: int):
    """The compiled kernel loaded onto CUDA device ``device_index`` (cached per device).

    A compiled CuTe DSL function binds itself to the device that is current at its first
    call; tensors on another GPU would then launch in the wrong context. One executor per
    (config, arch, device) avoids that; the compilation itself is shared.
    """
    return compile_gemm(config, arch).to(device_index)


def launch(
    config: GemmConfig,
    a_codes,
    b_codes,
    a_scales,
    b_scales,
    out,
    row_scale_a,
    row_scale_b,
    bias,
    offsets,
    m: int,
    n: int,
    k: int,
    groups: int,
    sb_strides: tuple[int, int],
    arch: str,
    schedule=None,
) -> None:
    """Run the compiled kernel on torch CUDA tensors (already validated by the public ops),
    on ``out``'s device and that device's current stream. ``schedule`` is the grouped
    variant's pair schedule (int32 ``[G + 1]``, :func:`.grouped_gemm.pair_schedule`)."""
    import torch

    gmem = cute.AddressSpace.gmem

    def ptr(dtype, t, align):
        return make_ptr(dtype, t.data_ptr(), gmem, assumed_align=align)

    if config.grouped and schedule is None:
        raise ValueError("the grouped NVFP4 GEMM needs its pair schedule (grouped_gemm.pair_schedule)")
    device = out.device
    dummy = row_scale_a  # never read when the variant has no bias / no groups
    with torch.cuda.device(device):
        compiled = executor(config, arch, device.index if device.index is not None else torch.cuda.current_device())
        stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
        compiled(
            ptr(cutlass.Float4E2M1FN, a_codes, 16),
            ptr(cutlass.Float4E2M1FN, b_codes, 16),
            ptr(cutlass.Float8E4M3FN, a_scales, 16),
            ptr(cutlass.Float8E4M3FN, b_scales, 16),
            ptr(_OUT_DTYPES[config.out_dtype], out, 16),
            ptr(cutlass.Float32, row_scale_a, 4),
            ptr(cutlass.Float32, row_scale_b, 4),
            ptr(cutlass.Float32, bias if bias is not None else dummy, 4),
            ptr(cutlass.Int32, offsets if offsets is not None else dummy, 4),
            ptr(cutlass.Int32, schedule if schedule is not None else dummy, 4),
            (m, n, k, groups),
            sb_strides,
            stream,
        )


def compile_artifacts(
    config: GemmConfig, arch: str = "sm_100a", dump_dir: str | None = None, plan: dict | None = None
) -> tuple[str, bytes]:
    """(PTX text, cubin bytes) of the kernel for ``config`` on ``arch``, compiled here (no GPU
    needed). The DSL writes the files into ``dump_dir`` (a fresh temporary folder if None).
    A ``plan`` dict is filled with the static choices the trace made: ``ab_stages`` (smem
    ring depth), ``sf_stages`` (the K = 96 kernel's scale ring; 0: scales ride with A/B),
    ``acc_stages`` (accumulators in tensor memory), ``tmem_cols``, ``mma_k``, ``threads``."""
    import tempfile

    _check_arch(config, arch)
    kernel = Nvfp4BlockScaledGemmKernel(config)
    with tempfile.TemporaryDirectory() as tmp:
        options = f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump_dir or tmp}"
        compiled = cute.compile(kernel, *_placeholder_args(config), options=options)
        ptx, cubin = compiled.__ptx__, compiled.__cubin__
    if plan is not None:
        plan.update(
            ab_stages=kernel.num_ab_stage,
            sf_stages=kernel.num_sf_stage,
            acc_stages=kernel.num_acc_stage,
            tmem_cols=kernel.num_acc_cols + kernel.num_sfa_cols + kernel.num_sfb_cols,
            mma_k=MMA_K_SM103 if kernel.k96 else kernel.mma_tiler[2] // kernel.kblocks_per_tile,
            threads=kernel.threads_per_cta,
        )
    return ptx, cubin if isinstance(cubin, bytes) else bytes(cubin)
