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

:func:`bf16_grouped_linear` is the BF16 counterpart (the BF16 twin, ``Recipe(precision="bf16")``):
fprop, dgrad and wgrad each one ``torch._grouped_mm`` launch (device-side offsets), as
Transformer Engine's grouped GEMM would run them.

Both read the experts' weights as one ``[G, N, K]`` tensor: a view when the ``weight{i}``
parameters are consecutive slices of one buffer (:func:`stacked_view`; how
``NVFP4GroupedLinear`` allocates them), else a stacked copy (e.g. after ``param.data = ...``).

Host synchronization: none here. The token counts arrive on the host (Megatron's dispatcher
synchronizes once per MoE layer to bring them there) and become a
:class:`~minite_megatron.nvfp4.group_sizes.GroupSizes` (:func:`shared_group_sizes`): the device
offsets and wgrad column index the kernels read are made once per MoE layer, in one pinned
non-blocking copy, and shared by fc1 and fc2 and by their backward (before: ten copies per MoE
layer and step, four of them blocking). Or they never leave the device (the MoE layer without its
routing wait: ``modules.moe``): a :class:`~minite_megatron.nvfp4.group_sizes.DeviceGroupSizes`,
its offsets summed on the device, the wgrad operands ``ceil16(T + 15 G)`` columns wide (zero
columns past the padded groups: the same bits). Both ops say where they cannot take those
(:func:`nvfp4_why_host_sizes`, :func:`bf16_why_host_sizes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..nvfp4.backends import BackendUnavailable, get_backend
from ..nvfp4.group_sizes import DeviceGroupSizes, GroupSizes
from ..nvfp4.tensor import NVFP4Tensor
from .weight_cache import QuantizedWeightCache
from .roles import gemm_role
from .linear import (
    LinearContext,
    _quantize,
    add_wgrad,
    backend_for,
    dgrad_gemm,
    wgrad_dtype,
    quantize_activation,
    quantize_dgrad_operand,
    quantize_wgrad_operand_for,
    shared_dy_amaxes,
)


def stacked_view(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The ``[G, N, K]`` tensor whose ``[g]`` is ``weights[g]`` without a copy, or None when the
    weights are not consecutive, equally shaped, contiguous slices of one storage. Detached."""
    if not weights:
        return None
    w0 = weights[0]
    if not w0.is_contiguous():
        return None
    step = w0.numel()
    storage = w0.untyped_storage().data_ptr()
    for g, w in enumerate(weights):
        if (w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device or not w.is_contiguous()
                or w.untyped_storage().data_ptr() != storage or w.storage_offset() != w0.storage_offset() + g * step):
            return None
    return w0.detach().as_strided((len(weights), *w0.shape), (step, *w0.stride()), w0.storage_offset())


def stacked_weights(weights: Sequence[torch.Tensor], stacked: torch.Tensor | None = None) -> torch.Tensor:
    """``[G, N, K]`` of the expert weights: ``stacked`` (a caller's known view of them),
    :func:`stacked_view`, or a stacked copy. Detached."""
    if stacked is not None:
        return stacked.detach()
    view = stacked_view(weights)
    return view if view is not None else torch.stack([t.detach() for t in weights])


def add_wgrads(weights: Sequence[torch.Tensor], dw: torch.Tensor, like: torch.Tensor) -> list[torch.Tensor]:
    """:func:`~.linear.add_wgrad` of every expert from the stacked ``dw`` ``[G, N, K]``, without a
    per-expert kernel: without ``main_grad`` the gradients are views of ``dw`` (one ``unbind``);
    with Megatron's ``main_grad`` on every expert one multi-tensor add (``torch._foreach_add_``,
    the same fp32 adds as one ``add_`` each) and one dummy gradient buffer, viewed per expert."""
    main_grads = [getattr(w, "main_grad", None) for w in weights]
    if all(g is None for g in main_grads):
        d = dw if dw.dtype == weights[0].dtype else dw.to(weights[0].dtype)
        return list(d.unbind(0))
    if (all(g is not None and hasattr(w, "grad_added_to_main_grad") for g, w in zip(main_grads, weights))
            and len({g.dtype for g in main_grads}) == 1):
        torch._foreach_add_(main_grads, list(dw.to(main_grads[0].dtype).unbind(0)))
        for w in weights:
            w.grad_added_to_main_grad = True
        return list(torch.empty(dw.shape, dtype=like.dtype, device=like.device).unbind(0))
    return [add_wgrad(w, dw[g], like) for g, w in enumerate(weights)]


def quantize_expert_weights(weights: Sequence[torch.Tensor], recipe, backend, lctx=None,
                            with_image: bool = True, stacked: torch.Tensor | None = None) -> NVFP4Tensor:
    """``[G, N, K]`` NVFP4 of the stacked expert weights, one global scale per expert (the
    amax of each whole expert weight under expert tensor parallelism)."""
    if recipe.weight_tile != "2d":
        raise ValueError("grouped expert linears need 16x16 weight tiles (--minite-weight-tile 2d)")
    role = gemm_role(recipe, "fprop", "weight", grouped=True)
    return _quantize(role, stacked_weights(weights, stacked), recipe, lctx, backend, with_image=with_image)


def expert_weights(cache: QuantizedWeightCache, weights, recipe, backend, lctx=None,
                   with_image: bool | None = None, stacked: torch.Tensor | None = None,
                   image_once: bool = False) -> NVFP4Tensor:
    """The ``[G, N, K]`` quantized expert weights from ``cache`` (once per weight version; the
    BF16 image only where ``cache.keep_images()`` says; ``image_once``: as
    :func:`~.linear.weight_operand`'s). With ``stacked`` (the
    experts' one-buffer view) the cache keys on that one tensor: a view shares its base's
    version counter, so any in-place change of an expert is seen."""
    key = stacked if stacked is not None else weights
    return cache.get(key, lambda _, image: quantize_expert_weights(weights, recipe, backend, lctx, image, stacked),
                     extra=backend.name, with_image=with_image, image_once=image_once)


_LAST_SIZES: list = [None, None]  # (the sequence a caller passed, its GroupSizes)


def shared_group_sizes(tokens_per_expert: Sequence[int]) -> GroupSizes | DeviceGroupSizes:
    """:class:`GroupSizes` of ``tokens_per_expert``: the one made for the previous call when the
    caller passes the very same sequence object again with the same values (Megatron's grouped
    MLP passes one list to fc1 and fc2), so both linears and their backward read one set of device
    index tensors. A new list (the next layer, the next step) gets new ones. A ``GroupSizes`` or a
    ``DeviceGroupSizes`` is returned as it is. Raises ValueError for a negative count."""
    if isinstance(tokens_per_expert, (GroupSizes, DeviceGroupSizes)):
        return tokens_per_expert
    source, sizes = _LAST_SIZES
    if source is tokens_per_expert and sizes is not None and sizes == tuple(tokens_per_expert):
        return sizes
    sizes = GroupSizes(tokens_per_expert)
    _LAST_SIZES[:] = [tokens_per_expert, sizes]
    return sizes


def nvfp4_why_host_sizes(recipe, device: torch.device | str) -> str | None:
    """None if :func:`nvfp4_grouped_linear` takes its counts as a :class:`DeviceGroupSizes` (left on
    the device) under ``recipe`` on ``device``, else the reason it needs host sizes."""
    if not recipe.full_update:
        return "the recipe's backward is not the full NVFP4 update (full_update off: it splits dy per expert on the host)"
    try:
        backend = backend_for(recipe, torch.device(device))
    except (BackendUnavailable, ValueError) as e:
        return str(e)
    for op in ("grouped_gemm", "grouped_gemm_nt", "quantize_wgrad_operand", "grouped_wgrad_gemm"):
        if op == "grouped_gemm_nt" and backend.supports(op, tile=(16, 16)) is not None:
            continue  # the dgrad then runs grouped_gemm on the relayout
        why = backend.supports(op, device_sizes=True)
        if why is not None:
            return why
    return None


def _transpose(q: NVFP4Tensor) -> NVFP4Tensor:
    return q.transpose()


class NVFP4GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens_per_expert, lctx: LinearContext, cache: QuantizedWeightCache, has_bias, with_image,
                stacked, *params):
        recipe = lctx.recipe
        backend = backend_for(recipe, x.device)
        groups = len(tokens_per_expert)
        weights, biases = params[:groups], (params[groups:] if has_bias else None)
        qw = expert_weights(cache, weights, recipe, backend, lctx, with_image, stacked, image_once=True)
        ctx.stacked = stacked
        qx = quantize_activation(x, lctx, backend)
        bias = torch.stack(biases) if has_bias else None
        y = backend.grouped_gemm(qx, qw, tokens_per_expert, bias, out_dtype=x.dtype, batch_invariant=recipe.strict)
        del qw  # an image made for this GEMM goes now

        ctx.lctx, ctx.cache, ctx.groups, ctx.has_bias = lctx, cache, groups, has_bias
        ctx.tokens_per_expert = tokens_per_expert  # a GroupSizes: its device tensors serve the backward too
        ctx.needs_wgrad = any(ctx.needs_input_grad[7 : 7 + groups])
        saved = list(weights)
        if ctx.needs_wgrad and recipe.full_update:
            qx_t = quantize_wgrad_operand_for(x, tokens_per_expert, lctx, backend, gradient=False)
            tensors, ctx.qx_t_meta = replace(qx_t, image=None).prepare_for_saving()
            saved += tensors
        elif ctx.needs_wgrad:
            saved.append(x)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        lctx: LinearContext = ctx.lctx
        if lctx.handoff is not None:
            lctx.handoff.clear()  # an offer of a producer recomputed for this backward (nobody takes it)
        recipe = lctx.recipe
        backend = backend_for(recipe, grad_out.device)
        weights, rest = ctx.saved_tensors[: ctx.groups], ctx.saved_tensors[ctx.groups :]
        sizes = ctx.tokens_per_expert
        dy = grad_out
        dx = None
        dws: list[torch.Tensor | None] = [None] * ctx.groups
        qw = expert_weights(ctx.cache, weights, recipe, backend, lctx, with_image=False, stacked=ctx.stacked)
        if recipe.full_update:
            amax_dgrad = amax_wgrad = None
            if ctx.needs_input_grad[0] and ctx.needs_wgrad:
                amax_dgrad, amax_wgrad = shared_dy_amaxes(dy, sizes, lctx, backend)
            if ctx.needs_input_grad[0]:
                qdy = quantize_dgrad_operand(dy, lctx, backend, amax_dgrad)
                dx = dgrad_gemm(backend, qdy, qw, ctx.cache, _transpose, grad_out.dtype, recipe.strict, group_sizes=sizes)
                del qdy
            ctx.cache.release_after_backward()
            del qw
            if ctx.needs_wgrad:
                qx_t = ctx.qx_t_meta.restore_from_saved(rest)
                qdy_t = quantize_wgrad_operand_for(dy, sizes, lctx, backend, gradient=True, amax=amax_wgrad)
                dw = backend.grouped_wgrad_gemm(qdy_t, qx_t, sizes.padded(), wgrad_dtype(weights[0]), recipe.strict)
                del qdy_t, qx_t
                dws = add_wgrads(weights, dw, grad_out)
        else:
            w_hat = qw.dequantize(dy.dtype)
            if ctx.needs_input_grad[0]:
                dx = torch.cat([d @ w_hat[g] for g, d in enumerate(torch.split(dy, sizes))]) if sum(sizes) else dy.new_zeros(0, w_hat.shape[-1])
            if ctx.needs_wgrad:
                (x,) = rest
                parts = zip(torch.split(dy, sizes), torch.split(x, sizes))
                dws = [add_wgrad(w, d.t().float() @ xx.float(), grad_out) for w, (d, xx) in zip(weights, parts)]
            ctx.cache.release_after_backward()
        dbias = []
        if ctx.has_bias:
            dbias = [d.sum(0).to(grad_out.dtype) for d in torch.split(dy, sizes)]
        return (dx, None, None, None, None, None, None, *dws, *dbias)


def nvfp4_grouped_linear(
    x: torch.Tensor,
    tokens_per_expert: Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor] | None,
    lctx: LinearContext,
    cache: QuantizedWeightCache,
    stacked: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ weights[g].T (+ biases[g])`` in NVFP4; x is ``[T, K]``.
    ``tokens_per_expert``: host ints (a list, or a ``GroupSizes``; the same list for fc1 and fc2
    shares their device index tensors: :func:`shared_group_sizes`), or a ``DeviceGroupSizes``
    (no host sync; where :func:`nvfp4_why_host_sizes` is None, no biases, no expert TP).
    ``stacked``: the weights' ``[G, N, K]`` one-buffer view if the caller knows it (no copy, an
    O(1) cache key). Raises ValueError when the counts do not match the experts or the rows, or
    device counts where they cannot be used."""
    sizes = _checked_sizes(tokens_per_expert, weights, x)
    if isinstance(sizes, DeviceGroupSizes):
        why = "the experts have biases" if biases is not None else nvfp4_why_host_sizes(lctx.recipe, x.device)
        if why is None and lctx.tp_group is not None and lctx.tp_group.size() > 1:
            why = "expert tensor parallelism (the wgrad operands' amax is reduced across ranks)"
        if why is not None:
            raise ValueError(f"nvfp4_grouped_linear: tokens_per_expert on the device ({sizes}) cannot be used: {why}")
    params = list(weights) + (list(biases) if biases is not None else [])
    return NVFP4GroupedLinearFunction.apply(x, sizes, lctx, cache, biases is not None, cache.keep_images(), stacked, *params)


def _checked_sizes(tokens_per_expert, weights, x) -> GroupSizes | DeviceGroupSizes:
    sizes = shared_group_sizes(tokens_per_expert)
    if len(sizes) != len(weights):
        raise ValueError(f"{len(sizes)} token counts for {len(weights)} experts")
    if sizes.total != x.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sizes.total}, x has {x.shape[0]} rows")
    return sizes


# ---- the BF16 twin's grouped linear -------------------------------------------------------------
def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Can ``torch._grouped_mm`` run these operands? (CPU: any float; CUDA: bf16 on sm_90+.)"""
    return grouped_mm_runs(x.dtype, x.device)


def grouped_mm_runs(dtype: torch.dtype, device: torch.device | str) -> bool:
    """:func:`grouped_mm_supported` for operands of ``dtype`` on ``device``."""
    device = torch.device(device)
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return False


def bf16_why_host_sizes(dtype: torch.dtype, device: torch.device | str, weight_dtype: torch.dtype) -> str | None:
    """None if :func:`bf16_grouped_linear` takes its counts as a :class:`DeviceGroupSizes` for
    inputs of ``dtype`` on ``device`` and weights of ``weight_dtype``, else the reason it needs host
    sizes (its fallback runs one matmul per expert on host splits)."""
    if not grouped_mm_runs(dtype, device):
        return f"torch._grouped_mm does not run {dtype} on {torch.device(device)} (one matmul per expert on host splits)"
    if weight_dtype != dtype:
        return f"the expert weights are {weight_dtype}, the tokens {dtype} (one matmul per expert on host splits)"
    return None


def group_end_offsets(sizes: Sequence[int], device) -> torch.Tensor:
    """int32 ``[G]`` cumulative row ends (``torch._grouped_mm``'s ``offs``) on ``device`` (a view
    of the shared :meth:`GroupSizes.offsets`: no host sync, one copy per MoE layer)."""
    return GroupSizes.of(sizes).offsets(device)[1:]


def _row_bias(biases, sizes: GroupSizes, rows: int) -> torch.Tensor:
    """``[T, N]``: each row's expert bias."""
    device = biases[0].device
    offsets = sizes.offsets(device)
    expert = torch.repeat_interleave(torch.arange(len(sizes), device=device), offsets[1:] - offsets[:-1],
                                     output_size=rows)
    return torch.stack(biases).index_select(0, expert)


class BF16GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, has_bias, stacked, *params):
        groups = len(sizes)
        weights, biases = params[:groups], (params[groups:] if has_bias else None)
        w = stacked_weights(weights, stacked)
        grouped = grouped_mm_supported(x) and w.dtype == x.dtype
        if grouped:
            offs = group_end_offsets(sizes, x.device)
            y = torch._grouped_mm(x.contiguous(), w.transpose(-2, -1), offs=offs)
        else:
            offs = None
            parts = [xe @ w[g].t() for g, xe in enumerate(torch.split(x, sizes))]
            y = torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])
        if has_bias:
            y = y + _row_bias(biases, sizes, x.shape[0]).to(y.dtype)
        ctx.sizes, ctx.groups, ctx.has_bias, ctx.grouped = sizes, groups, has_bias, grouped
        ctx.stacked = stacked  # a view of the parameters (never a copy: the backward re-stacks)
        ctx.save_for_backward(x, offs if offs is not None else torch.empty(0), *weights)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, offs, *weights = ctx.saved_tensors
        sizes = ctx.sizes
        dy = grad_out.contiguous()
        w = stacked_weights(weights, ctx.stacked)
        dx = None
        dws = [None] * ctx.groups
        if ctx.grouped:
            if ctx.needs_input_grad[0]:
                dx = torch._grouped_mm(dy, w, offs=offs)
            if any(ctx.needs_input_grad[4 : 4 + ctx.groups]):
                dw = torch._grouped_mm(dy.t(), x, offs=offs)  # [G, N, K]
                # no rows: no contribution (do not rely on the kernel's empty groups)
                if isinstance(sizes, DeviceGroupSizes):  # +0, as zero_(); on a GPU only the empty slices written
                    get_backend(None, dw.device).zero_empty_groups(dw, sizes.counts.to(dw.device))
                else:
                    for g, s in enumerate(sizes):
                        if s == 0:
                            dw[g].zero_()
                dws = add_wgrads(weights, dw, grad_out)
        else:
            dys, xs = torch.split(dy, sizes), torch.split(x, sizes)
            if ctx.needs_input_grad[0]:
                parts = [d @ w[g] for g, d in enumerate(dys)]
                dx = torch.cat(parts) if parts else dy.new_zeros(0, w.shape[2])
            if any(ctx.needs_input_grad[4 : 4 + ctx.groups]):
                dws = [add_wgrad(wt, d.t() @ xx, grad_out) for wt, d, xx in zip(weights, dys, xs)]
        dbias = []
        if ctx.has_bias:
            dbias = [d.sum(0).to(grad_out.dtype) for d in torch.split(dy, sizes)]
        return (dx, None, None, None, *dws, *dbias)


def bf16_grouped_linear(
    x: torch.Tensor,
    tokens_per_expert: Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor] | None = None,
    stacked: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ weights[g].T (+ biases[g])`` in the weights' precision.

    Args:
        x: ``[T, K]``, rows sorted by expert (``tokens_per_expert[g]`` rows for expert g).
        tokens_per_expert: G non-negative ints summing to T, or a ``DeviceGroupSizes`` (left on
            the device: no host sync; where :func:`bf16_why_host_sizes` is None, no biases).
        weights: G tensors ``[N, K]`` (one buffer's consecutive slices avoid a stacked copy).
        biases: G tensors ``[N]`` or None.
        stacked: the weights' ``[G, N, K]`` one-buffer view, if the caller knows it.
    Returns:
        ``[T, N]`` in ``x.dtype``: one ``torch._grouped_mm`` for fprop, dgrad and wgrad each
        where it runs (CPU; bf16 on sm_90+), else one matmul per expert. Weight gradients go to
        Megatron's ``main_grad`` when the weights have one.
    Raises:
        ValueError if the counts do not match the experts or the rows, or device counts where
        they cannot be used.
    """
    sizes = _checked_sizes(tokens_per_expert, weights, x)
    if isinstance(sizes, DeviceGroupSizes):
        why = "the experts have biases" if biases is not None else bf16_why_host_sizes(x.dtype, x.device, weights[0].dtype)
        if why is not None:
            raise ValueError(f"bf16_grouped_linear: tokens_per_expert on the device ({sizes}) cannot be used: {why}")
    params = list(weights) + (list(biases) if biases is not None else [])
    if stacked is None:
        stacked = stacked_view(weights)
    return BF16GroupedLinearFunction.apply(x, sizes, biases is not None, stacked, *params)
