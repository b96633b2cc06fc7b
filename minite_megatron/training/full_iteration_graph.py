"""``--cuda-graph-impl full_iteration`` for the minite layers: Megatron's own full-iteration graph.

Megatron-Core 0.19's training loop wraps its ``forward_backward_func`` in
``megatron.core.full_cuda_graph.FullCudaGraphWrapper`` when ``--cuda-graph-impl full_iteration``
is given: ``--cuda-graph-warmup-steps`` eager iterations, then one capture of every micro-batch's
forward and backward (static input buffers, the shared pool and capture stream, Megatron's RNG
states registered), then a replay per iteration. :class:`MiniteFullIterationGraph` is that class
with the three things a minite step needs around it, the same ones
:class:`~minite_megatron.training.cuda_graphs.GraphedStep` does for a plain loop, both through one
:class:`~minite_megatron.training.cuda_graphs.CaptureGuards`:

* stochastic rounding: the last warm-up iteration lists its stochastic quantizations
  (``ops.seeds.recording``), the capture reads one device seed per quantization
  (``ops.seeds.device_seeds``), and before every replay -- the one right after the capture
  included -- the seeds the eager iteration would draw are written there (Megatron's iteration
  hash: a resumed run rounds as an uninterrupted one);
* strict mode: the router's NaN check is a device flag per MoE layer while captured, read once
  after each replay (a ``ValueError`` before the optimizer applies the step);
* the quantized-weight caches are emptied before and after the capture, so every replay
  quantizes the parameters as the optimizer left them, and the tensors with autograd history
  that modules keep (Megatron's dispatchers keep the routing probabilities) are released before
  it (:func:`~minite_megatron.training.cuda_graphs.release_step_tensors`).

What cannot be captured is refused at the capture, one line (``why_not_graphable``: expert
parallelism, a dispatcher that takes its token counts to the host).
:func:`install` (``minite_megatron.launch.prepare`` calls it) puts the class where
``megatron.training.training`` looks the wrapper up; for a model without minite layers it is Megatron's wrapper (no stochastic
draws, no NaN flags, nothing refused).
"""

from __future__ import annotations

import torch
from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader


class MiniteFullIterationGraph(FullCudaGraphWrapper):
    """Megatron's ``FullCudaGraphWrapper`` with the minite step's seeds, NaN flags and weight
    caches handled around capture and replay (module docstring)."""

    # per stage, like Megatron's graphs and counters: class-level, because Megatron makes a new
    # wrapper per evaluation and replays the validation graph an earlier one captured
    _recorded: dict[str, list[int]] = {}
    _guards: dict[str, object] = {}

    def reset_cuda_graph(self, stage=None):
        """Megatron's reset (the graph, its result and its iteration counter), the static input
        buffers of the graph it drops (a new capture may read other shapes), and this class's seed
        lists and capture guards (seed slots, NaN flag) of ``stage`` (None: both)."""
        super().reset_cuda_graph(stage)
        for s in ("training", "validation") if stage is None else (stage,):
            StaticBufferLoader.static_buffers[s] = []
            for held in (self._recorded, self._guards):
                held.pop(s, None)

    def __call__(self, *args, **kwargs):
        from ..ops import seeds
        from .cuda_graphs import CaptureGuards, release_step_tensors, why_not_graphable

        stage = "validation" if kwargs.get("forward_only") else "training"
        it, warmup = self.curr_iter(stage), self.cuda_graph_warmup_steps
        if it < warmup:  # eager; the last warm-up iteration lists its stochastic quantizations
            if it < warmup - 1:
                return super().__call__(*args, **kwargs)
            with seeds.recording() as drawn:
                result = super().__call__(*args, **kwargs)
            self._recorded[stage] = drawn
            return result
        if it == warmup:  # Megatron captures, then replays once: the seeds must be in place before
            device = torch.device("cuda", torch.cuda.current_device())
            chunks = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
            for chunk in chunks:
                why = why_not_graphable(chunk, None, device)
                if why is not None:
                    raise ValueError(f"--cuda-graph-impl full_iteration cannot capture this model: {why}")
            for chunk in chunks:
                release_step_tensors(chunk)  # kept autograd history would pin the accumulators' stream
            guards = CaptureGuards(self._recorded.get(stage, []), device, "--cuda-graph-impl full_iteration")
            guards.before_replay()  # Megatron replays right after the capture
            inner = self.forward_backward_func
            self.forward_backward_func = guards.captured(inner)
            try:
                result = super().__call__(*args, **kwargs)
            finally:
                self.forward_backward_func = inner
            guards.after_capture()
            self._guards[stage] = guards
        else:
            self._guards[stage].before_replay()
            result = super().__call__(*args, **kwargs)
        if stage in self._guards:
            self._guards[stage].check_routing(f"{stage} iteration {self.curr_iter(stage) - 1}", "the step is not applied")
        return result


_ORIGINAL: dict[str, type] = {}


def install() -> None:
    """Make ``megatron.training.training`` wrap its step in :class:`MiniteFullIterationGraph`
    (idempotent; :func:`uninstall` undoes it)."""
    from megatron.training import training

    _ORIGINAL.setdefault("wrapper", training.FullCudaGraphWrapper)
    training.FullCudaGraphWrapper = MiniteFullIterationGraph


def uninstall() -> None:
    from megatron.training import training

    if "wrapper" in _ORIGINAL:
        training.FullCudaGraphWrapper = _ORIGINAL.pop("wrapper")
