"""One whole learner forward + backward captured as a CUDA graph and replayed (issue 24).

:func:`why_not_graphable` says, without touching CUDA, why a model and recipe cannot be graphed
(None where they can); :class:`GraphedStep` captures one step of a fixed token count and replays
it. What a captured graph freezes, and so what is refused:

* every MoE layer whose dispatcher answers ``why_host_counts``: the token counts go to the host
  (a wait, and host ints that size the permutation), which capture forbids;
* expert parallelism: the all-to-all takes its split sizes on the host.

Stochastic rounding: the captured quantizations read their seeds from device memory
(``ops.seeds.device_seeds``: a slot per stochastic quantization of the step, listed by the last
warm-up step), and :meth:`GraphedStep.step` draws the eager step's seeds on the host, in its
order, and copies them there before each replay: a replay rounds with the bits of the eager step
it stands for (also under ``megatron.training``, whose seeds hash the iteration).

Strict mode: its MoE layers keep the token counts on the device (the batch-invariant grouped
GEMMs take them there with the host counts' bits), and its router's NaN check, a host wait
eagerly, becomes a device flag per MoE layer (``invariant.topk.nan_checks_on_device``), which
:meth:`GraphedStep.step` reads after the replay: one wait per step instead of one per MoE layer,
and a step that routed NaN raises before its gradients can be applied.

Weights: the quantized-weight caches (``ops.weight_cache``) are invalidated before capture, so
the quantize kernels are part of the graph and every replay quantizes the weights as they are
then (an optimizer step that writes the parameters in place -- every torch / Megatron optimizer
does -- is seen by the next replay; a parameter *replaced* by a new tensor is not: capture again).

Autograd state: the tensors with autograd history that modules keep after their forward
(Megatron's token dispatchers keep the routing probabilities) are released before the warm-up,
after each warm-up step and after capture (:func:`release_step_tensors`), so the captured step
makes its own gradient accumulators on the capture stream; the last warm-up step checks that
every accumulator ran on the warm-up stream and otherwise names the parameters, one line.

Gradients: set to None before capture, so each parameter's ``.grad`` is a static output of the
graph, written (not accumulated) by each replay -- the eager step from grads set to None. Keep
them (do not set them to None) between replays; read them after :meth:`GraphedStep.step`.
"""

from __future__ import annotations

from typing import Callable

import torch


