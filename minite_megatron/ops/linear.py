"""The NVFP4 linear: ``y = x @ W^T + b`` with fprop, dgrad and wgrad in NVFP4 (full update).

::

    fprop   y  = gemm(Q_row(x),           Q_2d(W))             x: per-token global scale
    dgrad   dx = gemm(Q_row(dy, SR),      Q_2d(W)^T)           W^T: exact relayout of Q_2d(W)
    wgrad   dW = gemm(Q_col(dy, SR, RHT), Q_col(x, RHT))       both along tokens, fp32 output

``Q_col(t)`` quantizes ``t^T`` (blocks of 16 tokens; the token count is zero-padded to a multiple
of 16, which leaves dW unchanged). The forward saves ``Q_col(x)`` (packed
codes and scales: 4.5 bits per element) for wgrad, never a BF16 copy of x. The quantized weight
comes from a :class:`~.weight_cache.QuantizedWeightCache` (once per weight version; codes and
scales only in training, the GEMM builds the BF16 image it needs just in time; the dgrad GEMM
reads it transposed through :func:`dgrad_gemm`).
Stochastic-rounding seeds come from :mod:`.seeds` (a hash of the iteration, the call and the rank
under ``megatron.training``), so a run resumed from a checkpoint rounds like an uninterrupted one.

Where the weight has Megatron's fp32 ``main_grad``, the fp32 wgrad is added there directly (one
fp32 add, no BF16 rounding of the gradient) and a dummy gradient is returned, as Megatron's own
gradient-accumulation fusion does, so DDP's hooks still fire.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import nvfp4
from ..nvfp4.tensor import NVFP4Tensor
from ..recipe import Recipe
from .handoff import Handoff, activation_key
from .amax_sync import needs_sync
from .roles import domain_split, gemm_role, quantize_role
from .seeds import next_sr_seed
from .trace_hook import capture
from .weight_cache import QuantizedWeightCache


@dataclass
class LinearContext:
    """Per-module state the autograd function needs (not tensors).

    ``tp_group`` / ``parallel_mode`` ("column": weight rows and output features sharded; "row":
    weight columns and input features sharded) let amaxes of split scale domains be
    max-reduced across ranks (:mod:`.amax_sync`), so the quantized bytes do not depend on TP.
    """

    recipe: Recipe
    cache: QuantizedWeightCache
    trace_name: str | None = None
    tp_group: object = None
    parallel_mode: str | None = None
    handoff: Handoff | None = None  # the slot a producer offers this linear's input in (spec)

    @property
    def row(self) -> bool:
        return self.parallel_mode == "row"


def backend_for(recipe: Recipe, device: torch.device):
    return nvfp4.get_backend(recipe.backend, device)


def quantize_weight(weight: torch.Tensor, recipe: Recipe, backend, lctx: "LinearContext | None" = None,
                    with_image: bool = True) -> NVFP4Tensor:
    """The forward weight operand ``[N, K]`` (:func:`~.roles.gemm_role` fprop / weight: 16x16
    tiles or 1x16, one tensor scale: the amax of the whole, unsharded weight under TP)."""
    return _quantize(gemm_role(recipe, "fprop", "weight"), weight, recipe, lctx, backend, with_image=with_image)


def weight_operand(lctx: "LinearContext", weight: torch.Tensor, backend, with_image: bool | None = None,
                   image_once: bool = False) -> NVFP4Tensor:
    """The cached NVFP4 weight of a linear (quantized when its version changed); with its BF16
    image only where the cache's ``keep_images()`` says (``with_image``: that answer, taken
    where autograd's grad mode is the caller's). ``image_once`` (the forward GEMM): a weight
    quantized now comes with its image for this call, the cache keeping codes only
    (:meth:`~.weight_cache.QuantizedWeightCache.get`)."""
    recipe = lctx.recipe
    return lctx.cache.get(weight, lambda w, image: quantize_weight(w, recipe, backend, lctx, image),
                          extra=backend.name, with_image=with_image, image_once=image_once)


def dgrad_gemm(backend, qdy: NVFP4Tensor, qw: NVFP4Tensor, cache: QuantizedWeightCache, make_transposed,
               out_dtype: torch.dtype, batch_invariant: bool, group_sizes=None) -> torch.Tensor:
    """``dx = dy @ W`` (dense) or per expert ``dx_g = dy_g @ W_g`` (``group_sizes``).

    With 16x16 tiles the quantization of ``W^T`` is a relayout of ``W``'s (same codes, scales and
    global scale per element), so a backend that supports ``gemm_nt`` / ``grouped_gemm_nt`` (the
    Triton one: the image of ``W`` read transposed) needs no transposed copy; other backends get
    the relayout, made once per weight version (``make_transposed``) and released with the entry.
    Same bits either way.
    """
    if backend.supports("gemm_nt" if group_sizes is None else "grouped_gemm_nt", tile=qw.tile) is None:
        if group_sizes is None:
            return backend.gemm_nt(qdy, qw, None, out_dtype, batch_invariant)
        return backend.grouped_gemm_nt(qdy, qw, group_sizes, None, out_dtype, batch_invariant)
    qwt = cache.transposed(make_transposed)
    if group_sizes is None:
        return backend.gemm(qdy, qwt, None, out_dtype=out_dtype, batch_invariant=batch_invariant)
    return backend.grouped_gemm(qdy, qwt, group_sizes, None, out_dtype, batch_invariant)


def wgrad_dtype(weight: torch.Tensor) -> torch.dtype:
    """The wgrad GEMM's output dtype: fp32 into Megatron's ``main_grad``, else the weight's own
    (the kernel rounds its fp32 result once: the same bits as an fp32 output rounded after)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and hasattr(weight, "grad_added_to_main_grad"):
        return torch.float32
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def weight_transposed(q: NVFP4Tensor, weight: torch.Tensor, recipe: Recipe, backend, lctx: "LinearContext | None" = None) -> NVFP4Tensor:
    """The dgrad operand ``W^T`` ``[K, N]``: an exact relayout for 16x16 tiles, else re-quantized."""
    return _quantize(gemm_role(recipe, "dgrad", "weight"), weight, recipe, lctx, backend, fprop_weight=q)


