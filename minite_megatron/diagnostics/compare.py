"""Compare two traces point by point and find the first divergence.

For each capture point, rows are aligned by key (sequence, position[, expert]); only keys
present in both traces are compared (the learner may run tokens the sampler never fed back,
e.g. the last sampled token). Per point: bitwise equality (on the raw bits, same dtype), the
number of mismatching elements, max / mean absolute error and max relative error
``|a - b| / max(|a|, tiny)`` with ``a`` the reference, and, for routed (expert-permuted)
points, the number of common tokens whose expert *set* differs.

Status of a point:

- ``equal``: bitwise equal on every common row (and the same expert sets);
- ``within_tol``: not bitwise equal, but every element satisfies
  ``|a - b| <= atol + rtol * |a|`` (only when a tolerance is given; integer and bool points are
  always compared exactly);
- ``diverged``: anything else (including a dtype, kind or row-shape difference, a NaN on one
  side only, or a routing difference);
- ``no_common_rows``, ``missing_in_other``, ``missing_in_ref``: nothing to compare.

"First divergence" is the first ``diverged`` point in the reference trace's execution order.

Ranking by consequence. The first divergence is often harmless: a 1-ulp difference in an
attention output that the next quantizer rounds to the same codes. What spreads is a difference
that changes a *discrete* decision downstream -- NVFP4 codes or block scales, a routing map, a
top-k, an expert set. :func:`rank_by_consequence` follows each diverged point forward in
execution order: its **consequence** is the first diverged discrete point (integer values:
codes, scales, routing maps, indices; or a routed point whose tokens changed experts) reached
before any numeric point is bitwise equal again; a numeric point that is equal again first means
the difference was **absorbed** (the values agree again: nothing downstream can have flipped).
``Comparison.first_consequential`` is the first diverged point with a consequence -- the one to
fix. (Execution order stands in for data flow: a point equal again on a parallel branch can mark a
divergence absorbed that in fact reached a later point; the report names what it used.)
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

from ..testing import raw_bits
from .capture import index_rows
from .trace import Trace, TracePoint, describe_key, token_part

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"local_experts\.\d+\.")

STATUSES = ("equal", "within_tol", "diverged", "no_common_rows", "missing_in_other", "missing_in_ref")


def layer_of(name: str) -> int | None:
    """The layer number in a capture name (``decoder.layers.3.mlp`` -> 3), or None."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def point_label(name: str) -> str:
    """The name after its layer, expert numbers collapsed: the row label of the per-layer heatmap.

    ``decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.output`` ->
    ``mlp.experts.local_experts.*.linear_fc2.output``; a name without a layer is kept whole.
    """
    m = _LAYER_RE.search(name)
    label = name[m.end() :] if m else name
    return _EXPERT_RE.sub("local_experts.*.", label)


@dataclass
class PointResult:
    """The comparison of one capture point (see the module docstring for ``status``)."""

    index: int
    name: str
    layer: int | None
    label: str
    kind: str
    status: str
    rows_ref: int = 0
    rows_other: int = 0
    rows_common: int = 0
    elements: int = 0
    mismatched: int = 0
    max_abs: float = 0.0
    mean_abs: float = 0.0
    max_rel: float = 0.0
    ref_absmax: float = 0.0
    routing_mismatch_tokens: int = 0
    worst_key: str | None = None
    worst_element: list[int] | None = None
    worst_ref: float | int | None = None
    worst_other: float | int | None = None
    numeric: bool = True
    note: str = ""
    consequence: str | None = None
    absorbed_at: str | None = None

    @property
    def bitwise_equal(self) -> bool:
        return self.status == "equal"

    @property
    def compared(self) -> bool:
        return self.status in ("equal", "within_tol", "diverged")


@dataclass
class Comparison:
    """All point results in reference execution order, and the first divergence."""

    ref_engine: str
    other_engine: str
    atol: float | None
    rtol: float | None
    results: list[PointResult] = field(default_factory=list)
    first_divergence: PointResult | None = None
    first_consequential: PointResult | None = None

    @property
    def mode(self) -> str:
        if self.atol is None and self.rtol is None:
            return "bitwise"
        return f"atol={self.atol or 0.0:g}, rtol={self.rtol or 0.0:g}"

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def to_dict(self) -> dict:
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return repr(v)  # JSON has no inf/nan
            return v

        return {
            "ref_engine": self.ref_engine,
            "other_engine": self.other_engine,
            "mode": self.mode,
            "atol": self.atol,
            "rtol": self.rtol,
            "counts": self.counts(),
            "first_divergence": None if self.first_divergence is None else self.first_divergence.name,
            "first_consequential": None if self.first_consequential is None else self.first_consequential.name,
            "ranked_divergences": [r.name for r in rank_by_consequence(self)],
            "points": [{k: clean(v) for k, v in asdict(r).items()} for r in self.results],
        }


