"""Dense NVFP4 GEMM on Blackwell FP4 tensor cores (CuTe DSL): ``out = a @ b.T``.

``out[m, n] = round_out(fp32(S_dec_a[m] * S_dec_b[n]) * acc[m, n] (+ bias[n]))``, the epilogue
of :mod:`minite_megatron.nvfp4.gemm` (scale: one fp32 product; bias: one fp32 add; one
rounding), with ``acc`` accumulated in fp32 by ``tcgen05.mma ... kind::mxf4nvf4.block_scale
.block16`` (its order differs from the contract's canonical one: results are held to
:func:`nvfp4.fp32_accumulation_bound`, and are bitwise equal whenever every partial sum is
exact). Batch invariant: fixed 128 x ``tile_n`` x 256 tiles chosen from N only, no split-K.
On sm_103a (B300) the kernel runs B300's K = 96 MMA (768-wide k-tiles; :func:`.tiles.choose_mma_k`,
``MINITE_BLACKWELL_MMA_K=64`` forces the K = 64 one); the form depends on the GPU, never on M.

Operands (``torch.library`` op ``minite_cute::nvfp4_gemm``, CUDA, sm_100a / sm_103a):
    a_codes   uint8 ``[M, K/2]``  E2M1 codes, element 2i in the low nibble.
    a_scales  float8_e4m3fn, flat 128x4 swizzled ``[M, K/16]`` (``nvfp4.swizzle_scales``).
    a_global  fp32 ``[M]``        S_dec per row.
    b_codes   uint8 ``[N, K/2]``; b_scales likewise ``[N, K/16]`` swizzled.
    b_global  fp32 ``[N]`` (per row) or ``[1]`` (per tensor).
    bias      fp32/bf16 ``[N]`` or None; ``out_dtype`` bfloat16 (default), float16 or float32.
Limits: K a positive multiple of 64 (the MMA K), or of 32 on sm_103a's K = 96 kernel (the last
k-tile's tail is zero-filled by TMA; no padding copy); any M >= 0 and N >= 0 (tails are masked);
M * N < 2^31.
Raises TypeError (dtypes), ValueError (shapes, K, unswizzled scales) before touching the
device, then BackendUnavailable (with the reason) where no Blackwell GPU or DSL is present.

The kernel itself is :mod:`._blockscaled_gemm_impl` (imported on first launch).
"""

from __future__ import annotations

import torch

from minite_megatron.nvfp4 import NVFP4Tensor

from . import _host
from ._host import blackwell_arch, device_arch, tma_operand
from .scales import check_swizzled, operand_scales
from .tiles import MMA_K, GemmConfig, check_k, choose_mma_k, choose_tile_n
from ..custom_op import custom_op

_OUT_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _check_out_dtype(out_dtype: torch.dtype) -> str:
    if out_dtype not in _OUT_DTYPE_NAMES:
        raise TypeError(f"blackwell NVFP4 GEMM: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    return _OUT_DTYPE_NAMES[out_dtype]


def check_output_size(numel: int) -> None:
    """The kernels index the output with 32-bit offsets: at most 2^31 - 1 elements."""
    if numel >= 2**31:
        raise ValueError(f"blackwell NVFP4 GEMM: the output has {numel} elements, more than 2^31 - 1; split the call")


def _check_codes(codes: torch.Tensor, name: str, rank: int) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"{name}: packed E2M1 codes must be a torch.uint8 tensor, got {got}")
    if codes.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}D tensor of packed codes, got shape {tuple(codes.shape)}")


def _check_global(g: torch.Tensor, name: str, allowed: tuple[int, ...]) -> None:
    if not isinstance(g, torch.Tensor) or g.dtype != torch.float32:
        got = g.dtype if isinstance(g, torch.Tensor) else type(g).__name__
        raise TypeError(f"{name}: global decode scales must be float32, got {got}")
    if g.dim() != 1 or g.numel() not in allowed:
        raise ValueError(f"{name}: expected a 1D tensor of {' or '.join(map(str, allowed))} elements, got {tuple(g.shape)}")


