"""The minite core attention (torch SDPA) against Megatron's unfused ``DotProductAttention``.

Rule (docs/numerics.md): in fp32 the two agree to 1e-5 (different summation orders of the same
fp32 math); in bf16 the SDPA result's error against an fp64 reference stays within 2x the error
of Megatron's own bf16 attention (quack's rule), for the output and every gradient.
"""

import pytest
import torch

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from minite_megatron.modules.attention import MiniteDotProductAttention, effective_mask, sdpa_attention

from .minite_tiny import build_gpt, causal_mask, init_single_process, tiny_config


@pytest.fixture(scope="module")
def config():
    from megatron.core import tensor_parallel

    init_single_process()
    tensor_parallel.model_parallel_cuda_manual_seed(1)  # Megatron's attention forks the RNG tracker
    return tiny_config(num_attention_heads=4, num_query_groups=2, kv_channels=16)


def _qkv(s, b=2, heads=4, groups=2, d=16, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(s, b, groups, d, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(s, b, groups, d, generator=g).to(device, dtype).requires_grad_()
    return q, k, v


def _run(module, q, k, v, mask, seed=1):
    out = module(q, k, v, mask)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), go)
    return [out.detach(), *grads]


def _padding_mask(s, b, device="cpu", empty_row=True):
    """Causal plus two hidden keys and (``empty_row``) one query that sees nothing (all hidden)."""
    m = causal_mask(s).to(device).expand(b, 1, s, s).clone()
    m[0, ..., 2] = True
    if empty_row:
        m[1, ..., 0, :] = True
    return m


@pytest.mark.parametrize("which", ["causal", "none", "padding"])
def test_sdpa_attention_equals_megatron_unfused_in_fp32(config, which):
    """Same function as Megatron's local attention (output, dq, dk, dv) for Megatron's causal
    mask, no mask (the causal rule of the constructor), and a padding mask."""
    s, b = 12, 2
    ours = MiniteDotProductAttention(config, 1, AttnMaskType.causal, "self")
    ref = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(s, b)
    mask = {"causal": causal_mask(s), "none": None, "padding": _padding_mask(s, b)}[which]
    got = _run(ours, q, k, v, mask)
    want = _run(ref, q, k, v, mask if mask is not None else causal_mask(s))
    if which == "padding":  # Megatron averages an all-hidden row uniformly; the minite rule gives zeros
        keep = torch.ones(s, b, 1, dtype=torch.bool)
        keep[0, 1] = False
        got[0], want[0] = got[0] * keep, want[0] * keep
        assert bool((got[0][0, 1] == 0).all())
        for t in got[1:]:
            assert bool(torch.isfinite(t).all())
        got, want = got[:1], want[:1]
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)


def test_sdpa_attention_bf16_error_within_twice_megatrons(config):
    s, b = 64, 2
    ours = MiniteDotProductAttention(config, 1, AttnMaskType.causal, "self")
    ref = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(s, b, dtype=torch.bfloat16, seed=3)
    mask = causal_mask(s)
    got = _run(ours, q, k, v, mask)
    meg = _run(ref, q, k, v, mask)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = _run(ref, q64, k64, v64, mask)
    for name, a, m, e in zip(("out", "dq", "dk", "dv"), got, meg, exact):
        err = float((a.double() - e).norm() / e.norm())
        meg_err = float((m.double() - e).norm() / e.norm())
        assert err <= 2 * meg_err + 1e-6, f"{name}: sdpa error {err:.3e} vs Megatron bf16 {meg_err:.3e}"


def test_effective_mask_drops_a_causal_mask_once_per_mask_object():
    """Pins the fast path: Megatron's causal mask (and decode rows of it) hide nothing the causal
    rule does not, so SDPA gets no mask; the check runs once per mask object and version."""
    m = causal_mask(8)
    assert effective_mask(m, 8, 8, causal=True) is None
    assert effective_mask(m[..., 5:6, :6], 1, 6, causal=True) is None  # a decode row over the cache
    pad = m.clone()
    pad[..., 1] = True
    assert effective_mask(pad, 8, 8, causal=True) is pad
    assert effective_mask(m, 8, 8, causal=False) is m
    m.zero_()  # an in-place change (new version) is seen
    assert effective_mask(m, 8, 8, causal=True) is None
    m[..., 7, 0] = True
    assert effective_mask(m, 8, 8, causal=True) is m
    with pytest.raises(TypeError):
        effective_mask(m.float(), 8, 8, causal=True)


