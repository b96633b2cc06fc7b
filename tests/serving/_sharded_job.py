"""The gloo job of ``test_refit_sharded``: one unsharded learner and its TP / EP re-shardings.

Rank 0 and 1 build the tiny Qwen3-MoE GPT of :mod:`tests.parallel.model` on the minite spec with
the default recipe (``SPEC``) in the single-process layout (``ref``: TP = EP = 1, the
reference), save it with Megatron's distributed checkpointing (:mod:`tests.parallel.checkpoint`),
then for each layout rebuild it sharded, load the checkpoint (Megatron re-shards: TP splits, the
SwiGLU fc1 interleave, the expert split) and gather the learner's weights on rank 0. Rank 0
returns, per layout, the gathered Megatron-named weights, their ``export_tensors`` and the
:class:`GatherStats`, next to the reference's (in a ``torch.save`` file) (and writes the
reference export, whose ``config.json`` the vLLM side parses).
"""

from __future__ import annotations

import os

LAYOUTS = (
    "tp2_sp_etp2",  # experts tensor-parallel too (Megatron's default etp = tp)
    "ep2",
    "tp2_sp_ep2",  # MoE parallel folding: one TP group (dense part), one EP group (experts), expert TP 1
)
"""Layout names of :mod:`tests.parallel.layouts`, each on two ranks."""
SPEC = "nvfp4_sr"
"""The spec of :data:`tests.parallel.model.SPECS`: the minite spec with the default ``Recipe()``."""


def _strip(weights: dict) -> dict:
    """Drop the BF16 images the weight caches attach (not part of the exported bytes)."""
    from dataclasses import replace

    from minite_megatron.nvfp4 import NVFP4Tensor

    return {k: replace(v.linear(), image=None) if isinstance(v, NVFP4Tensor) else v.clone() for k, v in weights.items()}


def _build(name: str):
    """This rank's ``(config, model)`` of the tiny MoE under layout ``name`` (parallel state set)."""
    from tests.parallel import model as tiny
    from tests.parallel.layouts import parse
    from tests.parallel.train import set_parallel

    layout = parse(name)
    set_parallel(layout)
    config = tiny.transformer_config(layout)
    (model,) = tiny.build_chunks(SPEC, config)
    return config, model


def gather_job(rank: int, world_size: int, *, work_dir: str, layouts: list[str]) -> str:
    """Returns the path of a ``torch.save`` file holding this rank's results (NVFP4 tensors hold
    float8 storages, which the spawner's pickle round trip under Megatron does not carry)."""
    import torch
    import torch.distributed as dist

    from minite_megatron.export import export_modelopt
    from minite_megatron.export.gather import gather_learner_weights, learner_weights
    from minite_megatron.export.modelopt import export_tensors
    from minite_megatron.recipe import Recipe
    from tests.parallel import checkpoint
    from tests.parallel.model import SPECS

    recipe = Recipe.from_dict(SPECS[SPEC]["recipe"])
    weights_dir = os.path.join(work_dir, "weights")
    cfg, ref = _build("ref")
    checkpoint.save(weights_dir, [ref])
    out: dict = {}
    if rank == 0:
        w = learner_weights(ref)
        out["ref"] = {"weights": _strip(w), "tensors": export_tensors(w, cfg, recipe)}
        export_modelopt(os.path.join(work_dir, "export"), w, cfg, recipe, rope_theta=1e6, max_position_embeddings=64)
        out["export_dir"] = os.path.join(work_dir, "export")
    del ref
    for name in layouts:
        cfg, model = _build(name)
        checkpoint.load(weights_dir, [model])
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
