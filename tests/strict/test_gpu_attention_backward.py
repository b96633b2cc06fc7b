"""GPU: the attention backward without a forward recompute (issue 16) on torch's cuDNN / flash ops.

Run on the H200: ``python -m pytest -q -s tests/strict/test_gpu_attention_backward.py`` (``-s`` shows
the timing lines: old vs new backward, printed, not asserted). Pins, at the learner's shape
(B=4, Hq=32, Hkv=4, S=4096, D=128, bf16, causal) and small odd ones:
- ``bi_attention``'s LSE is the fp64 log-sum-exp within fp32 rounding (the fused forwards' own
  LSE errors are printed beside it), and the output is the same bits with and without it (a
  rollout decode step, which computes no LSE, still equals the learner's row);
- the direct path's gradients are within :func:`~minite_megatron.testing.attention_grad_gap_bound`
  of the recompute path's (the same backward kernel; the two forwards' outputs differ by their
  bf16 rounding), checked on one (batch, kv group) at the large shape (fp64 ``[8, S, S]`` matrices);
- the direct op was the one called (no fallback warning).
"""

import warnings

import pytest
import torch

from minite_megatron.invariant import attention as attention_module
from minite_megatron.invariant.attention import attention, sdpa_attention
from minite_megatron.nvfp4.backends import get_backend
from minite_megatron.settings import overridden
from minite_megatron.testing import assert_bitwise_equal, assert_within, attention_grad_gap_bound

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: only to dry-run this file's logic (interpreter)
LEARNER = (4, 32, 4, 4096, 4096, 128)
ODD = [(1, 6, 2, 77, 77, 64), (3, 8, 8, 130, 130, 128), (2, 8, 2, 1, 300, 128), (2, 4, 1, 200, 200, 96)]


def _qkv(b, hq, hkv, sq, sk, d, seed=0, layout="sbhd"):
    """bf16 q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D], dO; ``sbhd``: views of [S, B, H, D] tensors, as
    Megatron's core attention passes them."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def make(h, s):
        if layout == "sbhd":
            return torch.randn(s, b, h, d, generator=g, device=DEV).to(torch.bfloat16).permute(1, 2, 0, 3)
        return torch.randn(b, h, s, d, generator=g, device=DEV).to(torch.bfloat16)

    q, k, v, go = make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq)
    return q, k, v, go


def _run(q, k, v, go, direct, monkeypatch, calls=None):
    if calls is not None:
        real = attention_module.fused_attention_backward
        monkeypatch.setattr(attention_module, "fused_attention_backward",
                            lambda op, *a: calls.append(op) or real(op, *a))
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with overridden(attention_backward="direct" if direct else "recompute"):  # read by the forward
        out = attention(qq, kk, vv)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), go, retain_graph=True)  # kept for the timing
    refused = [str(w.message) for w in seen if "recomputing through SDPA" in str(w.message)]
    assert not refused, refused  # a refused op warns and recomputes: a failure here
    return out.detach(), (dq, dk, dv), (qq, kk, vv, out)


def _exact_lse(q, k, scale):
    group = q.shape[1] // k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
    return torch.logsumexp(s.masked_fill(hidden, float("-inf")), -1)


def _fused_lse(op, q, k, v, scale, is_causal):
    if op == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal,
                                                                  scale=scale)[1].reshape(q.shape[:3])
    if op == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)[1]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)[1]


def _check(shape, monkeypatch, subset=None, time_it=False, expect_op=("cudnn", "flash")):
    q, k, v, go = _qkv(*shape)
    scale = q.shape[-1] ** -0.5
    is_causal = q.shape[2] > 1
    calls = []
    out_new, new, graph_new = _run(q, k, v, go, True, monkeypatch, calls)
    assert len(calls) == 1 and calls[0] in expect_op, calls
    op = calls[0]
    out_old, old, graph_old = _run(q, k, v, go, False, monkeypatch)
    assert_bitwise_equal(out_new, out_old)  # the same forward either way
    with torch.no_grad():
        assert_bitwise_equal(out_new, attention(q, k, v))  # no LSE (rollout) == with LSE (learner)
    _, lse = get_backend("triton", q.device).bi_attention(q, k, v, None, scale, True, return_lse=True)
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # the fused forwards' LSE, any backend
    lse_old = _fused_lse(op, q.contiguous(), kr.contiguous(), vr.contiguous(), scale, is_causal)
    lse_gap = float((lse - lse_old).abs().max())  # enters the gradient bound (relative change of P)
    sdpa_out = sdpa_attention(*(t.detach().requires_grad_() for t in (q, k, v)), scale=scale, causal=True).detach()
    sl = (slice(None), slice(None)) if subset is None else subset
    kvs = sl if subset is None else (sl[0], slice(sl[1].start // group, sl[1].stop // group))
    exact = _exact_lse(q[sl], k[kvs], scale)
    d, sk = q.shape[3], k.shape[2]
    lse_err = (lse[sl].double() - exact).abs()
    # ours: fp32 -- a D-term dot product, exp2 / log2 per score, an Sk-term sum (the CPU test's bound)
    assert bool((lse_err <= (d + sk + 8) * 2.0**-24 * (1 + exact.abs())).all()), float(lse_err.max())
    fused_err = float((lse_old[sl].double() - exact).abs().max())
    bounds = attention_grad_gap_bound(q[sl], k[kvs], v[kvs], go[sl], out_new[sl], sdpa_out[sl], lse_gap, scale, True,
                                      (new[0][sl], new[1][kvs], new[2][kvs]), (old[0][sl], old[1][kvs], old[2][kvs]))
    report = []
    for name, a, b, bound in zip(("dq", "dk", "dv"), (new[0][sl], new[1][kvs], new[2][kvs]),
                                 (old[0][sl], old[1][kvs], old[2][kvs]), bounds):
        gap = (a.double() - b.double()).abs()
        rel = float(gap.norm() / b.double().norm())
        report.append(f"{name} max gap/bound {float((gap / bound).max()):.3f} rel {rel:.2e}")
        assert_within(a, b, bound, f"{shape} {op} {name}")
    print(f"\n{shape} op={op} LSE vs fp64: ours {float(lse_err.max()):.2e}, {op}'s forward {fused_err:.2e}; "
          + "; ".join(report))
    if time_it:
        for label, (qq, kk, vv, out) in (("recompute (old)", graph_old), ("direct (new)", graph_new)):
            ms = _time_backward(out, (qq, kk, vv), go)
            print(f"{shape} backward {label}: {ms:.3f} ms")


def _time_backward(out, inputs, go, reps=10):
    if DEV == "cpu":
        return float("nan")
    for _ in range(2):
        torch.autograd.grad(out, inputs, go, retain_graph=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        torch.autograd.grad(out, inputs, go, retain_graph=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def test_gpu_learner_shape_direct_backward_within_the_rounding_of_o(monkeypatch):
    _check(LEARNER, monkeypatch, subset=(slice(0, 1), slice(0, 8)), time_it=True)


@pytest.mark.parametrize("shape", ODD)
def test_gpu_odd_shapes_direct_backward_within_the_rounding_of_o(shape, monkeypatch):
    _check(shape, monkeypatch, time_it=shape == ODD[1])


def test_gpu_flash_backend_forced(monkeypatch):
    """With SDPA held to flash (``sdpa_kernel``) the direct path calls flash's backward, and the
    recompute path flash's forward + backward: the same checks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        _check((2, 8, 2, 333, 333, 128), monkeypatch, expect_op=("flash",))
