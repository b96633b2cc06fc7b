"""The ``triton`` NVFP4 backend: the object ``nvfp4.get_backend("triton")`` loads.

Protocol of :mod:`minite_megatron.nvfp4.backends` (``name``, ``available``, ``why_not``,
``quantize``, ``gemm``, ``grouped_gemm``, ``grouped_wgrad``), each op equal to its reference:

* ``quantize``: :mod:`.quantize`, bitwise (codes, scales, global scales, image), every kwarg.
* ``gemm``: the bf16 image GEMM (:mod:`.gemm`, wgmma on Hopper), or for few rows
  (``options.decode_max_m`` / ``decode_max_n``, where :meth:`~TritonBackend.decode_ok`) the decode
  GEMM on packed weights (:mod:`.decode_gemm`; in strict mode its batch-invariant configuration,
  where :meth:`~TritonBackend.strict_decode_ok`). Operands
  quantized without an image get one from :mod:`.image`.
* ``decode_grouped_gemm``: MoE decode on unsorted rows routed to experts, packed expert weights
  (:mod:`.decode_grouped_gemm`; default mode: the integer-dot kernel, ``options.idot_decode``), no
  host sync (CUDA-graph capturable); where the options switch the decode kernels (``decode_ok``) or
  their strict configuration (``strict_decode_ok``) off, the learner's grouped GEMM on rows sorted
  on the device.
* ``grouped_gemm`` / ``grouped_wgrad`` / ``grouped_wgrad_gemm`` (the GEMM half on operands
  already quantized along padded tokens) / ``quantize_wgrad_operand`` (those operands, padded
  through a gather instead of a copy): :mod:`.grouped_gemm`, :mod:`.grouped_wgrad`.

``batch_invariant=True`` (strict mode) takes the image GEMM with its one fixed config
(``STRICT_CONFIG``; with ``options.strict_canonical`` the contract's own accumulation order, so
strict results are also bitwise equal to the reference), or the decode kernel's strict
configuration, which runs the same chain of tensor-core steps (no split-K) and gives the same
bits (``strict_decode_ok``).

Where it runs: a CUDA device of compute capability >= 8.0 (bf16 tensor cores; TMA paths need
9.0 and fall back to pointer loads below), or CPU tensors under ``TRITON_INTERPRET=1`` (CI).
Elsewhere every op raises :class:`BackendUnavailable` with :meth:`why_not`'s reason.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minite_megatron.nvfp4.backends import Backend, BackendUnavailable
from minite_megatron.nvfp4.formats import BLOCK
from minite_megatron.nvfp4.tensor import NVFP4Tensor
from minite_megatron.nvfp4.gemm import check_gemm_operands
from minite_megatron.nvfp4.group_sizes import GroupSizes
from minite_megatron.nvfp4.grouped import (_take_rows, check_a_rows_in_range, check_decode_grouped_operands,
                                           check_expert_ids_in_range)

from minite_kernels.triton.nvfp4._nvfp4_math import interpreting
from minite_kernels.triton.decode import decode_gemm as _decode
from minite_kernels.triton.decode.decode_gemm import decode_gemm_forward
from minite_kernels.triton.decode.decode_grouped_gemm import decode_grouped_gemm_forward
from minite_kernels.triton.decode.decode_grouped_idot import decode_grouped_idot_forward, decode_idot_gemm_forward
from minite_kernels.triton.nvfp4.gemm import DEFAULT_CONFIG as GEMM_TILE, OUT_DTYPES, gemm_forward
from minite_kernels.triton.nvfp4.grouped_gemm import DEFAULT_CONFIG as GROUPED_GEMM_TILE
from minite_kernels.triton.nvfp4.grouped_gemm import group_offsets, grouped_gemm_forward, grouped_gemm_op
from minite_kernels.triton.nvfp4.grouped_wgrad import DEFAULT_CONFIG as GROUPED_WGRAD_TILE
from minite_kernels.triton.nvfp4.grouped_wgrad import dy_amaxes, grouped_wgrad_forward, grouped_wgrad_op, quantize_wgrad_operand_forward
from minite_kernels.triton.nvfp4.image import image_2d, image_op
from minite_kernels.triton.nvfp4.norm_quantize import rmsnorm_quantize
from minite_kernels.triton.nvfp4.quantize import quantize_forward
from minite_kernels.triton.nvfp4.quantize_tiles import DEFAULT as DEFAULT_TILES, QuantizeTiles
from minite_kernels.triton.nvfp4.swiglu_quantize import swiglu_quantize
from minite_kernels.triton.nvfp4 import group_zero as _group_zero
from minite_kernels.triton.nvfp4 import norm_quantize as _norm_quantize
from minite_kernels.triton.moe import moe_combine as _combine
from minite_kernels.triton.moe import moe_route as _route
from minite_kernels.triton.moe import weighted_swiglu as _wswiglu
from minite_kernels.triton.decode import qk_norm_rope as _qk_norm_rope

@dataclass(frozen=True)
class TritonOptions:
    """The Triton backend's kernel switches; the defaults are what runs (same bits under every
    setting except where noted).

    A benchmark or test that compares settings builds its own backend,
    ``TritonBackend(TritonOptions(...))``, and calls it (or registers it for the block:
    :func:`minite_megatron.nvfp4.backends.registered`), never a module global.

    Attributes:
        strict_canonical: strict mode accumulates in the contract's canonical order (bitwise equal
            to the reference). Off: the canonical GEMM runs ~3.3x cuBLAS time, and the default
            wgmma GEMM is already batch invariant (fixed config). Changes strict results' bits.
        decode_max_m: the decode kernels (packed weights) take GEMMs with at most this many rows.
        decode_max_n: ... and at most this many outputs (None: any N).
        decode_kernels: small-M GEMMs and MoE decode GEMMs dispatch to the decode kernels
            (:mod:`.decode.decode_gemm`, :mod:`.decode.decode_grouped_gemm`); False: the image GEMM
            (MoE decode: the learner's grouped GEMM on rows sorted on the device).
        strict_decode: strict mode takes the decode kernels' strict configuration (its bits equal
            the learner's strict GEMMs: ``tests/kernels/test_decode_strict_bitwise_gpu.py``); on a
            GPU only where K is a whole number of its K steps (the learner's zero-padded tail steps
            are not mimicked). False: strict mode on the image GEMM.
        idot_decode: default-mode MoE decode GEMMs (``batch_invariant=False``) on the integer-dot
            kernel (:mod:`.decode.decode_grouped_idot`: the packed codes of both operands, dp4a);
            False: the tensor-core split-K kernel of :mod:`.decode.decode_grouped_gemm`. Changes
            default-mode bits (another fp32 accumulation, each within the contract's bound).
        idot_dense_max_m: default-mode dense GEMMs with at most this many rows on the integer-dot
            kernel (``decode_grouped_idot.decode_idot_gemm_forward``) where ``idot_decode``; 0: never
            (the tensor-core decode kernel). Its work grows with the rows (a dp4a chain per row),
            the tensor-core kernel's does not: see BENCHMARKS.md for where they cross.
        quantize_tiles: the quantize kernels' GPU launch tiles (:mod:`.nvfp4.quantize_tiles`; the
            same bits under any).
        gemm_tile: the default-mode image GEMM's GPU launch for M > 64, ``(BLOCK_M, BLOCK_N,
            BLOCK_K, GROUP_M, num_warps, num_stages)`` (:data:`.nvfp4.gemm.DEFAULT_CONFIG`; its bits
            depend on BLOCK_K, within the contract's bound under any).
        grouped_gemm_tile: the default-mode grouped GEMM's (fprop, dgrad) GPU launch for more than
            64 rows per expert, ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``
            (:data:`.nvfp4.grouped_gemm.DEFAULT_CONFIG`).
        grouped_wgrad_tile: the grouped wgrad GEMM's GPU launch outside canonical mode, ``(BLOCK_M,
            BLOCK_N, BLOCK_T, num_warps, num_stages)`` (:data:`.nvfp4.grouped_wgrad.DEFAULT_CONFIG`).
        check_expert_ids: eager ``decode_grouped_gemm`` calls check that every expert id is in
            ``[0, E)`` (ValueError; one host sync), as a CUDA-graph capture never does. False skips
            it eagerly too (a row with a bad id then gets NaN): what a captured step runs.
    """

    strict_canonical: bool = False
    decode_max_m: int = 16
    decode_max_n: int | None = None
    decode_kernels: bool = True
    strict_decode: bool = True
    idot_decode: bool = True
    idot_dense_max_m: int = 0
    quantize_tiles: QuantizeTiles = DEFAULT_TILES
    gemm_tile: tuple[int, int, int, int, int, int] = GEMM_TILE
    grouped_gemm_tile: tuple[int, int, int, int, int] = GROUPED_GEMM_TILE
    grouped_wgrad_tile: tuple[int, int, int, int, int] = GROUPED_WGRAD_TILE
    check_expert_ids: bool = True


def _launch(tile: tuple, default: tuple) -> list[int] | None:
    """A kernel's ``config`` argument: None for its default launch, else the tile as a list (the
    custom ops' schema)."""
    return None if tuple(tile) == default else list(tile)


