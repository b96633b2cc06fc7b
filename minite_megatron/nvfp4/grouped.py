"""Grouped (MoE) GEMMs of the contract: all local experts in one op.

Rows (tokens) are sorted by expert; ``group_sizes[g]`` rows belong to expert g.

* fprop / dgrad (:func:`grouped_gemm_reference`): ``out[rows of g] = a[rows of g] @ b[g].T``
  with ``b`` a ``[G, N, K]`` tensor quantized with one global scale per expert (``"group"``).
* wgrad (:func:`grouped_wgrad_reference`): ``dW[g] = dY_g^T @ X_g``, K = the expert's tokens.
  Quantization blocks run along tokens and must not straddle experts, so each expert's tokens
  are zero-padded to a multiple of 16 (:func:`pad_groups`); both operands are then quantized
  once, as whole ``[N, T_pad]`` / ``[K, T_pad]`` matrices (one global scale per tensor or per
  row, over all experts), and expert g's product uses its own columns. A single expert with
  ``T`` a multiple of 16 is exactly the dense wgrad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from .formats import BLOCK
from .gemm import block_partials_accumulate, epilogue, gemm_reference
from .quantize import quantize_reference
from .tensor import NVFP4Tensor


def padded_group_sizes(group_sizes: Sequence[int], multiple: int = BLOCK) -> list[int]:
    return [-(-int(s) // multiple) * multiple for s in group_sizes]


def pad_groups(x: torch.Tensor, group_sizes: Sequence[int], multiple: int = BLOCK) -> torch.Tensor:
    """``[T, H]`` rows sorted by group -> ``[T_pad, H]``: each group zero-padded to ``multiple``
    (``x`` itself when every group already is a multiple)."""
    padded = padded_group_sizes(group_sizes, multiple)
    if list(padded) == [int(s) for s in group_sizes]:
        return x  # nothing to pad
    out = x.new_zeros(sum(padded), x.shape[1])
    src = dst = 0
    for size, psize in zip(group_sizes, padded):
        out[dst : dst + size] = x[src : src + size]
        src += size
        dst += psize
    return out


def grouped_gemm_reference(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    group_sizes: Sequence[int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """MoE fprop/dgrad: rows of ``a`` [M, K] are sorted by group; group g uses ``b.group(g)``.

    ``b`` is a ``[G, N, K]`` tensor quantized with ``global_scale="group"``;
    ``sum(group_sizes) == M``; ``bias`` is ``[G, N]`` or None. Returns ``[M, N]``.
    """
    if b.global_scale != "group" or len(b.shape) != 3:
        raise ValueError("grouped_gemm: b must be a [G, N, K] tensor with global_scale='group'")
    groups, n = b.shape[0], b.shape[1]
    if len(group_sizes) != groups:
        raise ValueError(f"grouped_gemm: {len(group_sizes)} group sizes for {groups} groups")
    am = a.matrix()
    if sum(group_sizes) != am.rows:
        raise ValueError(f"grouped_gemm: group sizes sum to {sum(group_sizes)}, a has {am.rows} rows")
    out = torch.empty(am.rows, n, dtype=out_dtype, device=a.device)
    start = 0
    for g, size in enumerate(group_sizes):
        if size:
            out[start : start + size] = gemm_reference(
                am.row_slice(start, start + size), b.group(g), None if bias is None else bias[g], out_dtype
            )
        start += size
    return out


def grouped_wgrad_gemm_reference(
    a: NVFP4Tensor,
    b: NVFP4Tensor,
    padded_group_sizes: Sequence[int],
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The GEMM half of the MoE wgrad: ``out[g] = a[:, cols_g] @ b[:, cols_g].T`` -> ``[G, N, K]``.

    ``a`` ``[N, T_pad]`` and ``b`` ``[K, T_pad]`` are the token-major operands quantized along
    tokens (:func:`pad_groups` then ``quantize(t.t())``); ``cols_g`` are expert g's padded
    columns (every size a multiple of 16). An expert with no tokens gets zeros.
    """
    if any(int(s) % BLOCK for s in padded_group_sizes):
        raise ValueError(f"grouped_wgrad_gemm: padded group sizes must be multiples of {BLOCK}: {list(padded_group_sizes)}")
    if a.k != b.k or a.k != sum(padded_group_sizes):
        raise ValueError(
            f"grouped_wgrad_gemm: operands have K={a.k} and K={b.k}, padded groups sum to {sum(padded_group_sizes)}"
        )
    ia, ib = a.image_fp32(), b.image_fp32()
    out = torch.zeros(len(padded_group_sizes), a.rows, b.rows, dtype=out_dtype, device=a.device)
    col = 0
    for g, psize in enumerate(padded_group_sizes):
        if psize:
            acc = block_partials_accumulate(ia[:, col : col + psize], ib[:, col : col + psize])
            out[g] = epilogue(acc, a.row_global_decode(), b.row_global_decode(), None, out_dtype)
        col += psize
    return out


