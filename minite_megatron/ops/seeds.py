"""Seeds of the stochastic-rounding streams: distinct per call, rank and step, and the same in a
run resumed from a checkpoint as in an uninterrupted one.

Under ``megatron.training`` the seed of the n-th stochastic quantization of an iteration is a
hash of (recipe seed, iteration, n, global rank): the iteration is restored from the
checkpoint, and the calls of an iteration happen in program order, so a resumed run draws
exactly the seeds of the uninterrupted one (a seed drawn from a shared generator would be
shifted by whatever else consumed it, e.g. building a data loader after a checkpoint load).
Distinct ranks get distinct streams, so data-parallel replicas do not round alike.

Outside ``megatron.training`` (plain loops, tests, the RL example) the seed is drawn from
torch's default CPU generator: reproducible under ``torch.manual_seed``, no device sync.
"""

from __future__ import annotations

import torch

from .. import nvfp4
from ..nvfp4.stochastic import fmix32

_STATE = {"iteration": None, "n": 0}


def _megatron_iteration() -> int | None:
    try:
        from megatron.training import global_vars
    except Exception:  # megatron.training unavailable
        return None
    args = global_vars._GLOBAL_ARGS
    it = getattr(args, "curr_iteration", None) if args is not None else None
    return int(it) if it is not None else None


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _mix(*words: int) -> int:
    h = 0  # Python ints: the same uint32 arithmetic as on int64 tensors, without a torch op per word
    for w in words:
        h = fmix32((h + (w & 0xFFFFFFFF) + 0x9E3779B9) & 0xFFFFFFFF)
    return h & 0x7FFFFFFF


def next_sr_seed(recipe_seed: int) -> int:
    """The seed of the next stochastic-rounding quantization (see the module docstring)."""
    it = _megatron_iteration()
    if it is None:
        return nvfp4.draw_seed()
    if _STATE["iteration"] != it:
        _STATE.update(iteration=it, n=0)
    n = _STATE["n"]
    _STATE["n"] += 1
    return _mix(recipe_seed, it, n, _rank())
