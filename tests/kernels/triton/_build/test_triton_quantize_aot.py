"""The fast quantize kernels compiled for the H200 (sm_90a) on this CPU machine, ahead of time.

Pins what their speed and exactness rest on, provable without a GPU (Triton ships ptxas and
cuobjdump): (almost) no register spills at the launch configs; the row kernel reads its input with
16-byte loads and writes the image with 16-byte stores; IEEE ``div.rn`` only (no approximate
division or reciprocal), no FMA that could merge two roundings, nothing flushed to zero.
"""

from __future__ import annotations

import pytest

from minite_kernels.triton._build._testing import run_aot_script

#: compile-only (sm_90a on any machine): CI runs these; the GPU set leaves them out
pytestmark = pytest.mark.aot

SCRIPT = r"""
import json, re
from minite_kernels.triton._build._aot import report, sass
from minite_kernels.triton._build import _aot_quantize as A
out = {}
for name, k in A.all_kernels():
    text = sass(k)
    out[name] = dict(report(k),
                     ldg128=len(re.findall(r"LDG\.E\.128", text)), stg128=len(re.findall(r"STG\.E\.128", text)),
                     ptx=sorted(set(re.findall(r"\b((?:div|rcp|fma|cvt|add|mul|max|min)\.[a-z0-9.]+)", k.asm["ptx"]))))
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    return run_aot_script(SCRIPT)


def test_no_spills_at_the_launch_configs(compiled):
    """At most one 8-byte register pair goes to local memory (the one-warp row kernel: one
    STL.64 / LDL.64, measured the fastest config on the H200); nothing in the hot loops."""
    for name, rep in compiled.items():
        assert rep["spill_bytes"] <= 8 and rep["LDL"] <= 1 and rep["STL"] <= 1, (name, rep)


def test_row_kernel_moves_16_byte_vectors(compiled):
    """Regression guard: the word loads / image stores of the row kernel stay 16 bytes wide
    (the layout that makes one thread own a whole block)."""
    rep = compiled["quantize rows K=2048 (one read)"]
    assert rep["ldg128"] >= 8 and rep["stg128"] >= 8, rep


def test_exact_division_no_fma_no_flush(compiled):
    for name, rep in compiled.items():
        ops = rep["ptx"]
        assert "div.rn.f32" in ops or name.startswith("amax "), (name, ops)  # an amax pass divides nothing
        assert not [o for o in ops if o.startswith(("div.full", "div.approx", "rcp.approx", "fma."))], (name, ops)
        assert not [o for o in ops if ".ftz" in o], (name, ops)