def _quantize(role, t, recipe: Recipe, lctx: "LinearContext | None", backend, **kwargs) -> NVFP4Tensor:
    """:func:`~.roles.quantize_role` with the linear's TP group and parallel mode (none without ``lctx``)."""
    tp = {} if lctx is None else dict(tp_group=lctx.tp_group, parallel_mode=lctx.parallel_mode)
    return quantize_role(role, t, recipe, backend, **tp, **kwargs)


def _trace(ctx: LinearContext, point: str, tensor: torch.Tensor) -> None:
    if ctx.trace_name is not None:
        capture(f"{ctx.trace_name}.{point}", tensor)


def add_wgrad(weight: torch.Tensor, dw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Accumulate an fp32 wgrad into Megatron's ``main_grad`` when there is one; returns the
    gradient autograd should see (a dummy when it went to ``main_grad``)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and hasattr(weight, "grad_added_to_main_grad"):
        main_grad.add_(dw.to(main_grad.dtype))
        weight.grad_added_to_main_grad = True
        return torch.empty(weight.shape, dtype=like.dtype, device=like.device)
    return dw.to(weight.dtype)


# ---- the operands of the three GEMMs (shared with the grouped linear; the rule: .roles) --------
def takes_handed_quantization(lctx: LinearContext) -> bool:
    """May this linear's fprop input quantization come from its producer (per-token scales of whole
    rows: no amax shared across ranks)? Where True, a fused producer's NVFP4 of the input under
    :func:`~.handoff.activation_key` is what :func:`quantize_activation` would compute."""
    return lctx.recipe.activation_scale == "row" and not needs_sync("row", lctx.tp_group, rows_sharded=False,
                                                                     k_sharded=lctx.row)


def quantize_activation(x2: torch.Tensor, lctx: LinearContext, backend) -> NVFP4Tensor:
    """fprop input ``[M, K]``: per-token (or tensor) scale; K is split under row parallelism.
    Taken from ``lctx.handoff`` (:mod:`.handoff`) when its producer quantized this very tensor."""
    recipe, slot = lctx.recipe, lctx.handoff
    qx = None
    if takes_handed_quantization(lctx):
        qx = slot and slot.take(x2, activation_key(recipe, backend))  # a fused producer's output (ops.producers)
    if qx is None:
        qx = _quantize(gemm_role(recipe, "fprop", "input"), x2, recipe, lctx, backend)
    _trace(lctx, "input_codes", qx.codes)
    _trace(lctx, "input_scales", qx.block_scales.view(torch.uint8))
    return qx


def quantize_dgrad_operand(dy: torch.Tensor, lctx: LinearContext, backend, amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """dgrad's gradient ``[M, N]`` along N (split under column parallelism), SR if the recipe says;
    ``amax``: its tensor amax if already known (:func:`shared_dy_amaxes`)."""
    return _quantize(gemm_role(lctx.recipe, "dgrad", "grad"), dy, lctx.recipe, lctx, backend, amax=amax)


def shared_dy_amaxes(dy: torch.Tensor, group_sizes, lctx: LinearContext, backend):
    """``(dgrad operand amax, wgrad operand amax)`` of the gradient ``dy`` [M, N] from one read
    (``backend.dy_amaxes``), or ``(None, None)`` where each quantizer takes its own pass: a scale
    that is not per tensor, a domain split across tensor-parallel ranks (their max-reduce), no
    such kernel, or no rows. The shared read gives the separate passes' amaxes (NaN, inf) and so the
    same gradients bit for bit (``tests/ops/test_nvfp4_linear_ops.py -k both_amaxes``)."""
    recipe = lctx.recipe
    dgrad, wgrad = gemm_role(recipe, "dgrad", "grad"), gemm_role(recipe, "wgrad", "grad")
    (d_rows, d_k), (w_rows, _) = domain_split(dgrad, lctx.parallel_mode), domain_split(wgrad, lctx.parallel_mode)
    if (dgrad.global_scale != "tensor" or wgrad.global_scale != "tensor" or dy.numel() == 0
            or backend.supports("dy_amaxes") is not None
            or needs_sync("tensor", lctx.tp_group, rows_sharded=d_rows, k_sharded=d_k)
            or needs_sync("tensor", lctx.tp_group, rows_sharded=w_rows, k_sharded=False)):  # (as quantize_role)
        return None, None
    return backend.dy_amaxes(dy, group_sizes, wgrad.rht_seed)


def quantize_wgrad_operand_for(t: torch.Tensor, group_sizes, lctx: LinearContext, backend, *, gradient: bool,
                               amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """A wgrad operand along tokens: ``dy`` (``gradient``: SR) or ``x``, both with the RHT, each
    group's tokens zero-padded to a multiple of 16 (dW unchanged). Its rows (features) are split
    under column (dy) or row (x) parallelism. ``dy``'s comes with its BF16 image (the wgrad GEMM
    reads it right away: no separate image pass); ``x``'s is saved for the backward as codes."""
    role = gemm_role(lctx.recipe, "wgrad", "grad" if gradient else "input")
    return _quantize(role, t, lctx.recipe, lctx, backend, group_sizes=group_sizes, wgrad_image=gradient, amax=amax)


class NVFP4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lctx: LinearContext,
                with_image: bool = True):
        recipe = lctx.recipe
        backend = backend_for(recipe, x.device)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        qw = weight_operand(lctx, weight, backend, with_image, image_once=True)
        qx = quantize_activation(x2, lctx, backend)
        y = backend.gemm(qx, qw, bias, out_dtype=x.dtype, batch_invariant=recipe.strict)
        del qw  # an image made for this GEMM goes now

        ctx.lctx = lctx
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        saved = [weight]
        ctx.needs_wgrad = ctx.needs_input_grad[1]
        if ctx.needs_wgrad and recipe.full_update:
            qx_t = quantize_wgrad_operand_for(x2, [x2.shape[0]], lctx, backend, gradient=False)
            tensors, ctx.qx_t_meta = replace(qx_t, image=None).prepare_for_saving()  # codes and scales only
            saved += tensors
        elif ctx.needs_wgrad:
            saved.append(x2)
        ctx.save_for_backward(*saved)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        lctx: LinearContext = ctx.lctx
        if lctx.handoff is not None:
            lctx.handoff.clear()  # an offer of a producer recomputed for this backward (nobody takes it)
        recipe = lctx.recipe
        weight, *rest = ctx.saved_tensors
        backend = backend_for(recipe, grad_out.device)
        n = grad_out.shape[-1]
        dy = grad_out.reshape(-1, n)
        if dy.dtype != weight.dtype and dy.dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise TypeError(f"NVFP4 linear backward got a {dy.dtype} gradient")
        qw = weight_operand(lctx, weight, backend, with_image=False)
        dx = dw_out = None

        if recipe.full_update:
            amax_dgrad = amax_wgrad = None
            if ctx.needs_input_grad[0] and ctx.needs_wgrad:
                amax_dgrad, amax_wgrad = shared_dy_amaxes(dy, [dy.shape[0]], lctx, backend)
            if ctx.needs_input_grad[0]:
                qdy = quantize_dgrad_operand(dy, lctx, backend, amax_dgrad)
                dx = dgrad_gemm(backend, qdy, qw, lctx.cache, lambda q: weight_transposed(q, weight, recipe, backend, lctx),
                                grad_out.dtype, recipe.strict)
                del qdy
            lctx.cache.release_after_backward()
            if ctx.needs_wgrad:
                qx_t = ctx.qx_t_meta.restore_from_saved(rest)
                qdy_t = quantize_wgrad_operand_for(dy, [dy.shape[0]], lctx, backend, gradient=True, amax=amax_wgrad)
                dw = backend.gemm(qdy_t, qx_t, None, out_dtype=wgrad_dtype(weight), batch_invariant=recipe.strict)
                del qdy_t, qx_t
                dw_out = add_wgrad(weight, dw, grad_out)
        else:
            # BF16 backward through the quantized weight (straight-through estimator)
            if ctx.needs_input_grad[0]:
                dx = dy @ qw.dequantize(dy.dtype)
            if ctx.needs_wgrad:
                (x2,) = rest
                dw_out = add_wgrad(weight, dy.t().float() @ x2.float(), grad_out)
            lctx.cache.release_after_backward()

        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        dbias = dy.sum(0).to(grad_out.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw_out, dbias, None, None


def nvfp4_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lctx: LinearContext
) -> torch.Tensor:
    """``x @ weight.T + bias`` in NVFP4 under ``lctx.recipe``; x is ``[..., K]``."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"nvfp4_linear: input has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    return NVFP4LinearFunction.apply(x, weight, bias, lctx, lctx.cache.keep_images())
