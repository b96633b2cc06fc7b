"""The backward of the batch-invariant attention without a forward recompute (issue 16).

With the Triton forward (here interpreted on CPU tensors) the backward calls torch's fused
attention backward on (q, k, v, O, LSE) -- on CPU ``aten._scaled_dot_product_flash_attention_for_cpu_backward``,
the same call shape as the GPU's cuDNN / flash ops -- instead of recomputing the forward through SDPA.
Pins: the gradients stay within the bound that the two forwards' bf16 rounding of O allows
(:func:`minite_megatron.testing.attention_grad_gap_bound`) of the recompute path's; the direct path is
really taken where it can run and not elsewhere; an op that refuses falls back to the recompute,
with one warning. The GPU tests are in ``test_gpu_attention_backward.py``.
"""

import warnings

import pytest
import torch

from minite_megatron.invariant import attention as attention_module
from minite_megatron.invariant.attention import attention, direct_backward_op, sdpa_attention
from minite_megatron.nvfp4.backends import get_backend
from minite_megatron.settings import overridden
from minite_megatron.testing import assert_bitwise_equal, assert_within, attention_grad_gap_bound

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter on CPU tensors; on a GPU: "
                                "test_gpu_attention_backward.py")


def _qkv(b, hq, hkv, sq, sk, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
    go = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    return q, k, v, go


def _grads(q, k, v, go, causal, direct, monkeypatch):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    with overridden(attention_backward="direct" if direct else "recompute"):  # read by the forward
        out = attention(qq, kk, vv, causal=causal)
    out.backward(go)
    return out.detach(), (qq.grad, kk.grad, vv.grad)


def _lse_gap(q, k, v, scale, causal):
    """max |LSE of bi_attention - LSE of the fused forward the recompute path runs| (CPU flash)."""
    _, lse = get_backend("triton", q.device).bi_attention(q, k, v, None, scale, causal, return_lse=True)
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    old = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kr, vr, 0.0, causal and q.shape[2] > 1,
                                                                      scale=scale)
    return float((lse - old[1]).abs().max())


@pytest.mark.parametrize("shape,causal", [((2, 4, 2, 40, 40, 16), True), ((1, 6, 3, 1, 37, 16), True),
                                          ((2, 2, 1, 9, 33, 8), False)])
def test_direct_backward_within_the_rounding_of_o_of_the_recompute(shape, causal, monkeypatch):
    """GQA; training (Sq == Sk, causal), one decode query (causal == all keys), non-causal Sq < Sk."""
    q, k, v, go = _qkv(*shape)
    calls = []
    real = attention_module.fused_attention_backward
    monkeypatch.setattr(attention_module, "fused_attention_backward", lambda op, *a: calls.append(op) or real(op, *a))
    with overridden(strict_backend="triton"):
        out_new, new = _grads(q, k, v, go, causal, True, monkeypatch)
        assert calls == ["flash_cpu"]
        with torch.no_grad():
            assert_bitwise_equal(out_new, attention(q, k, v, causal=causal))  # the LSE leaves the output bits alone
        _, old = _grads(q, k, v, go, causal, False, monkeypatch)
        assert calls == ["flash_cpu"]
    scale = q.shape[-1] ** -0.5
    out_old = sdpa_attention(*(t.clone().requires_grad_() for t in (q, k, v)), scale=scale, causal=causal)
    bounds = attention_grad_gap_bound(q, k, v, go, out_new, out_old.detach(), _lse_gap(q, k, v, scale, causal),
                                      scale, causal, new, old)
    for name, a, b, bound in zip(("dq", "dk", "dv"), new, old, bounds):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_within(a, b, bound, name)


