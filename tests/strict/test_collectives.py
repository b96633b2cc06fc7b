"""Fixed-order TP reductions on two gloo processes: every rank gets the same bits, a token's
result depends only on its own partials, the strict row-parallel linear at TP=2 equals TP=1
bitwise in fp32 (its per-rank partials are aligned halves of the K tree), and a strict dense GPT
at TP=2 has a learner-vs-rollout gap of exactly 0.0."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.multiproc


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from minite_megatron.invariant.collectives import invariant_all_reduce, invariant_reduce_scatter
    from minite_megatron.nvfp4.tree import tree_sum

    results = {}
    parts = [torch.randn(8, 5, generator=torch.Generator().manual_seed(r)) * 10 ** r for r in range(world)]
    x = parts[rank].clone().requires_grad_()  # (no Megatron yet: the primitives need only torch)
    y = invariant_all_reduce(x)
    results["all_reduce"] = y.detach()
    results["all_reduce_ref"] = tree_sum(torch.stack(parts), dim=0)
    results["all_reduce_rows"] = invariant_all_reduce(parts[rank][2:5])
    y.sum().backward()
    results["all_reduce_grad"] = x.grad
    xs = parts[rank].clone().requires_grad_()
    z = invariant_reduce_scatter(xs)
    results["reduce_scatter"] = z.detach()
    results["reduce_scatter_ref"] = tree_sum(torch.stack([p.view(world, 4, 5)[rank] for p in parts]), dim=0)
    (z * (rank + 1)).sum().backward()
    results["reduce_scatter_grad"] = xs.grad

    # the strict row-parallel linear at TP=2 (fp32): equal to the unsplit strict linear
    from minite_megatron import cpu_compat

    cpu_compat.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from minite_megatron.invariant.matmul import linear
    from minite_megatron.modules.linear import NVFP4RowParallelLinear
    from minite_megatron.recipe import Recipe

    parallel_state.initialize_model_parallel(world, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, tensor_model_parallel_size=world,
                            use_cpu_initialization=True, params_dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    w_full = torch.randn(32, 64, generator=g)
    inp = torch.randn(6, 2, 64, generator=g)
    row = NVFP4RowParallelLinear(64, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                 input_is_parallel=True, skip_bias_add=True, tp_group=dist.group.WORLD,
                                 recipe=Recipe(precision="bf16", strict=True), precision="bf16")
    shard = 64 // world
    with torch.no_grad():
        row.weight.copy_(w_full[:, rank * shard : (rank + 1) * shard])
        out, _ = row(inp[..., rank * shard : (rank + 1) * shard])
    results["row_tp"] = out
    results["row_full"] = linear(inp, w_full)

    # end to end: a strict dense GPT split over 2 TP ranks (heads, MLP columns, vocab)
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tiny_gpt

    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    model = tiny_gpt.build_gpt(True, num_moe_experts=None, moe_ffn_hidden_size=None, tensor_model_parallel_size=world)
    rollouts = RolloutEngine(model, eod_id=tiny_gpt.EOD).generate(tiny_gpt.PROMPTS, max_new_tokens=4, seed=1)
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, [r.tokens for r in rollouts])
    results["tp_rollout"] = [r.log_probs for r in rollouts]
    results["tp_learner"] = learner

    # the same with miniTE's NVFP4 spec in strict mode (NVFP4 row-parallel linears reduce in
    # the fixed order; quantization amaxes are max-reduced over the TP group)
    from megatron.core.models.gpt.gpt_model import GPTModel

    from minite_megatron.model import finalize_gpt_model
    from minite_megatron.recipe import Recipe
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    cfg_fp4 = tiny_gpt.tiny_config(True, torch.float32, num_moe_experts=None, moe_ffn_hidden_size=None,
                                   tensor_model_parallel_size=world)
    recipe = Recipe(strict=True)
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    fp4 = GPTModel(config=cfg_fp4, transformer_layer_spec=get_gpt_decoder_block_minite_spec(cfg_fp4, recipe),
                   vocab_size=tiny_gpt.VOCAB, max_sequence_length=64, position_embedding_type="rope")
    finalize_gpt_model(fp4, recipe).eval()
    rollouts = RolloutEngine(fp4, eod_id=tiny_gpt.EOD).generate(tiny_gpt.PROMPTS, max_new_tokens=4, seed=2)
    with torch.no_grad():
        learner = teacher_forced_logprobs(fp4, [r.tokens for r in rollouts])
    results["tp_fp4_rollout"] = [r.log_probs for r in rollouts]
    results["tp_fp4_learner"] = learner
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fixed_order_reductions_on_two_ranks():
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(_worker, args=(world, init_file, tmp), nprocs=world, start_method="spawn")
        res = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    from minite_megatron.testing import assert_bitwise_equal

    for r in range(world):
        assert_bitwise_equal(res[r]["all_reduce"], res[0]["all_reduce_ref"], f"all-reduce rank {r}")
        assert_bitwise_equal(res[r]["all_reduce_rows"], res[0]["all_reduce_ref"][2:5], f"rows rank {r}")
        assert_bitwise_equal(res[r]["all_reduce_grad"], torch.ones(8, 5))
        assert_bitwise_equal(res[r]["reduce_scatter"], res[r]["reduce_scatter_ref"], f"reduce-scatter rank {r}")
        grad = res[r]["reduce_scatter_grad"]  # all-gather of the per-rank output grads (1, then 2)
        assert_bitwise_equal(grad, torch.cat([torch.full((4, 5), 1.0), torch.full((4, 5), 2.0)]))
        assert_bitwise_equal(res[r]["row_tp"], res[r]["row_full"], f"row-parallel TP=2 vs TP=1, rank {r}")
        for i, (a, b) in enumerate(zip(res[r]["tp_rollout"], res[r]["tp_learner"])):
            assert_bitwise_equal(a, b, f"TP=2 strict gap, rank {r}, sequence {i}")
        for i, (a, b) in enumerate(zip(res[r]["tp_fp4_learner"], res[r]["tp_fp4_rollout"])):
            assert_bitwise_equal(a, b, f"TP=2 strict NVFP4 gap, rank {r}, sequence {i}")
    for a, b in zip(res[0]["tp_rollout"], res[1]["tp_rollout"]):
        assert_bitwise_equal(a, b, "ranks agree")
