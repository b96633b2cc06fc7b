"""The decode step's fused q/k RMSNorm + RoPE + KV-cache write (``minite_kernels.triton.decode.qk_norm_rope``).

Contract pinned here: the kernel's ``q``, key-cache and value-cache writes are bitwise what the
learner's modules compute for the same heads -- ``bi_rmsnorm`` (the batch-invariant RMSNorm of the
q/k layernorms in strict and aligned default mode), Megatron's ``_apply_rotary_pos_emb_bshd`` at
each row's position, and ``index_put_`` into the cache -- on fresh normal and heavy-tailed data,
with partial rotary, zero-centered weights, no qk-layernorm, no RoPE, a cache bucket wider than
the batch and untouched cache rows. Under the interpreter the norm oracle is
``bi_rmsnorm(x.float(), w).to(dtype)`` (the same fp32 arithmetic and one RNE; the interpreter's
bf16 cast truncates, which the kernel works around on the bits). On sm_90a (compiled on the CPU)
the reduction PTX equals bi_rmsnorm's -- the guarantee of the norm's bits on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from minite_kernels.triton._build._testing import DEVICE, HAS_CUDA, heavy_tailed, kernels_runnable, randn, run_aot_script
from minite_megatron.testing import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.invariant.bi_rmsnorm import bi_rmsnorm  # noqa: E402
from minite_kernels.triton.decode.qk_norm_rope import qk_norm_rope_cache  # noqa: E402


def _freqs(s: int, rot: int) -> torch.Tensor:
    """Megatron's RotaryEmbedding frequencies [S, 1, 1, rot] (base 10000, non-interleaved)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat([f, f], -1)[:, None, None, :]


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, zc: bool) -> torch.Tensor:
    if HAS_CUDA:
        return bi_rmsnorm(x.to(DEVICE), w.to(DEVICE), eps, zc).cpu()
    return bi_rmsnorm(x.float(), w, eps, zc).to(x.dtype)