def _global_decode(q: NVFP4Tensor) -> torch.Tensor:
    """The GEMM's per-row or per-tensor scale of a 2D operand (never a stride-0 expansion)."""
    if q.global_scale in ("row", "tensor"):
        return q.global_decode.reshape(-1).contiguous()
    return q.row_global_decode().contiguous()


def _stacked_operands(w: NVFP4Tensor, e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [E*N, K/2], linear block scales [E*N, K/16], global decode)`` of stacked expert
    weights: ``[E]`` per expert for ``"group"`` weights (no per-row expansion: that is a copy of
    ``E*N`` scales per call), ``[E*N]`` per row for the ``[E*N, K]`` matrix form."""
    if w.global_scale == "group":
        lin = w.linear()
        return lin.codes.reshape(e * n, k // 2), lin.block_scales.reshape(e * n, k // BLOCK), w.global_decode.reshape(-1)
    m = w.matrix()
    return m.codes, m.block_scales, m.global_decode


def _grouped_image(b: NVFP4Tensor) -> torch.Tensor:
    """bf16 ``[G, N, K]`` image of grouped weights: the attached one, or one built now."""
    if b.image is not None:
        return b.image
    groups, n, k = b.shape
    lin = b.linear()
    return image_op(lin.codes.reshape(groups * n, k // 2),
                    lin.block_scales.reshape(groups * n, k // BLOCK).view(torch.uint8)).view(groups, n, k)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """A CUDA device's compute capability (fixed for the process: asked once, not at every op)."""
    return torch.cuda.get_device_capability(index)