def test_direct_path_only_where_it_can_run(monkeypatch):
    q, k, v, _ = _qkv(1, 4, 2, 12, 12, 16)
    triton = get_backend("triton", q.device)  # the backend whose bi_attention kernel runs (None: the torch formulation)
    assert direct_backward_op(q, k, v, None, True, triton) == ("flash_cpu", True)
    assert direct_backward_op(q[:, :, :1], k, v, None, True, triton) == ("flash_cpu", False)
    assert direct_backward_op(q, k, v, None, True, None) is None  # the torch formulation has no LSE
    assert direct_backward_op(q, k, v, torch.zeros(1, 1, 12, 12, dtype=torch.bool), True, triton) is None
    assert direct_backward_op(q[:, :, 5:], k, v, None, True, triton) is None  # causal, 1 < Sq < Sk
    assert direct_backward_op(q[:, :, 5:], k, v, None, False, triton) == ("flash_cpu", False)
    assert direct_backward_op(q.float(), k.float(), v.float(), None, True, triton) is None
    assert direct_backward_op(q[..., :8], k[..., :8], v, None, True, triton) is None  # Dv != D
    with overridden(attention_backward="recompute"):
        assert direct_backward_op(q, k, v, None, True, triton) is None


def test_a_refused_op_falls_back_to_the_recompute_once(monkeypatch):
    """Pins the fallback: an op raising for some shapes gives the recompute path's gradients
    (the same code, so the same bits), one warning, and is not tried again for those shapes."""
    q, k, v, go = _qkv(1, 2, 1, 10, 10, 16, seed=3)
    calls = []

    def refuse(op, *args):
        calls.append(op)
        raise RuntimeError("cuDNN Frontend error: no engine supports this\nsecond line")

    monkeypatch.setattr(attention_module, "_FAILED", set())
    with overridden(strict_backend="triton"):
        _, old = _grads(q, k, v, go, True, False, monkeypatch)
        monkeypatch.setattr(attention_module, "fused_attention_backward", refuse)
        with pytest.warns(UserWarning, match="flash_cpu backward refused.*recomputing"):
            _, first = _grads(q, k, v, go, True, True, monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, second = _grads(q, k, v, go, True, True, monkeypatch)
    assert calls == ["flash_cpu"]
    for a, b, c in zip(first, second, old):
        assert_bitwise_equal(a, c)
        assert_bitwise_equal(b, c)


def test_megatron_core_attention_takes_the_direct_path(tiny_gpt, monkeypatch):
    """Megatron's layout ([s, b, heads, d] views) and its causal mask (dropped as redundant) reach
    the direct backward; its gradients stay within the bound of the recompute path's."""
    from megatron.core.transformer.enums import AttnMaskType

    from minite_megatron.modules.core_attention import AlignedDotProductAttention

    module = AlignedDotProductAttention(tiny_gpt.tiny_config(True), 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(7)
    s, b = 33, 2
    q, k, v = (torch.randn(s, b, n, 16, generator=g).to(torch.bfloat16) for n in (4, 2, 2))
    go = torch.randn(s, b, 64, generator=g).to(torch.bfloat16)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    calls = []
    real = attention_module.fused_attention_backward
    monkeypatch.setattr(attention_module, "fused_attention_backward", lambda op, *a: calls.append(op) or real(op, *a))
    grads, outs = [], []
    with overridden(strict_backend="triton"):
        for direct in ("direct", "recompute"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with overridden(attention_backward=direct):
                out = module(*leaves, mask, attn_mask_type=AttnMaskType.causal)
            out.backward(go)
            grads.append(tuple(t.grad.permute(1, 2, 0, 3) for t in leaves))
            outs.append(out.detach())
    assert calls == ["flash_cpu"]
    assert_bitwise_equal(outs[0], outs[1])
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    dout = go.view(s, b, 4, 16).permute(1, 2, 0, 3)
    o_new = outs[0].view(s, b, 4, 16).permute(1, 2, 0, 3)
    o_old = sdpa_attention(qb, kb, vb, scale=0.25, causal=True)
    with overridden(strict_backend="triton"):
        gap = _lse_gap(qb, kb, vb, 0.25, True)
    bounds = attention_grad_gap_bound(qb, kb, vb, dout, o_new, o_old, gap, 0.25, True, grads[0], grads[1])
    for name, a, c, bound in zip(("dq", "dk", "dv"), grads[0], grads[1], bounds):
        assert_within(a, c, bound, name)
