"""QuantizeTiles: launch settings that would compute a wrong answer are refused when made."""

import pytest

from minite_kernels.triton.nvfp4.quantize_rows import config
from minite_kernels.triton.nvfp4.quantize_tiles import DEFAULT, MAX_CHUNKS, QuantizeTiles


def test_more_register_chunks_than_the_row_kernel_unrolls_is_refused():
    # rows=(8, 1, 16) once ran 2x faster than copy speed: the kernel skipped chunks 4..15 of each row
    with pytest.raises(ValueError, match="QuantizeTiles.rows: at most 4 chunks"):
        QuantizeTiles(rows=(8, 1, MAX_CHUNKS + 1))
    with pytest.raises(ValueError, match="QuantizeTiles.rows_stochastic: at most 4 chunks"):
        QuantizeTiles(rows_stochastic=(8, 1, MAX_CHUNKS + 1))
    QuantizeTiles(rows=(8, 1, MAX_CHUNKS), rows_stochastic=(8, 1, 0))


def test_row_kernel_holds_at_most_max_chunks():
    for k in (256, 2048, 5120):
        for tiles in (DEFAULT, QuantizeTiles(rows=(8, 1, 4)), QuantizeTiles(rows=(2, 1, 4))):
            for stochastic in (False, True):
                _, _, _, chunks = config(16384, k, tiles=tiles, stochastic=stochastic)
                assert chunks <= MAX_CHUNKS