def _check_bias(bias: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if bias is None:
        return
    if bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")
    if tuple(bias.shape) != shape:
        raise ValueError(f"bias must have shape {shape}, got {tuple(bias.shape)}")


def validate_gemm_operands(
    a_codes, a_scales, a_global, b_codes, b_scales, b_global, bias, out_dtype, mma_k: int = MMA_K
) -> tuple[int, int, int]:
    """Check the raw operands of the dense op for the kernel with MMA K ``mma_k`` (its K rule:
    :func:`.tiles.check_k`); returns (M, N, K). Device-independent."""
    _check_codes(a_codes, "a_codes", 2)
    _check_codes(b_codes, "b_codes", 2)
    m, n, k = a_codes.shape[0], b_codes.shape[0], 2 * a_codes.shape[1]
    if 2 * b_codes.shape[1] != k:
        raise ValueError(f"blackwell NVFP4 GEMM: K mismatch, a has K={k} and b has K={2 * b_codes.shape[1]}")
    check_k(k, mma_k)
    check_swizzled(a_scales, m, k, 1, "a_scales")
    check_swizzled(b_scales, n, k, 1, "b_scales")
    _check_global(a_global, "a_global", (m,))
    _check_global(b_global, "b_global", (n, 1) if n != 1 else (1,))
    _check_bias(bias, (n,))
    _check_out_dtype(out_dtype)
    check_output_size(m * n)
    tensors = [a_codes, a_scales, a_global, b_codes, b_scales, b_global] + ([bias] if bias is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"blackwell NVFP4 GEMM: operands on several devices: {sorted(map(str, devices))}")
    return m, n, k


@custom_op("minite_cute::nvfp4_gemm", mutates_args=())
def nvfp4_gemm_op(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    a_global: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    b_global: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fill: float | None = None,
) -> torch.Tensor:
    """The launch (see the module docstring). Raises BackendUnavailable off Blackwell."""
    mma_k = choose_mma_k(blackwell_arch(a_codes.device))
    m, n, k = validate_gemm_operands(a_codes, a_scales, a_global, b_codes, b_scales, b_global, bias, out_dtype, mma_k)
    arch = device_arch(a_codes.device)
    out = _host.new_output(m, n, dtype=out_dtype, device=a_codes.device, fill=fill)
    if m == 0 or n == 0:
        return out
    from . import _blockscaled_gemm_impl as impl

    config = GemmConfig(
        tile_n=choose_tile_n(n), out_dtype=_OUT_DTYPE_NAMES[out_dtype], has_bias=bias is not None, mma_k=mma_k
    )
    impl.launch(
        config,
        tma_operand(a_codes),
        tma_operand(b_codes),
        tma_operand(a_scales),
        tma_operand(b_scales),
        out,
        a_global.contiguous(),
        b_global.contiguous(),
        None if bias is None else bias.to(torch.float32).contiguous(),
        None,
        m=m,
        n=n,
        k=k,
        groups=1,
        sb_strides=(1 if b_global.numel() == n and n != 1 else 0, 0),
        arch=arch,
    )
    return out


@nvfp4_gemm_op.register_fake
def _(a_codes, a_scales, a_global, b_codes, b_scales, b_global, bias, out_dtype, fill=None):
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[0]), dtype=out_dtype)


def nvfp4_gemm(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fill: float | None = None,
) -> torch.Tensor:
    """``a @ b.T`` for NVFP4 ``a`` ``[..., K]`` and ``b`` ``[N, K]`` -> ``[..., N]`` (``out_dtype``).

    Both operands must carry swizzled block scales (``q.swizzled()``; the ``blackwell``
    backend's quantize returns them so). Any global-scale kind is accepted: per-row or
    per-tensor for either operand. See the module docstring for limits and errors.
    """
    if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
        raise TypeError("nvfp4_gemm takes two NVFP4Tensor operands (quantize them first)")
    for name, q in (("a", a), ("b", b)):
        if q.layout != "swizzled":
            raise ValueError(
                f"nvfp4_gemm: operand {name} has linear block scales; the Blackwell kernel reads the "
                f"128x4 swizzled layout: pass {name}.swizzled()"
            )
    if len(b.shape) != 2:
        raise ValueError(f"nvfp4_gemm: b must be a 2D [N, K] tensor, got shape {tuple(b.shape)}")
    b_global = b.global_decode if b.global_scale == "tensor" else b.row_global_decode()
    out = nvfp4_gemm_op(
        a.codes.reshape(a.rows, a.k // 2),
        operand_scales(a),
        a.row_global_decode().contiguous(),
        b.codes,
        operand_scales(b),
        b_global.reshape(-1),
        bias,
        out_dtype,
        fill,
    )
    return out.reshape(*a.shape[:-1], b.rows)
