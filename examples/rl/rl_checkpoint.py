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
written by ``minite-convert hf-to-megatron``) loads the weights only: a starting point. A converted
checkpoint also says which model it holds (the HF config the converter stores), so the trainer
builds that model (:func:`inspect`).

Every refusal is a :class:`rl_args.UsageError` naming ``--load`` and the directory.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from rl_args import UsageError

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


def _common(path: str) -> dict:
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise UsageError(f"--load {path}: no such directory")
    ckpt = checkpoint_dir(path)
    if ckpt is None or not os.path.isfile(os.path.join(ckpt, "metadata.json")):
        raise UsageError(f"--load {path}: no Megatron checkpoint there (no {TRACKER}, no metadata.json)")
    try:
        common = dist_checkpointing.load_common_state_dict(ckpt)
    except Exception as e:  # noqa: BLE001 - a torn or foreign directory: say which, in one line
        raise UsageError(f"--load {path}: cannot read the checkpoint's common state ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return common if isinstance(common, dict) else {}


def read_rl_state(path: str) -> dict | None:
    """The ``rl_state`` of the checkpoint at ``path`` (a run of this trainer), else None. Raises
    UsageError when ``path`` holds no checkpoint."""
    return _common(path).get("rl_state")


def inspect(path: str) -> dict:
    """What the checkpoint at ``path`` says about its model: ``rl_state`` (a run of this trainer),
    ``hf_config`` and ``vocab_divisible_by`` (one that ``minite-convert hf-to-megatron`` wrote);
    None where absent. UsageError when there is no checkpoint."""
    common = _common(path)
    args = common.get("args")
    hf_config = common.get("hf_config")
    return {"rl_state": common.get("rl_state"), "hf_config": dict(hf_config) if isinstance(hf_config, dict) else None,
            "vocab_divisible_by": int(getattr(args, "make_vocab_size_divisible_by", 1) or 1)}


def _dist_load(state: dict, ckpt: str, path: str) -> dict:
    """``dist_checkpointing.load``, its refusals (a shape or key this model does not have) in one line."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        return dist_checkpointing.load(state, ckpt)
    except CheckpointingException as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UsageError(f"--load {path}: the checkpoint does not fit this model ({first[:300]}); its model is "
                         "named by --preset / --hf-checkpoint, or read from the checkpoint when it holds an HF "
                         "config (minite-convert hf-to-megatron)") from None


def load_weights(path: str, model) -> None:
    """Load only the model weights (a foreign checkpoint: a starting point)."""
    from megatron.core import dist_checkpointing

    ckpt = checkpoint_dir(path)
    state = _dist_load({"model": model.sharded_state_dict()}, ckpt, path)
    _load_module(model, state["model"], f"--load {path}")


def _load_module(module, sd: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise UsageError(f"{what}: the checkpoint lacks {len(missing)} weight(s) of this model, e.g. {missing[:3]}")


def _load_scheduler(scheduler, state: dict, path: str, override: bool) -> None:
    """Megatron's ``OptimizerParamScheduler.load_state_dict``; where it would assert that a value
    differs (``megatron_wheel`` makes that a ``ScheduleMismatch``), one line naming the flags."""
    from minite_megatron.training.megatron_wheel import ScheduleMismatch

    scheduler.override_opt_param_scheduler = override
    scheduler.use_checkpoint_opt_param_scheduler = False  # megatron.training's default (its constructor's is True)
    try:
        scheduler.load_state_dict(state)
    except ScheduleMismatch as e:
        raise UsageError(f"--load {path}: the checkpoint's LR schedule has {e.name} {e.checkpoint_value} (optimizer "
                         f"steps), this run's flags give {e.run_value} (--steps, --ppo-epochs, --rollout-batch-size, "
                         "--mini-batch-size, --lr*, --weight-decay); add --override-opt-param-scheduler to continue "
                         "with this run's schedule") from None


def load(path: str, *, model, optimizer, scheduler, ref_model, expect: dict,
         override_scheduler: bool = False) -> dict:
    """Restore a run of this trainer (collective); returns its ``rl_state``.

    ``expect``: the current run's architecture / recipe / seed; a mismatch raises UsageError naming
    the field (a resumed run must be the same run). ``override_scheduler``: the LR schedule of this
    run's flags (Megatron's ``--override-opt_param-scheduler``); else a schedule that differs from
    the checkpoint's (e.g. more ``--steps``) is refused, naming that flag."""
    from megatron.core import dist_checkpointing

    ckpt = checkpoint_dir(path)
    rl_state = read_rl_state(path)
    _, world = _rank_world()
    if rl_state.get("world_size") != world:
        raise UsageError(f"--load {path}: saved by {rl_state.get('world_size')} ranks, this run has {world} "
                         "(an exact resume needs the same layout: per-rank RNG streams)")
    for key, value in expect.items():
        if rl_state.get(key) != value:
            raise UsageError(f"--load {path}: the checkpoint's {key} {rl_state.get(key)!r} differs from this run's "
                             f"{value!r}")
    if ref_model is None and rl_state.get("has_ref_model"):
        raise UsageError(f"--load {path}: the checkpoint has a reference model; pass the same --kl-coef")
    if ref_model is not None and not rl_state.get("has_ref_model"):
        raise UsageError(f"--load {path}: the checkpoint has no reference model (it ran with --kl-coef 0)")
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True)
    state["rng_state"] = _rng_object(None)
    if ref_model is not None:
        state["ref_model"] = ref_model.sharded_state_dict(prefix="ref_model.")
    loaded = _dist_load(state, ckpt, path)
    _load_module(model, loaded["model"], f"--load {path}")
    optimizer.load_state_dict(loaded["optimizer"])
    common = dist_checkpointing.load_common_state_dict(ckpt)
    _load_scheduler(scheduler, common["opt_param_scheduler"], path, override_scheduler)
    if ref_model is not None:
        _load_module(ref_model, _strip("ref_model.", loaded["ref_model"]), f"--load {path} (reference model)")
    set_rng_state(loaded["rng_state"])
    return rl_state
