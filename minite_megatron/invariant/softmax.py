"""Batch-invariant softmax, log-softmax and sigmoid (fp32), with a fixed per-row order.

``log_softmax(x)[i] = (x_i - m) - log(tree(exp(x_j - m)))`` with ``m = max_j x_j`` (a max is
exact in any order), the sum the aligned pairwise tree of :mod:`minite_megatron.nvfp4.tree`; ``softmax`` is
``exp(x_i - m) / tree(...)``. Everything is fp32 whatever the input dtype. The elementwise
``exp``/``log`` are the backend's own functions: per element they do not depend on where the
element sits (tested: ``tests/strict/test_elementwise_position.py``); torch's own ``softmax``,
``log_softmax``, ``sigmoid`` and ``silu`` are *not* used because ATen's reductions and some of its
vectorized-vs-scalar code paths may depend on the row length and on an element's position.

Masked entries (``mask`` True = hidden, Megatron's convention) contribute exact zeros; a row
with no visible entry yields zeros (softmax) instead of NaN. Non-finite logits: ``+inf``/NaN
propagate to their row (NaN), ``-inf`` entries get probability 0.

``log_softmax`` over the last dimension runs the backend's ``bi_log_softmax`` kernel where
:func:`minite_megatron.nvfp4.backends.invariant_backend` has one (Triton: one program per row, fixed
chunk order), else :func:`log_softmax_torch`.
"""

from __future__ import annotations

import torch

from ..nvfp4.backends import invariant_backend
from ..nvfp4.tree import tree_sum


def _shifted(x: torch.Tensor, dim: int, mask: torch.Tensor | None):
    xf = x.to(torch.float32)
    if mask is not None:
        xf = xf.masked_fill(mask, float("-inf"))
    m = torch.amax(xf, dim=dim, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # all-hidden row: no NaN
    return xf - m


def softmax(x: torch.Tensor, dim: int = -1, mask: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 softmax of ``x`` over ``dim``; ``mask`` (bool, broadcastable, True = hidden) optional.

    Differentiable through torch ops. Raises TypeError for non-floating ``x``.
    """
    if not x.dtype.is_floating_point:
        raise TypeError(f"softmax needs a floating tensor, got {x.dtype}")
    e = torch.exp(_shifted(x, dim, mask))
    s = tree_sum(e, dim=dim, keepdim=True)
    p = e / s
    return torch.where(s > 0, p, torch.zeros_like(p))


def log_softmax_torch(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    z = _shifted(x, dim, None)
    return z - torch.log(tree_sum(torch.exp(z), dim=dim, keepdim=True))


class _LogSoftmaxLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, kernels):
        if kernels is not None:
            out = kernels.bi_log_softmax(x2d)
        else:
            out = log_softmax_torch(x2d, -1)
        ctx.save_for_backward(out)
        ctx.in_dtype = x2d.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        g = g.to(torch.float32)
        return (g - torch.exp(out) * g.sum(-1, keepdim=True)).to(ctx.in_dtype), None


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 log-softmax of ``x`` (any floating dtype) over ``dim``, batch invariant.

    Returns fp32 of ``x.shape``. Differentiable. Raises TypeError for non-floating ``x``.
    """
    if not x.dtype.is_floating_point:
        raise TypeError(f"log_softmax needs a floating tensor, got {x.dtype}")
    if x.numel() == 0:
        return x.to(torch.float32)
    xt = x.movedim(dim, -1)
    backend = invariant_backend(x.device)
    kernels = backend if backend.supports("bi_log_softmax") is None else None  # None: the torch formulation
    out = _LogSoftmaxLastDim.apply(xt.reshape(-1, xt.shape[-1]), kernels).reshape(xt.shape)
    return out.movedim(-1, dim)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., tokens]``: fp32 ``[...]`` for ``logits`` ``[..., V]`` and integer
    ``tokens`` ``[...]`` (the raw per-token log-probs RL needs). Raises ValueError for a token id
    outside ``[0, V)`` or mismatched shapes."""
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"token_log_probs: tokens {tuple(tokens.shape)} vs logits {tuple(logits.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[-1]):
        raise ValueError(f"token_log_probs: token ids must lie in [0, {logits.shape[-1]})")
    lp = log_softmax(logits, dim=-1)
    return torch.gather(lp, -1, tokens.long().unsqueeze(-1)).squeeze(-1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``1 / (1 + exp(-x))`` (torch's own sigmoid rounds differently by element position
    on CPU). Differentiable."""
    xf = x.to(torch.float32)
    return 1.0 / (1.0 + torch.exp(-xf))
