"""Strict attention (torch formulation): decode over a KV cache == prefill == learner, bitwise,
whatever the batch; accurate; GQA; masks; hidden keys cannot leak; gradients."""

import pytest
import torch

from minite_megatron.invariant import attention as attention_module
from minite_megatron.invariant.attention import attention
from minite_megatron.testing import assert_bitwise_equal


def _qkv(b, hq, hkv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    return q, k, v


def _exact(q, k, v, scale, mask=None):
    qd, kd, vd = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    hidden = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
    if mask is not None:
        hidden = hidden | mask
    s = (qd @ kd.transpose(-1, -2) * scale).masked_fill(hidden, float("-inf"))
    return torch.softmax(s, -1) @ vd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_equal_the_full_sequence(dtype):
    """Pins the prefill/decode invariance: query t over keys 0..t (KV cache) gives the bits of
    row t of the causal forward over all T keys, for every t, alone or in any batch."""
    b, hq, hkv, t_len, d = 3, 4, 2, 19, 16
    q, k, v = _qkv(b, hq, hkv, t_len, d, dtype)
    full = attention(q, k, v)
    for t in range(t_len):
        step = attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])
        assert_bitwise_equal(step, full[:, :, t : t + 1], f"decode step {t}")
        alone = attention(q[1:2, :, t : t + 1], k[1:2, :, : t + 1], v[1:2, :, : t + 1])
        assert_bitwise_equal(alone, full[1:2, :, t : t + 1], f"decode step {t}, batch of one")
    # a prefill of the first 7 tokens, then 4 new tokens over the cache of 11
    assert_bitwise_equal(attention(q[:, :, :7], k[:, :, :7], v[:, :, :7]), full[:, :, :7])
    assert_bitwise_equal(attention(q[:, :, 7:11], k[:, :, :11], v[:, :, :11]), full[:, :, 7:11])


def test_longer_padded_sequence_and_other_batch_members_do_not_matter():
    q, k, v = _qkv(2, 2, 2, 12, 8, torch.float32, seed=1)
    q2, k2, v2 = _qkv(3, 2, 2, 30, 8, torch.float32, seed=2)
    q2[1, :, :12], k2[1, :, :12], v2[1, :, :12] = q[0], k[0], v[0]  # sequence 0 inside a longer batch
    assert_bitwise_equal(attention(q2, k2, v2)[1, :, :12], attention(q, k, v)[0])


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_accuracy_against_fp64(hq, hkv):
    q, k, v = _qkv(2, hq, hkv, 23, 32, torch.float32, seed=3)
    out = attention(q, k, v, scale=0.17)
    assert float((out.double() - _exact(q, k, v, 0.17)).abs().max()) < 2e-6


def test_mask_hides_keys_and_empty_rows_are_zero():
    q, k, v = _qkv(1, 2, 2, 6, 8, torch.float32, seed=4)
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 2] = True
    mask[..., 0, 0] = True  # query 0 sees nothing
    out = attention(q, k, v, mask=mask)
    assert bool((out[:, :, 0] == 0).all())
    ref = _exact(q, k, v, 8**-0.5, mask[0, 0])
    assert float((out[:, :, 1:].double() - ref[:, :, 1:]).abs().max()) < 2e-6
    nc = attention(q, k, v, causal=False)
    assert float((nc.double() - torch.softmax(q.double() @ k.double().transpose(-1, -2) * 8**-0.5, -1) @ v.double()).abs().max()) < 2e-6


def test_hidden_nonfinite_values_do_not_leak():
    """Regression guard: a later (causally hidden) token's inf/NaN must not reach earlier queries."""
    q, k, v = _qkv(1, 2, 2, 8, 8, torch.float32, seed=5)
    clean = attention(q, k, v)
    k[:, :, 6] = float("inf")
    v[:, :, 6] = float("nan")
    dirty = attention(q, k, v)
    assert_bitwise_equal(dirty[:, :, :6], clean[:, :, :6])
    assert bool(torch.isnan(dirty[:, :, 6:]).all())


def test_chunking_does_not_change_bits(monkeypatch):
    q, k, v = _qkv(2, 2, 1, 17, 8, torch.float32, seed=6)
    ref = attention(q, k, v)
    monkeypatch.setattr(attention_module, "_CHUNK_ELEMENTS", 17 * 8 * 3)
    assert_bitwise_equal(attention(q, k, v), ref)


def test_gradients_match_reference():
    q, k, v = _qkv(2, 4, 2, 9, 8, torch.float64, seed=7)
    qs, ks, vs = (t.float().requires_grad_() for t in (q, k, v))
    out = attention(qs, ks, vs)
    go = torch.randn_like(out)
    out.backward(go)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    _exact(qr, kr, vr, 8**-0.5).backward(go.double())
    for a, r in ((qs, qr), (ks, kr), (vs, vr)):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise():
    q, k, v = _qkv(1, 3, 2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v)
    q, k, v = _qkv(1, 2, 2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="queries"):
        attention(torch.cat([q, q], 2), k, v)
    with pytest.raises(TypeError):
        attention(q, k, v, mask=torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="broadcast"):
        attention(q, k, v, mask=torch.zeros(1, 1, 3, 4, dtype=torch.bool))