def quantize_wgrad_operand(
    t: torch.Tensor,
    group_sizes: Sequence[int],
    *,
    global_scale: str = "tensor",
    rounding: str = "nearest",
    seed: int | None = None,
    rht_seed: int | None = None,
    nonfinite: str = "propagate",
    quantize=quantize_reference,
    amax_fn=None,
    with_image: bool = False,
) -> NVFP4Tensor:
    """``[T, H]`` token-major rows sorted by expert -> NVFP4 ``[H, T_pad]`` along tokens.

    ``amax_fn(padded_t)`` may supply the global amax (e.g. max-reduced across ranks); ``with_image``:
    the BF16 image too (for a GEMM that reads the operand right away)."""
    padded_t = pad_groups(t, group_sizes).t()
    return quantize(
        padded_t,
        global_scale=global_scale,
        rounding=rounding,
        seed=seed,
        rht_seed=rht_seed,
        amax=None if amax_fn is None else amax_fn(padded_t),
        nonfinite=nonfinite,
        with_image=with_image,
    )


def grouped_wgrad_reference(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    group_sizes: Sequence[int],
    *,
    global_scale: str = "tensor",
    grad_rounding: str = "nearest",
    grad_seed: int | None = None,
    rht_seed: int | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``dW[g] = dY_g^T @ X_g`` in NVFP4 for ``grad_out`` [T, N] and ``x`` [T, K] -> ``[G, N, K]``.

    ``grad_out`` is quantized with ``grad_rounding`` (stochastic: ``grad_seed``), ``x`` with
    round-to-nearest; both get the same random Hadamard transform when ``rht_seed`` is set.
    An expert with no tokens gets zeros.
    """
    if grad_out.shape[0] != x.shape[0] or sum(group_sizes) != x.shape[0]:
        raise ValueError(
            f"grouped_wgrad: grad_out {tuple(grad_out.shape)}, x {tuple(x.shape)} and group sizes "
            f"summing to {sum(group_sizes)} disagree"
        )
    qa = quantize_wgrad_operand(
        grad_out, group_sizes, global_scale=global_scale, rounding=grad_rounding, seed=grad_seed, rht_seed=rht_seed
    )
    qb = quantize_wgrad_operand(x, group_sizes, global_scale=global_scale, rht_seed=rht_seed)
    return grouped_wgrad_gemm_reference(qa, qb, padded_group_sizes(group_sizes), out_dtype)


# ---- decode (rollout): rows routed to experts, unsorted -----------------------------------
def stack_expert_weights(weights: Sequence[NVFP4Tensor]) -> NVFP4Tensor:
    """E experts' quantized ``[N, K]`` weights -> one ``[E, N, K]`` tensor, ``global_scale="group"``.

    Each input keeps its bytes (codes, block scales: never re-quantized) and its global decode
    scale (``"tensor"``: one value; ``"group"`` of one matrix). Its :meth:`NVFP4Tensor.matrix`
    view is the ``[E*N, K]`` matrix with a per-row global decode scale (each expert's scale
    repeated over its N rows). Block scales come out in the linear layout; bf16 images are
    dropped (decode kernels read the packed bytes). The learner's grouped weights
    (``quantize(w, global_scale="group")`` of ``[E, N, K]``) already have this form.

    Raises ValueError for an empty list, experts of different shapes/tiles/devices, or an expert
    with per-row global scales (an expert's N rows must share one scale).
    """
    if len(weights) == 0:
        raise ValueError("stack_expert_weights: no expert weights given")
    first = weights[0]
    for e, w in enumerate(weights):
        if not isinstance(w, NVFP4Tensor):
            raise TypeError(f"stack_expert_weights: expert {e} is a {type(w).__name__}, not an NVFP4Tensor")
        if len(w.shape) != 2 or tuple(w.shape) != tuple(first.shape):
            raise ValueError(
                f"stack_expert_weights: expert {e} has shape {tuple(w.shape)}; every expert must be "
                f"[N, K] = {tuple(first.shape)}"
            )
        if w.tile != first.tile or w.device != first.device:
            raise ValueError(f"stack_expert_weights: expert {e} has tile {w.tile} on {w.device}, "
                             f"expert 0 has {first.tile} on {first.device}")
        if w.global_decode.numel() != 1:
            raise ValueError(
                f"stack_expert_weights: expert {e} has {w.global_decode.numel()} global scales "
                f"(global_scale={w.global_scale!r}); each expert needs one tensor scale"
            )
    n, k = first.shape
    lin = [w.linear() for w in weights]
    return NVFP4Tensor(
        codes=torch.stack([w.codes.reshape(n, k // 2) for w in lin]),
        block_scales=torch.stack([w.block_scales.reshape(n, k // BLOCK) for w in lin]),
        global_decode=torch.cat([w.global_decode.reshape(1).to(torch.float32) for w in lin]),
        shape=torch.Size([len(weights), n, k]),
        global_scale="group",
        tile=first.tile,
        layout="linear",
    )


def decode_weight_geometry(w_stacked: NVFP4Tensor, num_experts: int | None = None) -> tuple[int, int, int]:
    """(E, N, K) of decode expert weights: ``[E, N, K]`` (``"group"`` or ``"row"`` scales), or
    ``[E*N, K]`` (``"row"`` scales) with ``num_experts`` given. Raises ValueError otherwise."""
    if not isinstance(w_stacked, NVFP4Tensor):
        raise TypeError("decode_grouped_gemm: w_stacked must be an NVFP4Tensor (see stack_expert_weights)")
    if len(w_stacked.shape) == 3:
        e, n, k = w_stacked.shape
        if num_experts is not None and num_experts != e:
            raise ValueError(f"decode_grouped_gemm: num_experts={num_experts} but w_stacked is {tuple(w_stacked.shape)}")
        if w_stacked.global_scale not in ("group", "row"):
            raise ValueError("decode_grouped_gemm: [E, N, K] weights need 'group' (or per-row) global scales, "
                             f"got {w_stacked.global_scale!r}")
        return e, n, k
    if len(w_stacked.shape) == 2:
        if num_experts is None or num_experts <= 0 or w_stacked.shape[0] % num_experts:
            raise ValueError(
                f"decode_grouped_gemm: [E*N, K] weights {tuple(w_stacked.shape)} need num_experts= dividing "
                f"{w_stacked.shape[0]} (got {num_experts}); stack_expert_weights gives an [E, N, K] tensor"
            )
        if w_stacked.global_scale != "row":
            raise ValueError("decode_grouped_gemm: [E*N, K] weights need per-row global scales (each expert's "
                             f"scale repeated over its rows), got {w_stacked.global_scale!r}")
        return num_experts, w_stacked.shape[0] // num_experts, w_stacked.shape[1]
    raise ValueError(f"decode_grouped_gemm: w_stacked must be [E, N, K] or [E*N, K], got {tuple(w_stacked.shape)}")


def check_decode_grouped_operands(a: NVFP4Tensor, w_stacked: NVFP4Tensor, expert_ids: torch.Tensor,
                                  num_experts: int | None = None, a_rows: torch.Tensor | None = None) -> tuple[int, int, int]:
    """The errors every backend's decode_grouped_gemm raises (no host sync: ids and ``a_rows`` are
    not read). Returns (E, N, K)."""
    e, n, k = decode_weight_geometry(w_stacked, num_experts)
    if not isinstance(a, NVFP4Tensor):
        raise TypeError("decode_grouped_gemm: a must be an NVFP4Tensor (quantize the rows first)")
    if len(a.shape) != 2 or a.k != k:
        raise ValueError(f"decode_grouped_gemm: a must be [R, K={k}], got {tuple(a.shape)}")
    if a.global_scale not in ("row", "tensor"):
        raise ValueError(f"decode_grouped_gemm: a needs a per-row or per-tensor global scale, got {a.global_scale!r}")
    if a_rows is not None and (not isinstance(a_rows, torch.Tensor) or a_rows.dim() != 1
                               or a_rows.dtype not in (torch.int32, torch.int64) or a_rows.device != a.device):
        raise ValueError(f"decode_grouped_gemm: a_rows must be a 1-D int32/int64 tensor of row indices on {a.device}, "
                         f"got {getattr(a_rows, 'dtype', type(a_rows).__name__)} {tuple(getattr(a_rows, 'shape', ()))}")
    rows = a.rows if a_rows is None else a_rows.numel()
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 1 or expert_ids.numel() != rows:
        raise ValueError(f"decode_grouped_gemm: expert_ids must be a 1-D tensor of {rows} expert indices, got "
                         f"{getattr(expert_ids, 'shape', type(expert_ids).__name__)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"decode_grouped_gemm: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if a.device != w_stacked.device or expert_ids.device != a.device:
        raise ValueError(f"decode_grouped_gemm: a on {a.device}, w_stacked on {w_stacked.device}, "
                         f"expert_ids on {expert_ids.device}")
    return e, n, k


def _check_indices_in_range(indices: torch.Tensor, limit: int, name: str, where: str) -> None:
    """ValueError naming the first entry of ``indices`` outside ``[0, limit)`` (a host sync)."""
    if indices.numel() == 0:
        return
    bad = (indices < 0) | (indices >= limit)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise ValueError(f"decode_grouped_gemm: {name}[{r}] = {int(indices[r])} is outside {where}")


def check_a_rows_in_range(a_rows: torch.Tensor, rows: int) -> None:
    """ValueError naming the first product row whose activation row index is outside ``[0, rows)``
    (a host sync)."""
    _check_indices_in_range(a_rows, rows, "a_rows", f"the {rows} rows of a")


def check_expert_ids_in_range(expert_ids: torch.Tensor, num_experts: int) -> None:
    """ValueError naming the first row whose expert index is outside ``[0, E)`` (a host sync)."""
    _check_indices_in_range(expert_ids, num_experts, "expert_ids", f"[0, {num_experts})")


def _expert_matrix(w_stacked: NVFP4Tensor, e: int, n: int, k: int) -> NVFP4Tensor:
    """Expert ``e``'s ``[N, K]`` weights with its one global scale."""
    m = w_stacked.matrix()
    return replace(
        m,
        codes=m.codes[e * n : (e + 1) * n],
        block_scales=m.block_scales[e * n : (e + 1) * n],
        global_decode=m.global_decode[e * n : (e + 1) * n],
        shape=torch.Size([n, k]),
        global_scale="row",
        image=None if m.image is None else m.image[e * n : (e + 1) * n],
    )


def _take_rows(a: NVFP4Tensor, rows: torch.Tensor) -> NVFP4Tensor:
    m = a.matrix()
    g = m.global_decode[rows] if m.global_scale == "row" else m.global_decode
    return replace(
        m,
        codes=m.codes[rows],
        block_scales=m.block_scales[rows],
        global_decode=g,
        shape=torch.Size([rows.numel(), a.k]),
        image=None if m.image is None else m.image[rows],
    )


def decode_grouped_gemm_reference(
    a: NVFP4Tensor,
    w_stacked: NVFP4Tensor,
    expert_ids: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool = False,
    *,
    num_experts: int | None = None,
    a_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoE decode: ``out[r] = gemm(a[r], w_stacked[expert_ids[r]])`` -> ``[R, N]`` ``out_dtype``
    (with ``a_rows``: ``gemm(a[a_rows[r]], ...)``).

    Args:
        a: NVFP4 ``[R, K]``, per-row (or per-tensor) global scale; one row per (token, chosen
            expert) pair, in any order (rows of one expert need not be adjacent).
        w_stacked: NVFP4 ``[E, N, K]`` (:func:`stack_expert_weights`, or the learner's
            ``"group"`` weights), or its ``[E*N, K]`` matrix with per-row scales and
            ``num_experts=E``.
        expert_ids: int32/int64 ``[R]``, each in ``[0, E)``.
        a_rows: optional int32/int64 ``[R]``: product row ``r`` takes row ``a_rows[r]`` of ``a``
            (then ``[T, K]``: the decode step's T tokens, each read by its k experts' rows), each
            in ``[0, T)``; the same bits as ``a``'s rows gathered first.
        batch_invariant: accepted for the backends' signature; the reference is always batch
            invariant (the contract's canonical accumulation order, row by row).

    Every row is the contract's dense GEMM of that row with its expert's weights, bit for bit
    (so ``R = 0``, experts chosen by no row, and several rows of one expert all follow).
    This reference reads ``expert_ids`` on the host (a sync); kernels must not.

    Raises TypeError / ValueError for operands of the wrong kind, shape or device, and
    ValueError for an expert index outside ``[0, E)``.
    """
    e, n, k = check_decode_grouped_operands(a, w_stacked, expert_ids, num_experts, a_rows)
    check_expert_ids_in_range(expert_ids, e)
    if a_rows is not None:
        check_a_rows_in_range(a_rows, a.rows)
        a = _take_rows(a, a_rows.to(torch.int64))
    out = torch.empty(a.rows, n, dtype=out_dtype, device=a.device)
    if a.rows == 0:
        return out
    ids = expert_ids.to(torch.int64)
    for expert in torch.unique(ids).tolist():
        rows = (ids == expert).nonzero().reshape(-1)
        out[rows] = gemm_reference(_take_rows(a, rows), _expert_matrix(w_stacked, expert, n, k), None, out_dtype)
    return out
