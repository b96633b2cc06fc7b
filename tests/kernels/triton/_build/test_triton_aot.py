"""The Triton kernels compiled for the H200 (sm_90a) on this CPU machine, ahead of time.

Pins what a CPU-only CI can prove about the GPU code (no GPU needed: Triton ships ptxas and
cuobjdump): the image GEMM and the decode GEMM run on wgmma (SASS ``HGMMA``, not ``HMMA`` /
``FFMA``) without register spills; the quantize kernel divides with IEEE ``div.rn.f32`` (never
the approximate ``div.full`` / ``rcp.approx`` that flips codes) and contains no FMA that could
merge two roundings; nothing is flushed to zero (``.ftz``).
"""

from __future__ import annotations

import pytest

from minite_kernels.triton._build._testing import run_aot_script

#: compile-only (sm_90a on any machine): CI runs these; the GPU set leaves them out
pytestmark = pytest.mark.aot

SCRIPT = r"""
import json, re
from minite_kernels.triton._build._aot import report, sass
from minite_kernels.triton._build import _aot_kernels as K
from minite_kernels.triton.nvfp4 import gemm
from minite_kernels.triton.nvfp4 import quantize
out = {}
g = K._gemm(gemm.select_config(4096, 4096, 4096, False, False, gpu=True))
out["gemm"] = report(g)
d = K._decode(16, nchunk=4, depth=4)
out["decode"] = report(d)
from minite_kernels.triton._build._aot import issue_report
out["decode_issue"] = issue_report(sass(d), 64 * 128 * 4 // 128)
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


def test_decode_issues_every_weight_load_first_and_stays_cheap(compiled):
    """The decode program (BLOCK_N 64 x 4 K steps of 128 over 128 threads = 256 weights per
    thread, unrolled): every step's code, scale and activation loads are issued before the
    first barrier (a shared-memory layout change waits for its load, so a barrier between two
    steps' loads serializes their round trips: the pre-2026-12-02 kernel had one step in flight);
    one wgmma per 16-wide K step; under ~6.5 SASS instructions per weight for the whole kernel
    (the dequant itself is 20 PTX instructions per 8 weights; the rest is addressing, the
    shared-memory operand staging and the split-K epilogue)."""
    d = compiled["decode_issue"]
    assert d["HGMMA"] == 4 * 128 // 16 and d["HMMA"] == 0, d
    # per thread and step: 4 code loads (8 bytes), 2 activation loads, 1 scale load
    assert d["LDG_before_first_BAR"] >= 4 * (4 + 2 + 1), d
    assert d["per_weight"] < 6.5, d


def test_quantize_divides_exactly_and_never_fuses_or_flushes(compiled):
    ops = compiled["quantize_ptx"]
    assert "div.rn.f32" in ops and "div.rn.f64" in ops, ops
    assert not [o for o in ops if o.startswith(("div.full", "div.approx", "rcp.approx"))], ops
    assert not [o for o in ops if o.startswith("fma.")], ops
    assert not [o for o in ops if ".ftz" in o], ops
    assert compiled["quantize"]["spill_bytes"] == 0, compiled["quantize"]


GROUPED_SCRIPT = r"""
import json
from minite_kernels.triton._build import _aot_kernels as K
from minite_kernels.triton.decode import decode_gemm as td
from minite_kernels.triton.decode import decode_grouped_gemm as tg
from minite_kernels.triton._build._aot import kernel_opcodes, loop_opcode_counts, ptxas_resources, sass
out = {}
for name, entry in (("unrolled", td.GPU_STRICT_DECODE), ("rolled", dict(tg.GPU_STRICT_GROUPED_DECODE, ONE_SPLIT=False)),
                    ("default", tg.GPU_STRICT_GROUPED_DECODE)):
    kern = K._decode_grouped(td.strict_config(16, 2048, entry))
    text = sass(kern)
    ops = kernel_opcodes(text)
    out[name] = {**ptxas_resources(kern), "HGMMA": ops.count("HGMMA"), "HMMA": ops.count("HMMA")}
    out[name + "_loop"] = loop_opcode_counts(text)
cfg = td.strict_config(16, 4096, td.GPU_STRICT_DECODE)
kern = K._decode(m_pad=16, block_k=cfg["BLOCK_K"], nchunk=cfg["NCHUNK"], depth=cfg["DEPTH"], split_max=1)
ops = kernel_opcodes(sass(kern))
out["dense"] = {**ptxas_resources(kern), "HGMMA": ops.count("HGMMA"), "HMMA": ops.count("HMMA")}
print("JSON" + json.dumps(out))
"""


def test_strict_decode_launches_run_wgmma_without_spills():
    """The strict MoE decode at fc1's K (2048: 16 K steps of 128) on sm_90a: unrolled, the chain
    runs out of registers (255 and spills); rolled into 2-step iterations it keeps the same wgmma
    steps (8 per 128-wide K step) with no spill, and with the split-K code compiled out
    (``ONE_SPLIT``: the default, ``GPU_STRICT_GROUPED_DECODE``) it needs fewer registers still. The
    dense strict launch (``GPU_STRICT_DECODE``) at o's K (4096) is wgmma without spills too (an
    ``HMMA``, mma.sync, would give other bits)."""
    got = run_aot_script(GROUPED_SCRIPT)
    unrolled, rolled, default, dense = got["unrolled"], got["rolled"], got["default"], got["dense"]
    assert unrolled["HGMMA"] == 16 * 128 // 16 and unrolled["spill_bytes"] > 0, unrolled
    for name, r in (("rolled", rolled), ("default", default), ("dense", dense)):
        assert r["HGMMA"] > 0 and r["HMMA"] == 0 and r["spill_bytes"] == 0, (name, r)
    assert got["rolled_loop"].get("HGMMA") == 2 * 128 // 16, got["rolled_loop"]
    assert got["default_loop"].get("HGMMA") == 2 * 128 // 16, got["default_loop"]
    assert default["regs"] < rolled["regs"], got


IDOT_SCRIPT = r"""
import json, re
from minite_kernels.triton._build import _aot_kernels as K
from minite_kernels.triton.decode.decode_grouped_idot import GPU_IDOT
from minite_kernels.triton._build._aot import kernel_opcodes, ptxas_resources, sass
out = {}
# (K, rows by offsets, activation rows by index): fc1 and fc2, and fc1 as the decode step runs it
# (sorted rows reading the tokens' quantization through the route's token index)
for k, sorted_rows, gather in ((2048, True, False), (2048, False, False), (768, True, False), (768, False, False),
                               (2048, True, True)):
        kern = K._decode_grouped_idot(dict(GPU_IDOT), k=k, sorted_rows=sorted_rows, gather=gather)
        text = sass(kern)
        ops = kernel_opcodes(text)
        out[f"{k} {sorted_rows}{' gather' if gather else ''}"] = {**ptxas_resources(kern), "IDP": ops.count("IDP"), "HGMMA": ops.count("HGMMA"),
                                     "HMMA": ops.count("HMMA"), "x_or": len(re.findall(r"LOP3\.LUT R\d+, R\d+, 0x80808080, RZ, 0xfc", text))}
print("JSON" + json.dumps(out))
"""


def test_integer_dot_decode_runs_dp4a_without_spills_and_shares_the_activation_conversion():
    """The integer-dot MoE decode (``decode_grouped_idot.GPU_IDOT``) at fc1's and fc2's K, rows by
    offsets and by ids (and fc1's rows by offsets reading the activation rows by index), on sm_90a: dp4a (``IDP.4A``) and no tensor-core op, no spill; the
    activation's conversion (4 ``or 0x80808080`` per code word) is shared by a thread's weight rows:
    at least 4 dp4a per such ``or`` (a thread with one weight row does the conversion once per row:
    1 per ``or``; what Triton's default layout, 8 K blocks of one row per thread, gave)."""
    got = run_aot_script(IDOT_SCRIPT)
    assert len(got) == 5, sorted(got)
    for name, r in got.items():
        assert r["IDP"] > 0 and r["HGMMA"] == 0 and r["HMMA"] == 0, (name, r)
        assert r["spill_bytes"] == 0, (name, r)
        assert r["IDP"] >= 4 * r["x_or"] > 0, (name, r)