def _reference(mixed, wq, wk, eps, zc, freqs, pos, kc, vc, groups, per):
    """The learner's modules: split, q/k norms, Megatron's RoPE, the cache writes (all on the CPU)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    b, d = mixed.shape[0], kc.shape[-1]
    m = mixed.view(b, groups, per + 2, d)
    q = m[:, :, :per].reshape(1, b, groups * per, d)
    k = m[:, :, per].reshape(1, b, groups, d)
    v = m[:, :, per + 1]
    if wq is not None:
        q = _norm(q.reshape(-1, d), wq, eps, zc).view(q.shape)
        k = _norm(k.reshape(-1, d), wk, eps, zc).view(k.shape)
    if freqs is not None:
        f = freqs.index_select(0, pos).view(1, b, 1, -1)
        q, k = _apply_rotary_pos_emb_bshd(q, f), _apply_rotary_pos_emb_bshd(k, f)
    kc, vc = kc.clone(), vc.clone()
    kc.index_put_((pos, torch.arange(b)), k[0])
    vc.index_put_((pos, torch.arange(b)), v)
    return q[0], kc, vc


def check(b=3, groups=2, per=3, d=32, rot=None, s=12, bucket=4, norm=True, zc=False, dtype=torch.bfloat16,
          heavy=False, seed=0):
    width = groups * (per + 2) * d
    mixed = heavy_tailed(b, width, seed=seed, dtype=dtype) if heavy else randn(b, width, seed=seed, scale=3.0, dtype=dtype)
    wq = wk = None
    if norm:
        wq = (torch.rand(d, generator=torch.Generator().manual_seed(seed + 1)) + 0.5 - (1.0 if zc else 0.0)).to(dtype)
        wk = (torch.rand(d, generator=torch.Generator().manual_seed(seed + 2)) + 0.5 - (1.0 if zc else 0.0)).to(dtype)
    freqs = None if rot == 0 else _freqs(s, rot or d)
    pos = torch.randperm(s, generator=torch.Generator().manual_seed(seed + 3))[:b]
    kc = randn(s, bucket, groups, d, seed=seed + 4, dtype=dtype)  # untouched rows must stay as they are
    vc = randn(s, bucket, groups, d, seed=seed + 5, dtype=dtype)
    q_ref, kc_ref, vc_ref = _reference(mixed, wq, wk, 1e-6, zc, freqs, pos, kc, vc, groups, per)
    cos = sin = None
    if freqs is not None:
        f = freqs.reshape(s, -1)
        cos, sin = torch.cos(f).to(dtype), torch.sin(f).to(dtype)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    kc_d, vc_d = kc.to(DEVICE), vc.to(DEVICE)
    q = qk_norm_rope_cache(mixed.to(DEVICE), dev(wq), dev(wk), 1e-6, zc, dev(cos), dev(sin), pos.to(DEVICE), kc_d, vc_d,
                           groups, per)
    assert q.shape == (b, groups * per, d)
    assert_bitwise_equal(q.cpu(), q_ref, "q", nan_equal=True)
    assert_bitwise_equal(kc_d.cpu(), kc_ref, "k cache", nan_equal=True)
    assert_bitwise_equal(vc_d.cpu(), vc_ref, "v cache", nan_equal=True)


def test_random_heads_equal_the_learners_modules():
    check(b=3, groups=2, per=3, d=32, bucket=4)
    check(b=1, groups=1, per=1, d=16, bucket=1)


def test_heavy_tails_partial_rotary_zero_centered_fp16_and_odd_head_dim():
    check(b=2, per=1, heavy=True, rot=16, seed=7)  # RoPE over the first half, the rest passes through
    check(b=2, per=1, zc=True, d=48, seed=9)  # head dim not a power of two (masked lanes)
    if HAS_CUDA:  # the interpreter has no exact fp16 rounding
        check(dtype=torch.float16, seed=11)


def test_without_qk_layernorm_or_rope():
    check(b=2, per=1, norm=False, seed=12)
    check(b=2, per=1, rot=0, seed=13)


def test_bad_arguments():
    d, groups, per = 16, 2, 1
    mixed = torch.zeros(2, groups * (per + 2) * d, dtype=torch.bfloat16, device=DEVICE)
    kc = torch.zeros(8, 2, groups, d, dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(d, dtype=torch.bfloat16, device=DEVICE)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(TypeError, match="16-bit"):
        qk_norm_rope_cache(mixed.float(), w, w, 1e-6, False, None, None, pos, kc, kc.clone(), groups, per)
    with pytest.raises(ValueError, match="mixed"):
        qk_norm_rope_cache(mixed[:, :-16], w, w, 1e-6, False, None, None, pos, kc, kc.clone(), groups, per)
    with pytest.raises(ValueError, match="both norm weights"):
        qk_norm_rope_cache(mixed, w, None, 1e-6, False, None, None, pos, kc, kc.clone(), groups, per)
    with pytest.raises(ValueError, match="RoPE tables"):
        qk_norm_rope_cache(mixed, w, w, 1e-6, False, torch.zeros(8, 15, dtype=torch.bfloat16, device=DEVICE),
                           torch.zeros(8, 15, dtype=torch.bfloat16, device=DEVICE), pos, kc, kc.clone(), groups, per)
    with pytest.raises(ValueError, match="k_cache"):
        qk_norm_rope_cache(mixed, w, w, 1e-6, False, None, None, pos, kc[:, :1], kc.clone(), groups, per)


AOT_SCRIPT = r"""
import json
from minite_kernels.triton._build._aot import report
from minite_kernels.triton.nvfp4 import norm_quantize as N
from minite_kernels.triton.decode import qk_norm_rope as Q
out = {}
for d in (128, 64):
    kq, kb = Q.aot_kernel(d, "bf16"), N.aot_bi_rmsnorm(d, "bf16")
    a, b = N.reduction_ptx(kq.asm["ptx"]), N.reduction_ptx(kb.asm["ptx"])
    out[str(d)] = dict(same=a == b, length=len(a), **report(kq))
print("JSON" + json.dumps(out))
"""


@pytest.mark.aot  # compile-only (sm_90a on any machine): CI runs it; the GPU set leaves it out
def test_sm90_norm_reduction_is_bi_rmsnorms():
    """On the GPU the norm's bits rest on this: for head dims 128 and 64 the kernel's fp32 /
    shuffle / barrier instructions up to ``sqrt.rn`` are bi_rmsnorm's (same layout, tree and
    contraction of the sum of squares); no spills."""
    aot = run_aot_script(AOT_SCRIPT)
    for d, r in aot.items():
        assert r["same"] and r["length"] > 10, (d, r)
        assert r["spill_bytes"] == 0 and r["LDL"] == 0, (d, r)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_gpu_fp16_and_qwen3_shapes():
    """On the H200: the qwen3-moe layer's heads (4 groups of 8 query heads of 128) at batch 8
    and 64, bf16 and fp16, against bi_rmsnorm and Megatron's RoPE on the GPU."""
    for b in (8, 64):
        for dtype in (torch.bfloat16, torch.float16):
            check(b=b, groups=4, per=8, d=128, s=160, bucket=b, dtype=dtype, seed=b)
