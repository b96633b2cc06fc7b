"""Compare each layout's results with one process: bitwise where the layout allows, else the 2x rule.

The rule (``docs/numerics.md``, "Parallel layouts"), normwise per tensor, for a loss tensor
``[B, S]`` of one step or one parameter's gradient::

    ||layout - exact||  <=  2 * ||single - exact||  +  N_MAX * 2^-24 * ||exact||

``single`` is the same spec in one process, ``exact`` the same weights and data in one process
with every part in high precision (fp32 GEMMs). For an fp32 spec ``single`` *is* ``exact`` and
the rule is the fp32 re-association bound: reordering an n-term sum changes it by at most
``n * u`` relative to the sum of magnitudes (u = 2^-24), and N_MAX = 128 is the model's longest
reduction. For NVFP4 the first term is quack's 2x rule: no layout may be more than twice as far
from the exact model as one process is. What must be bitwise is in :func:`layouts.expectations`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import DISTOPT_PAIR, expectations, parse
from .model import EXACT_OF, INVARIANT_EXPERTS, N_MAX

U = 2.0**-24
REASSOCIATION = N_MAX * U


@dataclass
class Row:
    layout: str
    quantity: str
    rule: str  # "bitwise" or "2x"
    measured: str
    ok: bool
    why: str = ""

    def __str__(self) -> str:
        flag = "ok  " if self.ok else "FAIL"
        return f"{flag} {self.layout:<22} {self.quantity:<26} {self.rule:<8} {self.measured}"


def max_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two fp32 tensors (0 == bitwise)."""
    ia = a.float().contiguous().view(torch.int32).to(torch.int64)
    ib = b.float().contiguous().view(torch.int32).to(torch.int64)
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # sign-magnitude -> a monotonic integer line
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _dist(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm())


def within_rule(got: torch.Tensor, single: torch.Tensor, exact: torch.Tensor) -> tuple[bool, float, float]:
    """``(ok, ||got - exact||, bound)`` of the 2x rule for one tensor."""
    err = _dist(got, exact)
    bound = 2 * _dist(single, exact) + REASSOCIATION * float(exact.double().norm())
    return bool(torch.isfinite(got).all()) and err <= bound, err, bound


def _compare(layout: str, quantity: str, bitwise: bool, why: str, got: dict, single: dict, exact: dict) -> Row:
    """One row over a set of named tensors (all of a step's losses, or all gradients)."""
    if set(got) != set(single):
        return Row(layout, quantity, "bitwise" if bitwise else "2x", f"names differ: {sorted(set(got) ^ set(single))}",
                   False, why)
    if bitwise:
        bad = {k: max_ulp_distance(got[k], single[k]) for k in got}
        bad = {k: v for k, v in bad.items() if v}
        measured = "0 ulp" if not bad else f"{len(bad)} differ, worst {max(bad.values())} ulp ({max(bad, key=bad.get)})"
        return Row(layout, quantity, "bitwise", measured, not bad, why)
    worst, fails = 0.0, []
    for k in got:
        ok, err, bound = within_rule(got[k], single[k], exact[k])
        ratio = err / bound if bound else (0.0 if err == 0 else float("inf"))
        worst = max(worst, ratio)
        if not ok:
            fails.append(k)
    measured = f"worst err/bound {worst:.3f}" + (f"; over: {fails[:4]}" if fails else "")
    return Row(layout, quantity, "2x", measured, not fails, why)


def compare(results: dict, spec: str, layouts: list[str], world: int, *, bitwise_capable: bool = True) -> list[Row]:
    """Rows for every layout of ``spec`` in ``results`` (keys ``"spec:layout"``)."""
    single, exact = results[f"{spec}:ref"], results[f"{EXACT_OF[spec]}:ref"]
    rows = []
    for name in layouts:
        got = results[f"{spec}:{name}"]
        exp = expectations(parse(name), world, bitwise_capable=bitwise_capable, stochastic=spec == "nvfp4_sr",
                           invariant_experts=INVARIANT_EXPERTS[spec])
        tag = f"{spec}:{name}"
        steps = got["losses"].shape[0]
        for i in range(steps):
            bitwise = exp.forward if i == 0 else exp.trajectory
            why = exp.why[0] if i == 0 else exp.why[2]
            rows.append(_compare(tag, f"loss step {i + 1}", bitwise, why,
                                 {"loss": got["losses"][i]}, {"loss": single["losses"][i]}, {"loss": exact["losses"][i]}))
        if "grads" in got:
            rows.append(_compare(tag, "grads step 1", exp.grads, exp.why[1], got["grads"], single["grads"], exact["grads"]))
        if "weights" in got and exp.trajectory:  # (Adam turns re-association noise in near-zero
            # gradients into +-lr steps: weights are compared only where they must be bitwise)
            rows.append(_compare(tag, f"weights after step {steps}", True, exp.why[2],
                                 got["weights"], single["weights"], exact["weights"]))
    rows += distributed_optimizer_pairs(results, spec, layouts, world, bitwise_capable=bitwise_capable)
    return rows


def distributed_optimizer_pairs(results: dict, spec: str, layouts: list[str], world: int, *,
                                bitwise_capable: bool = True) -> list[Row]:
    """``X_do`` against ``X``: the distributed optimizer changes nothing but who updates what."""
    rows = []
    by_sizes = {}
    for name in layouts:
        lay = parse(name)
        by_sizes[(lay.tp, lay.sp, lay.ep, lay.etp, lay.pp, lay.vp, lay.do)] = name
    for name in layouts:
        lay = parse(name)
        plain = by_sizes.get((lay.tp, lay.sp, lay.ep, lay.etp, lay.pp, lay.vp, False))
        if not lay.do or plain is None:
            continue
        a, b = results[f"{spec}:{name}"], results[f"{spec}:{plain}"]
        bitwise = bitwise_capable and spec != "nvfp4_sr" and lay.dp(world) <= 2
        tensors_a = {f"loss step {i + 1}": a["losses"][i] for i in range(a["losses"].shape[0])} | a["weights"]
        tensors_b = {f"loss step {i + 1}": b["losses"][i] for i in range(b["losses"].shape[0])} | b["weights"]
        if bitwise:
            rows.append(_compare(f"{spec}:{name}", f"vs {plain}", True, DISTOPT_PAIR, tensors_a, tensors_b, tensors_b))
    return rows


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (0 when both are zero)."""
    den = float(b.double().norm())
    num = _dist(a, b)
    return num / den if den else num
