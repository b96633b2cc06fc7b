"""Batch-invariant Triton kernels (bi_matmul, bi_rmsnorm, bi_log_softmax, bi_attention).

On CPU they run under TRITON_INTERPRET=1 (set by tests/conftest.py) on small shapes; there the
tile product is an explicit product-and-sum (see kernels/triton/invariant/bi_common.py), so these tests
check each kernel's logic -- fixed tiles and block order, masking, epilogue, online softmax --
for batch and prefill/decode invariance, bitwise, and accuracy against fp64. The GPU tests
(marked ``gpu``) check the same on the tensor-core path at realistic shapes.
"""

import pytest
import torch

from minite_megatron.testing import assert_bitwise_equal

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


# ---- bi_matmul ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bi_matmul_rows_invariant_and_accurate(dtype):
    from minite_kernels.triton.invariant.bi_matmul import bi_matmul

    m, k, n = 70, 80, 72  # two row tiles, a partial K step, two column tiles
    x, w, b = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype, seed=1, scale=k**-0.5), _rand(n, seed=2)
    full = bi_matmul(x, w, b, torch.float32)
    for rows in ([0], [69], [5, 64], list(range(3, 67))):
        assert_bitwise_equal(bi_matmul(x[rows], w, b, torch.float32), full[rows], f"rows {rows[:2]}")
    exact = x.double() @ w.double().t() + b.double()
    mag = x.double().abs() @ w.double().abs().t() + b.double().abs()
    assert bool(((full.double() - exact).abs() <= (k + 2) * 2.0**-24 * mag).all())
    out = bi_matmul(x, w, b)
    assert out.dtype == dtype
    assert_bitwise_equal(out, full.to(dtype))


def test_bi_matmul_strided_mixed_and_empty():
    from minite_kernels.triton.invariant.bi_matmul import bi_matmul

    x, w = _rand(10, 48, dtype=torch.bfloat16), _rand(20, 48, seed=1)
    ref = bi_matmul(x.float(), w, None, torch.float32)
    assert_bitwise_equal(bi_matmul(x, w, None, torch.float32), ref)
    xt = x.float().t().contiguous().t()
    assert_bitwise_equal(bi_matmul(xt, w, None, torch.float32), ref)
    assert bi_matmul(x[:0], w.to(torch.bfloat16)).shape == (0, 20)
    with pytest.raises(ValueError):
        bi_matmul(x, w[:, :40])


