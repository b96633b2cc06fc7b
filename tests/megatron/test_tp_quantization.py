"""Quantization does not depend on the tensor-parallel layout (2 processes, gloo).

Pins: a rank quantizing its shard with its own amax would write other bytes than the unsharded
weight/activation (learner at TP=2 vs a sampler at TP=1, and an export that cannot merge shards).
With the amax max-reduced over the TP group, every shard equals the matching slice of the
unsharded quantization, bitwise, and a column-parallel output equals the unsharded output's
columns bitwise.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from .minite_tiny import free_port

pytestmark = pytest.mark.multiproc


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from minite_megatron import cpu_compat

    cpu_compat.activate()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from minite_megatron import nvfp4
    from minite_megatron.modules.linear import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear
    from minite_megatron.recipe import Recipe
    from minite_megatron.testing import assert_bitwise_equal

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, tensor_model_parallel_size=world)
    recipe = Recipe(grad_stochastic_rounding=False, wgrad_rht=False)
    init = torch.nn.init.normal_
    torch.manual_seed(3)
    col = NVFP4ColumnParallelLinear(64, 96, config=cfg, init_method=init, bias=False, recipe=recipe,
                                    keep_master_weight_for_test=True)
    row = NVFP4RowParallelLinear(96, 64, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                                 skip_bias_add=True, recipe=recipe, keep_master_weight_for_test=True)
    w_col, w_row = col.master_weight, row.master_weight  # the unsharded weights, identical on all ranks

    g = torch.Generator().manual_seed(11)
    x = torch.randn(24, 64, generator=g)
    x[3] *= 1000.0  # rows with very different scales
    y, _ = col(x.unsqueeze(1))
    full = nvfp4.gemm(nvfp4.quantize(x), nvfp4.quantize(w_col, "tensor", (16, 16)), out_dtype=torch.float32)
    shard = slice(rank * 48, (rank + 1) * 48)
    assert_bitwise_equal(y.squeeze(1), full[:, shard], f"rank {rank}: column-parallel output")

    # row-parallel: the weight shard and the activation shard are slices of the unsharded ones
    q_full = nvfp4.quantize(w_row, "tensor", (16, 16))
    q_shard = row.quantized_weight()
    codes_full = nvfp4.unpack_e2m1(q_full.codes)[:, rank * 48 : (rank + 1) * 48]
    assert_bitwise_equal(nvfp4.unpack_e2m1(q_shard.codes), codes_full, f"rank {rank}: row weight codes")
    assert_bitwise_equal(q_shard.global_decode, q_full.global_decode, f"rank {rank}: row weight scale")
    h = torch.randn(24, 96, generator=g)
    h[5, :48] *= 50.0  # the row amax lives on rank 0 only
    out, _ = row(h[:, shard].unsqueeze(1))
    want = nvfp4.gemm(nvfp4.quantize(h), q_full, out_dtype=torch.float32)
    exact, bound = nvfp4.fp32_accumulation_bound(nvfp4.quantize(h), q_full)
    err = (out.squeeze(1).double() - exact).abs()
    assert bool((err <= 2 * bound + 1e-30).all()), f"rank {rank}: row-parallel output off the unsharded one"
    assert torch.allclose(out.squeeze(1), want, rtol=1e-5, atol=1e-5)
    dist.barrier()
    dist.destroy_process_group()


def test_tp2_quantization_equals_unsharded(tmp_path):
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
