"""The gloo job of ``test_refit_sharded``: one unsharded learner and its TP / EP re-shardings.

Rank 0 and 1 build the Qwen3-MoE-shaped tiny GPT on the minite spec at TP = EP = 1 (the
reference), save it with Megatron's distributed checkpointing, then for each layout rebuild it
sharded, load the checkpoint (Megatron re-shards: TP splits, the SwiGLU fc1 interleave, the
expert split) and gather the learner's weights on rank 0. Rank 0 returns, per layout, the
gathered Megatron-named weights, their ``export_tensors`` and the :class:`GatherStats`, next to
the reference's (in a ``torch.save`` file) (and writes the reference export, whose ``config.json`` the vLLM side parses).
"""

from __future__ import annotations

import os

LAYOUTS = {
    "tp2": dict(tp=2, ep=1, etp=2, sp=True),  # experts tensor-parallel too (Megatron's default etp = tp)
    "ep2": dict(tp=1, ep=2, etp=1, sp=False),
    "tp2_ep2": dict(tp=2, ep=2, etp=1, sp=True),  # MoE parallel folding: one TP group, one EP group
}
REF = dict(tp=1, ep=1, etp=1, sp=False)
SPEC = "minite_megatron.specs:get_gpt_decoder_block_minite_spec"


def _strip(weights: dict) -> dict:
    """Drop the BF16 images the weight caches attach (not part of the exported bytes)."""
    from dataclasses import replace

    from minite_megatron.nvfp4 import NVFP4Tensor

    return {k: replace(v.linear(), image=None) if isinstance(v, NVFP4Tensor) else v.clone() for k, v in weights.items()}


def gather_job(rank: int, world_size: int, *, work_dir: str, layouts: list[str]) -> str:
    """Returns the path of a ``torch.save`` file holding this rank's results (NVFP4 tensors hold
    float8 storages, which the harness's pickle round trip under Megatron does not carry)."""
    import torch
    import torch.distributed as dist

    from minite_megatron.export import export_modelopt
    from minite_megatron.export.gather import gather_learner_weights, learner_weights
    from minite_megatron.export.modelopt import export_tensors
    from minite_megatron.recipe import Recipe
    from tests.megatron._parallel_harness import _build, _load, _save

    recipe = Recipe()
    kw = {"recipe": recipe}
    weights_dir = os.path.join(work_dir, "weights")
    cfg, ref = _build(REF, SPEC, kw, {})
    _save(ref, weights_dir)
    out: dict = {}
    if rank == 0:
        w = learner_weights(ref)
        out["ref"] = {"weights": _strip(w), "tensors": export_tensors(w, cfg, recipe)}
        export_modelopt(os.path.join(work_dir, "export"), w, cfg, recipe, rope_theta=1e6, max_position_embeddings=64)
        out["export_dir"] = os.path.join(work_dir, "export")
    del ref
    for name in layouts:
        cfg, model = _build(LAYOUTS[name], SPEC, kw, {})
        _load(model, weights_dir)
        got, stats = gather_learner_weights(model)
        if rank == 0:
            out[name] = {"weights": _strip(got), "tensors": export_tensors(got, cfg, recipe), "stats": stats}
        else:
            assert got is None
            out[name] = {"stats": stats}
        del model
        dist.barrier()
    path = os.path.join(work_dir, f"result{rank}.pt")
    torch.save(out, path)
    return path
