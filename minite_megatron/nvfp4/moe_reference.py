"""The contract of the MoE ops without quantization, in torch: the references every backend's
kernels equal (:class:`~.backends.Backend` ops ``weighted_swiglu``, ``weighted_swiglu_backward``,
``deterministic_unpermute``, ``ordered_sum``, ``zero_empty_groups``, ``moe_route``'s
:class:`Route`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Route(NamedTuple):
    """A decode step's routing in Megatron's expert-major row order (``moe_route``'s result)."""

    ids: torch.Tensor      # [T * k] int32: expert of each expert-major row
    tokens: torch.Tensor   # [T * k] int32: token of each row
    probs: torch.Tensor    # [T * k] fp32: routing probability of each row
    combine: torch.Tensor  # [T * k] int32: rows of each token, its experts in increasing order
    sizes: torch.Tensor    # [E] int32: rows per expert
    offsets: torch.Tensor  # [E + 1] int32: first row of each expert (and T * k)


def weighted_swiglu_reference(h: torch.Tensor, probs: torch.Tensor, act_fn=None) -> torch.Tensor:
    """Megatron's unfused computation: ``(act_fn(h) * probs[:, None]).to(h.dtype)``.

    ``act_fn`` is the module's SwiGLU (default: ``silu(gate) * up`` with torch's ``silu``, what
    :class:`~minite_megatron.modules.activation.MiniteActivation` computes); ``h`` [R, 2F],
    ``probs`` [R] (any float dtype). Differentiable."""
    if act_fn is None:
        gate, up = torch.chunk(h, 2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
    else:
        a = act_fn(h)
    return (a * probs.unsqueeze(-1)).to(h.dtype)


def weighted_swiglu_backward_reference(dy: torch.Tensor, h: torch.Tensor, probs: torch.Tensor,
                                       compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused backward's formula in torch: ``(dh [R, 2F] h.dtype, dp [R] fp32)``.

    In ``compute_dtype`` (fp32; tests take fp64 as the exact gradient) from ``dy`` [R, F], ``h``
    [R, 2F] and ``probs`` [R]: ``sig = 1 / (1 + exp(-gate))``, ``da = dy * p``, ``d gate = da *
    up * sig * (1 + gate * (1 - sig))``, ``d up = da * gate * sig`` (each rounded once to
    ``h.dtype``), ``dp = sum(dy * gate * sig * up)`` over F (torch's reduction order: the
    kernel's differs, within fp32 rounding)."""
    gate, up = (t.to(compute_dtype) for t in torch.chunk(h, 2, dim=-1))
    p = probs.to(compute_dtype).unsqueeze(-1)
    dyf = dy.to(compute_dtype)
    sig = 1.0 / (1.0 + torch.exp(-gate))
    silu = gate * sig
    da = dyf * p
    dgate = da * up * (sig * (1.0 + gate * (1.0 - sig)))
    dup = da * silu
    return torch.cat([dgate, dup], dim=-1).to(h.dtype), (dyf * (silu * up)).sum(-1).float()


def deterministic_unpermute_reference(permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum the permuted rows back into their tokens in a fixed order (torch ops; the reference).

    Args:
        permuted: ``[P, H]`` expert outputs in permuted (expert-major) order.
        sorted_indices: ``[P]`` int: the token each permuted row belongs to.
        num_tokens: number of tokens T.
    Returns:
        ``[T, H]`` in ``permuted.dtype``: ``out[t] = ((+0 + r_0) + r_1) + ...`` over the rows of
        token ``t`` in increasing permuted position; tokens without rows are zeros. Differentiable.
    Raises:
        ValueError for mismatched shapes or indices outside ``[0, T)``.
    """
    if permuted.dim() != 2 or sorted_indices.shape != (permuted.shape[0],):
        raise ValueError(f"deterministic_unpermute: permuted {tuple(permuted.shape)} vs indices {tuple(sorted_indices.shape)}")
    hidden = permuted.shape[1]
    out = permuted.new_zeros(num_tokens, hidden)
    if permuted.shape[0] == 0:
        return out
    idx = sorted_indices.long()
    if int(idx.min()) < 0 or int(idx.max()) >= num_tokens:
        raise ValueError(f"deterministic_unpermute: token indices outside [0, {num_tokens})")
    order = torch.argsort(idx, stable=True)  # rows grouped by token, in permuted order
    counts = torch.bincount(idx, minlength=num_tokens)
    starts = torch.cumsum(counts, 0) - counts
    last = permuted.shape[0] - 1
    for slot in range(int(counts.max())):
        has = counts > slot
        rows = order[torch.clamp(starts + slot, max=last)]
        out = out + torch.where(has[:, None], permuted.index_select(0, rows), 0.0)
    return out


def ordered_sum_reference(rows: torch.Tensor) -> torch.Tensor:
    """``[T, k, H]`` -> ``[T, H]``: ``((+0 + rows[:, 0]) + rows[:, 1]) + ...`` in ``rows.dtype``,
    one rounding per add: :func:`deterministic_unpermute_reference`'s sum for tokens whose k rows
    are given in increasing expert order (every token has all k rows: no token dropping). No host sync."""
    if rows.dim() != 3:
        raise ValueError(f"ordered_sum: rows must be [T, k, H], got {tuple(rows.shape)}")
    out = rows.new_zeros(rows.shape[0], rows.shape[2])
    for j in range(rows.shape[1]):
        out = out + rows[:, j]
    return out


def zero_empty_groups_reference(out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out[g] = +0`` where ``counts[g] == 0`` (``out``: ``[G, ...]``, ``counts``: ``[G]`` ints), in place."""
    return out.masked_fill_((counts == 0).to(out.device).view(-1, *([1] * (out.dim() - 1))), 0)
