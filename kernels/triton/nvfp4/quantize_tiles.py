"""The quantize kernels' GPU launch tiles, one frozen record: ``TritonOptions.quantize_tiles``. Any
setting gives the same bits (a tile only splits the work); the interpreter keeps its small CPU tiles."""

from dataclasses import astuple, dataclass

#: Chunks of a row the row kernel (:mod:`.quantize_rows`) can hold in registers: it unrolls ``CHUNKS``
#: up to this many, so a larger ``rows[2]`` would skip the rest of the row (rejected below).
MAX_CHUNKS = 4


@dataclass(frozen=True)
class QuantizeTiles:
    #: Generic row-major kernel (:mod:`.quantize`): (BLOCK_R, BLOCK_K, num_warps) of a K-loop program.
    loop_tile: tuple[int, int, int] = (16, 256, 8)
    #: Rows up to this K (rounded up to a power of two) are quantized in one pass from registers
    #: (H200, 2026-11-29: at K = 2048 the K-loop ran 0.095 ms, one pass 0.136-0.17 ms).
    single_pass_k: int = 1024
    #: Up to this many rows (decode), rows of K <= 16384 run in one pass (the K loop's latency chain: 9.4 us for 1 x 2048).
    small_r: int = 64
    #: Elements per single-pass program (BLOCK_R = this // next_pow2(K)).
    single_pass_elems: int = 8192
    #: (BLOCK_T, BLOCK_H, num_warps) of the generic transposed-input kernel.
    transposed_tile: tuple[int, int, int] = (16, 128, 4)
    #: Row kernel (:mod:`.quantize_rows`): (threads per row, num_warps, max chunks held in registers, at most
    #: ``MAX_CHUNKS``; longer rows are read twice). H200, 2026-11-30 (benchmarks.quantize_kernels, 16384 x 2048 bf16, row scale + image):
    #: 1 warp 41.3 us (87% of copy), 2 / 4 / 8 warps 49.1 / 51.8 / 62.0 (~180 registers: small programs pack more).
    rows: tuple[int, int, int] = (32, 1, 4)
    #: The row kernel with stochastic rounding (the gradients): H200, 2026-12-01 (benchmarks.learner_sweep,
    #: dy [131072, 2048] / [131072, 1536], tensor scale + SR + image, ms): (16, 1, 4) 0.592 / 0.458 (K = 2048 read
    #: twice), (32, 1, 4) 0.708 / 0.460 (the whole row in registers: the SR hashes' registers cost more than a read).
    rows_stochastic: tuple[int, int, int] = (16, 1, 4)
    #: 16x16 tiles: (threads per row, num_warps); BLOCK_R = 32 / threads * warps rows (a multiple of 16): the
    #: 16-row max is warp shuffles, no shared memory (checked ahead of time: test_triton_quantize_aot.py).
    #: H200, 2026-12-01 (benchmarks.learner_sweep, the experts' stacked weights, amax pass included, ms):
    #: fc1 [128 x 1536, 2048] / fc2 [128 x 2048, 768]: (4, 2) 0.550 / 0.289; (8, 4) 0.547 / 0.294;
    #: (4, 4) 0.556 / 0.290; (2, 1), the default before, 1.078 / 0.488; (1, 1) 2.006 / 0.737.
    weight_tile: tuple[int, int] = (4, 2)
    #: Column kernel (:mod:`.quantize_cols`): (BLOCK_H, BLOCK_NB, num_warps). H200, 2026-11-30 sweep
    #: (x.t() 2048 x 16384 / dy.t() 5120 x 16384 with SR + RHT, us): (64, 4, 4) 83.7 / 256;
    #: (64, 8, 8) 82.2 / 314; (32, 8, 4) 85.8 / 271; (32, 16, 4) 88.3 / 305; (128, 4, 4) 85.2 / 291.
    cols_tile: tuple[int, int, int] = (64, 4, 4)
    #: Column kernel: at most this many token-block groups per program, at least this many programs.
    cols_grid: tuple[int, int] = (8, 1024)

    def __post_init__(self):
        for name in ("rows", "rows_stochastic"):  # the row kernel unrolls that many chunks: more would be skipped
            if not 0 <= getattr(self, name)[2] <= MAX_CHUNKS:
                raise ValueError(f"QuantizeTiles.{name}: at most {MAX_CHUNKS} chunks held in registers, "
                                 f"got {getattr(self, name)[2]}")

    def as_list(self) -> list[int]:
        """The fields flattened (what the ``minite::quantize`` custom op takes; :meth:`from_list`)."""
        return [v for f in astuple(self) for v in (f if isinstance(f, tuple) else (f,))]

    @classmethod
    def from_list(cls, values: list[int]) -> "QuantizeTiles":
        it = iter(values)
        return cls(*(tuple(next(it) for _ in d) if isinstance(d, tuple) else next(it) for d in astuple(DEFAULT)))


DEFAULT = QuantizeTiles()
