"""Gloo workers of the converter's multi-process tests (run by ``tests.megatron._dist.run_distributed``)."""

from __future__ import annotations

import os

LAYOUTS = {
    "tp2": dict(tp=2, ep=1, pp=1),  # + sequence parallelism (Megatron needs it for MoE under TP)
    "ep2": dict(tp=1, ep=2, pp=1),
    "pp2": dict(tp=1, ep=1, pp=2),
    "tp2_minite": dict(tp=2, ep=1, pp=1, impl="minite"),  # NVFP4 linears, amaxes synced over TP
    "pp2_dense": dict(tp=1, ep=1, pp=2, model="dense"),  # layer-stacked keys; tied head on the last stage
}


def import_worker(rank: int, world_size: int, *, hf_dirs: dict[str, str], layouts: list[str], out_dir: str) -> dict:
    """For each layout: set Megatron's parallel state, import ``hf_dirs[model]`` (its spec, FP32), record
    the bytes this rank read, write the model as a torch_dist checkpoint and as HF safetensors,
    and (without PP) its logits on a fixed batch. Rank 0 returns {layout: {...}}."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from minite_megatron.convert import build_gpt_from_hf, load_hf_weights, save_hf_checkpoint
    from minite_megatron.convert.hf_files import HFCheckpoint
    from minite_megatron.convert.megatron_checkpoint import save_torch_dist

    from .conftest import megatron_logits, tokens

    results = {}
    for name in layouts:
        lay = LAYOUTS[name]
        hf_dir = hf_dirs[lay.get("model", "moe")]
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"],
                                     expert_model_parallel_size=lay["ep"], expert_tensor_parallel_size=1)
        model = build_gpt_from_hf(hf_dir, impl=lay.get("impl", "local"), dtype=torch.float32, seed=1234,
                                  config_overrides={"parallel_output": False}).eval()
        report = load_hf_weights(model, hf_dir)  # again, to see what this rank reads
        read = [None] * world_size
        dist.all_gather_object(read, report.bytes_read)
        save_torch_dist(model, os.path.join(out_dir, name), HFCheckpoint(hf_dir).config)
        save_hf_checkpoint(model, os.path.join(out_dir, name + "_hf"), hf_dir)
        logits = megatron_logits(model, tokens()) if lay["pp"] == 1 else None
        results[name] = {"bytes_read": read, "logits": logits}
        dist.barrier()
    return results if rank == 0 else {}
