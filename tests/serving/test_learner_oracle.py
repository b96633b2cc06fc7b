"""The plugin inside vLLM's own Qwen3-MoE blocks against the learner's own Megatron modules.

One learner (a Megatron GPT on the minite spec, BF16, a dense layer then an MoE layer with 8
experts top-4), its weights exported, vLLM's ``Qwen3MoeSparseMoeBlock`` / ``Qwen3MoeMLP`` /
attention projections / ``RMSNorm`` / LM head built from the export and loaded as vLLM loads
them. The same hidden states go through both; default and strict recipes:

- dense linears (``NVFP4ColumnParallelLinear`` / ``NVFP4RowParallelLinear``) and the whole dense
  MLP (vLLM's ``SiluAndMul`` run eagerly): bitwise;
- router logits (``TopKRouter.gating`` / ``StrictTopKRouter.gating``), the routing
  (``router.routing``, the training forward) and the LM head (``output_layer``): bitwise;
- the MoE block against the learner's MoE layer: strict mode bitwise. Default mode on ``main``
  (Megatron's ``MoELayer``): every expert output row bitwise; the combine differs exactly as
  follows: Megatron's ``scatter_add_`` sums a token's rows in fp32 and rounds once (CPU), the
  plugin adds them in increasing expert order rounding each add to bf16 (the strict combine).
  Both are checked. Where the default layer uses the deterministic combine (the rollout
  branch's ``DeterministicMoELayer``), the block is checked bitwise.
- vLLM's RMSNorm (native forward) equals the learner's ``MiniteNorm`` bitwise.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh runs this in .venv-vllm")

from minite_megatron.export import export_modelopt  # noqa: E402
from minite_megatron.export.gather import learner_weights  # noqa: E402
from minite_megatron.export.rows import qkv_row_ranges  # noqa: E402
from minite_megatron.recipe import Recipe  # noqa: E402
from minite_megatron.serving import numerics  # noqa: E402
from minite_megatron.testing import assert_bitwise_equal  # noqa: E402

from . import _vllm_layers as V  # noqa: E402

H, HEADS, GROUPS, HEAD_DIM, FFN, EXPERTS, TOPK, MOE_FFN, VOCAB = 64, 4, 2, 16, 128, 8, 4, 32, 128


def _learner(recipe: Recipe):
    from minite_megatron.training.presets import build_gpt

    shape = dict(layers=2, hidden=H, heads=HEADS, groups=GROUPS, head_dim=HEAD_DIM, experts=EXPERTS, topk=TOPK,
                 moe_ffn=MOE_FFN, vocab=VOCAB)
    model = build_gpt(shape, recipe, max_seq=64, device="cpu", dtype=torch.bfloat16, seed=0, ffn_hidden_size=FFN,
                      moe_layer_freq=[0, 1], init_method_std=0.05)
    return model.config, model.eval()


@pytest.fixture(scope="module", params=["default", "strict", "unaligned"])
def pair(request, megatron_env, tmp_path_factory):
    """(learner model, vLLM blocks, vLLM config, recipe) on the same exported weights; "unaligned"
    is default mode without the recipe's aligned ops and attention (Megatron's router)."""
    from safetensors.torch import load_file

    recipe = {"default": Recipe(), "strict": Recipe(strict=True),
              "unaligned": Recipe(aligned_ops=False, aligned_attention=False)}[request.param]
    cfg, model = _learner(recipe)
    d = tmp_path_factory.mktemp("oracle")
    export_modelopt(d, learner_weights(model), cfg, recipe, rope_theta=1e6, max_position_embeddings=64)
    vc = V.vllm_config(d)
    root = V.build(vc)
    flat = {}
    for f in sorted(d.glob("model-*.safetensors")):
        flat.update(load_file(str(f)))
    loaded = V.load(root, flat.items())
    assert len(loaded) == len(dict(root.named_parameters())), "a vLLM parameter was not loaded"
    V.finish_loading(root)
    return model, root, vc, recipe


def _x(tokens: int = 9, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    x[0, :16] = 0.0  # a zero block
    x[1] *= 1e3  # per-token scales far apart
    return x


def _megatron(module, x):
    """A Megatron module on ``[T, H]`` as the sequence ``[T, 1, H]``, grad enabled (the training forward)."""
    with torch.enable_grad():
        out = module(x[:, None])
    return (out[0] if isinstance(out, tuple) else out)[:, 0].detach()


def test_dense_linears_and_mlp_equal_the_learners_modules(pair):
    model, root, vc, _ = pair
    dense, moe_layer = model.decoder.layers
    att, mlp = root.model.layers["1"].self_attn, root.model.layers["0"].mlp
    x, xa, xf = _x(), _x(seed=2), torch.randn(9, FFN, generator=torch.Generator().manual_seed(3)).bfloat16()
    with V.running(vc):
        got = {"qkv": att.qkv_proj(x)[0], "proj": att.o_proj(xa)[0], "fc1": mlp.gate_up_proj(x)[0],
               "fc2": mlp.down_proj(xf)[0], "mlp": mlp(x)}
    want = {"qkv": _megatron(moe_layer.self_attention.linear_qkv, x),
            "proj": _megatron(moe_layer.self_attention.linear_proj, xa),
            "fc1": _megatron(dense.mlp.linear_fc1, x), "fc2": _megatron(dense.mlp.linear_fc2, xf),
            "mlp": _megatron(dense.mlp, x)}
    r = qkv_row_ranges(HEADS, GROUPS, HEAD_DIM)  # vLLM's q|k|v vs Megatron's per-group interleave
    want["qkv"] = torch.cat([want["qkv"][:, a:b] for part in "qkv" for a, b in r[part]], dim=1)
    for name in got:
        assert_bitwise_equal(got[name], want[name], name)


def test_router_routing_and_lm_head_equal_the_learners_modules(pair):
    model, root, vc, recipe = pair
    router = model.decoder.layers[1].mlp.router
    x = _x()
    with V.running(vc):
        logits = root.moe.gate(x)[0]
        head = root.lm_head.quant_method.apply(root.lm_head, x)
        probs, rmap = numerics.route(logits, TOPK, True, recipe.strict, invariant=recipe.strict or recipe.aligned_ops)
    with torch.enable_grad():
        want_logits = router.gating(x)
        want_probs, want_map = router.routing(want_logits.detach().view(9, 1, EXPERTS))
    assert logits.dtype == torch.float32
    assert_bitwise_equal(logits, want_logits.detach(), "router logits")
    assert torch.equal(rmap, want_map), "routing map"
    assert_bitwise_equal(probs, want_probs.detach(), "routing probs")
    assert_bitwise_equal(head, _megatron(model.output_layer, x), "lm head")


def test_moe_block_equals_the_learners_moe_layer(pair):
    """Strict: bitwise. Default on main: expert rows bitwise, then each side's combine (docstring)."""
    from minite_megatron.modules.deterministic_moe import deterministic_unpermute

    model, root, vc, recipe = pair
    layer = model.decoder.layers[1].mlp
    x = _x()
    rows_seen = []
    hook = layer.experts.register_forward_hook(lambda mod, args, out: rows_seen.append(out[0].detach()))
    try:
        want = _megatron(layer, x)
    finally:
        hook.remove()
    with V.running(vc):
        got = root.moe(x)
        e = root.moe.experts.routed_experts
        rows, token_of = numerics.moe_expert_rows(x, root.moe.gate(x)[0], e.minite_w13, e.minite_w2, topk=TOPK,
                                                  strict=recipe.strict,
                                                  invariant_routing=recipe.strict or recipe.aligned_ops)
    assert_bitwise_equal(rows, rows_seen[0], "expert outputs (permuted rows)")
    assert_bitwise_equal(got, deterministic_unpermute(rows, token_of, x.shape[0]), "plugin combine")
    if type(layer.token_dispatcher).__module__ == "minite_megatron.modules.deterministic_moe":  # the deterministic combine
        assert_bitwise_equal(got, want, "moe block")
    else:  # Megatron's scatter_add_: fp32 sum per token, one rounding (CPU)
        fp32 = torch.zeros(x.shape[0], H).index_add_(0, token_of, rows.float())
        assert_bitwise_equal(want, fp32.to(torch.bfloat16), "learner combine")
        # the two sums of the same k rows: (k - 1) bf16 roundings of partial sums against one
        absum = torch.zeros(x.shape[0], H).index_add_(0, token_of, rows.float().abs())
        assert bool(((got.float() - want.float()).abs() <= TOPK * 2.0**-8 * absum).all())


