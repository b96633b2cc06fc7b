"""The bf16 image of an NVFP4 tensor from its packed codes and linear block scales.

``image[r, k] = bf16(e2m1(code[r, k]) * fp32(scale[r, k // 16]))``: exact (an E2M1 value
times an E4M3 scale has at most 4 significant bits), equal to
``NVFP4Tensor.image_fp32().to(torch.bfloat16)`` bit for bit (NaN scales give 0x7FC0).
Used when a quantized tensor arrives without the image its quantize pass could have written
(a loaded checkpoint, the reference backend, a swizzled-scale tensor). Memory-bound: reads
0.56 bytes per element and writes 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_megatron.nvfp4.formats import BLOCK
from minite_megatron.nvfp4.tensor import NVFP4Tensor

from minite_kernels.triton.nvfp4._nvfp4_math import bf16_image_bits, e2m1_value, e4m3_value, exact_launch
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2


@triton.jit
def _image_kernel(codes_ptr, scales_ptr, image_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    scols = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    rmask = (rows < R)[:, None]
    packed = tl.load(codes_ptr + rows[:, None].to(tl.int64) * (K // 2) + pcols[None, :],
                     mask=rmask & (pcols < K // 2)[None, :], other=0).to(tl.int32)
    sf = tl.load(scales_ptr + rows[:, None].to(tl.int64) * (K // 16) + scols[None, :],
                 mask=rmask & (scols < K // 16)[None, :], other=0)
    sf = e4m3_value(sf.to(tl.int32))
    codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_R, BLOCK_K))
    img = tl.reshape(tl.reshape(e2m1_value(codes), (BLOCK_R, BLOCK_K // 16, 16)) * sf[:, :, None],
                     (BLOCK_R, BLOCK_K))
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(image_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], bf16_image_bits(img),
             mask=rmask & (cols < K)[None, :])


@custom_op("minite::nvfp4_image", mutates_args=())
def image_op(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[R, K/2]`` + uint8 (e4m3 bits) linear scales ``[R, K/16]`` -> bf16 ``[R, K]``."""
    r, k = codes.shape[0], codes.shape[1] * 2
    image = torch.empty(r, k, dtype=torch.bfloat16, device=codes.device)
    if r and k:
        block_k = min(next_pow2(k), 256)
        block_r = max(1, min(64, 8192 // block_k))
        grid = (cdiv(r, block_r), cdiv(k, block_k))
        _image_kernel[grid](codes.contiguous(), scales.contiguous(), image.view(torch.int16), r, k,
                            BLOCK_R=block_r, BLOCK_K=block_k, **exact_launch())
    return image


@image_op.register_fake
def _(codes, scales):
    return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=torch.bfloat16)


def image_2d(q: NVFP4Tensor) -> torch.Tensor:
    """bf16 ``[rows, K]`` image of ``q``: the attached one (a view, maybe strided) or a new one."""
    if q.image is not None:
        return q.image.reshape(q.rows, q.k) if q.image.dim() != 2 else q.image
    codes = q.codes.reshape(q.rows, q.k // 2)
    scales = q.linear_scales().reshape(q.rows, q.k // BLOCK).view(torch.uint8)
    return image_op(codes, scales)
