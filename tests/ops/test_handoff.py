"""The producer -> linear handoff: the norm's quantized output is taken by the qkv / fc1 linear
from the slot the spec gave both, only when it is provably the same tensor and the same
quantization, and a model computes the same numbers with it as without it."""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.backends import ReferenceBackend
from minite_megatron.ops import handoff
from minite_megatron.recipe import Recipe

KEY = ("row", "propagate", "reference")


def _q(t):
    return nvfp4.quantize_reference(t, global_scale="row", with_image=True)


def test_take_matches_the_offered_storage_only():
    slot, other = handoff.Handoff(Recipe()), handoff.Handoff(Recipe())
    y = torch.randn(4, 8, 32)
    q = _q(y.reshape(-1, 32))
    slot.offer(y, q, KEY)
    assert other.take(y.reshape(-1, 32), KEY) is None  # another pair's slot: nothing offered there
    assert slot.take(y.reshape(-1, 32), KEY) is q  # a view of the same [M, K] matrix
    assert slot.take(y.reshape(-1, 32), KEY) is None  # taken once
    slot.offer(y, q, KEY)
    assert slot.take(torch.randn(32, 32), KEY) is None  # another tensor: no match, and the stale
    assert slot._offer is None  # offer is dropped (it held the producer's output alive)


def test_take_refuses_a_changed_tensor_or_another_quantization():
    slot = handoff.Handoff(Recipe())
    y = torch.randn(16, 32)
    slot.offer(y, _q(y), KEY)
    y.mul_(2)  # in-place change after the offer
    assert slot.take(y, KEY) is None
    slot.offer(y, _q(y), KEY)
    assert slot.take(y, ("row", "raise", "reference")) is None
    slot.offer(y, _q(y), KEY)
    assert slot.take(y[:, :16].contiguous(), KEY) is None
    slot.offer(y, _q(y), KEY)
    assert slot.take(y.t(), KEY) is None  # not contiguous


def test_the_spec_gives_each_producer_and_its_linear_one_slot():
    """Each norm / SwiGLU -> NVFP4 linear pair of a layer shares one ``Handoff``, its own (no
    module-global or thread-local state); BF16 linears get none."""
    from minite_megatron.specs import get_gpt_layer_minite_spec

    def slots(spec):
        sub = spec.submodules
        attn, mlp = sub.self_attention.submodules, sub.mlp.keywords["submodules"]
        pairs = [(sub.input_layernorm, attn.linear_qkv), (sub.pre_mlp_layernorm, mlp.linear_fc1),
                 (mlp.activation_func, mlp.linear_fc2)]
        for producer, consumer in pairs:
            assert producer.keywords["offer_to"] is consumer.keywords["handoff"]
        assert attn.linear_proj.keywords["handoff"] is None
        return [p.keywords["offer_to"] for p, _ in pairs]

    a, b = slots(get_gpt_layer_minite_spec(Recipe())), slots(get_gpt_layer_minite_spec(Recipe()))
    assert all(isinstance(h, handoff.Handoff) for h in a) and len({id(h) for h in a + b}) == 6
    assert slots(get_gpt_layer_minite_spec(Recipe(), layer_in_bf16=True)) == [None, None, None]


#: a dense tiny model (every MLP feeds NVFP4 linears)
DENSE = dict(num_moe_experts=None, moe_router_topk=None, moe_ffn_hidden_size=None)


def _loss_and_grads(cfg, step: int = 0):
    """One forward + backward of a tiny minite GPT (default recipe): ``(loss, {name: grad})``."""
    from tests.megatron.minite_tiny import build_gpt, causal_mask, init_single_process, lm_batch

    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    init_single_process()
    tokens, labels = lm_batch(step)
    pos = torch.arange(32).unsqueeze(0).expand(4, -1)
    model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, Recipe()), finalize_recipe=Recipe())
    loss = model(tokens, pos, causal_mask(32), labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_run(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


def test_producers_hand_over_their_quantization_and_nothing_changes(monkeypatch):
    """The norms in front of qkv / fc1 and the SwiGLU in front of fc2 (the minite activation
    module: ``use_te_activation_func``) hand their quantization to the NVFP4 linear: 6 handoffs
    in 2 dense layers, and the same loss and gradients as without the handoff."""
    from tests.megatron.minite_tiny import tiny_config

    taken = []
    real_take = handoff.Handoff.take

    def spy(self, t, key):
        q = real_take(self, t, key)
        taken.append(q is not None)
        return q

    monkeypatch.setattr(handoff.Handoff, "take", spy)
    cfg = tiny_config(use_te_activation_func=True, **DENSE)
    with_handoff = _loss_and_grads(cfg)
    # 2 layers x (input norm -> qkv, pre-MLP norm -> fc1, SwiGLU -> fc2): every one taken
    assert taken.count(True) == 6, taken
    taken.clear()
    monkeypatch.setattr("minite_megatron.modules.norm.MiniteNorm.forward", lambda self, x: self._norm(x))
    monkeypatch.setattr("minite_megatron.modules.activation.MiniteActivation.forward",
                        lambda self, x: self.activation(x))
    without = _loss_and_grads(cfg)
    assert not any(taken)
    _assert_same_run(with_handoff, without)


def test_norm_offers_nothing_under_sequence_parallelism():
    from minite_megatron.modules.norm import MiniteNorm

    from tests.megatron.minite_tiny import tiny_config

    cfg = tiny_config(tensor_model_parallel_size=2, sequence_parallel=True)
    assert MiniteNorm(cfg, 64, offer_to=handoff.Handoff(Recipe())).offer_to is None
    assert MiniteNorm(tiny_config(), 64, offer_to=handoff.Handoff(Recipe())).offer_to is not None


@pytest.mark.parametrize("nonfinite", ["propagate", "raise"])
def test_fused_norm_falls_back_to_the_module_norm_on_the_reference_backend(nonfinite):
    from minite_megatron.ops.producers import fused_supported

    x = torch.randn(2, 32, dtype=torch.bfloat16)
    for op in ("rmsnorm_quantize", "swiglu_quantize"):
        assert not fused_supported(op, x, Recipe(nonfinite=nonfinite), ReferenceBackend())


@pytest.mark.parametrize("moe", [False, True])
def test_the_minite_activation_module_computes_megatrons_activation(moe):
    """The same model with Megatron's inline activation (``use_te_activation_func=False``) and with
    the minite module in every MLP (dense, shared experts, grouped experts): identical loss and
    gradients."""
    from tests.megatron.minite_tiny import tiny_config

    extra = dict(moe_shared_expert_intermediate_size=32) if moe else DENSE
    inline, module = (_loss_and_grads(tiny_config(use_te_activation_func=m, **extra), step=1) for m in (False, True))
    _assert_same_run(inline, module)


@pytest.mark.parametrize(
    "recompute",
    [dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     dict(recompute_granularity="selective", recompute_modules=["mlp"])],
)
def test_handoff_under_activation_recompute(recompute):
    """Recomputed layers offer and take again in the backward; the loss and the gradients are
    those of the run without recompute, bit for bit. (Megatron 0.19.2's selective "layernorm"
    recompute needs Transformer Engine whatever the spec: its CheckpointWithoutOutput always
    takes the FP8 path.)"""
    from tests.megatron.minite_tiny import tiny_config

    plain, recomputed = (_loss_and_grads(tiny_config(use_te_activation_func=True, **DENSE, **kw))
                         for kw in ({}, recompute))
    _assert_same_run(plain, recomputed)