def test_rmsnorm_equals_the_learners_norm(pair):
    model, root, vc, _ = pair
    x = _x()
    with V.running(vc):
        got = root.model.layers["1"].input_layernorm(x)
    assert_bitwise_equal(got, _megatron(model.decoder.layers[1].input_layernorm, x), "rmsnorm")


def test_default_mode_routing_sorts_the_top_k_as_the_training_forward():
    """Megatron sorts the top-k only while grad is enabled (``sorted=torch.is_grad_enabled()``);
    the softmax over the k selected logits then sums them in another order. The plugin routes as
    the training forward (sorted) whatever the grad mode; under ``no_grad`` Megatron picks the
    same experts but may round the probabilities differently (qwen3-moe shapes: 128 experts,
    top-8)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.randn(512, 128, generator=torch.Generator().manual_seed(5))
    with torch.enable_grad():
        train_probs, train_map = topk_routing_with_score_function(logits, 8, use_pre_softmax=False)
    with torch.no_grad():
        nograd_probs, nograd_map = topk_routing_with_score_function(logits, 8, use_pre_softmax=False)
        probs, rmap = numerics.route(logits, 8, True, strict=False)
    assert torch.equal(rmap, train_map) and torch.equal(nograd_map, train_map)
    assert_bitwise_equal(probs, train_probs, "plugin routing vs the training forward")


def test_a_nan_token_gives_nan_and_leaves_the_others_alone(pair):
    """Pins: vLLM's profiling forward feeds the MoE garbage (its attention returns an
    uninitialized buffer without metadata); the strict router refused the NaN and killed the
    engine. Now that token's output is NaN, every other token's is what it was."""
    _, root, vc, _ = pair
    x = _x()
    bad = x.clone()
    bad[4] = float("nan")
    with V.running(vc):
        want, got = root.moe(x), root.moe(bad)
    assert bool(torch.isnan(got[4]).all())
    keep = [i for i in range(x.shape[0]) if i != 4]
    assert_bitwise_equal(got[keep], want[keep], "the other tokens")
