"""Every parallel layout of CI (2 gloo ranks) trains the tiny MoE like one process.

Real megatron-core on CPU (the CPU compatibility layer): ``tests.parallel.train`` trains each
layout 3 steps through Megatron's DDP, optimizer and pipeline schedules on the same initial
weights and data as one process; :mod:`tests.parallel.rules` compares the per-token losses of
every step, the step-1 gradients (gathered into the single-process layout) and, where they must
be bitwise, the final weights. Bitwise where the layout allows (``layouts.expectations`` says
why per layout), else the 2x rule of ``docs/numerics.md``. The spec is the minite NVFP4 spec with
nearest rounding of gradients (deterministic, so bitwise properties are visible on the product
path); one layout also runs the default recipe (stochastic rounding: the rule only), and the
layouts that split sums also run the exact (fp32) spec, where the rule is the tight fp32
re-association bound alone (``single`` is ``exact``).

The same checks on more ranks / NCCL: ``python -m tests.parallel.run --nproc 8 --backend nccl
--layouts multi-gpu`` (issue 12).
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.layouts import CI_LAYOUTS, expectations, parse
from tests.parallel.rules import compare, relative_error
from tests.parallel.run import run_layouts

pytestmark = [pytest.mark.multiproc]
WORLD = 2
SR = ("nvfp4_sr", "tp2_sp_ep2")
EXACT = ("tp2_sp", "etp2", "tp2_sp_ep2", "ep2")


@pytest.fixture(scope="module")
def results():
    return run_layouts(list(CI_LAYOUTS), world=WORLD, specs=["nvfp4"], steps=3,
                       also=[SR, *(("exact", name) for name in EXACT)])


def test_references_are_real(results):
    """The single-process runs train, NVFP4 really quantizes, and gradients are non-zero."""
    single, exact = results["nvfp4:ref"], results["exact:ref"]
    for r in (single, exact):
        assert torch.isfinite(r["losses"]).all() and not any(r["skipped"])
        assert r["losses"][-1].mean() < r["losses"][0].mean(), "three Adam steps should lower the loss"
        zero = [k for k, g in r["grads"].items() if not torch.isfinite(g).all() or g.abs().max() == 0]
        assert zero == [], f"reference gradients zero or non-finite: {zero}"
    rel = relative_error(single["losses"][0], exact["losses"][0])
    assert 1e-4 < rel < 0.1, f"single-process NVFP4 loss vs exact: {rel}"
    assert any(".experts." in k for k in single["grads"])


@pytest.mark.parametrize("layout", CI_LAYOUTS)
def test_layout_matches_one_process(results, layout):
    rows = compare(results, "nvfp4", [layout], WORLD)
    exp = expectations(parse(layout), WORLD)
    assert rows and all(r.rule == "bitwise" for r in rows if r.quantity == "loss step 1") == exp.forward
    failed = [str(r) for r in rows if not r.ok]
    assert failed == [], "\n".join(failed)


def test_default_recipe_with_stochastic_rounding_within_the_rule(results):
    rows = compare(results, SR[0], [SR[1]], WORLD)
    assert rows and all(r.rule == "2x" for r in rows)  # tp2: not even the forward is bitwise
    failed = [str(r) for r in rows if not r.ok]
    assert failed == [], "\n".join(failed)


@pytest.mark.parametrize("layout", EXACT)
def test_fp32_layout_within_the_reassociation_bound(results, layout):
    """The exact model (fp32 GEMMs) under the tight bound: what the NVFP4 rule's 2x term could hide."""
    rows = compare(results, "exact", [layout], WORLD)
    failed = [str(r) for r in rows if not r.ok]
    assert rows and failed == [], "\n".join(failed)
