"""CUDA graphs of the decode step, one per (batch bucket, sampling settings).

:class:`StepGraphs` captures ``body()`` -- a decode step that reads and writes only static
buffers (tokens, positions, done mask, output grid, KV cache, fixed-address weights) -- into a
``torch.cuda.CUDAGraph`` the first time a (bucket, key) pair is asked for, and replays it after.
All graphs share one memory pool (they never run concurrently and keep no live outputs). The
sampling generator is registered with every graph (``register_generator_state``), so each replay
draws fresh noise from it and ``generator.manual_seed`` between replays reseeds the graphs too.

Capture protocol (PyTorch's): two warm-up runs on a side stream (Triton compiles its kernels,
cuBLAS creates its workspaces), then the capture; the warm-ups mutate the static buffers, so the
caller sets the real state up *after* :meth:`get` returns, and they draw noise from the
generator, whose state is restored afterwards (a first call draws what later calls with the same
seed draw). A graph's noise has its bucket's shape: sampled tokens depend on the bucket (the
same call, bucket and seed give the same rollouts; greedy tokens never depend on it). While warming up and capturing, the
runner's :meth:`~.decode_step.DecodeModel.capturing` context is active.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepGraphs:
    """Captured decode steps keyed by ``(bucket, key)`` (see the module docstring)."""

    def __init__(self, generator: torch.Generator | None, capturing: Callable):
        self.generator = generator
        self.capturing = capturing
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()

    def get(self, key, body: Callable[[], None], reset: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """The graph of ``key``, captured from ``body`` if new (``reset()`` puts the static buffers in
        a valid state before each warm-up run)."""
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        # the warm-ups draw sampling noise: put the generator back where the caller seeded it
        rng_state = self.generator.get_state() if self.generator is not None else None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with self.capturing(), torch.cuda.stream(stream):
            for _ in range(2):
                reset()
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        reset()
        with self.capturing(), torch.cuda.graph(graph, pool=self.pool):
            body()
        if rng_state is not None:
            self.generator.set_state(rng_state)
        self._graphs[key] = graph
        return graph
