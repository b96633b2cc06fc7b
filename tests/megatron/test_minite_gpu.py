"""miniTE on a CUDA GPU: the reference contract is device independent, and a real Megatron
model built from the minite specs runs its GEMMs on the Triton kernels (skipped without CUDA)."""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.backends import register_backend
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal, assert_nvfp4_equal

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "kw",
    [
        dict(global_scale="row"),
        dict(global_scale="tensor", tile=(16, 16)),
        dict(global_scale="tensor", rounding="stochastic", seed=9, rht_seed=4),
    ],
)
def test_reference_contract_is_bitwise_identical_on_cpu_and_cuda(kw):
    """The contract's claim 'bitwise equal on every device' for the pure-torch reference."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(256, 512, generator=g) * torch.exp(torch.randn(256, 1, generator=g) * 4)).bfloat16()
    x[7, 3] = float("nan")
    w = torch.randn(128, 512, generator=g)
    on_cpu = nvfp4.quantize_reference(x, **kw)
    on_gpu = _to_cpu(nvfp4.quantize_reference(x.cuda(), **kw))
    assert_nvfp4_equal(on_gpu, on_cpu)
    w_cpu = nvfp4.quantize_reference(w, global_scale="tensor", tile=(16, 16))
    w_gpu = nvfp4.quantize_reference(w.cuda(), global_scale="tensor", tile=(16, 16))
    out_cpu = nvfp4.gemm_reference(on_cpu, w_cpu)
    out_gpu = nvfp4.gemm_reference(nvfp4.quantize_reference(x.cuda(), **kw), w_gpu)
    assert_bitwise_equal(out_gpu.cpu(), out_cpu, "reference GEMM cuda vs cpu", nan_equal=True)


def _to_cpu(q):
    from dataclasses import replace

    return replace(q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu())


class _Spy:
    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, "spy-triton", 0

    def available(self, device=None):
        return self.inner.available(device)

    def why_not(self, device=None):
        return self.inner.why_not(device)

    def __getattr__(self, op):
        fn = getattr(self.inner, op)

        def wrapped(*a, **k):
            self.calls += 1
            return fn(*a, **k)

        return wrapped


@pytest.fixture(scope="module")
def megatron_gpu():
    from .minite_tiny import init_single_process

    init_single_process()


def _model(recipe):
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    from .minite_tiny import build_gpt, tiny_config

    cfg = tiny_config(use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True)
    return build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe).cuda()


def test_minite_model_runs_on_the_triton_kernels(megatron_gpu):
    from .minite_tiny import causal_mask, lm_batch

    spy = _Spy(nvfp4.get_backend("triton", "cuda"))
    register_backend(spy)
    model = _model(Recipe(backend="spy-triton"))
    tokens, labels = (t.cuda() for t in lm_batch(0))
    pos = torch.arange(32, device="cuda").unsqueeze(0).expand(4, -1)
    loss = model(tokens, pos, causal_mask(32).cuda(), labels=labels).float().mean()
    loss.backward()
    assert spy.calls > 0 and torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad.float()).all(), name


def test_triton_and_reference_backends_agree_on_a_model_forward(megatron_gpu):
    """Same weights, same tokens: the Triton model's logits equal the reference model's up to
    the GEMM accumulation order (bf16 activations: a few bf16 ulps after 2 layers)."""
    from .minite_tiny import causal_mask, lm_batch

    tri, ref = _model(Recipe(backend="triton")), _model(Recipe(backend="reference"))
    ref.load_state_dict(tri.state_dict(), strict=False)
    tokens, _ = (t.cuda() for t in lm_batch(1))
    pos = torch.arange(32, device="cuda").unsqueeze(0).expand(4, -1)
    with torch.no_grad():
        a = tri(tokens, pos, causal_mask(32).cuda()).float()
        b = ref(tokens, pos, causal_mask(32).cuda()).float()
    rel = ((a - b).norm() / b.norm()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert rel < 2e-2 and agree > 0.95, (rel, agree)


def test_training_on_the_gpu_decreases_the_loss(megatron_gpu):
    from .minite_tiny import train

    model = _model(Recipe())
    model.cuda()

    class _OnGpu(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, tokens, pos, mask, labels):
            return self.m(tokens.cuda(), pos.cuda(), mask.cuda(), labels=labels.cuda()).float()

    losses = train(_OnGpu(model), 30)
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses


@pytest.mark.parametrize("activation_module", [False, True])
@pytest.mark.parametrize("strict", [True, False])
def test_fused_producer_handoff_on_the_gpu(megatron_gpu, monkeypatch, strict, activation_module):
    """The norms in front of qkv / fc1 (and, with the minite activation module, the SwiGLU in
    front of fc2) run the fused producer kernels and the linears take their quantization: 4
    (6) handoffs in 2 dense layers. In strict mode the fused norm is the batch-invariant norm
    and the fused SwiGLU is torch's, bit for bit, so the loss equals that of the unfused
    modules exactly; so do the gradients with the norm alone (the fused SwiGLU's backward is
    Megatron's ``swiglu_back``, which rounds differently from autograd's)."""
    from minite_megatron.modules.activation import MiniteActivation
    from minite_megatron.modules.norm import MiniteNorm
    from minite_megatron.ops import handoff
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    from .minite_tiny import build_gpt, causal_mask, lm_batch, tiny_config

    taken = []
    real_take = handoff.Handoff.take
    monkeypatch.setattr(handoff.Handoff, "take", lambda self, t, key: taken.append(q := real_take(self, t, key)) or q)
    cfg = tiny_config(num_moe_experts=None, moe_router_topk=None, moe_ffn_hidden_size=None,
                      params_dtype=torch.bfloat16, bf16=True, use_te_activation_func=activation_module)
    recipe = Recipe(strict=strict)
    tokens, labels = (t.cuda() for t in lm_batch(2))
    pos = torch.arange(32, device="cuda").unsqueeze(0).expand(4, -1)

    def run():
        model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe).cuda()
        loss = model(tokens, pos, causal_mask(32).cuda(), labels=labels).float().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_fused, grads_fused = run()
    assert sum(q is not None for q in taken) == (6 if activation_module else 4), taken
    if strict:
        monkeypatch.setattr(MiniteNorm, "forward", lambda self, x: self._norm(x))
        monkeypatch.setattr(MiniteActivation, "forward", lambda self, x: self.activation(x))
        loss_plain, grads_plain = run()
        assert torch.equal(loss_fused, loss_plain)
        if not activation_module:
            for n in grads_fused:
                assert torch.equal(grads_fused[n], grads_plain[n]), n
