"""The NVFP4 grouped (MoE expert) linear: all local experts in one op, full update.

Rows of ``x`` ``[T, K]`` are tokens sorted by expert (``tokens_per_expert[g]`` rows for expert
g, as Megatron's token dispatcher permutes them); the experts' weights ``W_g`` ``[N, K]`` are
quantized together as one ``[G, N, K]`` tensor with 16x16 tiles and one global scale per
expert::

    fprop   y[g]  = gemm(Q_row(x_g),                 Q_2d(W_g))
    dgrad   dx[g] = gemm(Q_row(dy_g, SR),            Q_2d(W_g)^T)        exact relayout
    wgrad   dW_g  = gemm(Q_col(dy_g, SR, RHT),       Q_col(x_g, RHT))    along the expert's tokens

The wgrad operands are quantized along tokens, each expert's tokens zero-padded to a multiple of
16 so that no block straddles two experts (:mod:`minite_megatron.nvfp4.grouped`); the forward
saves ``Q_col(x)`` (codes and scales), not a BF16 copy of ``x``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..nvfp4.grouped import grouped_wgrad_gemm_reference, padded_group_sizes
from ..nvfp4.tensor import NVFP4Tensor
from .weight_cache import QuantizedWeightCache
from .linear import (
    LinearContext,
    add_wgrad,
    backend_for,
    quantize_activation,
    quantize_dgrad_operand,
    quantize_wgrad_operand_for,
)


def quantize_expert_weights(weights: Sequence[torch.Tensor], recipe, backend, lctx=None) -> NVFP4Tensor:
    """``[G, N, K]`` NVFP4 of the stacked expert weights, one global scale per expert (the
    amax of each whole expert weight under expert tensor parallelism)."""
    w = torch.stack([t.detach() for t in weights])
    if recipe.weight_tile == "2d":
        amax = None if lctx is None else lctx.amax(w, "group", rows_sharded=lctx.column, k_sharded=lctx.row)
        return backend.quantize(
            w, global_scale="group", tile=(16, 16), amax=amax, with_image=True, nonfinite=recipe.nonfinite
        )
    raise ValueError("grouped expert linears need 16x16 weight tiles (--minite-weight-tile 2d)")


def _wgrad_gemm(backend, a, b, padded, out_dtype, strict):
    fn = getattr(backend, "grouped_wgrad_gemm", None)
    if fn is None:  # a backend without its own: the contract's, on the backend's device
        return grouped_wgrad_gemm_reference(a, b, padded, out_dtype)
    return fn(a, b, padded, out_dtype, strict)


def expert_weights(cache: QuantizedWeightCache, weights, recipe, backend, lctx=None) -> NVFP4Tensor:
    """The ``[G, N, K]`` quantized expert weights from ``cache`` (once per optimizer step)."""
    return cache.get(weights, lambda ws: quantize_expert_weights(ws, recipe, backend, lctx), extra=backend.name)


def _transpose(q: NVFP4Tensor) -> NVFP4Tensor:
    return q.transpose()


class NVFP4GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens_per_expert, lctx: LinearContext, cache: QuantizedWeightCache, has_bias, *params):
        recipe = lctx.recipe
        backend = backend_for(recipe, x.device)
        groups = len(tokens_per_expert)
        weights, biases = params[:groups], (params[groups:] if has_bias else None)
        qw = expert_weights(cache, weights, recipe, backend, lctx)
        qx = quantize_activation(x, lctx, backend)
        bias = torch.stack(biases) if has_bias else None
        y = backend.grouped_gemm(qx, qw, tokens_per_expert, bias, out_dtype=x.dtype, batch_invariant=recipe.strict)

        ctx.lctx, ctx.cache, ctx.groups, ctx.has_bias = lctx, cache, groups, has_bias
        ctx.tokens_per_expert = list(tokens_per_expert)
        ctx.needs_wgrad = any(ctx.needs_input_grad[5 : 5 + groups])
        saved = list(weights)
        if ctx.needs_wgrad and recipe.full_update:
            qx_t = quantize_wgrad_operand_for(x, tokens_per_expert, lctx, backend, gradient=False)
            ctx.qx_t_meta = replace(qx_t, image=None)
            saved += [qx_t.codes, qx_t.block_scales, qx_t.global_decode]
        elif ctx.needs_wgrad:
            saved.append(x)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        lctx: LinearContext = ctx.lctx
        recipe = lctx.recipe
        backend = backend_for(recipe, grad_out.device)
        weights, rest = ctx.saved_tensors[: ctx.groups], ctx.saved_tensors[ctx.groups :]
        sizes = ctx.tokens_per_expert
        dy = grad_out
        dx = None
        dws: list[torch.Tensor | None] = [None] * ctx.groups
        qw = expert_weights(ctx.cache, weights, recipe, backend, lctx)
        if recipe.full_update:
            if ctx.needs_input_grad[0]:
                qdy = quantize_dgrad_operand(dy, lctx, backend)
                dx = backend.grouped_gemm(qdy, ctx.cache.transposed(_transpose), sizes, None, grad_out.dtype, recipe.strict)
            if ctx.needs_wgrad:
                codes, scales, gdec = rest
                qx_t = replace(ctx.qx_t_meta, codes=codes, block_scales=scales, global_decode=gdec)
                qdy_t = quantize_wgrad_operand_for(dy, sizes, lctx, backend, gradient=True)
                dw = _wgrad_gemm(backend, qdy_t, qx_t, padded_group_sizes(sizes), torch.float32, recipe.strict)
                dws = [add_wgrad(w, dw[g], grad_out) for g, w in enumerate(weights)]
        else:
            w_hat = qw.dequantize(dy.dtype)
            if ctx.needs_input_grad[0]:
                dx = torch.cat([d @ w_hat[g] for g, d in enumerate(torch.split(dy, sizes))]) if sum(sizes) else dy.new_zeros(0, w_hat.shape[-1])
            if ctx.needs_wgrad:
                (x,) = rest
                parts = zip(torch.split(dy, sizes), torch.split(x, sizes))
                dws = [add_wgrad(w, d.t().float() @ xx.float(), grad_out) for w, (d, xx) in zip(weights, parts)]
        dbias = []
        if ctx.has_bias:
            dbias = [d.sum(0).to(grad_out.dtype) for d in torch.split(dy, sizes)]
        return (dx, None, None, None, None, *dws, *dbias)


def nvfp4_grouped_linear(
    x: torch.Tensor,
    tokens_per_expert: Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor] | None,
    lctx: LinearContext,
    cache: QuantizedWeightCache,
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ weights[g].T (+ biases[g])`` in NVFP4; x is ``[T, K]``."""
    sizes = [int(s) for s in tokens_per_expert]
    if len(sizes) != len(weights):
        raise ValueError(f"{len(sizes)} token counts for {len(weights)} experts")
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sum(sizes)}, x has {x.shape[0]} rows")
    params = list(weights) + (list(biases) if biases is not None else [])
    return NVFP4GroupedLinearFunction.apply(x, sizes, lctx, cache, biases is not None, *params)