# ---- bi_rmsnorm / bi_log_softmax ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bi_rmsnorm_rows_invariant_and_accurate(dtype):
    from minite_kernels.triton.invariant.bi_rmsnorm import bi_rmsnorm

    x, w = _rand(9, 96, dtype=dtype, scale=3), _rand(96, seed=1)
    out = bi_rmsnorm(x, w, 1e-5)
    for rows in ([0], [8], [2, 3, 4]):
        assert_bitwise_equal(bi_rmsnorm(x[rows], w, 1e-5), out[rows])
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    tol = 2.0 ** -(8 if dtype == torch.bfloat16 else 20)
    assert float(((out.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max()) < tol
    zc = bi_rmsnorm(x, w, 1e-5, True)
    assert float((zc.double() - exact / w.double() * (w.double() + 1)).abs().max()) < 8 * tol


def test_bi_log_softmax_rows_invariant_and_accurate(monkeypatch):
    from minite_kernels.triton.invariant import bi_log_softmax as mod

    monkeypatch.setattr(mod, "MAX_BLOCK", 256)  # several chunks per row on a small vocabulary
    x = _rand(7, 1000, dtype=torch.bfloat16, scale=4)
    out = mod.bi_log_softmax(x)
    assert out.dtype == torch.float32
    for rows in ([0], [6], [1, 2, 3]):
        assert_bitwise_equal(mod.bi_log_softmax(x[rows]), out[rows])
    assert float((out.double() - torch.log_softmax(x.double(), -1)).abs().max()) < 1e-5
    y = torch.tensor([[0.0, float("-inf"), 2.0]], device=DEV)
    got = mod.bi_log_softmax(y)
    assert got[0, 1].item() == float("-inf") and bool(torch.isfinite(got[0, [0, 2]]).all())


# ---- bi_attention ------------------------------------------------------------------------------
def _qkv(b, hq, hkv, s, d, dtype=torch.float32, seed=0):
    return (_rand(b, hq, s, d, dtype=dtype, seed=seed), _rand(b, hkv, s, d, dtype=dtype, seed=seed + 1),
            _rand(b, hkv, s, d, dtype=dtype, seed=seed + 2))


def _exact(q, k, v, mask=None):
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
    if mask is not None:
        hidden = hidden | mask
    s = (qd @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(hidden, float("-inf"))
    return torch.softmax(s, -1) @ vd


def test_bi_attention_decode_equals_prefill():
    """Pins the fixed KV-block order: a decode step over the cache == that row of the prefill,
    bitwise, including queries in the middle, at the end and across block boundaries."""
    from minite_kernels.triton.invariant.bi_attention import bi_attention, block_config

    BLOCK_M, BLOCK_N = block_config()[:2]
    t_len = max(BLOCK_N, BLOCK_M) + 9
    q, k, v = _qkv(2, 4, 2, t_len, 16)
    full = bi_attention(q, k, v)
    for t in sorted({0, 1, BLOCK_N - 1, BLOCK_N, BLOCK_M - 1, t_len - 1}):
        step = bi_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])
        assert_bitwise_equal(step, full[:, :, t : t + 1], f"decode step {t}")
    assert_bitwise_equal(bi_attention(q[1:, :, 5:9], k[1:, :, :9], v[1:, :, :9]), full[1:, :, 5:9])
    assert float((full.double() - _exact(q, k, v)).abs().max()) < 2e-6


def test_bi_attention_mask_gqa_and_empty_rows():
    from minite_kernels.triton.invariant.bi_attention import bi_attention

    q, k, v = _qkv(1, 6, 2, 10, 8, seed=3)
    mask = torch.zeros(1, 1, 10, 10, dtype=torch.bool, device=DEV)
    mask[..., 3] = True
    mask[..., 0, 0] = True
    out = bi_attention(q, k, v, mask=mask)
    assert bool((out[:, :, 0] == 0).all())
    assert float((out[:, :, 1:].double() - _exact(q, k, v, mask[0, 0])[:, :, 1:]).abs().max()) < 2e-6
    nc = bi_attention(q, k, v, causal=False)
    ref = torch.softmax(q.double() @ k.double().repeat_interleave(3, 1).transpose(-1, -2) / 8**0.5, -1)
    assert float((nc.double() - ref @ v.double().repeat_interleave(3, 1)).abs().max()) < 2e-6
    with pytest.raises(ValueError):
        bi_attention(q[:, :5], k, v)


def _exact_lse(q, k, mask=None, causal=True):
    group = q.shape[1] // k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    hidden = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
    if mask is not None:
        hidden = hidden | mask
    return torch.logsumexp(s.masked_fill(hidden, float("-inf")), -1)


def _lse_bound(exact, d, sk):
    """fp32: a D-term dot product and exp2/log2 per score, an Sk-term sum: (D + Sk + 8) ulps of |lse| + 1."""
    return (d + sk + 8) * 2.0**-24 * (1 + exact.abs())


def test_bi_attention_lse_accurate_and_output_bits_unchanged():
    """Pins issue 16's LSE: the natural log-sum-exp of the scaled visible scores (+inf for a query
    with no visible key); with it the output is the same bits as without it; a decode step's LSE is
    the bits of the prefill's row (the same final state)."""
    from minite_kernels.triton.invariant.bi_attention import bi_attention, block_config

    BLOCK_M, BLOCK_N = block_config()[:2]
    t_len = max(BLOCK_N, BLOCK_M) + 9
    q, k, v = _qkv(2, 4, 2, t_len, 16, seed=5)
    out, lse = bi_attention(q, k, v, return_lse=True)
    assert lse.shape == (2, 4, t_len) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert_bitwise_equal(out, bi_attention(q, k, v))
    exact = _exact_lse(q, k)
    assert bool(((lse.double() - exact).abs() <= _lse_bound(exact, 16, t_len)).all())
    for t in (0, BLOCK_N, t_len - 1):
        o1, l1 = bi_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], return_lse=True)
        assert_bitwise_equal(o1, out[:, :, t : t + 1], f"decode step {t}")
        assert_bitwise_equal(l1, lse[:, :, t : t + 1], f"decode step {t} LSE")
    q, k, v = _qkv(1, 6, 2, 10, 8, seed=3)
    mask = torch.zeros(1, 1, 10, 10, dtype=torch.bool, device=DEV)
    mask[..., 3] = True
    mask[..., 0, 0] = True
    for causal in (True, False):
        out, lse = bi_attention(q, k, v, mask=mask, causal=causal, return_lse=True)
        assert_bitwise_equal(out, bi_attention(q, k, v, mask=mask, causal=causal))
        exact = _exact_lse(q, k, mask[0, 0], causal)
        seen = torch.isfinite(exact)
        assert bool((lse[~seen] == float("inf")).all()) and int((~seen).sum()) == (6 if causal else 0)
        assert bool(((lse.double() - exact).abs() <= _lse_bound(exact, 8, 10))[seen].all())