#: The fused producers' operand limits: width multiple (RMSNorm H; SwiGLU 2F, so F % 16 == 0).
_PRODUCER_WIDTH = {"rmsnorm_quantize": BLOCK, "swiglu_quantize": 2 * BLOCK}


_HALF = (torch.bfloat16, torch.float16)
_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _swiglu_limit(shape) -> str | None:
    dtype, width = shape.get("dtype", torch.bfloat16), shape.get("width", 32)
    if dtype not in _HALF:
        return f"the weighted SwiGLU kernel reads bf16 / fp16, not {dtype}"
    if width <= 0 or width % 32:
        return f"the weighted SwiGLU kernel needs 2F a positive multiple of 32, got {width}"
    return None


def _combine_limit(shape) -> str | None:
    dtype = shape.get("dtype", torch.bfloat16)
    return None if dtype in _COMBINE_DTYPES else f"the MoE combine kernel adds bf16 / fp16 / fp32, not {dtype}"


def _route_limit(shape) -> str | None:
    t, e, k = shape.get("tokens"), shape.get("experts"), shape.get("topk")
    if None not in (t, e, k) and not _route.fits(t, e, k):
        return f"{t} tokens x {e} experts (top-{k}) do not fit one routing program"
    return None


def _group_zero_limit(shape) -> str | None:
    return None if shape.get("contiguous", True) else "the group-zero kernel writes a contiguous output only"


#: op -> the kernel's operand limits (``supports(op, **shape)``): shape facts the callers pass.
_MOE_LIMITS = {
    "weighted_swiglu": _swiglu_limit, "weighted_swiglu_backward": _swiglu_limit,
    "deterministic_unpermute": _combine_limit, "ordered_sum": _combine_limit, "moe_sum_rows": _combine_limit,
    "moe_route": _route_limit, "zero_empty_groups": _group_zero_limit,
}


