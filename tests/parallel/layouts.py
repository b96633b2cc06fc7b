"""Parallel layouts by name, and what each one may change in the arithmetic.

A layout name is a ``_``-separated list of parts (order free)::

    tp<N>   tensor parallelism          sp   sequence parallelism (needs tp > 1)
    ep<N>   expert parallelism          etp<N> expert tensor parallelism (default: 1)
    pp<N>   pipeline parallelism        vp<N>  virtual pipeline stages per rank (needs pp > 1)
    do      Megatron's distributed optimizer (shards the optimizer state over data parallelism)
    dp      nothing but data parallelism (a marker: data parallelism is always what is left)
    ref     one process: every size 1 (only as the whole name)

Data parallelism is what the world leaves: ``dp = world / (tp * pp)`` for the dense part and
``edp = world / (etp * ep * pp)`` for the experts (Megatron's MoE parallel folding), so the same
name means more data parallelism on more ranks: ``tp2_sp`` is TP2 x DP1 on 2 ranks and TP2 x DP4
on 8. Examples: ``tp2_sp``, ``ep2``, ``etp2``, ``pp2``, ``pp2_vp2``, ``do``, ``tp2_sp_ep2``,
``pp2_vp2_ep2_do``, ``tp2_sp_etp2_ep2_pp2``.

:func:`expectations` says, per layout, which results must be bitwise equal to one process and
why (the reasons are the documentation: ``PARALLELISM.md`` quotes them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PART = re.compile(r"^(tp|ep|etp|pp|vp)(\d+)$")


class LayoutError(ValueError):
    """A layout name that does not parse or does not fit the world size."""


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 1
    pp: int = 1
    vp: int | None = None
    do: bool = False

    # ---- derived sizes (need the world size) --------------------------------------------------
    def dp(self, world: int) -> int:
        return world // (self.tp * self.pp)

    def edp(self, world: int) -> int:
        return world // (self.etp * self.ep * self.pp)

    @property
    def chunks(self) -> int:
        """Model chunks per rank (virtual pipeline stages)."""
        return self.vp or 1

    def check(self, world: int, *, num_layers: int, num_experts: int, global_batch: int, micro_batch: int,
              num_query_groups: int | None = None, moe_ffn_hidden_size: int | None = None) -> None:
        """Raise :class:`LayoutError` when this layout cannot run ``world`` ranks of the model."""
        problems = []
        if num_query_groups is not None and num_query_groups % self.tp:
            problems.append(f"tp{self.tp} does not divide the {num_query_groups} query groups")
        if moe_ffn_hidden_size is not None and (moe_ffn_hidden_size % self.etp or (moe_ffn_hidden_size // self.etp) % 16):
            problems.append(f"etp{self.etp} leaves an expert FFN slice of {moe_ffn_hidden_size / self.etp:g}, "
                            "not a multiple of 16 (NVFP4 blocks)")
        if world % (self.tp * self.pp):
            problems.append(f"tp*pp = {self.tp * self.pp} does not divide the world size {world}")
        elif world % (self.etp * self.ep * self.pp):
            problems.append(f"etp*ep*pp = {self.etp * self.ep * self.pp} does not divide the world size {world}")
        if num_experts % self.ep:
            problems.append(f"ep{self.ep} does not divide the {num_experts} experts")
        if num_layers % (self.pp * self.chunks):
            problems.append(f"pp*vp = {self.pp * self.chunks} does not divide the {num_layers} layers")
        if self.tp > 1 and not self.sp:
            problems.append("MoE with tp > 1 needs sp (Megatron requires sequence parallelism there)")
        if not problems:
            dp = self.dp(world)
            if global_batch % (micro_batch * dp):
                problems.append(f"the global batch {global_batch} does not split into micro-batches of "
                                f"{micro_batch} over dp{dp}")
            elif self.vp and (global_batch // (micro_batch * dp)) % self.pp:
                problems.append("the interleaved schedule needs a number of micro-batches divisible by pp")
        if problems:
            raise LayoutError(f"layout {self.name!r} on {world} ranks: " + "; ".join(problems))


def parse(name: str) -> Layout:
    """``"tp2_sp_ep2"`` -> ``Layout(tp=2, sp=True, ep=2)``; raises :class:`LayoutError`."""
    if name == "ref":
        return Layout(name)
    sizes: dict = {}
    for part in name.split("_"):
        m = _PART.match(part)
        if m:
            key, value = m.group(1), int(m.group(2))
            if value < 1:
                raise LayoutError(f"layout {name!r}: {part} must be >= 1")
            sizes[key] = value
        elif part in ("sp", "do"):
            sizes[part] = True
        elif part == "dp":
            continue
        else:
            raise LayoutError(f"layout {name!r}: unknown part {part!r} (tp<N>, sp, ep<N>, etp<N>, pp<N>, vp<N>, do, dp)")
    if sizes.get("sp") and sizes.get("tp", 1) == 1:
        raise LayoutError(f"layout {name!r}: sp needs tp > 1")
    if "vp" in sizes and sizes.get("pp", 1) == 1:
        raise LayoutError(f"layout {name!r}: vp needs pp > 1")
    return Layout(name, **sizes)


# ---- what may be bitwise ----------------------------------------------------------------------
FORWARD_EXACT = (
    "forward bitwise: data, expert and pipeline parallelism move whole tokens and whole layers; "
    "no sum is split (the experts' GEMMs are batch invariant, so a token's expert output does not "
    "depend on how many tokens of other ranks share its expert's GEMM; the combine adds a token's "
    "expert outputs in a fixed order)"
)
FORWARD_EP_GEMM = (
    "forward within the rule: expert parallelism puts the tokens of every EP rank into one "
    "expert's GEMM, and this spec's expert GEMMs are the BLAS GEMM, whose rows depend on the "
    "number of rows (on the CPU here: groups of 1 to 3 rows take another kernel); fp32 "
    "re-association only (strict mode or NVFP4 experts: bitwise)"
)
FORWARD_TP = (
    "forward within the rule: tensor parallelism splits the K of row-parallel GEMMs (two partial "
    "sums, then an all-reduce) and the vocabulary of the loss: a re-association of fp32 sums"
)
GRADS_EXACT = (
    "gradients bitwise: only pipeline stages change; each layer sees the same micro-batches in the "
    "same order and the stages exchange activations and gradients exactly"
)
GRADS_DP = (
    "gradients within the rule: data parallelism sums the micro-batch gradients of several ranks "
    "(another order), expert weights sum tokens that arrive from several ranks, and NVFP4 "
    "gradient scales are taken over the tokens of one rank"
)
TRAJECTORY_EXACT = (
    "later steps bitwise: bitwise gradients, an element-wise Adam update (also on the distributed "
    "optimizer's shards) and no gradient clipping"
)
TRAJECTORY_RULE = "later steps within the rule: they start from weights updated with rule-bound gradients"
DISTOPT_PAIR = (
    "distributed optimizer == plain data parallelism, bitwise, on 2 data-parallel ranks: a "
    "reduce-scatter and an all-reduce add the same two terms (which commutes), and Adam is "
    "element-wise on the shards"
)


@dataclass(frozen=True)
class Expectation:
    forward: bool
    grads: bool
    trajectory: bool
    why: tuple[str, ...]


STOCHASTIC = (
    "within the rule only: stochastic rounding of gradients draws a stream per rank (and the "
    "forward from step 2 on sees weights updated with those gradients)"
)
GPU = "within the rule only: GPU GEMMs may pick their kernel (and K order) by the number of rows"


def expectations(layout: Layout, world: int, *, bitwise_capable: bool = True, stochastic: bool = False,
                 invariant_experts: bool = True) -> Expectation:
    """Which results of ``layout`` on ``world`` ranks must equal one process bit for bit.

    ``bitwise_capable``: the device's GEMMs give the same rows for the same row count (true of
    the CPU kernels; not promised by cuBLAS, whose kernel choice depends on M: on GPUs every
    check falls back to the rule). ``stochastic``: the spec rounds gradients stochastically (the
    forward of step 1 may still be bitwise). ``invariant_experts``: the spec's expert GEMMs are
    batch invariant (``model.INVARIANT_EXPERTS``); if not, expert parallelism changes the
    number of rows of each expert's GEMM and the forward is held to the rule.
    """
    if not bitwise_capable:
        return Expectation(False, False, False, (GPU,) * 3)
    split = layout.tp > 1 or layout.etp > 1
    forward = not split and (layout.ep == 1 or invariant_experts)
    forward_why = FORWARD_EXACT if forward else FORWARD_TP if split else FORWARD_EP_GEMM
    if stochastic:
        return Expectation(forward, False, False, (forward_why, STOCHASTIC, STOCHASTIC))
    grads = forward and layout.dp(world) == 1 and layout.edp(world) == 1
    why = (
        forward_why,
        GRADS_EXACT if grads else GRADS_DP,
        TRAJECTORY_EXACT if grads else TRAJECTORY_RULE,
    )
    return Expectation(forward, grads, grads, why)


CI_LAYOUTS = ("tp2_sp", "ep2", "etp2", "tp2_sp_ep2", "pp2", "pp2_vp2", "dp", "dp_do", "ep2_do")
"""What CI runs on 2 gloo ranks (each also under the 2x rule against the exact model)."""

MULTI_GPU_LAYOUTS = (
    "tp2_sp", "ep2", "ep4", "tp2_sp_ep4", "etp2_ep2", "tp2_sp_etp2_ep2", "pp2", "pp2_vp2", "dp_do",
    "ep4_do", "tp2_sp_pp2_ep2_do", "pp2_vp2_ep2_do",
)
"""A suggested set for 8 GPUs (issue 12): every kind of parallelism and their combinations. The
tiny model allows tp <= 2 (2 query groups) and etp <= 2 (expert FFN 32); on 8 ranks the runner
raises the global batch so that every data-parallel rank gets micro-batches."""
