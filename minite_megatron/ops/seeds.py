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

A CUDA graph cannot take host ints that change per step. An eager warm-up step run under
:func:`recording` lists the recipe seeds of its stochastic quantizations, in order; a
:class:`DeviceSeedSlots` built from that list holds one device key per quantization. While the
step is captured (:func:`device_seeds`) each draw returns the next slot (an
:class:`~minite_megatron.nvfp4.DeviceSeed` the kernels read when they run) and
:meth:`DeviceSeedSlots.refill` draws, before every replay, the seeds an eager step would draw
at that point, in the same order, and writes their keys into the slots: a replay rounds with the
eager step's bits, and the draws advance as an eager run's do.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import nvfp4
from ..nvfp4.stochastic import fmix32

_STATE = {"iteration": None, "n": 0, "slots": None, "record": None}


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


def next_sr_seed(recipe_seed: int) -> "int | nvfp4.DeviceSeed":
    """The seed of the next stochastic-rounding quantization (see the module docstring): an int,
    or while a step is captured (:func:`device_seeds`) the next slot of the capture's buffer."""
    slots = _STATE["slots"]
    if slots is not None:
        return slots.take(recipe_seed)
    if _STATE["record"] is not None:
        _STATE["record"].append(int(recipe_seed))
    return _host_seed(recipe_seed)


@contextmanager
def recording():
    """Within: the recipe seeds of the stochastic quantizations drawn (eagerly), in order, are
    appended to the list this yields (one warm-up step's list sizes a :class:`DeviceSeedSlots`)."""
    if _STATE["record"] is not None:
        raise RuntimeError("recording: already recording a step's draws")
    drawn: list[int] = []
    _STATE["record"] = drawn
    try:
        yield drawn
    finally:
        _STATE["record"] = None


def _host_seed(recipe_seed: int) -> int:
    it = _megatron_iteration()
    if it is None:
        return nvfp4.draw_seed()
    if _STATE["iteration"] != it:
        _STATE.update(iteration=it, n=0)
    n = _STATE["n"]
    _STATE["n"] += 1
    return _mix(recipe_seed, it, n, _rank())


class DeviceSeedSlots:
    """One device seed (an int32 key on ``device``) per stochastic quantization of a captured step:
    ``recipe_seeds`` are those of an eager step of the same shapes (:func:`recording`), slot ``i``
    is the ``i``-th quantization, filled by :meth:`refill` before each replay."""

    def __init__(self, recipe_seeds: list[int], device: torch.device | str):
        self.device = torch.device(device)
        self.recipe_seeds = [int(s) for s in recipe_seeds]
        self.keys = torch.zeros(max(len(self.recipe_seeds), 1), dtype=torch.int32, device=self.device)
        self._staging = torch.zeros(self.keys.shape, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._copied = None  # the event after the last staging copy (the staging buffer is reused)
        self.taken = 0

    def take(self, recipe_seed: int) -> "nvfp4.DeviceSeed":
        i, n = self.taken, len(self.recipe_seeds)
        if i >= n:
            raise RuntimeError(f"the captured step draws more than the {n} stochastic-rounding seeds of its "
                               "warm-up step (the number of stochastic quantizations changed between steps)")
        if int(recipe_seed) != self.recipe_seeds[i]:
            raise RuntimeError(f"the captured step's stochastic quantization {i} has recipe seed {int(recipe_seed)}, "
                               f"its warm-up step's {self.recipe_seeds[i]} (the step's quantizations changed)")
        self.taken += 1
        return nvfp4.DeviceSeed(self.keys[i:i + 1])

    def check_taken(self, who: str) -> None:
        """After the capture: every slot was taken (the captured step drew what its warm-up drew)."""
        if self.taken != len(self.recipe_seeds):
            raise RuntimeError(f"{who}: the captured step drew {self.taken} stochastic-rounding seeds, its warm-up "
                               f"step {len(self.recipe_seeds)} (the step's quantizations must not change)")

    def refill(self) -> None:
        """Draw the step's seeds on the host (as an eager step would, in its order) and copy their
        keys into the slots on the current stream (before the replay that reads them)."""
        n = len(self.recipe_seeds)
        if n == 0:
            return
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the staging buffer
        self._staging[:n] = torch.tensor([nvfp4.sr_key(_host_seed(s)) for s in self.recipe_seeds], dtype=torch.int32)
        self.keys[:n].copy_(self._staging[:n], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


@contextmanager
def device_seeds(slots: DeviceSeedSlots):
    """Within: every stochastic-rounding draw takes the next slot of ``slots`` (a capture)."""
    if _STATE["slots"] is not None:
        raise RuntimeError("device_seeds: already recording a step's seeds")
    _STATE["slots"] = slots
    try:
        yield slots
    finally:
        _STATE["slots"] = None
