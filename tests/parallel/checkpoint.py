"""Save and load model + optimizer as ``megatron.training`` does (``torch_dist`` format).

:func:`save` / :func:`load` make the same megatron-core calls as ``megatron.training.checkpointing``
(``generate_state_dict``, ``dist_checkpointing.save/load``, ``load_model_state_dict``,
``optimizer.load_state_dict``) with the same content metadata (``chained_optim_avoid_prefix``;
for the distributed optimizer ``distrib_optim_sharding_type`` = ``dp_reshardable``, Megatron's
default, or ``fully_reshardable``, what ``--dist-ckpt-optim-fully-reshardable`` saves and what
loading into another TP/PP layout needs), without megatron.training's global arguments. Loading
reads the sharding type from the checkpoint's content metadata, as megatron.training does. A
checkpoint is a folder holding the iteration and every model chunk's and the optimizer's state.
"""

from __future__ import annotations

import os


def content_metadata(use_distributed_optimizer: bool, sharding_type: str = "dp_reshardable") -> dict:
    """``_build_sharded_state_dict_metadata`` of megatron.training for this run."""
    from megatron.core import parallel_state as ps

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = sharding_type
        if sharding_type == "fully_reshardable":
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return metadata


def _state_dict(chunks: list, optimizer, metadata: dict, iteration: int | None, is_loading: bool) -> dict:
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(list(chunks))  # what megatron.training saves: the modules inside DDP
    state: dict = {} if iteration is None else {"iteration": iteration}
    for i, chunk in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{i}"] = chunk.sharded_state_dict(metadata=metadata)
    if optimizer is not None:
        kwargs = {"metadata": metadata, "is_loading": True} if is_loading else {"metadata": metadata}
        state["optimizer"] = optimizer.sharded_state_dict(state, **kwargs)
    return state


def _serializable(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if k != "dp_cp_group"}


def save(directory: str, chunks: list, optimizer=None, *, iteration: int = 0, use_distributed_optimizer: bool = False,
         sharding_type: str = "dp_reshardable"):
    """Write ``chunks`` (DDP-wrapped or not) and ``optimizer`` (or None: weights only) to ``directory``."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    metadata = content_metadata(use_distributed_optimizer, sharding_type)
    state = _state_dict(chunks, optimizer, metadata, iteration, is_loading=False)
    dist_checkpointing.save(state, directory, content_metadata=_serializable(metadata))


def load(directory: str, chunks: list, optimizer=None, *, use_distributed_optimizer: bool = False,
         strict_model: bool = True) -> int:
    """Load ``directory`` into ``chunks`` (and ``optimizer``); returns the saved iteration.

    Raises AssertionError naming any model weight the checkpoint lacks (``_extra_state`` aside,
    which the minite modules do not write), unless ``strict_model=False``.
    """
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_content_metadata(directory) or {}
    metadata = content_metadata(use_distributed_optimizer, saved.get("distrib_optim_sharding_type", "dp_reshardable"))
    state = _state_dict(chunks, optimizer, metadata, 0, is_loading=True)
    loaded = dist_checkpointing.load(state, directory)
    from megatron.core.utils import unwrap_model

    for i, module in enumerate(unwrap_model(list(chunks))):
        key = "model" if len(chunks) == 1 else f"model{i}"
        missing, _ = module.load_state_dict(loaded[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing and strict_model:
            raise AssertionError(f"weights missing from checkpoint {directory}: {missing}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    return int(loaded.get("iteration", 0))