def why_not_graphable(model: torch.nn.Module, recipe, device: torch.device | str) -> str | None:
    """None if one forward + backward of ``model`` under ``recipe`` on ``device`` can be captured
    as a CUDA graph (module docstring), else the reason, one line. Touches no CUDA state."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (got {device})"
    config = getattr(model, "config", None)
    if config is not None and (getattr(config, "expert_model_parallel_size", 1) or 1) > 1:
        return "expert parallelism: the all-to-all takes its split sizes on the host"
    dtype = torch.bfloat16 if config is None else config.params_dtype
    for name, module in model.named_modules():
        dispatcher = getattr(module, "token_dispatcher", None)  # an MoE layer's (not a module: not walked)
        if dispatcher is None:
            continue
        where = f"{name}.token_dispatcher" if name else "token_dispatcher"
        why_host = getattr(dispatcher, "why_host_counts", None)
        if not callable(why_host):
            return (f"{where}: {type(dispatcher).__name__} takes the MoE token counts to the host "
                    "(--moe-token-dispatcher-type alltoall keeps them on the device)")
        why = why_host(dtype, device)
        if why is not None:
            return f"{where}: the MoE token counts go to the host ({why})"
    return None


def release_step_tensors(model: torch.nn.Module) -> list[str]:
    """Drop the tensors with autograd history that modules keep as attributes after their forward
    (Megatron's token dispatchers keep the routing probabilities: ``local_probs``, ``probs``) and
    return their names. Call between steps only (each forward sets them afresh).

    Why a graph needs it: a kept tensor keeps the autograd graph above it, and with it the gradient
    accumulators of every parameter below it; the next forward reuses those live accumulators, so
    they keep the stream of the step that made them, for good. The backward of a captured step then
    makes that stream (the legacy default stream after one eager step) wait on the capture, which
    CUDA refuses (``cudaErrorStreamCaptureImplicit``); pytorch/pytorch#164302."""
    released: list[str] = []

    def release(obj, path: str, depth: int) -> None:
        for attr, value in list(vars(obj).items()):
            if isinstance(value, torch.Tensor):
                if value.grad_fn is not None:
                    setattr(obj, attr, None)
                    released.append(f"{path}.{attr}" if path else attr)
            elif depth < 2 and not isinstance(value, (torch.nn.Module, type)) and hasattr(value, "__dict__") \
                    and type(value).__module__.split(".")[0] in ("megatron", "minite_megatron"):
                release(value, f"{path}.{attr}" if path else attr, depth + 1)  # a dispatcher, its comm manager

    for name, module in model.named_modules():
        release(module, name, 0)
    return released


def _foreign_accumulators(loss: torch.Tensor, stream: "torch.cuda.Stream", names: dict[int, str]) -> list[str]:
    """Hooks on every gradient accumulator of ``loss``'s graph that record, when its backward runs,
    whether it runs on ``stream``; the list of those that did not is filled by the backward."""
    foreign: list[str] = []
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo += [next_fn for next_fn, _ in node.next_functions]
        variable = getattr(node, "variable", None)
        if variable is not None:
            def check(_grads, variable=variable):
                if torch.cuda.current_stream() != stream:
                    foreign.append(names.get(id(variable), f"a tensor of shape {tuple(variable.shape)}"))
            node.register_prehook(check)
    return foreign


class CaptureGuards:
    """What a minite step needs around its CUDA-graph capture and replays, for both graph paths
    (:class:`GraphedStep`, ``full_iteration_graph.MiniteFullIterationGraph``); the module docstring
    says why each is needed.

    Made right before the capture from the last warm-up step's stochastic quantizations
    (``drawn``, :func:`ops.seeds.recording`): empties the quantized-weight caches (the quantize
    kernels are captured). :meth:`captured` wraps the captured body (device seed slots, the
    router's NaN checks as one device flag); :meth:`after_capture` checks the body drew every slot
    and empties the caches again; :meth:`before_replay` writes the seeds an eager step would draw;
    :meth:`check_routing` raises after a replay that routed NaN (``who`` opens each message)."""

    def __init__(self, drawn: list[int], device: torch.device, who: str):
        from ..ops import seeds
        from ..ops.weight_cache import invalidate_weight_caches

        invalidate_weight_caches()
        self.who = who
        self.slots = seeds.DeviceSeedSlots(drawn, device)
        self.nan: torch.Tensor | None = None  # set by the captured body: NaN routed in a replay

    def captured(self, body: Callable) -> Callable:
        """``body`` as the capture must run it: its stochastic quantizations take the device seed
        slots, and the NaN checks of its routers become one device flag, computed by every replay."""
        from ..invariant.topk import nan_checks_on_device
        from ..ops import seeds

        def run(*args, **kwargs):
            with seeds.device_seeds(self.slots), nan_checks_on_device() as flags:
                out = body(*args, **kwargs)
                self.nan = torch.stack(flags).any() if flags else None
            return out

        return run

    def after_capture(self) -> None:
        from ..ops.weight_cache import invalidate_weight_caches

        self.slots.check_taken(self.who)
        invalidate_weight_caches()  # an eager step after this one quantizes afresh (the graph's pool is its own)

    def before_replay(self) -> None:
        self.slots.refill()  # this step's stochastic-rounding seeds, as an eager step draws them

    def check_routing(self, what: str, consequence: str) -> None:
        """After a replay: ValueError if strict routing saw NaN (one wait per step)."""
        if self.nan is not None and bool(self.nan):
            raise ValueError(f"{self.who}: NaN in the routing scores of {what} (strict mode refuses to route them; "
                             f"{consequence})")


class GraphedStep:
    """One forward + backward of ``loss_fn(tokens, labels)`` (a scalar loss of ``model``) for
    inputs of the shapes of ``tokens`` / ``labels``, captured once and replayed by :meth:`step`.

    ``warmup``: eager iterations on a side stream before capture (lazy state, autotuning,
    allocator pools)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, tokens: torch.Tensor, labels: torch.Tensor,
                 *, recipe=None, warmup: int = 3):
        from ..ops import seeds
        from ..ops.weight_cache import invalidate_weight_caches

        why = why_not_graphable(model, recipe, tokens.device)
        if why is not None:
            raise ValueError(f"GraphedStep: cannot graph this step: {why}")
        self.model, self.loss_fn = model, loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.static_tokens, self.static_labels = tokens.clone(), labels.clone()
        names = {id(p): n for n, p in model.named_parameters()}
        release_step_tensors(model)  # the accumulators of an earlier (default-stream) step go with them
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(max(1, warmup)):
                self._set_grads_none()
                invalidate_weight_caches()
                with seeds.recording() as drawn:  # the stochastic quantizations of one step, in order
                    loss = loss_fn(self.static_tokens, self.static_labels)
                    stale = _foreign_accumulators(loss, side, names) if i == max(1, warmup) - 1 else None
                    loss.backward()
                del loss
                release_step_tensors(model)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if stale:
            raise RuntimeError(
                "GraphedStep: the gradient accumulators of " + ", ".join(stale[:6])
                + (f" (+{len(stale) - 6} more)" if len(stale) > 6 else "")
                + " were made on another stream and are still held: a tensor with autograd history of an earlier "
                "step is kept outside the modules (release_step_tensors drops what modules keep), e.g. a loss kept "
                "from an eager step; drop it before graphing")
        self._set_grads_none()
        self.guards = CaptureGuards(drawn, tokens.device, "GraphedStep")

        def body():
            loss = loss_fn(self.static_tokens, self.static_labels)
            loss.backward()
            return loss

        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            loss = self.guards.captured(body)()
        self.guards.after_capture()
        self.static_loss = loss.detach()
        del loss
        release_step_tensors(model)  # the captured graph's autograd nodes are not kept by the modules
        self.static_grads = [p.grad for p in self.params]
        self.replays = 0
        torch.cuda.synchronize()

    def _set_grads_none(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Copy ``tokens`` / ``labels`` into the static buffers and replay; the loss (a static
        tensor: clone it to keep it past the next replay). The gradients are in ``.grad``."""
        if tokens.shape != self.static_tokens.shape or labels.shape != self.static_labels.shape:
            raise ValueError(f"GraphedStep.step: tokens {tuple(tokens.shape)} / labels {tuple(labels.shape)}: the graph "
                             f"was captured for {tuple(self.static_tokens.shape)} / {tuple(self.static_labels.shape)}")
        for p, g in zip(self.params, self.static_grads):
            if p.grad is not g:
                raise RuntimeError("GraphedStep.step: a parameter's .grad was replaced since capture "
                                   "(keep the graph's gradients; do not set them to None between replays)")
        self.static_tokens.copy_(tokens)
        self.static_labels.copy_(labels)
        self.guards.before_replay()
        self.graph.replay()
        self.replays += 1
        self.guards.check_routing(f"replay {self.replays}", "do not apply this step's gradients")
        return self.static_loss
