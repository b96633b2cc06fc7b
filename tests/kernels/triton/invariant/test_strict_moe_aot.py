"""The strict and MoE-combine kernels compiled for the H200 (sm_90a) on this CPU, ahead of time.

The interpreter tests check these kernels' logic, not that they compile for the GPU or what
the compiler makes of them (issue 16 round 2 changed all three). Pins: the three kernels
compile; ``bi_matmul``'s tensor-core tile and
``bi_attention`` (the learner's variant, which also stores the log-sum-exp, and the rollout's)
run on wgmma (``HGMMA``) without register spills, ``bi_attention``'s
probabilities use one ``fma`` per score; the combine adds in fp32 and rounds to bf16 with
round-to-nearest-even (``cvt.rn.bf16.f32``), nothing flushed to zero.
"""

import pytest

from minite_kernels.triton._build._testing import run_aot_script

#: compile-only (sm_90a on any machine): CI runs these; the GPU set leaves them out
pytestmark = pytest.mark.aot

SCRIPT = r"""
import json, re
from minite_kernels.triton._build._aot import report
from minite_kernels.triton._build import _aot_kernels as K
from minite_kernels.triton.invariant import bi_attention
from minite_kernels.triton.invariant import bi_matmul
out = {}
out["bi_matmul"] = report(K._bi_matmul(bi_matmul.MMA_CONFIG))
att = K._bi_attention(bi_attention.GPU_CONFIG)
out["bi_attention"] = report(att)
out["bi_attention_ptx"] = sorted(set(re.findall(r"\b((?:fma|ex2)\.[a-z0-9.]+)", att.asm["ptx"])))
out["bi_attention_rollout"] = report(K._bi_attention(bi_attention.GPU_CONFIG, with_lse=False))
comb = K._moe_combine()
out["combine"] = report(comb)
out["combine_ptx"] = sorted(set(re.findall(r"\b((?:cvt|add)\.[a-z0-9.]+)", comb.asm["ptx"])))
out["combine_k8"] = report(K._moe_combine(8))
out["gather"] = report(K._moe_combine(gather=True))
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    return run_aot_script(SCRIPT)


def test_strict_kernels_use_wgmma_without_spills(compiled):
    for name in ("bi_matmul", "bi_attention", "bi_attention_rollout"):
        assert compiled[name]["HGMMA"] > 0 and compiled[name]["HMMA"] == 0, (name, compiled[name])
        assert compiled[name]["spill_bytes"] == 0, (name, compiled[name])
    assert any(op.startswith("fma.rn.f32") for op in compiled["bi_attention_ptx"]), compiled["bi_attention_ptx"]


def test_combine_rounds_each_add_to_bf16_nearest_even(compiled):
    ptx = compiled["combine_ptx"]
    assert "cvt.rn.bf16.f32" in ptx and "add.f32" in ptx and not any(".ftz" in op for op in ptx), ptx
    for name in ("combine", "combine_k8", "gather"):
        assert compiled[name]["spill_bytes"] == 0, (name, compiled[name])
