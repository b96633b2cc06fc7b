"""miniTE's quantizers behind Transformer Engine's CustomRecipe.

TE (>= 2.16) cannot be installed on the CPU CI machine nor carried to the H200 (a ~276 MB
wheel): the TE-only tests skip with the import error as the reason. What runs everywhere: the
role mapping, the operand quantization (identical to the minite modules'), and the clear error
when the TE path is requested without TE.
"""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.recipe import Recipe
from minite_megatron.te import quantizer_factory as qf
from minite_megatron.testing import assert_nvfp4_equal

TE_REASON = qf.te_why_not()
needs_te = pytest.mark.skipif(TE_REASON is not None, reason=TE_REASON or "")


class _Role:
    def __init__(self, module_type, tensor_type):
        self.module_type, self.tensor_type = module_type, tensor_type


@pytest.mark.parametrize(
    "role, kind",
    [
        ("linear_input", "input"),
        ("linear_weight", "weight"),
        ("linear_grad_output", "grad_output"),
        ("linear_output", None),
        ("linear_grad_input", None),
        (_Role("linear", "weight"), "weight"),
        (_Role("grouped_linear", "input"), "input"),
        (_Role("linear", "output"), None),
        (None, None),
    ],
)
def test_role_mapping(role, kind):
    assert qf.role_kind(role) == kind


def test_operands_match_the_minite_modules():
    recipe = Recipe(grad_stochastic_rounding=False, rht_seed=4)
    w = torch.randn(64, 96)
    row, col = qf.quantize_operand(w, "weight", recipe, True, True)
    assert_nvfp4_equal(row, nvfp4.quantize(w, "tensor", (16, 16)))
    assert_nvfp4_equal(col, nvfp4.quantize(w.t(), "tensor", (16, 16)))
    x = torch.randn(2, 16, 96)
    row, col = qf.quantize_operand(x, "input", recipe, True, True)
    assert_nvfp4_equal(row, nvfp4.quantize(x.reshape(32, 96), "row"))
    assert_nvfp4_equal(col, nvfp4.quantize(x.reshape(32, 96).t(), "tensor", rht_seed=4))


def test_factory_takes_every_operand_from_the_role_table():
    """The TE factory used to restate the role rule without TP amax sync or token padding (issue
    11): its columnwise dy of 24 tokens (not a multiple of 16) is now the padded wgrad operand of
    the table, and each form equals :func:`ops.roles.quantize_role` of the role TE_ROLES names."""
    from minite_megatron.ops import roles

    recipe = Recipe(grad_stochastic_rounding=True, rht_seed=4, seed=11)
    dy = torch.randn(24, 32)
    assert set(qf.TE_ROLES) == {"weight", "input", "grad_output"}
    torch.manual_seed(5)  # outside megatron.training the SR seeds come from torch's generator
    row, col = qf.quantize_operand(dy, "grad_output", recipe, True, True)
    torch.manual_seed(5)
    ref = nvfp4.get_backend("reference")
    want_row = roles.quantize_role(roles.gemm_role(recipe, "dgrad", "grad"), dy, recipe, ref)
    want_col = roles.quantize_role(roles.gemm_role(recipe, "wgrad", "grad"), dy, recipe, ref)
    assert_nvfp4_equal(row, want_row)
    assert_nvfp4_equal(col, want_col)
    assert col.shape == (32, 32)  # 24 tokens padded to 32 along K
    for kind, pair in qf.TE_ROLES.items():
        for gemm, operand in pair:
            assert roles.gemm_role(recipe, gemm, operand).gemm == gemm, kind


def test_te_tensor_saves_its_forms_as_tensors():
    """TE saves custom tensors through ``prepare_for_saving``; it used to return no tensors (the
    forms stayed plain attributes, out of reach of saved-tensor hooks)."""
    x = torch.randn(32, 48)
    row, col = qf.quantize_operand(x, "input", Recipe(grad_stochastic_rounding=False), True, True)
    t = qf.MiniteTETensor(row=row, col=col, dtype=x.dtype, device=x.device, original_shape=(32, 48))
    tensors, same = t.prepare_for_saving()
    assert same is t and t.row is None and t.col is None and len(tensors) == 7  # row image + 3 + 3
    assert t.restore_from_saved([*tensors, "rest"]) == ["rest"]
    assert_nvfp4_equal(t.row, row)
    assert_nvfp4_equal(t.col, col)


@pytest.mark.skipif(TE_REASON is None, reason="Transformer Engine is importable here")
def test_te_path_without_te_fails_fast_naming_the_flag():
    with pytest.raises(qf.TransformerEngineUnavailable, match="--fp4-recipe custom"):
        qf.qfactory("linear_input")
    with pytest.raises(qf.TransformerEngineUnavailable, match=r"\[te\] extra"):
        qf.make_qfactory(Recipe())


@needs_te
@pytest.mark.gpu
def test_te_linear_with_minite_factory_equals_the_minite_linear():
    """A TE Linear under CustomRecipe(qfactory) computes the minite contract's forward."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import CustomRecipe

    torch.manual_seed(0)
    recipe = Recipe(grad_stochastic_rounding=False, wgrad_rht=False)
    lin = te.Linear(128, 64, bias=False, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=CustomRecipe(qfactory=qf.make_qfactory(recipe))):
        y = lin(x)
    want = nvfp4.gemm(nvfp4.quantize(x, "row"), nvfp4.quantize(lin.weight.detach(), "tensor", (16, 16)))
    torch.testing.assert_close(y.float(), want.float(), rtol=0, atol=0)
