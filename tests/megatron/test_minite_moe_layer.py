"""The default-mode MoE layer skips Megatron's identity token sort and computes the same bits.

Regression (H200, 2026-12-01, BENCHMARKS.md run 7): with one EP and TP rank, Megatron's
all-to-all dispatcher still split the routed tokens into 128 chunks and concatenated them in the
same order, forward and backward: 4.8 ms of a 40.6 ms BF16 training step.
"""

from functools import partial

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from minite_megatron.modules.moe import MiniteMoELayer
from minite_megatron.recipe import Recipe
from minite_megatron.specs import get_gpt_decoder_block_minite_spec
from minite_megatron.testing import assert_bitwise_equal

from .minite_tiny import build_gpt, causal_mask, init_single_process, tiny_config


def _run(layer_cls):
    cfg = tiny_config(num_moe_experts=8, moe_router_topk=3)
    spec = get_gpt_decoder_block_minite_spec(cfg, Recipe(precision="bf16"))
    for layer in spec.layer_specs:
        moe = layer.submodules.mlp
        assert issubclass(moe.func, MoELayer)  # the spec's MoE layer, replaced by the one under test
        layer.submodules.mlp = partial(layer_cls, *moe.args, **moe.keywords)
    model = build_gpt(cfg, spec, vocab=128, seq=32, seed=3)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    loss = model(tokens, pos, causal_mask(16), labels=tokens).mean()
    loss.backward()
    dispatchers = [m.token_dispatcher for m in model.modules() if isinstance(m, MoELayer)]
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, dispatchers


def test_identity_sort_skip_is_bitwise_megatrons_moe_layer():
    init_single_process()
    loss, grads, dispatchers = _run(MiniteMoELayer)
    assert dispatchers and all(d._sort_is_identity() for d in dispatchers)
    ref_loss, ref_grads, _ = _run(MoELayer)
    assert_bitwise_equal(loss, ref_loss, "loss")
    for name in ref_grads:
        assert_bitwise_equal(grads[name], ref_grads[name], name)


def test_deterministic_moe_layer_with_the_combine_kernel_is_bitwise_megatrons():
    """The deterministic combine (Triton kernel, interpreted) and the ordered permutation backward
    give Megatron's loss and every gradient bit for bit on a CPU, where Megatron's
    ``scatter_add_`` / ``index_add_`` add in the same (increasing row) order."""
    from minite_megatron.modules import deterministic_moe as strict_moe

    init_single_process()
    loss, grads, dispatchers = _run(partial(strict_moe.DeterministicMoELayer, kernels_on_cpu=True))
    assert dispatchers and all(isinstance(d, strict_moe.StrictAlltoAllTokenDispatcher) and d.kernels_on_cpu
                               for d in dispatchers)
    ref_loss, ref_grads, _ = _run(MoELayer)
    assert_bitwise_equal(loss, ref_loss, "loss")
    for name in ref_grads:
        assert_bitwise_equal(grads[name], ref_grads[name], name)
