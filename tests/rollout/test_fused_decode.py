"""The decode step's fused kernels (``rollout.fused_ops``: q/k norm + RoPE + KV-cache write, MoE
routing, weighted SwiGLU -> NVFP4, the sorted expert rows, the combine, the residual add fused
into the next RMSNorm -> NVFP4) inside the engine.

Pinned here, on the CPU with the kernels forced under the interpreter (``kernels_on_cpu=True``) and
the batch-invariant ops on their Triton kernels (``settings.overridden(strict_backend="triton")``, what
a GPU runs): a decode step through the fused kernels gives bitwise the logits and KV cache of
the unfused step on the learner's modules, in default (aligned) and strict mode; and the
routing reference is the router module's own output. The kernels' own contracts are in
tests/kernels/triton/decode/test_qk_norm_rope.py, test_moe_route.py, test_triton_producers.py and
test_residual_norm.py.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron.rollout import fused_ops
from minite_megatron.testing import assert_bitwise_equal

INTERPRETING = __import__("os").environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _tiny(strict: bool, seed: int = 3, backend: str = "reference", layers: int = 1):
    """``layers`` MoE layers of the tiny preset in bf16; NVFP4 GEMMs on the reference backend (the
    interpreted Triton GEMMs would take minutes and are tested on their own)."""
    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import PRESETS, build_gpt

    preset = dict(PRESETS["tiny"], vocab=64, layers=layers)
    return build_gpt(preset, Recipe(strict=strict, backend=backend), max_seq=16, device="cpu",
                     dtype=torch.bfloat16, seed=seed).eval()


def _two_decode_steps(runner, cache):
    """Two greedy decode steps of the 3 prompts from ``cache`` (filled to position 4): the logits
    of each and the KV cache after them."""
    tokens, positions = torch.tensor([3, 1, 4]), torch.tensor([4, 4, 4])
    logits = []
    for _ in range(2):
        logits.append(runner.step(tokens, positions, cache))
        tokens, positions = logits[-1].argmax(-1), positions + 1
    return logits, [t.clone() for t in cache.k + cache.v]


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_fused_decode_step_equals_the_unfused_step(monkeypatch, strict):
    """Prefill 3 prompts, then two decode steps each way from the same cache -- a CPU's choice (the
    references), ``fused_kernels=False`` (none, even with ``kernels_on_cpu``) and the fused kernels
    (``kernels_on_cpu=True``): logits and every layer's keys and values bitwise equal (and the
    fused path really ran its kernels, the others none: two layers, so the residual add is fused
    into the second layer's input norm, each pre-MLP norm and the final norm). The data
    are fixed: under the interpreter the routing kernel's ``exp`` is numpy's, which gives torch's
    CPU bits on them (tests/kernels/triton/moe/test_moe_route.py compares exactly that)."""
    from minite_megatron.rollout.decode_step import DecodeModel, KVCache
    from minite_megatron.settings import overridden
    from minite_megatron.training.presets import init_single_process

    init_single_process(1)
    model = _tiny(strict, layers=2)
    runners = {"cpu": DecodeModel(model, invariant_gemm=True),
               "off": DecodeModel(model, invariant_gemm=True, fused_kernels=False, kernels_on_cpu=True),
               "fused": DecodeModel(model, invariant_gemm=True, kernels_on_cpu=True)}
    assert runners["cpu"].fused.name == "reference" and runners["off"].fused is None
    assert runners["fused"].fused.name == "triton"
    runner = runners["cpu"]
    prompts = torch.tensor([[5, 17, 33, 2], [9, 8, 7, 6], [11, 22, 1, 3]])
    launched = []
    import minite_kernels.triton.moe.moe_route as mr
    import minite_kernels.triton.nvfp4.norm_quantize as nq
    import minite_kernels.triton.decode.qk_norm_rope as qk

    for mod, name in ((mr, "moe_route"), (qk, "qk_norm_rope_cache"), (nq, "add_rmsnorm_quantize")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **k: (launched.append(_n), _fn(*a, **k))[1])
    with overridden(strict_backend="triton"), torch.no_grad():
        outs, launches = {}, {}
        prefilled = KVCache(runner.num_layers, 16, 3, runner.groups, runner.head_dim, torch.bfloat16, "cpu")
        runner.prefill(prompts, prefilled)
        for name, runner in runners.items():
            launched.clear()
            cache = KVCache(runner.num_layers, 16, 3, runner.groups, runner.head_dim, torch.bfloat16, "cpu")
            for dst, src in zip(cache.k + cache.v, prefilled.k + prefilled.v):
                dst.copy_(src)
            outs[name] = _two_decode_steps(runner, cache)
            launches[name] = list(launched)
    assert launches["cpu"] == launches["off"] == []
    assert {"moe_route", "qk_norm_rope_cache", "add_rmsnorm_quantize"} <= set(launches["fused"])
    # per fused step: layer 1's input norm falls back (the reference GEMM backend has no fused
    # producer to match), the two pre-MLP norms and the final norm fuse
    assert launches["fused"].count("add_rmsnorm_quantize") == 2 * 3, launches["fused"]
    for name in ("off", "fused"):
        for i, (a, b) in enumerate(zip(outs["cpu"][0], outs[name][0])):
            assert_bitwise_equal(b, a, f"{name}: step {i} logits")
        for i, (a, b) in enumerate(zip(outs["cpu"][1], outs[name][1])):
            assert_bitwise_equal(b, a, f"{name}: cache {i}")


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")
def test_routed_experts_read_the_norms_quantization_by_token(monkeypatch):
    """Default mode with the NVFP4 GEMMs on the Triton backend (a GPU's choice): the pre-MLP norm's
    fused NVFP4 of the T tokens goes to the routed experts' fc1, which reads each (token, expert)
    row's token row by index (``decode_grouped_gemm(..., a_rows=)``) instead of gathering and
    quantizing the T * k rows, and the MoE combine runs inside the final norm's kernel
    (``add_rmsnorm_quantize(..., combine=)``, no ``moe_sum_rows``): two decode steps' logits and KV
    cache bitwise those of the step on the learner's modules (``fused_kernels=False``)."""
    from minite_kernels.triton.backend import TritonBackend

    from minite_megatron.rollout.decode_step import DecodeModel, KVCache
    from minite_megatron.settings import overridden
    from minite_megatron.training.presets import init_single_process

    init_single_process(1)
    model = _tiny(False, backend="triton", layers=1)
    calls, combines = [], []
    real = {name: getattr(TritonBackend, name) for name in ("decode_grouped_gemm", "add_rmsnorm_quantize", "moe_sum_rows")}

    def spy_gemm(self, *a, **k):
        calls.append(k.get("a_rows") is not None)
        return real["decode_grouped_gemm"](self, *a, **k)

    def spy_norm(self, *a, **k):
        combines.append("in the norm" if k.get("combine") is not None else "none")
        return real["add_rmsnorm_quantize"](self, *a, **k)

    def spy_sum(self, *a, **k):
        combines.append("moe_sum_rows")
        return real["moe_sum_rows"](self, *a, **k)

    monkeypatch.setattr(TritonBackend, "decode_grouped_gemm", spy_gemm)
    monkeypatch.setattr(TritonBackend, "add_rmsnorm_quantize", spy_norm)
    monkeypatch.setattr(TritonBackend, "moe_sum_rows", spy_sum)
    runners = {"off": DecodeModel(model, fused_kernels=False, kernels_on_cpu=True),
               "fused": DecodeModel(model, kernels_on_cpu=True)}
    prompts = torch.tensor([[5, 17, 33, 2], [9, 8, 7, 6], [11, 22, 1, 3]])
    outs, by_index = {}, {}
    with overridden(strict_backend="triton"), torch.no_grad():
        for name, runner in runners.items():
            cache = KVCache(runner.num_layers, 16, 3, runner.groups, runner.head_dim, torch.bfloat16, "cpu")
            runner.prefill(prompts, cache)
            calls.clear()
            combines.clear()
            outs[name] = _two_decode_steps(runner, cache)
            by_index[name] = (list(calls), list(combines))
    # per step: fc1 by index, fc2 on its own rows; the pre-MLP norm, then the final norm with the combine
    assert by_index["fused"] == ([True, False] * 2, ["none", "in the norm"] * 2), by_index
    assert not any(by_index["off"][0]) and by_index["off"][1] == [], by_index
    for i, (a, b) in enumerate(zip(outs["off"][0], outs["fused"][0])):
        assert_bitwise_equal(b, a, f"step {i} logits")
    for i, (a, b) in enumerate(zip(outs["off"][1], outs["fused"][1])):
        assert_bitwise_equal(b, a, f"cache {i}")


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("offered", [True, False], ids=["offering norm", "plain aligned norm"])
def test_add_then_norm_is_the_bias_dropout_add_then_the_norm(monkeypatch, offered):
    """``decode_step.add_then_norm`` in one kernel gives bitwise the learner's bias-dropout-add
    (Megatron's, inference) then its norm: ``h``, ``y`` and, for a norm feeding an NVFP4 linear
    (Triton backend: the learner's fused RMSNorm -> NVFP4 producer), the quantization it hands
    over; a bias, ``fire`` (hooks) or no fused backend takes the unfused path."""
    from types import SimpleNamespace

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from minite_megatron.modules.norm import MiniteNorm
    from minite_megatron.ops import handoff
    from minite_megatron.ops.linear import backend_for
    from minite_megatron.recipe import Recipe
    from minite_megatron.rollout.decode_step import add_then_norm
    from minite_megatron.settings import overridden
    import minite_kernels.triton.nvfp4.norm_quantize as nq

    recipe = Recipe(backend="triton")
    cfg = SimpleNamespace(normalization="RMSNorm", layernorm_zero_centered_gamma=False, params_dtype=torch.bfloat16,
                          use_cpu_initialization=True, sequence_parallel=False, tensor_model_parallel_size=1)
    slot = handoff.Handoff(recipe) if offered else None
    norm = MiniteNorm(cfg, 256, eps=1e-6, offer_to=slot, aligned=True)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        norm.weight.copy_((torch.rand(256, generator=g) + 0.5).to(torch.bfloat16))
    residual = (torch.randn(2, 3, 256, generator=g) * 4).to(torch.bfloat16)
    out = torch.randn(2, 3, 256, generator=g).to(torch.bfloat16)
    fn = get_bias_dropout_add(False, False)

    def bda(out_with_bias, res):  # Megatron's adds in place into ``out`` in eval mode: on copies
        return fn(tuple(None if t is None else t.clone() for t in out_with_bias), res, 0.0)

    bda.plain = True
    key = handoff.activation_key(recipe, backend_for(recipe, out.device))
    launched = []
    kernel = nq.add_rmsnorm_quantize
    monkeypatch.setattr(nq, "add_rmsnorm_quantize", lambda *a, **k: (launched.append(1), kernel(*a, **k))[1])
    fused = fused_ops.fused_backend(out.device, kernels_on_cpu=True)
    with overridden(strict_backend="triton"), torch.no_grad():
        h_ref = bda((out, None), residual)
        y_ref = norm(h_ref)
        q_ref = slot and slot.take(y_ref, key)
        h, y, _ = add_then_norm(norm, residual, ((out, None), bda), False, fused)
        q = slot and slot.take(y, key)
        assert len(launched) == 1
        add_then_norm(norm, residual, ((out, None), bda), True, fused)
        add_then_norm(norm, residual, ((out, torch.zeros(256, dtype=torch.bfloat16)), bda), False, fused)
        add_then_norm(norm, residual, ((out, None), bda), False, None)
        assert len(launched) == 1, "fire / a bias / no fused backend must take the unfused path"
    assert_bitwise_equal(h, h_ref, "h")
    assert_bitwise_equal(y, y_ref, "y")
    assert (q is None) == (q_ref is None) == (not offered)
    if offered:
        for f in ("codes", "block_scales", "global_decode", "image"):
            assert_bitwise_equal(getattr(q, f), getattr(q_ref, f), f"handed-over {f}")


def test_route_reference_is_the_router_modules_output():
    """``moe_route_reference`` on the aligned router's logits is the router module's forward
    (probabilities and routing map) laid out in Megatron's expert-major order."""
    from minite_megatron.nvfp4.backends import kernel_backend
    from minite_megatron.training.presets import init_single_process

    init_single_process(1)
    model = _tiny(False, seed=5)
    moe = model.decoder.layers[0].mlp
    x = torch.randn(6, 1, moe.router.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        probs, routing_map = moe.router(x)
        logits = moe.router.gating(x.view(6, -1))
    assert fused_ops.route_supported(moe.router, 6, kernel_backend("cpu"))
    route = fused_ops.moe_route_reference(logits, moe.router.topk)
    t, e = routing_map.shape
    order_e, order_t = torch.nonzero(routing_map.t(), as_tuple=True)  # expert-major, tokens in order
    assert_bitwise_equal(route.ids.long(), order_e, "ids")
    assert_bitwise_equal(route.tokens.long(), order_t, "tokens")
    assert_bitwise_equal(route.probs, probs[order_t, order_e], "probs")
    assert_bitwise_equal(route.sizes, routing_map.sum(0).to(torch.int32), "sizes")
    assert_bitwise_equal(route.offsets[1:], torch.cumsum(route.sizes, 0, dtype=torch.int32), "offsets")
    assert int(route.offsets[0]) == 0
    # combine lists each token's rows in increasing expert order
    rows = torch.arange(t * moe.router.topk).view(t, -1)
    assert_bitwise_equal(order_e[route.combine.long()].view(t, -1), torch.sort(order_e[route.combine.long()].view(t, -1), -1).values, "combine")
    assert_bitwise_equal(order_t[route.combine.long()].view(t, -1), rows // moe.router.topk, "combine tokens")


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")
def test_sorted_rows_skip_the_fallbacks_sort():
    """``decode_grouped_gemm(..., group_offsets=)`` on rows already in expert order: the learner's
    grouped-GEMM fallback (a device without verified decode kernels) reads them as they are and
    gives the bits of its sorting path."""
    import minite_kernels.triton.backend as tb
    from minite_megatron import nvfp4
    from minite_megatron.nvfp4.grouped import stack_expert_weights

    g = torch.Generator().manual_seed(0)
    qs = [nvfp4.quantize_reference(torch.randn(32, 64, generator=g), global_scale="tensor", tile=(16, 16))
          for _ in range(4)]
    st = stack_expert_weights(qs)
    ids = torch.tensor([0, 0, 2, 3, 3, 3], dtype=torch.int32)
    a = nvfp4.quantize_reference(torch.randn(6, 64, generator=g), global_scale="row", with_image=True)
    offsets = torch.tensor([0, 2, 2, 3, 6], dtype=torch.int32)
    fallback = tb.TritonBackend(tb.TritonOptions(decode_kernels=False))
    sorted_out = fallback.decode_grouped_gemm(a, st, ids, batch_invariant=True, group_offsets=offsets)
    assert_bitwise_equal(sorted_out, fallback.decode_grouped_gemm(a, st, ids, batch_invariant=True), "fallback")
    assert_bitwise_equal(sorted_out, nvfp4.decode_grouped_gemm_reference(a, st, ids), "reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_gpu_fused_graphs_equal_the_unfused_eager_steps(strict):
    """On the GPU (bf16, Triton backend, CUDA graphs): the fused decode kernels give bitwise the
    tokens and log-probs of the unfused eager steps on the learner's modules, and the learner's
    teacher-forced log-probs: exactly in strict mode, within the issue's 1e-3 mean |dlogp| in
    default mode (aligned ops: only the bf16 LM head's cuBLAS kernel still sums by shape)."""
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs
    from minite_megatron.training.presets import PRESETS, build_gpt, init_single_process
    from minite_megatron.recipe import Recipe

    init_single_process()
    preset = dict(PRESETS["tiny"], vocab=96)
    model = build_gpt(preset, Recipe(strict=strict), max_seq=48, device="cuda", dtype=torch.bfloat16, seed=3).eval()
    prompts = [[5, 17, 33, 2, 71, 9, 12], [64, 7], [11, 22, 33, 44, 55], [90, 1, 4, 9]]
    fused = RolloutEngine(model, eod_id=0, max_batch_size=4).generate(prompts, 12, temperature=1.0, seed=4)
    unfused = RolloutEngine(model, eod_id=0, max_batch_size=4, cuda_graphs=False, fused_kernels=False).generate(
        prompts, 12, temperature=1.0, seed=4)
    for a, b in zip(fused, unfused):
        assert a.tokens == b.tokens
        assert_bitwise_equal(a.log_probs, b.log_probs, "fused vs unfused")
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, [r.tokens for r in fused])
    gaps = torch.cat([(r.log_probs - lp.float().cpu()).abs() for r, lp in zip(fused, learner)])
    if strict:
        assert float(gaps.max()) == 0.0
    else:
        assert float(gaps.mean()) <= 1e-3, f"default-mode mean |dlogp| {float(gaps.mean()):.3g}"
