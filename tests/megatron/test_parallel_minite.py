"""miniTE's NVFP4 spec under TP=2+SP, EP=2 and TP2+EP2 (two gloo processes) against one process.

NVFP4 gradients are not bitwise across layouts: stochastic rounding draws other bits, and the
wgrad blocks of 16 tokens group other tokens when experts receive them in another order. What
must hold is that no layout is *worse*: measured against the exact (unquantized, FP32) gradient
of the same weights and batch -- the same spec with every linear in high precision -- each
layout's error stays within twice the single-process NVFP4 error (quack's 2x rule), per
parameter and for the loss. An FP32 re-association allowance (``n_max * 2^-24`` relative, see
test_parallel_equivalence.py) covers tensors the recipe leaves in high precision.
"""

from __future__ import annotations

import pytest
import torch

from ._parallel_harness import relative_error, run_equivalence
from .test_parallel_equivalence import FP32_REASSOCIATION

pytestmark = [pytest.mark.multiproc]

SPEC = "minite_megatron.megatron_args:minite_layer_spec"
EXACT = dict(quantize_attention=False, quantize_dense_mlp=False, quantize_experts=False, quantize_shared_experts=False)


@pytest.fixture(scope="module")
def runs():
    exact = run_equivalence(SPEC, spec_kwargs={"recipe": EXACT}, layouts=["ref"])["ref"]
    fp4 = run_equivalence(SPEC, spec_kwargs={"recipe": {}})
    return exact, fp4


def _err(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a.double() - exact.double()).norm())


def test_nvfp4_really_quantizes(runs):
    exact, fp4 = runs
    rel = relative_error(fp4["ref"]["loss"], exact["loss"])
    assert 0 < rel < 0.1, f"single-process NVFP4 loss vs exact: {rel}"


@pytest.mark.parametrize("layout", ["ep2", "tp2_sp", "tp2_ep2"])
def test_every_layout_is_as_accurate_as_one_process(runs, layout):
    exact, fp4 = runs
    single, got = fp4["ref"], fp4[layout]
    assert torch.isfinite(got["loss"]).all()
    loss_bound = 2 * _err(single["loss"], exact["loss"]) + FP32_REASSOCIATION * float(exact["loss"].double().norm())
    assert _err(got["loss"], exact["loss"]) <= loss_bound, layout
    assert set(got["grads"]) == set(exact["grads"])
    worse = {}
    for k, g in got["grads"].items():
        e = exact["grads"][k]
        bound = 2 * _err(single["grads"][k], e) + FP32_REASSOCIATION * float(e.double().norm())
        if not _err(g, e) <= bound:
            worse[k] = (_err(g, e), bound)
    assert worse == {}, f"{layout}: gradients further from exact than 2x the single-process NVFP4 error: {worse}"
