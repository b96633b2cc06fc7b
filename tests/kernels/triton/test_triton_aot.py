"""The Triton kernels compiled for the H200 (sm_90a) on this CPU machine, ahead of time.

Pins what a CPU-only CI can prove about the GPU code (no GPU needed: Triton ships ptxas and
cuobjdump): the image GEMM and the decode GEMM run on wgmma (SASS ``HGMMA``, not ``HMMA`` /
``FFMA``) without register spills; the quantize kernel divides with IEEE ``div.rn.f32`` (never
the approximate ``div.full`` / ``rcp.approx`` that flips codes) and contains no FMA that could
merge two roundings; nothing is flushed to zero (``.ftz``).
"""

from __future__ import annotations

import pytest

from minite_kernels.triton._testing import run_aot_script

SCRIPT = r"""
import json, re
from minite_kernels.triton._aot import report, sass
from minite_kernels.triton import _aot_kernels as K, gemm, quantize
out = {}
g = K._gemm(gemm.select_config(4096, 4096, 4096, False, False, gpu=True))
out["gemm"] = report(g)
d = K._decode(16)
out["decode"] = report(d)
from minite_kernels.triton._aot import loop_opcode_counts
out["decode_loop"] = loop_opcode_counts(sass(d))
q = K._quantize(*quantize._config(1 << 20, 2048, False, True), stochastic=True)
ptx = q.asm["ptx"]
out["quantize"] = report(q)
out["quantize_ptx"] = sorted(set(re.findall(r"\b((?:div|rcp|fma|cvt|add|mul|max|min)\.[a-z0-9.]+)", ptx)))
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    return run_aot_script(SCRIPT)


def test_image_gemm_uses_wgmma_without_spills(compiled):
    g = compiled["gemm"]
    assert g["HGMMA"] > 0 and g["HMMA"] == 0 and g["FFMA"] == 0, g
    assert g["spill_bytes"] == 0, g


def test_decode_gemm_uses_wgmma_without_spills(compiled):
    d = compiled["decode"]
    assert d["HGMMA"] > 0 and d["HMMA"] == 0, d
    assert d["spill_bytes"] == 0, d


def test_decode_dequantization_stays_cheap(compiled):
    """The decode K loop (BLOCK_N 64 x BLOCK_K 128 weights over 128 threads = 64 per thread):
    the prmt lookup-table dequant keeps it near 6 SASS instructions per weight (the fp32
    bit-arithmetic decode it replaced took ~14), and one wgmma per 16-wide K step."""
    loop = compiled["decode_loop"]
    per_weight = sum(loop.values()) / 64
    assert per_weight < 6.5, (per_weight, loop)
    assert loop.get("HGMMA", 0) == 128 // 16 and loop.get("PRMT", 0) > 0, loop


def test_quantize_divides_exactly_and_never_fuses_or_flushes(compiled):
    ops = compiled["quantize_ptx"]
    assert "div.rn.f32" in ops and "div.rn.f64" in ops, ops
    assert not [o for o in ops if o.startswith(("div.full", "div.approx", "rcp.approx"))], ops
    assert not [o for o in ops if o.startswith("fma.")], ops
    assert not [o for o in ops if ".ftz" in o], ops
    assert compiled["quantize"]["spill_bytes"] == 0, compiled["quantize"]
