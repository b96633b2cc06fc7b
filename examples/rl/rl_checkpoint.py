"""RL checkpoints with Megatron's ``dist_checkpointing`` (``torch_dist`` format), in Megatron's
layout: ``DIR/iter_0000010/`` plus ``DIR/latest_checkpointed_iteration.txt``.

One checkpoint holds everything a run needs to continue *exactly*:

* ``model``: the policy's sharded state dict (each rank writes its TP / EP shard);
* ``ref_model``: the frozen reference policy, when the run has one (``--kl-coef > 0``);
* ``optimizer``: Megatron's optimizer state (Adam moments, FP32 master weights of BF16 params,
  step counts) and ``opt_param_scheduler`` (the LR schedule);
* ``rng_state``: per rank, Python / NumPy / torch CPU / CUDA generators and Megatron's RNG tracker
  (the NVFP4 stochastic-rounding seeds are drawn from torch's CPU generator);
* ``rl_state`` (common): the RL step reached, the run's seed (prompts, rollout seeds and mini-batch
  shuffles are functions of ``(seed, step)``, so the data position is the step), the model
  architecture and the recipe (both checked on load), and the world size.

``--load`` of a directory whose checkpoint has no ``rl_state`` (``pretrain_gpt.py``'s, or one
written by ``minite-convert hf-to-megatron``) loads the weights only: a starting point.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"


def _rank_world():
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def get_rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_object(state):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = _rank_world()
    return ShardedObject("rl/rng_state", state, (world,), (rank,), replica_id=0)


def _strip(prefix: str, sd: dict) -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def checkpoint_dir(path: str) -> str | None:
    """The torch_dist directory ``path`` names: its latest ``iter_*`` (Megatron's tracker file), or
    ``path`` itself when it holds a checkpoint; None when there is none."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as fh:
            it = fh.read().strip()
        return os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    return None


def save(directory: str, step: int, *, model, optimizer, scheduler, ref_model, rl_state: dict) -> str:
    """Write ``directory/iter_{step}`` on every rank (collective) and update the tracker file."""
    from megatron.core import dist_checkpointing

    rank, world = _rank_world()
    path = os.path.join(directory, f"iter_{step:07d}")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    _barrier()
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = _rng_object(get_rng_state())
    state["rl_state"] = dict(rl_state, step=int(step), world_size=world)
    if ref_model is not None:
        state["ref_model"] = ref_model.sharded_state_dict(prefix="ref_model.")
    dist_checkpointing.save(state, path)
    _barrier()
    if rank == 0:
        with open(os.path.join(directory, TRACKER), "w") as fh:
            fh.write(str(step))
    _barrier()
    return path


def read_rl_state(path: str) -> dict | None:
    """The ``rl_state`` of the checkpoint at ``path`` (a run of this trainer), else None. Raises
    FileNotFoundError when ``path`` holds no checkpoint."""
    from megatron.core import dist_checkpointing

    ckpt = checkpoint_dir(path)
    if ckpt is None:
        raise FileNotFoundError(f"--load {path}: no Megatron checkpoint there (no {TRACKER}, no metadata.json)")
    common = dist_checkpointing.load_common_state_dict(ckpt)
    return common.get("rl_state") if isinstance(common, dict) else None


def load_weights(path: str, model) -> None:
    """Load only the model weights (a foreign checkpoint: a starting point)."""
    from megatron.core import dist_checkpointing

    ckpt = checkpoint_dir(path)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)
    _load_module(model, state["model"], f"--load {path}")


def _load_module(module, sd: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"{what}: the checkpoint lacks {len(missing)} weight(s) of this model, e.g. {missing[:3]}")


def load(path: str, *, model, optimizer, scheduler, ref_model, expect: dict) -> dict:
    """Restore a run of this trainer (collective); returns its ``rl_state``.

    ``expect``: the current run's architecture / recipe / seed; a mismatch raises ValueError naming
    the field (a resumed run must be the same run)."""
    from megatron.core import dist_checkpointing

    ckpt = checkpoint_dir(path)
    rl_state = read_rl_state(path)
    _, world = _rank_world()
    if rl_state.get("world_size") != world:
        raise ValueError(f"--load {path}: saved by {rl_state.get('world_size')} ranks, this run has {world} "
                         "(an exact resume needs the same layout: per-rank RNG streams)")
    for key, value in expect.items():
        if rl_state.get(key) != value:
            raise ValueError(f"--load {path}: the checkpoint's {key} {rl_state.get(key)!r} differs from this run's "
                             f"{value!r}")
    if ref_model is None and rl_state.get("has_ref_model"):
        raise ValueError(f"--load {path}: the checkpoint has a reference model; pass the same --kl-coef")
    if ref_model is not None and not rl_state.get("has_ref_model"):
        raise ValueError(f"--load {path}: the checkpoint has no reference model (it ran with --kl-coef 0)")
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True)
    state["rng_state"] = _rng_object(None)
    if ref_model is not None:
        state["ref_model"] = ref_model.sharded_state_dict(prefix="ref_model.")
    loaded = dist_checkpointing.load(state, ckpt)
    _load_module(model, loaded["model"], f"--load {path}")
    optimizer.load_state_dict(loaded["optimizer"])
    common = dist_checkpointing.load_common_state_dict(ckpt)
    scheduler.load_state_dict(common["opt_param_scheduler"])
    if ref_model is not None:
        _load_module(ref_model, _strip("ref_model.", loaded["ref_model"]), f"--load {path} (reference model)")
    set_rng_state(loaded["rng_state"])
    return rl_state