def _float_error(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(err, a64, b64): float64 |a - b| with equal values (incl. both NaN, same infinities) at 0
    and a NaN/inf on one side only at +inf."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    err = torch.where(same, torch.zeros_like(a64), (a64 - b64).abs())
    return torch.nan_to_num(err, nan=math.inf, posinf=math.inf), a64, b64


def compare_point(
    index: int, ref: TracePoint, other: TracePoint, atol: float | None, rtol: float | None
) -> PointResult:
    """Compare one point present in both traces."""
    res = PointResult(index, ref.name, layer_of(ref.name), point_label(ref.name), ref.kind, "diverged")
    res.rows_ref, res.rows_other = ref.rows, other.rows
    if ref.kind != other.kind:
        res.note = f"kind differs: {ref.kind} vs {other.kind}"
        return res
    if ref.values.shape[1:] != other.values.shape[1:]:
        res.note = f"row shape differs: {tuple(ref.values.shape[1:])} vs {tuple(other.values.shape[1:])}"
        return res

    same_keys = torch.equal(ref.keys, other.keys)  # the common case: no alignment work
    if same_keys:
        ia = ib = None
        res.rows_common = ref.rows
    else:
        in_other = torch.isin(other.keys, ref.keys)
        ib = in_other.nonzero().reshape(-1)
        ia = torch.searchsorted(ref.keys, other.keys[ib])
        res.rows_common = int(ib.numel())

    routing_bad = 0
    if ref.kind == "routed" and not same_keys:
        tok_a, tok_b = token_part(ref.keys), token_part(other.keys)
        common_tok = tok_a[torch.isin(tok_a, tok_b)].unique()
        ka = ref.keys[torch.isin(tok_a, common_tok)]
        kb = other.keys[torch.isin(tok_b, common_tok)]
        sym = torch.cat([ka[~torch.isin(ka, kb)], kb[~torch.isin(kb, ka)]])
        routing_bad = int(token_part(sym).unique().numel())
        res.routing_mismatch_tokens = routing_bad
        if routing_bad:
            res.note = f"{routing_bad} common token(s) routed to different experts"
    if res.rows_common == 0:
        res.status = "diverged" if routing_bad else "no_common_rows"
        return res

    a = ref.values if ia is None else index_rows(ref.values, ia)
    b = other.values if ib is None else index_rows(other.values, ib)
    res.elements = int(a.numel())
    same_dtype = a.dtype == b.dtype
    res.numeric = a.dtype.is_floating_point and b.dtype.is_floating_point
    if same_dtype and not routing_bad and torch.equal(raw_bits(a), raw_bits(b)):
        res.status = "equal"  # fast path: nothing to measure
        return res
    if same_dtype:
        neq = raw_bits(a) != raw_bits(b)
    else:
        neq = torch.ones(a.shape, dtype=torch.bool)
        res.note = (res.note + "; " if res.note else "") + f"dtype differs: {a.dtype} vs {b.dtype}"
    res.mismatched = int(neq.sum())

    exact_only = not (a.dtype.is_floating_point and b.dtype.is_floating_point)
    res.numeric = not exact_only
    err, a64, b64 = _float_error(a, b)
    finite_a = a64[torch.isfinite(a64)]
    res.ref_absmax = float(finite_a.abs().max()) if finite_a.numel() else 0.0
    if err.numel():
        res.max_abs = float(err.max())
        res.mean_abs = float(err.mean())
        tiny = torch.finfo(a.dtype).tiny if a.dtype.is_floating_point else 1.0
        rel = err / a64.abs().clamp_min(tiny)
        rel = torch.where(err == 0, torch.zeros_like(rel), rel)
        res.max_rel = float(rel.nan_to_num(nan=math.inf).max())
    if res.mismatched:
        pick = neq.to(torch.float64) if (exact_only or res.max_abs == 0) else err
        flat = pick.reshape(err.shape[0], -1)
        worst = int(flat.reshape(-1).argmax())
        row, col = divmod(worst, max(flat.shape[1], 1))
        res.worst_key = describe_key(int(ref.keys[row if ia is None else ia[row]]), ref.kind)
        elem = list(torch.unravel_index(torch.tensor(col), a.shape[1:])) if a.dim() > 1 else []
        res.worst_element = [int(e) for e in elem]
        res.worst_ref = float(a64.reshape(a64.shape[0], -1)[row, col]) if a64.dim() > 1 else float(a64[row])
        res.worst_other = float(b64.reshape(b64.shape[0], -1)[row, col]) if b64.dim() > 1 else float(b64[row])
    if exact_only:
        # Integer / bool points (packed codes, routing maps, indices): a numeric difference of
        # packed bytes means nothing, only which elements differ does.
        res.max_abs = res.mean_abs = res.max_rel = math.nan
        if res.worst_ref is not None:
            res.worst_ref, res.worst_other = int(res.worst_ref), int(res.worst_other)

    if res.mismatched == 0 and same_dtype and not routing_bad:
        res.status = "equal"
    elif routing_bad or exact_only or (atol is None and rtol is None):
        res.status = "diverged"
    else:
        tol = (atol or 0.0) + (rtol or 0.0) * a64.abs()
        res.status = "diverged" if bool((err > tol).any()) else "within_tol"
    return res


def compare_traces(ref: Trace, other: Trace, *, atol: float | None = None, rtol: float | None = None) -> Comparison:
    """Compare ``other`` against ``ref`` point by point, in ``ref``'s execution order.

    Args:
        atol, rtol: tolerance; both None (default) means bitwise: any differing bit diverges.

    Raises ValueError for a negative tolerance.
    """
    for nm, v in (("atol", atol), ("rtol", rtol)):
        if v is not None and not (v >= 0):
            raise ValueError(f"{nm} must be >= 0, got {v}")
    cmp = Comparison(ref.engine or "reference", other.engine or "other", atol, rtol)
    for i, name in enumerate(ref.order):
        if name in other:
            r = compare_point(i, ref[name], other[name], atol, rtol)
        else:
            p = ref[name]
            r = PointResult(i, name, layer_of(name), point_label(name), p.kind, "missing_in_other", rows_ref=p.rows)
        cmp.results.append(r)
        if cmp.first_divergence is None and r.status == "diverged":
            cmp.first_divergence = r
    n = len(ref.order)
    for j, name in enumerate(nm for nm in other.order if nm not in ref):
        p = other[name]
        cmp.results.append(
            PointResult(n + j, name, layer_of(name), point_label(name), p.kind, "missing_in_ref", rows_other=p.rows)
        )
    _trace_consequences(cmp)
    return cmp


def is_discrete(r: PointResult) -> bool:
    """A point holding decisions (codes, scales, routing, indices) rather than values."""
    return not r.numeric or r.routing_mismatch_tokens > 0


def _trace_consequences(cmp: Comparison) -> None:
    """Fill ``consequence`` / ``absorbed_at`` of every diverged point and ``first_consequential``
    (see the module docstring)."""
    compared = [r for r in cmp.results if r.compared]
    for i, r in enumerate(compared):
        if r.status != "diverged":
            continue
        if is_discrete(r):
            r.consequence = r.name  # a flipped decision is its own consequence
        else:
            for later in compared[i + 1 :]:
                if later.status == "diverged" and is_discrete(later):
                    r.consequence = later.name
                    break
                if later.status == "equal" and later.numeric and not is_discrete(later):
                    r.absorbed_at = later.name
                    break
        if r.consequence is not None and cmp.first_consequential is None:
            cmp.first_consequential = r


def rank_by_consequence(cmp: Comparison) -> list[PointResult]:
    """Diverged points, those with a downstream consequence first (in execution order), then the
    absorbed ones, then those whose fate the trace does not show (nothing compared after them)."""
    diverged = [r for r in cmp.results if r.status == "diverged"]
    return ([r for r in diverged if r.consequence is not None]
            + [r for r in diverged if r.consequence is None and r.absorbed_at is not None]
            + [r for r in diverged if r.consequence is None and r.absorbed_at is None])


__all__ = ["Comparison", "PointResult", "compare_point", "compare_traces", "is_discrete", "layer_of", "point_label",
           "rank_by_consequence"]
