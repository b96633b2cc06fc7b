"""Start a few processes (gloo on CPUs, NCCL on GPUs), run one function in each, collect results.

``run_distributed("pkg.module:function", world_size, backend="gloo", **kwargs)`` starts
``world_size`` fresh processes (``spawn``), activates the CPU compatibility layer when there is no
GPU (and, on GPUs, gives rank r the device r), applies the launcher's run-time fixes
(:func:`minite_megatron.launch.prepare`), initializes ``torch.distributed``, calls
``function(rank, world_size, **kwargs)`` and returns the list of the ranks' return values
(pickled through files). A failing rank fails the caller with its traceback. The target is named
by a dotted path so that anyone can pass their own worker.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set by it) :func:`run_in_this_process`
does the same set-up in the current process instead of spawning.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import tempfile
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve(path: str):
    """``"pkg.mod:attr"`` (or ``"pkg.mod.attr"``) -> the object."""
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _set_up(rank: int, world_size: int, backend: str, local_rank: int) -> None:
    for name in [k for k in os.environ if k.startswith("NVTE_")]:
        del os.environ[name]  # Megatron exports these per attention backend; the parent's must not leak
    import logging

    import torch
    import torch.distributed as dist

    from minite_megatron.launch import prepare

    logging.getLogger("megatron").setLevel(logging.WARNING)  # Megatron logs every bucket at INFO

    prepare()  # CPU layer (no GPU only), the megatron.training fixes, the upstream patches
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)  # tiny models on a shared 2-core machine: no thread-pool contention
        if backend == "nccl":
            raise RuntimeError("backend nccl needs CUDA GPUs; this machine has none (use gloo)")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size)


def _entry(rank: int, world_size: int, port: int, target: str, kwargs: dict, out_dir: str, backend: str) -> None:
    for name in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        del os.environ[name]  # spawned from a torchrun rank: rendezvous on our own port, not torchrun's store
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    out = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        _set_up(rank, world_size, backend, rank)
        result = resolve(target)(rank, world_size, **kwargs)
        with open(out, "wb") as fh:
            pickle.dump(("ok", result), fh)
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        with open(out, "wb") as fh:
            pickle.dump(("error", traceback.format_exc()), fh)
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(target: str, world_size: int, backend: str = "gloo", **kwargs):
    """Run ``target(rank, world_size, **kwargs)`` on ``world_size`` fresh ranks; list of results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="minite_dist_") as out_dir:
        try:
            mp.start_processes(
                _entry,
                args=(world_size, free_port(), target, kwargs, out_dir, backend),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is reported below
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} of {target} died without a result")
            with open(path, "rb") as fh:
                status, value = pickle.load(fh)
            if status != "ok":
                raise AssertionError(f"rank {rank} of {target} failed:\n{value}")
            results.append(value)
        return results


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_in_this_process(target: str, backend: str = "gloo", **kwargs):
    """Under torchrun: set this rank up and run ``target(rank, world_size, **kwargs)`` here."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _set_up(rank, world_size, backend, int(os.environ.get("LOCAL_RANK", rank)))
    return resolve(target)(rank, world_size, **kwargs)


def init_single_process() -> None:
    """In this process: the CPU layer (no GPU), torch.distributed (gloo, world 1) and Megatron's
    model-parallel state (TP=EP=1); idempotent. Leaves them initialized (other tests reuse them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from minite_megatron import cpu_compat

    cpu_compat.activate()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
