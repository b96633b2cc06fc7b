"""The fast quantize kernels as compiled for the H200 (sm_90a), for ahead-of-time checks on a CPU.

Each function compiles one kernel at the configuration its launcher picks on the GPU
(:func:`.quantize_rows.config`, ``QuantizeTiles.cols_tile``), with the argument
specialisations a real launch sees (16-byte aligned pointers, strides and K divisible by 16).
Requires a process without ``TRITON_INTERPRET=1`` (see :mod:`._aot`).
"""

from __future__ import annotations

from minite_kernels.triton._build._aot import compile_for
from minite_kernels.triton.nvfp4._nvfp4_math import EXACT_LAUNCH


def rows_kernel(r: int = 1 << 20, k: int = 2048, stochastic: bool = False, row_amax: bool = True,
                tile16: bool = False, with_image: bool = True):
    """The row kernel at its GPU launch config for ``[r, k]`` bf16 input (image written)."""
    from minite_kernels.triton.nvfp4 import quantize_rows as qr

    block_nb, block_r, warps, chunks = qr.config(r, k, tile16, stochastic=stochastic)
    sig = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8", "sdec_ptr": "*fp32",
           "image_ptr": "*bf16", "R": "i32", "K": "i32", "stride_w": "i32", "rows_per_group": "i32", "key": "i32",
           "scale_cols_padded": "i32"}
    ce = dict(ROW_AMAX=row_amax, STOCHASTIC=stochastic, WITH_IMAGE=with_image, SWIZZLED=False, IS_FP16=False,
              BLOCK_NB=block_nb, BLOCK_R=block_r, CHUNKS=chunks, TILE16=tile16)
    return compile_for(qr._quantize_rows_kernel, sig, ce, num_warps=warps,
                       divisible=("K", "stride_w", "scale_cols_padded"), **EXACT_LAUNCH)


def cols_kernel(stochastic: bool = False, rht: bool = False, col_index: bool = False, amax_only: bool = False,
                plain_amax: bool = False):
    """The column kernel at its GPU tile for a bf16 source (image written; ``plain_amax``: the amax
    pass that also reduces the untransformed values, ``amax_launch(plain=True)``)."""
    from minite_kernels.triton.nvfp4 import quantize_cols as qc

    bh, nb, warps = qc.DEFAULT.cols_tile
    sig = {"s_ptr": "*bf16", "col_ptr": "*i32", "amax_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8",
           "sdec_ptr": "*fp32", "image_ptr": "*bf16", "R": "i32", "K": "i32", "stride_s": "i32",
           "rows_per_group": "i32", "key": "i32", "rht_mask": "i32", "scale_cols_padded": "i32",
           "groups_per_prog": "i32"}
    ce = dict(HAS_COL_INDEX=col_index, STOCHASTIC=stochastic, WITH_IMAGE=True, SWIZZLED=False, RHT=rht,
              AMAX_ONLY=amax_only, BLOCK_H=bh, BLOCK_NB=nb, PLAIN_AMAX=plain_amax)
    return compile_for(qc._quantize_cols_kernel, sig, ce, num_warps=warps,
                       divisible=("R", "K", "stride_s", "scale_cols_padded"), **EXACT_LAUNCH)


def all_kernels():
    """(name, compiled kernel) of the fast quantize kernels at their H200 launch configs."""
    yield "quantize rows K=2048 (one read)", rows_kernel()
    yield "quantize rows K=5120 SR tensor (two reads)", rows_kernel(k=5120, stochastic=True, row_amax=False)
    yield "quantize 16x16 weight tiles K=2048 (codes only)", rows_kernel(k=2048, row_amax=False, tile16=True,
                                                                         with_image=False)
    yield "quantize cols SR RHT gather", cols_kernel(stochastic=True, rht=True, col_index=True)
    yield "amax cols RHT gather + plain amax (dy_amaxes)", cols_kernel(rht=True, col_index=True, amax_only=True,
                                                                       plain_amax=True)