def test_kv_cache_layout_queries_are_the_last_positions():
    """A decode step (one query over the cache) equals that row of the full causal forward."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 10, 8, generator=g) for h in (4, 2, 2))
    full = sdpa_attention(q, k, v, scale=8**-0.5)
    for t in (0, 4, 9):
        step = sdpa_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], scale=8**-0.5)
        torch.testing.assert_close(step, full[:, :, t : t + 1], rtol=1e-6, atol=1e-6)
    chunk = sdpa_attention(q[:, :, 6:], k, v, scale=8**-0.5)  # a chunked prefill: 4 queries after 6 cached
    torch.testing.assert_close(chunk, full[:, :, 6:], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        sdpa_attention(q, k[:, :, :5], v[:, :, :5], scale=1.0)


def test_the_minite_spec_uses_sdpa_except_in_strict_or_aligned_mode():
    """Default mode (and the BF16 twin) take the batch-invariant attention forward
    (``aligned_attention``, on by default: the sampler's decode steps get the learner's bits);
    with it off, torch SDPA; strict mode its own strict module."""
    from minite_megatron.recipe import Recipe
    from minite_megatron.specs import get_gpt_layer_minite_spec
    from minite_megatron.modules.core_attention import AlignedDotProductAttention, StrictDotProductAttention

    for recipe, cls in ((Recipe(), AlignedDotProductAttention), (Recipe(precision="bf16"), AlignedDotProductAttention),
                        (Recipe(aligned_attention=False), MiniteDotProductAttention),
                        (Recipe(precision="bf16", aligned_attention=False), MiniteDotProductAttention),
                        (Recipe(strict=True), StrictDotProductAttention)):
        spec = get_gpt_layer_minite_spec(recipe, num_experts=4, qk_layernorm=True)
        assert spec.submodules.self_attention.submodules.core_attention is cls
    assert not AlignedDotProductAttention.minite_strict  # default mode is not reported as strict


def test_aligned_attention_with_dropout_in_training_is_the_sdpa_attention(config):
    """Training with attention dropout: the aligned core attention computes what the SDPA module
    does (the same function, the same RNG fork), bitwise, output and gradients. Pins the shared
    ``sdpa_core_attention`` that replaced ``MiniteDotProductAttention.forward(self, ...)`` called
    on an ``AlignedDotProductAttention``."""
    import dataclasses

    from megatron.core import tensor_parallel

    from minite_megatron.modules.core_attention import AlignedDotProductAttention
    from minite_megatron.testing import assert_bitwise_equal

    cfg = dataclasses.replace(config, attention_dropout=0.25)
    results = []
    for cls in (MiniteDotProductAttention, AlignedDotProductAttention):
        module = cls(cfg, 1, AttnMaskType.causal, "self").train()
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        results.append(_run(module, *_qkv(7), causal_mask(7)))
    for got, ref in zip(results[1], results[0]):
        assert_bitwise_equal(got, ref)
    eval_out = AlignedDotProductAttention(cfg, 1, AttnMaskType.causal, "self").eval()(*_qkv(7), causal_mask(7))
    assert not torch.equal(eval_out.detach(), results[1][0])  # dropout was applied in training


def test_model_loss_and_grads_equal_megatron_attention_in_fp32(config):
    """The BF16 twin's whole model with the SDPA attention vs the same model with Megatron's
    unfused attention: loss and every gradient (fp32, CPU)."""
    from minite_megatron.recipe import Recipe
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    cfg = tiny_config()
    outs = []
    for core in (None, DotProductAttention):
        spec = get_gpt_decoder_block_minite_spec(cfg, Recipe(precision="bf16", aligned_attention=False))
        if core is not None:
            for layer in spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = core
        model = build_gpt(cfg, spec, vocab=128, seq=32, seed=11)
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(16).unsqueeze(0).expand(2, -1)
        loss = model(tokens, pos, causal_mask(16), labels=tokens).mean()
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = outs
    torch.testing.assert_close(l0, l1, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.gpu
def test_sdpa_attention_on_the_gpu_within_twice_megatrons_bf16_error(config):
    """Output and gradients for Megatron's causal mask and a padding mask. An all-hidden query row
    is left out of the comparison: Megatron averages it over every key (its gradients reach
    every value), the minite rule gives zeros (regression, H200 2026-12-01: dv 9.4e-3 vs 4.4e-3
    with such a row in the mask, all from that convention)."""
    s, b = 512, 2
    ours = MiniteDotProductAttention(config, 1, AttnMaskType.causal, "self").cuda()
    ref = DotProductAttention(config, 1, AttnMaskType.causal, "self").cuda()
    for mask in (causal_mask(s).cuda(), _padding_mask(s, b, "cuda", empty_row=False)):
        q, k, v = _qkv(s, b, dtype=torch.bfloat16, seed=4, device="cuda")
        got = _run(ours, q, k, v, mask)
        meg = _run(ref, q, k, v, mask)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        exact = _run(ref, q64, k64, v64, mask)
        for name, a, m, e in zip(("out", "dq", "dk", "dv"), got, meg, exact):
            assert bool(torch.isfinite(a).all()), name
            err = float((a.double() - e).norm() / e.norm())
            meg_err = float((m.double() - e).norm() / e.norm())
            assert err <= 2 * meg_err + 1e-6, f"{name}: sdpa error {err:.3e} vs Megatron bf16 {meg_err:.3e}"
    q, k, v = _qkv(s, b, dtype=torch.bfloat16, seed=5, device="cuda")
    out, *grads = _run(ours, q, k, v, _padding_mask(s, b, "cuda"))
    assert bool((out[0, 1] == 0).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
