"""The operand-role table (:mod:`minite_megatron.ops.roles`): one rule for every GEMM operand,
read by the linears and the TE factory alike (issue 11: it was written twice, the TE copy
without TP amax sync or token padding)."""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.ops.roles import gemm_role, quantize_role
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_nvfp4_equal


def test_table_rows_under_the_default_recipe():
    r = Recipe()
    rows = {(g, o): gemm_role(r, g, o) for g, o in [("fprop", "input"), ("fprop", "weight"), ("dgrad", "grad"),
                                                     ("dgrad", "weight"), ("wgrad", "grad"), ("wgrad", "input")]}
    facts = {k: (v.tile, v.global_scale, v.rounding, v.rht_seed, v.transposed, v.rows_split, v.k_split)
             for k, v in rows.items()}
    assert facts == {
        ("fprop", "input"): ((1, 16), r.activation_scale, "nearest", None, False, None, "row"),
        ("fprop", "weight"): (r.weight_tile_shape, "tensor", "nearest", None, False, "column", "row"),
        ("dgrad", "grad"): ((1, 16), r.grad_scale, r.grad_rounding, None, False, None, "column"),
        ("dgrad", "weight"): ((1, 16), "tensor", "nearest", None, True, "column", "row"),
        ("wgrad", "grad"): ((1, 16), r.grad_scale, r.grad_rounding, r.wgrad_rht_seed, True, "column", None),
        ("wgrad", "input"): ((1, 16), r.grad_scale, "nearest", r.wgrad_rht_seed, True, "row", None),
    }
    assert gemm_role(r, "fprop", "weight", grouped=True).global_scale == "group"
    with pytest.raises(ValueError, match="no NVFP4 operand 'grad' in the 'fprop' GEMM"):
        gemm_role(r, "fprop", "grad")


def test_quantize_role_is_the_contract_per_role():
    r = Recipe(grad_stochastic_rounding=False, rht_seed=3)
    ref = nvfp4.get_backend("reference")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 48, generator=g), torch.randn(20, 48, generator=g)
    qw = quantize_role(gemm_role(r, "fprop", "weight"), w, r, ref)
    assert_nvfp4_equal(qw, nvfp4.quantize_reference(w, global_scale="tensor", tile=(16, 16), with_image=True))
    assert quantize_role(gemm_role(r, "dgrad", "weight"), w, r, ref, fprop_weight=qw).shape == (48, 32)
    assert_nvfp4_equal(quantize_role(gemm_role(r, "wgrad", "input"), x, r, ref, group_sizes=[4, 16]),
                       nvfp4.quantize_wgrad_operand(x, [4, 16], global_scale=r.grad_scale, rht_seed=3))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_wgrad_operand_carries_its_image_only_when_asked(backend):
    # dy's wgrad operand is read by the wgrad GEMM right away: the quantize pass writes its image (no
    # separate image pass); x's is saved for the backward as codes only (no image written)
    r = Recipe(rht_seed=5, grad_stochastic_rounding=False)  # (SR would draw a new seed per call)
    be = nvfp4.get_backend(backend)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(21, 48, generator=g).to(torch.bfloat16)
    role = gemm_role(r, "wgrad", "grad")
    with_image = quantize_role(role, dy, r, be, group_sizes=[5, 16], wgrad_image=True)
    codes_only = quantize_role(role, dy, r, be, group_sizes=[5, 16])
    assert codes_only.image is None and with_image.image is not None
    assert torch.equal(with_image.image.view(torch.int16), with_image.image_fp32().to(torch.bfloat16).view(torch.int16))
    assert torch.equal(with_image.codes, codes_only.codes)
