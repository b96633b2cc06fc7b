"""TP=2+SP, EP=2 and TP2+EP2 (two gloo processes) agree with the single-process run: real
megatron-core on CPU through the CPU compatibility layer. See ``_parallel_harness`` for how the
weights are re-sharded and the gradients brought back to the single-process layout.

Tolerances (FP32 model, Megatron's local spec)
----------------------------------------------
* EP=2 (TP=1) changes no arithmetic of the dense part, and the MoE layer is a per-token
  permutation, per-row expert GEMMs and a per-token combine in the same order: the **loss and
  every non-expert gradient are compared bitwise**. This assumes the CPU GEMM's row results do
  not depend on the number of rows (true of MKL/oneDNN/OpenBLAS sgemm kernels, whose K order is
  fixed). The expert weight gradients sum over that expert's tokens, which EP=2 receives from both
  ranks (the batch is replicated), in another order: not bitwise.
* TP=2+SP splits the K dimension of the row-parallel GEMMs (two partial sums then an all-reduce)
  and the vocabulary of the loss: a re-association of fp32 sums. Reordering an n-term sum changes
  it by at most gamma_n = n*u relative to the sum of magnitudes (u = 2^-24). We allow, per tensor
  and normwise, ``n_max * u`` with ``n_max`` the longest reduction in the model (the 128 tokens of a
  wgrad, or K = 128): 128 * 2^-24 = 7.6e-6 (measured: <= 7e-7 for grads, 1 ulp for the loss).
* Everything is also checked to be finite and the reference gradients non-zero, so a broken
  backward cannot pass by being empty.

The harness takes the spec builder as a dotted path: add a row to ``SPECS`` to run it on
another spec (e.g. the minite NVFP4 spec, with tolerances that follow from its recipe).
"""

from __future__ import annotations

import pytest
import torch

from ._parallel_harness import BATCH, SEQ, TINY_MOE, max_ulp_distance, relative_error, run_equivalence

pytestmark = [pytest.mark.multiproc]

U = 2.0**-24
N_MAX = max(BATCH * SEQ * 2, TINY_MOE["ffn_hidden_size"], TINY_MOE["hidden_size"])  # 128
FP32_REASSOCIATION = N_MAX * U

SPECS = {
    "local": ("tests.megatron._parallel_harness:local_spec", {}),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def results(request):
    builder, kwargs = SPECS[request.param]
    return run_equivalence(builder, spec_kwargs=kwargs)


def _is_expert(name: str) -> bool:
    return ".experts." in name


def test_reference_gradients_are_real(results):
    ref = results["ref"]
    assert torch.isfinite(ref["loss"]).all()
    assert ref["loss"].shape == (BATCH, SEQ)
    zero = [k for k, g in ref["grads"].items() if not torch.isfinite(g).all() or g.abs().max() == 0]
    assert zero == [], f"reference gradients zero or non-finite: {zero}"
    assert any(_is_expert(k) for k in ref["grads"]) and any(not _is_expert(k) for k in ref["grads"])


def test_ep2_matches_bitwise_where_the_math_allows(results):
    ref, ep2 = results["ref"], results["ep2"]
    assert max_ulp_distance(ep2["loss"], ref["loss"]) == 0, "EP=2 loss differs from the single-process loss"
    dense_diff = [k for k, g in ep2["grads"].items() if not _is_expert(k) and max_ulp_distance(g, ref["grads"][k])]
    assert dense_diff == [], f"non-expert gradients not bitwise under EP=2: {dense_diff}"
    for k, g in ep2["grads"].items():
        assert relative_error(g, ref["grads"][k]) <= FP32_REASSOCIATION, k


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2_ep2"])
def test_tensor_parallel_layouts_match_to_fp32_reassociation(results, layout):
    ref, got = results["ref"], results[layout]
    assert torch.isfinite(got["loss"]).all()
    assert relative_error(got["loss"], ref["loss"]) <= FP32_REASSOCIATION
    assert set(got["grads"]) == set(ref["grads"])
    worst = {k: relative_error(g, ref["grads"][k]) for k, g in got["grads"].items()}
    bad = {k: v for k, v in worst.items() if not v <= FP32_REASSOCIATION}
    assert bad == {}, f"{layout}: gradients beyond {FP32_REASSOCIATION:.2e} (normwise): {bad}"