def test_strict_ops_dispatch_to_the_triton_kernels():
    """The strict API with the triton backend forced: invariant and close to the torch one."""
    from minite_megatron.invariant.attention import attention
    from minite_megatron.invariant.matmul import linear
    from minite_megatron.invariant.rmsnorm import rms_norm
    from minite_megatron.invariant.softmax import log_softmax
    from minite_megatron.settings import overridden

    x, w = _rand(5, 32, seed=1), _rand(24, 32, seed=2)
    q, k, v = _qkv(1, 2, 2, 6, 16, seed=4)
    torch_out = (linear(x, w), rms_norm(x, w[0]), log_softmax(x), attention(q, k, v))
    with overridden(strict_backend="triton"):
        tri = (linear(x, w), rms_norm(x, w[0]), log_softmax(x), attention(q, k, v))
        assert_bitwise_equal(linear(x[2:3], w), tri[0][2:3])
    for a, b in zip(tri, torch_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- GPU: the tensor-core path at realistic shapes ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_bi_matmul_invariant_across_m(dtype):
    from minite_kernels.triton.invariant.bi_matmul import bi_matmul

    x, w = _rand(4099, 2048, dtype=dtype), _rand(1536, 2048, dtype=dtype, seed=1, scale=2048**-0.5)
    full = bi_matmul(x, w, None, torch.float32)
    for m in (1, 3, 64, 65, 1000):
        assert_bitwise_equal(bi_matmul(x[-m:], w, None, torch.float32), full[-m:], f"M={m}")
    exact = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    u = 2.0**-24 if dtype == torch.float32 else 2.0**-24  # fp32 accumulation either way
    assert bool(((full.double() - exact).abs() <= 2048 * u * mag + 1e-30).all())


@pytest.mark.gpu
def test_gpu_bi_matmul_tile_keeps_the_bits():
    """The tensor-core tile (MMA_CONFIG, issue 16 round 2) against the 64x64x32 tile it replaced (FMA_CONFIG, here on the tensor cores):
    the same k16 MMA sequence per element, so the same bits (strict LM head and router shapes:
    bf16 operands, fp32 output, a partial row / column / K tile)."""
    from minite_kernels.triton.invariant.bi_matmul import FMA_CONFIG, MMA_CONFIG, _launch

    assert MMA_CONFIG != FMA_CONFIG
    for m, n in ((4099, 1000), (33, 128)):
        x, w = _rand(m, 2080, dtype=torch.bfloat16), _rand(n, 2080, dtype=torch.bfloat16, seed=1, scale=0.02)
        b = _rand(n, seed=2)
        new = _launch(x, w, b, torch.float32, MMA_CONFIG)
        assert_bitwise_equal(new, _launch(x, w, b, torch.float32, FMA_CONFIG), f"{m}x{n}")


@pytest.mark.gpu
def test_gpu_bi_attention_decode_equals_prefill():
    from minite_kernels.triton.invariant.bi_attention import bi_attention

    q, k, v = _qkv(4, 16, 4, 300, 128, dtype=torch.bfloat16)
    full = bi_attention(q, k, v)
    for t in (0, 31, 32, 63, 64, 127, 128, 200, 255, 256, 299):
        assert_bitwise_equal(bi_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1]), full[:, :, t : t + 1])
    assert float((full.double() - _exact(q, k, v)).abs().max()) < 2e-2  # p rounded to bf16 for the PV product


@pytest.mark.gpu
def test_gpu_bi_rmsnorm_and_log_softmax_invariant():
    from minite_kernels.triton.invariant.bi_log_softmax import bi_log_softmax
    from minite_kernels.triton.invariant.bi_rmsnorm import bi_rmsnorm

    x, w = _rand(513, 4096, dtype=torch.bfloat16), _rand(4096, seed=1)
    out = bi_rmsnorm(x, w)
    assert_bitwise_equal(bi_rmsnorm(x[7:8], w), out[7:8])
    logits = _rand(257, 151936, seed=2, scale=3)
    lp = bi_log_softmax(logits)
    assert_bitwise_equal(bi_log_softmax(logits[100:101]), lp[100:101])
    assert float((lp.double() - torch.log_softmax(logits.double(), -1)).abs().max()) < 1e-4
