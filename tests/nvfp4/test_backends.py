"""The backend base class: every op, a clear refusal for the ones a backend does not run, and
``supports(op, **shape)`` answering before anything runs (issue 11: optional abilities were
found with ``hasattr``, so a backend could silently lose a fused path)."""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.backends import INVARIANT_OPS, REFERENCE_OPS, OPS, Backend, OpNotSupported, ReferenceBackend


class _QuantizeOnly(Backend):
    name = "quantize-only"

    def quantize(self, x, **kwargs):
        return nvfp4.quantize_reference(x, **kwargs)


def test_every_op_is_a_method_of_the_base_class_that_refuses_with_its_reason():
    b = Backend()
    for op in OPS:
        assert callable(getattr(Backend, op)), op
        want = f"the backend backend has no {op} kernel"
        if op in REFERENCE_OPS:  # the base runs the contract's reference for these
            want += ": the contract's reference runs"
        if op in INVARIANT_OPS:  # the callers run the torch formulation for these
            want += ": the torch formulation (minite_megatron.invariant) runs"
        assert b.supports(op) == (None if op == "grouped_wgrad_gemm" else want)
    with pytest.raises(OpNotSupported, match=r"^quantize-only does not support gemm: the quantize-only backend has no gemm kernel$"):
        _QuantizeOnly().gemm(None, None)
    with pytest.raises(ValueError, match="unknown NVFP4 backend op 'gemm_tn'"):
        b.supports("gemm_tn")


def test_reference_backend_supports_the_contract_ops_and_names_what_it_lacks():
    ref = ReferenceBackend()
    runs = {op for op in OPS if ref.supports(op) is None}
    assert runs == {"quantize", "gemm", "grouped_gemm", "grouped_wgrad", "grouped_wgrad_gemm", "decode_grouped_gemm"}
    assert "no rmsnorm_quantize kernel" in ref.supports("rmsnorm_quantize", dtype=torch.bfloat16, width=64)
    assert ref.available("cpu") and ref.why_not("cpu") is None


def test_default_grouped_wgrad_gemm_is_the_contracts():
    """A backend without its own wgrad GEMM runs the contract's (what ops.grouped_linear did by hand)."""
    g = torch.Generator().manual_seed(0)
    sizes = [16, 0, 32]
    dy, x = torch.randn(48, 16, generator=g), torch.randn(48, 32, generator=g)
    qa = nvfp4.quantize_wgrad_operand(dy, sizes, global_scale="tensor")
    qb = nvfp4.quantize_wgrad_operand(x, sizes, global_scale="tensor")
    got = _QuantizeOnly().grouped_wgrad_gemm(qa, qb, sizes)
    want = nvfp4.grouped_wgrad_gemm_reference(qa, qb, sizes, torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_blackwell_backend_refuses_decode_with_a_reason():
    from minite_kernels.cute.backend import BACKEND

    assert isinstance(BACKEND, Backend)
    assert "no decode_grouped_gemm kernel" in BACKEND.supports("decode_grouped_gemm")
    with pytest.raises(OpNotSupported, match="blackwell does not support decode_grouped_gemm"):
        BACKEND.decode_grouped_gemm(None, None, None)


def test_missing_backend_is_a_backend_that_says_why():
    missing = nvfp4.backends._Missing("x", ImportError("no module named x"))
    assert not missing.available() and "cannot be imported" in missing.why_not()