class TritonBackend(Backend):
    """NVFP4 contract on Triton kernels (see the module docstring)."""

    name = "triton"
    device_group_sizes = True  # every grouped op takes a DeviceGroupSizes (device offsets, the width bound)

    def __init__(self, options: TritonOptions | None = None):
        self.options = options if options is not None else TritonOptions()
        o = self.options  # the GEMM kernels' ``config`` arguments (None: their default launches)
        self._gemm_cfg = _launch(o.gemm_tile, GEMM_TILE)
        self._grouped_cfg = _launch(o.grouped_gemm_tile, GROUPED_GEMM_TILE)
        self._wgrad_cfg = _launch(o.grouped_wgrad_tile, GROUPED_WGRAD_TILE)
        self._bounds: dict = {}  # moe_sum_rows: (tokens, k, device) -> the fixed row bounds

    # ---- the batch-invariant ops (:mod:`.invariant`, imported on first use; references: the torch
    # formulations of :mod:`minite_megatron.invariant`) -----------------------------------------
    @staticmethod
    def _invariant_limit(op: str, shape) -> str | None:
        """The ``bi_*`` kernels' operand limits (``supports(op, **shape)``)."""
        if op == "bi_rmsnorm_backward":
            from .invariant.bi_rmsnorm_backward import MAX_H

            if shape.get("width", 0) > MAX_H:
                return f"the one-pass RMSNorm backward kernel takes rows of at most {MAX_H}, got {shape['width']}"
        return None

    def bi_matmul(self, x2d, weight, bias, out_dtype):
        """:mod:`.invariant.bi_matmul`: one fixed tile configuration, K walked in order, no split-K."""
        from .invariant.bi_matmul import bi_matmul

        self._require(x2d.device)
        return bi_matmul(x2d, weight, bias, out_dtype)

    def bi_rmsnorm(self, x2d, weight, eps, zero_centered_gamma):
        """:mod:`.invariant.bi_rmsnorm`: one fixed-size block reduction per row."""
        from .invariant.bi_rmsnorm import bi_rmsnorm

        self._require(x2d.device)
        return bi_rmsnorm(x2d, weight, eps, zero_centered_gamma)

    def bi_rmsnorm_backward(self, gy, x2d, weight, eps, zero_centered_gamma, weight_grad=True):
        """:mod:`.invariant.bi_rmsnorm_backward`: ``dx`` and the weight gradient in one pass (H <= its ``MAX_H``)."""
        from .invariant.bi_rmsnorm_backward import bi_rmsnorm_backward

        self._require(x2d.device)
        reason = self._invariant_limit("bi_rmsnorm_backward", {"width": x2d.shape[-1]})
        if reason is not None:
            self._refuse("bi_rmsnorm_backward", reason)
        return bi_rmsnorm_backward(gy, x2d, weight, eps, zero_centered_gamma, weight_grad)

    def bi_log_softmax(self, x2d):
        """:mod:`.invariant.bi_log_softmax`: one program per row, a fixed chunk order."""
        from .invariant.bi_log_softmax import bi_log_softmax

        self._require(x2d.device)
        return bi_log_softmax(x2d)

    def bi_attention(self, q, k, v, mask, scale, causal, return_lse=False):
        """:mod:`.invariant.bi_attention`: one fixed KV-block order for prefill and decode."""
        from .invariant.bi_attention import bi_attention

        self._require(q.device)
        return bi_attention(q, k, v, mask, scale, causal, return_lse=return_lse)

    def decode_ok(self, device: torch.device) -> bool:
        """May small-M GEMMs dispatch to the decode kernels (``options.decode_kernels``)?"""
        return self.options.decode_kernels

    def strict_decode_ok(self, k: int, device: torch.device) -> bool:
        """May strict mode use the decode kernels' strict configuration for this K
        (``options.strict_decode``; on a GPU K a multiple of its K step)?"""
        if not (self.options.decode_kernels and self.options.strict_decode):
            return False
        return device.type == "cpu" or k % _decode.GPU_STRICT_DECODE["BLOCK_K"] == 0

    def idot_decode_ok(self, device: torch.device) -> bool:
        """May default-mode MoE decode GEMMs run the integer-dot kernel (``options.idot_decode``)?"""
        return self.options.idot_decode

    def why_not(self, device: torch.device | str | None = None) -> str | None:
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "no CUDA device is available"
            cc = _capability(device.index if device.index is not None else torch.cuda.current_device())
            if cc < (8, 0):
                return f"needs a GPU of compute capability >= 8.0 (bf16 tensor cores); {device} has {cc[0]}.{cc[1]}"
            return None
        if device.type == "cpu":
            if interpreting():
                return None
            return "CPU tensors run the Triton kernels only under TRITON_INTERPRET=1 (tests); use the reference backend"
        return f"unsupported device type {device.type!r}"

    def supports(self, op: str, **shape) -> str | None:
        """The base check, then the kernels' limits: the fused producers write per-token
        (``global_scale="row"``) bf16/fp16 operands of a width multiple of 16 (SwiGLU: 2F of 32);
        the ``*_nt`` GEMMs read 16x16-tile weights transposed."""
        reason = super().supports(op, **shape)
        if reason is None and op in _PRODUCER_WIDTH:
            if shape.get("global_scale", "row") != "row":
                reason = f"the fused {op} kernel writes per-token scales, not {shape['global_scale']!r}"
            elif shape.get("dtype", torch.bfloat16) not in (torch.bfloat16, torch.float16):
                reason = f"the fused {op} kernel reads bf16 / fp16, not {shape['dtype']}"
            elif shape.get("width", 0) % _PRODUCER_WIDTH[op]:
                reason = f"the fused {op} kernel needs a width multiple of {_PRODUCER_WIDTH[op]}, got {shape['width']}"
        if reason is None and op in _MOE_LIMITS:
            reason = _MOE_LIMITS[op](shape)
        if reason is None and op.startswith("bi_"):
            reason = self._invariant_limit(op, shape)
        if reason is None and op in ("gemm_nt", "grouped_gemm_nt") and tuple(shape.get("tile", (BLOCK, BLOCK))) != (BLOCK, BLOCK):
            reason = f"{op} reads a weight of 16x16 tiles transposed; this one has {tuple(shape['tile'])} blocks"
        if reason is None and op == "decode_grouped_gemm" and shape.get("a_rows"):
            reason = self._rows_by_index_limit(shape.get("batch_invariant", False), torch.device(shape.get("device", "cuda")))
        return reason

    def _rows_by_index_limit(self, batch_invariant: bool, device: torch.device) -> str | None:
        """Why ``decode_grouped_gemm(..., a_rows=)`` gathers the rows before its kernel (None: the
        integer-dot kernel reads them by index)."""
        if batch_invariant:
            return "the strict MoE decode kernel reads its rows in order: they are gathered first"
        if not (self.decode_ok(device) and self.idot_decode_ok(device)):
            return "only the integer-dot MoE decode kernel reads rows by index: they are gathered first"
        return None

    def _require(self, device: torch.device) -> None:
        reason = self.why_not(device)
        if reason is not None:
            raise BackendUnavailable(f"NVFP4 backend 'triton' unavailable on {device}: {reason}")

    # ---- quantize -------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, **kwargs) -> NVFP4Tensor:
        """:func:`nvfp4.quantize_reference`'s signature and result, bit for bit."""
        if isinstance(x, torch.Tensor):
            self._require(x.device)
        return quantize_forward(x, tiles=self.options.quantize_tiles, **kwargs)

    # ---- fused producers ------------------------------------------------------------------
    def rmsnorm_quantize(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                         zero_centered_gamma: bool = False, **kwargs) -> tuple[torch.Tensor, NVFP4Tensor]:
        """RMSNorm (``bi_rmsnorm``'s arithmetic, bitwise) and the per-token NVFP4 of its output from
        one kernel (:mod:`.norm_quantize`; ``nvfp4.producers.rmsnorm_quantize_reference``)."""
        self._require(x.device)
        return rmsnorm_quantize(x, weight, eps, zero_centered_gamma, **kwargs)

    def swiglu_quantize(self, h: torch.Tensor, **kwargs) -> tuple[torch.Tensor, NVFP4Tensor]:
        """Megatron's SwiGLU of ``h`` [M, 2F] and the per-token NVFP4 of it, one kernel
        (:mod:`.swiglu_quantize`; ``nvfp4.producers.swiglu_quantize_reference``)."""
        self._require(h.device)
        return swiglu_quantize(h, **kwargs)

    # ---- MoE ops and the decode step's fusions ---------------------------------------------
    def weighted_swiglu(self, h, probs, *, inline_glu=False):
        """:mod:`.moe.weighted_swiglu` (``probs`` fp32); the reference where :meth:`supports` says no."""
        if _swiglu_limit({"dtype": h.dtype, "width": h.shape[-1] if h.dim() == 2 else 0}) is not None:
            return super().weighted_swiglu(h, probs, inline_glu=inline_glu)
        self._require(h.device)
        return _wswiglu.weighted_swiglu(h, probs.float(), inline_glu=inline_glu)

    def weighted_swiglu_backward(self, dy, h, probs):
        """The fused backward of :mod:`.moe.weighted_swiglu`; the reference where :meth:`supports` says no."""
        if _swiglu_limit({"dtype": h.dtype, "width": h.shape[-1] if h.dim() == 2 else 0}) is not None:
            return super().weighted_swiglu_backward(dy, h, probs)
        self._require(h.device)
        return _wswiglu.weighted_swiglu_backward(dy, h, probs.float())

    def deterministic_unpermute(self, permuted, sorted_indices, num_tokens):
        """:func:`.moe.moe_combine.deterministic_unpermute` (out-of-range indices: a device-side assertion)."""
        if _combine_limit({"dtype": permuted.dtype}) is not None:
            return super().deterministic_unpermute(permuted, sorted_indices, num_tokens)
        self._require(permuted.device)
        return _combine.deterministic_unpermute(permuted, sorted_indices, num_tokens)

    def ordered_sum(self, rows):
        """:func:`.moe.moe_combine.ordered_sum` for ``[T, k, H]`` rows."""
        if rows.dim() != 3 or _combine_limit({"dtype": rows.dtype}) is not None:
            return super().ordered_sum(rows)
        self._require(rows.device)
        return _combine.ordered_sum(rows)

    def moe_sum_rows(self, rows, combine, k):
        """``minite::moe_sum_rows`` over the fixed bounds ``0, k, 2k, ..`` (made once per shape, on the
        first eager call, before any CUDA-graph capture reads them)."""
        if _combine_limit({"dtype": rows.dtype}) is not None:
            return super().moe_sum_rows(rows, combine, k)
        self._require(rows.device)
        t = combine.numel() // k
        key = (t, k, rows.device)
        bounds = self._bounds.get(key)
        if bounds is None:
            bounds = self._bounds[key] = torch.arange(0, t * k + 1, k, dtype=torch.int32, device=rows.device)
        return torch.ops.minite.moe_sum_rows(rows, combine, bounds, 0)

    def zero_empty_groups(self, out, counts):
        """:mod:`.nvfp4.group_zero`: only the empty groups' slices written (a contiguous ``out``)."""
        if not out.is_contiguous():
            return super().zero_empty_groups(out, counts)
        self._require(out.device)
        return _group_zero.zero_empty_groups(out, counts.to(out.device))

    def moe_route(self, logits, k, scaling_factor=None):
        """:mod:`.moe.moe_route`: router logits -> top-k -> probabilities -> expert-major rows, one kernel."""
        self._require(logits.device)
        reason = _route_limit({"tokens": logits.shape[0], "experts": logits.shape[1], "topk": k})
        if reason is not None:
            self._refuse("moe_route", reason)
        return _route.moe_route(logits, k, scaling_factor)

    def add_rmsnorm_quantize(self, residual, x, weight, eps, zero_centered_gamma=False, **kwargs):
        """:func:`.nvfp4.norm_quantize.add_rmsnorm_quantize` (``bi_rmsnorm``'s arithmetic)."""
        self._require(x.device)
        return _norm_quantize.add_rmsnorm_quantize(residual, x, weight, eps, zero_centered_gamma, **kwargs)

    def qk_norm_rope_cache(self, mixed, wq, wk, eps, zero_centered_gamma, cos, sin, positions, k_cache, v_cache,
                           groups, heads_per_group):
        """:mod:`.decode.qk_norm_rope`: q/k RMSNorm + RoPE + KV-cache write of all heads, one kernel."""
        self._require(mixed.device)
        return _qk_norm_rope.qk_norm_rope_cache(mixed, wq, wk, eps, zero_centered_gamma, cos, sin, positions, k_cache, v_cache,
                                   groups, heads_per_group)

    # ---- dense GEMM -----------------------------------------------------------------------
    def gemm(
        self,
        a: NVFP4Tensor,
        b: NVFP4Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """``a @ b.T``: ``a`` [..., K], ``b`` [N, K] (any global scale) -> ``[..., N]``."""
        check_gemm_operands(a, b)
        self._require(a.device)
        if out_dtype not in OUT_DTYPES:
            raise TypeError(f"nvfp4.gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
        bm = b.matrix()
        n = bm.rows
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"nvfp4.gemm: bias must have shape ({n},), got {tuple(bias.shape)}")
        a_img = image_2d(a)
        a_scale, b_scale = _global_decode(a), _global_decode(bm)
        o = self.options
        if (not batch_invariant and 0 < a.rows <= o.idot_dense_max_m and bm.layout == "linear"
                and self.idot_decode_ok(a.device)):
            out = decode_idot_gemm_forward(a.codes.reshape(a.rows, a.k // 2), a.linear_scales().view(torch.uint8),
                                           a_scale, bm.codes, bm.block_scales.view(torch.uint8), b_scale, bias, out_dtype)
        elif (0 < a.rows <= o.decode_max_m and self.decode_ok(a.device) and (o.decode_max_n is None or n <= o.decode_max_n)
                and bm.layout == "linear" and (not batch_invariant or self.strict_decode_ok(a.k, a.device))):
            out = decode_gemm_forward(a_img, bm.codes, bm.block_scales.view(torch.uint8), a_scale, b_scale,
                                      bias, out_dtype, batch_invariant)
        else:
            out = gemm_forward(a_img, image_2d(bm), a_scale, b_scale, bias, out_dtype, batch_invariant,
                               canonical=batch_invariant and self.options.strict_canonical, config=self._gemm_cfg)
        return out.reshape(*a.shape[:-1], n)

    def gemm_nt(
        self,
        a: NVFP4Tensor,
        b: NVFP4Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """``a @ b`` for ``b`` ``[N, K]`` (16x16 tiles, tensor scale) -> ``[..., K]``: the dgrad
        GEMM ``dY @ W``, equal to ``gemm(a, b.transpose())`` bit for bit, reading ``b``'s image
        transposed (a strided view; built just in time if ``b`` has none) instead of a relayout."""
        if b.tile != (BLOCK, BLOCK) or b.global_scale != "tensor" or len(b.shape) != 2:
            raise ValueError("gemm_nt: b must be a [N, K] NVFP4 tensor with 16x16 tiles and a tensor scale")
        if a.k != b.shape[0]:
            raise ValueError(f"gemm_nt: a has K={a.k}, b has {b.shape[0]} rows")
        self._require(a.device)
        n_out = b.shape[1]
        o = self.options
        if not batch_invariant and 0 < a.rows <= o.decode_max_m and (o.decode_max_n is None or n_out <= o.decode_max_n):
            return self.gemm(a, b.transpose(), bias, out_dtype, batch_invariant)  # the decode kernel reads codes
        if out_dtype not in OUT_DTYPES:
            raise TypeError(f"nvfp4.gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
        bm = b.linear()
        out = gemm_forward(image_2d(a), image_2d(bm).t(), _global_decode(a), _global_decode(bm), bias, out_dtype,
                           batch_invariant, canonical=batch_invariant and self.options.strict_canonical,
                           config=self._gemm_cfg)
        return out.reshape(*a.shape[:-1], n_out)

    # ---- grouped (MoE) GEMMs --------------------------------------------------------------
    def grouped_gemm(
        self,
        a: NVFP4Tensor,
        b: NVFP4Tensor,
        group_sizes: Sequence[int] | torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """MoE fprop/dgrad: ``a`` [M, K] rows sorted by group, ``b`` [G, N, K] (``"group"`` scales)."""
        if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
            raise TypeError("grouped_gemm takes two NVFP4Tensor operands (quantize them first)")
        if b.global_scale != "group" or len(b.shape) != 3:
            raise ValueError("grouped_gemm: b must be a [G, N, K] tensor with global_scale='group'")
        if a.k != b.k:
            raise ValueError(f"grouped_gemm: K mismatch, a has K={a.k} and b has K={b.k}")
        self._require(a.device)
        am = a.matrix()
        return grouped_gemm_forward(image_2d(am), _grouped_image(b), group_sizes, _global_decode(am), b.global_decode,
                                    bias, out_dtype, batch_invariant, canonical=batch_invariant and self.options.strict_canonical,
                                    config=self._grouped_cfg)

    def decode_grouped_gemm(
        self,
        a: NVFP4Tensor,
        w_stacked: NVFP4Tensor,
        expert_ids: torch.Tensor,
        out_dtype: torch.dtype = torch.bfloat16,
        batch_invariant: bool = False,
        *,
        num_experts: int | None = None,
        group_offsets: torch.Tensor | None = None,
        a_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MoE decode: ``out[r] = gemm(a[r], w_stacked[expert_ids[r]])`` -> ``[R, N]``
        (``nvfp4.grouped.decode_grouped_gemm_reference``'s contract; ``w_stacked`` ``[E, N, K]``
        or its ``[E*N, K]`` matrix with ``num_experts``). No host sync while a CUDA graph is being
        captured; eagerly, expert ids outside ``[0, E)`` raise ValueError (one sync).
        ``group_offsets`` (optional int32 ``[E + 1]`` prefix offsets on the device) says the rows are
        already sorted by expert (Megatron's expert-major order), expert ``g``'s rows at
        ``offsets[g]:offsets[g + 1]``: the fallback through the learner's grouped GEMM then reads
        them as they are instead of sorting (same bits). ``a_rows`` (int ``[R]``): product row ``r``
        takes row ``a_rows[r]`` of ``a`` -- read by index in the integer-dot kernel, gathered first
        on the other paths (:meth:`supports` with ``a_rows=True`` says which); eagerly an index
        outside ``a``'s rows raises ValueError, under capture its row is NaN (integer-dot kernel)."""
        e, n, k = check_decode_grouped_operands(a, w_stacked, expert_ids, num_experts, a_rows)
        self._require(a.device)
        if out_dtype not in OUT_DTYPES:
            raise TypeError(f"decode_grouped_gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
        capturing = a.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.options.check_expert_ids and not capturing:
            check_expert_ids_in_range(expert_ids, e)
            if a_rows is not None:
                check_a_rows_in_range(a_rows, a.rows)
        if a_rows is not None and self._rows_by_index_limit(batch_invariant, a.device) is not None:
            a, a_rows = _take_rows(a, a_rows.to(torch.int64)), None
        if not self.decode_ok(a.device) or (batch_invariant and not self.strict_decode_ok(k, a.device)):
            return self._sorted_grouped_decode(a, w_stacked, expert_ids, e, n, k, out_dtype, batch_invariant,
                                               group_offsets)
        w_codes, w_scales, w_scale = _stacked_operands(w_stacked, e, n, k)
        if not batch_invariant and self.idot_decode_ok(a.device):
            return decode_grouped_idot_forward(
                a.codes.reshape(a.rows, k // 2), a.linear_scales().view(torch.uint8), _global_decode(a), w_codes,
                w_scales.view(torch.uint8), w_scale, e, expert_ids=None if group_offsets is not None else expert_ids,
                offsets=group_offsets, out_dtype=out_dtype, a_rows=a_rows)
        return decode_grouped_gemm_forward(image_2d(a), w_codes, w_scales.view(torch.uint8), w_scale,
                                           expert_ids, _global_decode(a), e, out_dtype, batch_invariant)

    def _sorted_grouped_decode(self, a, w_stacked, expert_ids, e, n, k, out_dtype, batch_invariant,
                               group_offsets=None):
        """Decode through the learner's grouped GEMM (strict: its strict config): rows sorted by
        expert on the device (stable), group sizes counted with ``scatter_add_`` (no sync),
        results put back -- or, with ``group_offsets``, the rows as given (already sorted). Needs
        the experts' bf16 images: the attached one (the learner's ``"group"`` weights carry it)
        or one made here from all experts' bytes."""
        order = sizes = valid = None
        if group_offsets is None:
            # ids outside [0, E) (unchecked: check_expert_ids=False or under capture) are counted and
            # gathered as expert 0 and their rows made NaN, as the decode kernel does: an index out of
            # range would be a device-side assert that poisons the whole CUDA context
            ids = expert_ids.to(torch.int64)
            valid = (ids >= 0) & (ids < e)
            ids = torch.where(valid, ids, 0)
            order = torch.argsort(ids, stable=True)
            sizes = torch.zeros(e, dtype=torch.int32, device=a.device).scatter_add_(
                0, ids, torch.ones_like(ids, dtype=torch.int32))
        a_img, a_scale = image_2d(a), _global_decode(a)
        w_codes, w_scales, w_scale = _stacked_operands(w_stacked, e, n, k)
        if w_stacked.image is not None:
            w_img = w_stacked.image.reshape(e, n, k)
        else:
            w_img = image_op(w_codes, w_scales.view(torch.uint8)).view(e, n, k)
        if w_stacked.global_scale != "group":
            w_scale = w_scale.reshape(e, n)[:, 0].contiguous()
        if order is None:  # rows already sorted: the learner's grouped GEMM on the given offsets
            if tuple(group_offsets.shape) != (e + 1,) or group_offsets.dtype != torch.int32:
                raise ValueError(f"decode_grouped_gemm: group_offsets must be int32 [{e + 1}], got "
                                 f"{group_offsets.dtype} {tuple(group_offsets.shape)}")
            return grouped_gemm_op(a_img.contiguous(), w_img, group_offsets, a_scale.float().reshape(-1),
                                   w_scale.float().reshape(-1), None, out_dtype, batch_invariant,
                                   batch_invariant and self.options.strict_canonical, self._grouped_cfg)
        sorted_out = grouped_gemm_forward(a_img[order], w_img, sizes, a_scale[order] if a_scale.numel() > 1 else a_scale,
                                          w_scale, None, out_dtype, batch_invariant,
                                          canonical=batch_invariant and self.options.strict_canonical,
                                          config=self._grouped_cfg)
        out = torch.empty_like(sorted_out)
        out[order] = sorted_out
        return out.masked_fill_(~valid[:, None], float("nan"))

    def grouped_gemm_nt(
        self,
        a: NVFP4Tensor,
        b: NVFP4Tensor,
        group_sizes: Sequence[int] | torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """MoE dgrad ``dx_g = dy_g @ W_g``: ``a`` [M, N] rows sorted by group, ``b`` [G, N, K]
        (16x16 tiles, ``"group"`` scales) -> ``[M, K]``; equal to ``grouped_gemm(a, b.transpose())``
        bit for bit, reading ``b``'s image transposed (built just in time if ``b`` has none)."""
        if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
            raise TypeError("grouped_gemm_nt takes two NVFP4Tensor operands (quantize them first)")
        if b.global_scale != "group" or len(b.shape) != 3 or b.tile != (BLOCK, BLOCK):
            raise ValueError("grouped_gemm_nt: b must be a [G, N, K] tensor with 16x16 tiles and global_scale='group'")
        if a.k != b.shape[1]:
            raise ValueError(f"grouped_gemm_nt: a has K={a.k}, b has N={b.shape[1]}")
        self._require(a.device)
        am = a.matrix()
        return grouped_gemm_forward(image_2d(am), _grouped_image(b).transpose(1, 2), group_sizes, _global_decode(am),
                                    b.global_decode, bias, out_dtype, batch_invariant,
                                    canonical=batch_invariant and self.options.strict_canonical,
                                    config=self._grouped_cfg)

    def grouped_wgrad(
        self,
        grad_out: torch.Tensor,
        x: torch.Tensor,
        group_sizes: Sequence[int] | torch.Tensor,
        **kwargs,
    ) -> torch.Tensor:
        """MoE wgrad ``dW[g] = dY_g^T @ X_g`` -> ``[G, N, K]`` (kwargs of the reference)."""
        self._require(x.device)
        return grouped_wgrad_forward(grad_out, x, group_sizes, **kwargs, config=self._wgrad_cfg)

    def quantize_wgrad_operand(self, t: torch.Tensor, group_sizes: Sequence[int], **kwargs) -> NVFP4Tensor:
        """``nvfp4.quantize_wgrad_operand`` (each group's tokens padded to 16, along tokens) read in
        place through a gather, no padded copy (:func:`.grouped_wgrad.quantize_wgrad_operand_forward`)."""
        self._require(t.device)
        return quantize_wgrad_operand_forward(t, group_sizes, **kwargs)

    def dy_amaxes(self, dy: torch.Tensor, group_sizes: Sequence[int], rht_seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One read of ``dy`` for its dgrad and wgrad operands' amaxes (:func:`.grouped_wgrad.dy_amaxes`)."""
        self._require(dy.device)
        return dy_amaxes(dy, group_sizes, rht_seed)

    def grouped_wgrad_gemm(
        self,
        a: NVFP4Tensor,
        b: NVFP4Tensor,
        padded_group_sizes: Sequence[int],
        out_dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """The GEMM half of the MoE wgrad on operands quantized along padded tokens:
        ``a`` [N, T_pad], ``b`` [K, T_pad] -> ``[G, N, K]`` (``grouped_wgrad_gemm_reference``)."""
        if not isinstance(a, NVFP4Tensor) or not isinstance(b, NVFP4Tensor):
            raise TypeError("grouped_wgrad_gemm takes two NVFP4Tensor operands")
        sizes = GroupSizes.of(padded_group_sizes)  # its offsets: those its sizes were padded from, if so
        if sizes.padded() is not sizes:  # (DeviceGroupSizes: its padded view)
            raise ValueError(f"grouped_wgrad_gemm: padded group sizes must be multiples of {BLOCK}: {sizes}")
        if a.k != b.k or a.k != sizes.total:
            raise ValueError(
                f"grouped_wgrad_gemm: operands have K={a.k} and K={b.k}, padded groups sum to {sizes.total}"
            )
        if out_dtype not in OUT_DTYPES:
            raise TypeError(f"grouped_wgrad_gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
        self._require(a.device)
        am, bm = a.matrix(), b.matrix()
        poffs = group_offsets(sizes, a.device)
        a_img, b_img = image_2d(am).contiguous(), image_2d(bm).contiguous()
        return grouped_wgrad_op(a_img, b_img, poffs, _global_decode(am), _global_decode(bm), len(sizes), out_dtype,
                                batch_invariant and self.options.strict_canonical, self._wgrad_cfg)


BACKEND = TritonBackend()
