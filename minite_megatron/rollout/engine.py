"""Rollout engine: generation with per-token log-probs on the learner's own Megatron model.

:class:`RolloutEngine` samples continuations of token-id prompts with the learner's modules,
kernels and weights, and returns each token's log-prob as the learner's
:func:`~minite_megatron.rollout.logprobs.teacher_forced_logprobs` computes it. Two paths:

* **fast** (default wherever it can run, :mod:`.support`): the learner's forward as a batched
  prefill into a static KV cache, then a decode step per token that walks the model's modules
  on fixed-address copies of their quantized weights (:mod:`.decode_step`), MoE tokens routed
  straight to the grouped decode GEMM, sampling and log-probs on the device -- on a GPU the
  whole step is one CUDA-graph replay per batch bucket (:mod:`.fast_path`, :mod:`.cuda_graphs`).
* **megatron**: Megatron-Core's ``StaticInferenceEngine`` loop (:mod:`.megatron_path`), used
  where the fast path cannot run (pipeline or tensor parallelism, a module it does not know)
  or when asked for (``fast=False``).

One log line says which path runs and why. Both score tokens with
:func:`~minite_megatron.rollout.logprobs.token_logprobs`: raw log-probs by default,
``logprobs="sampled"`` at the sampling temperature; in strict mode both equal the learner's
teacher-forced log-probs bit for bit.

Why not Megatron-Core 0.19.2's own inference CUDA graphs (``cuda_graph_impl="local"``,
``CudaGraphManager``)? Read from its code: in static batching a graph is keyed by
``(batch, decode-only)`` only, while the static context slices the KV cache and the RoPE table
with a Python ``sequence_len_offset`` that changes every step (``key = memory[:sequence_end]``)
-- a replayed graph would attend to the wrong length; the MoE token dispatcher and grouped MLP
read ``tokens_per_expert`` on the host (``.tolist()``), which no graph may do; sampling and
log-probs run outside the graphed layers with host syncs per step; and its dynamic engine (whose
graphs are keyed by padded batch dimensions) needs flash-attn's ``flash_attn_with_kvcache``,
absent on the H200 image, bypasses the layer's ``core_attention`` (so strict attention cannot
run there) and returns log-probs of the filtered distribution. The fast path therefore captures
its own step.

Weights: the fast path copies a new weight version into its buffers at the start of every
``generate`` (an identity test per weight otherwise: the learner's caches are keyed on the
optimizer step and the parameters' version counters), so the trainer calls nothing after an
optimizer step. After replacing parameters some other way (``param.data = ...``) call
:meth:`RolloutEngine.sync_weights`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from megatron.core.utils import get_attr_wrapped_model

from ..ops.trace_hook import active_tracer
from .logprobs import model_is_strict
from .rollout import Rollout

log = logging.getLogger(__name__)

__all__ = ["Rollout", "RolloutEngine"]


class RolloutEngine:
    """Generation with per-token log-probs on a Megatron ``GPTModel`` (see the module docstring).

    Args:
        model: the learner's ``GPTModel`` (any spec; strict modules give strict log-probs), or a
            wrapper of one (``Float16Module``, DDP); one pipeline stage, any TP (TP > 1 runs
            Megatron's path, logits gathered).
        eod_id: end-of-document token: padding and, unless ``stop_at_eod=False``, termination.
        max_batch_size: sequences per static batch (larger requests are split).
        max_sequence_length: KV-cache length, prompt + new tokens (default: the model's).
        strict: batch-invariant log-softmax (default: :func:`model_is_strict`).
        fast: ``None`` (the fast path where it can run, else Megatron's), ``True`` (raise
            ValueError with the reason if it cannot), ``False`` (Megatron's path).
        cuda_graphs: capture the fast path's decode step (default: on a GPU, where the model
            allows; :func:`.support.graph_refusal`).
        attention: the fast path's decode attention: ``"module"`` (each layer's own
            ``core_attention``, as the learner runs it) or ``"sdpa"`` (torch's
            ``scaled_dot_product_attention``; not allowed in strict mode).
        invariant_gemm: in default mode, decode GEMMs in the learner's accumulation order (the
            batch-invariant tensor-core configurations, strict mode's) instead of the fast decode
            kernels (default: False -- the MoE experts on the integer-dot kernel, the dense GEMMs
            split-K: 0.89 vs 2.79 ms per decode step at batch 8 on the H200, with the default-mode
            gap 0 there too, BENCHMARKS.md run 11).
        fused_kernels: the fast path's fused decode kernels (:mod:`.fused_ops`; default True);
            False: the learner's modules and the ops' torch references only, the same bits (tests
            and ``benchmarks.rollout`` compare the two).
        kernels_on_cpu: on a CPU model, the fused decode kernels of the Triton backend under
            ``TRITON_INTERPRET=1`` (tests, ``benchmarks.kernels._decode_count``); default False: a
            CPU runs the references.
    Raises:
        ValueError for an ``eod_id`` outside the vocabulary, bad options, or ``fast=True`` where
        the fast path cannot run.
    """

    def __init__(self, model, *, eod_id: int, max_batch_size: int = 8, max_sequence_length: int | None = None,
                 strict: bool | None = None, fast: bool | None = None, cuda_graphs: bool | None = None,
                 attention: str = "module", invariant_gemm: bool = False, fused_kernels: bool = True,
                 kernels_on_cpu: bool = False):
        from .support import fast_path_refusal, graph_refusal

        self.model = model
        self.vocab_size = int(get_attr_wrapped_model(model, "vocab_size"))
        if not 0 <= eod_id < self.vocab_size:
            raise ValueError(f"eod_id {eod_id} outside the vocabulary [0, {self.vocab_size})")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if attention not in ("module", "sdpa"):
            raise ValueError(f"attention must be 'module' or 'sdpa', got {attention!r}")
        self.eod_id = eod_id
        self.max_batch_size = max_batch_size
        self.max_sequence_length = int(max_sequence_length or get_attr_wrapped_model(model, "max_sequence_length"))
        self.strict = model_is_strict(model) if strict is None else strict
        if attention == "sdpa" and self.strict:
            raise ValueError("attention='sdpa' is not batch invariant: strict mode uses the model's own attention")
        why = None if fast is False else fast_path_refusal(model)
        if fast and why is not None:
            raise ValueError(f"RolloutEngine(fast=True): the fast path cannot run this model: {why}")
        self.path = "fast" if (fast is not False and why is None) else "megatron"
        self._megatron = None
        self._fast = None
        if self.path == "fast":
            device = next(model.parameters()).device
            no_graphs = graph_refusal(model, device)
            if cuda_graphs and no_graphs is not None:
                raise ValueError(f"RolloutEngine(cuda_graphs=True): {no_graphs}")
            use_graphs = no_graphs is None if cuda_graphs is None else bool(cuda_graphs)
            from .fast_path import FastGenerator

            self._fast = FastGenerator(
                model, eod_id=eod_id, vocab_size=self.vocab_size, max_batch_size=max_batch_size,
                max_sequence_length=self.max_sequence_length, strict=self.strict, use_graphs=use_graphs,
                attention=attention, invariant_gemm=bool(invariant_gemm), fused_kernels=bool(fused_kernels),
                kernels_on_cpu=bool(kernels_on_cpu),
            )
            graphs = "CUDA graphs per batch bucket" if use_graphs else f"eager decode steps ({no_graphs or 'cuda_graphs=False'})"
            log.info("RolloutEngine: fast path (static KV cache, %s%s)", graphs, ", strict" if self.strict else "")
        else:
            reason = "fast=False" if fast is False else why
            log.info("RolloutEngine: Megatron's static inference engine (%s)", reason)
            self._megatron_generator()
        self.path_reason = None if self.path == "fast" else ("fast=False" if fast is False else why)

    def _megatron_generator(self):
        if self._megatron is None:
            from .megatron_path import MegatronGenerator

            self._megatron = MegatronGenerator(
                self.model, eod_id=self.eod_id, vocab_size=self.vocab_size, max_batch_size=self.max_batch_size,
                max_sequence_length=self.max_sequence_length, strict=self.strict,
            )
        return self._megatron

    def sync_weights(self) -> None:
        """Make the fast path read the model's current weights now (it does so by itself at every
        ``generate``; call this after replacing parameters other than in place)."""
        from .resident import is_resident
        from .support import unwrap_gpt

        if is_resident(unwrap_gpt(self.model)):
            raise ValueError("RolloutEngine.sync_weights: this model's NVFP4 weights are frozen (built by "
                             "rollout.resident.build_resident_gpt; it holds no BF16 weights to re-quantize)")
        if self._fast is not None:
            from ..ops.weight_cache import invalidate_weight_caches

            invalidate_weight_caches()
            self._fast.sync_weights()

    def _check(self, prompts, max_new_tokens, temperature, top_k, top_p):
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not (temperature >= 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
        if top_k < 0 or top_k >= self.vocab_size:
            raise ValueError(f"top_k must lie in [0, {self.vocab_size}), got {top_k}")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"top_p must lie in [0, 1], got {top_p}")
        if top_k > 0 and top_p > 0.0:
            raise ValueError("use top_k or top_p, not both (Megatron's sampler refuses the combination)")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
            if len(p) + max_new_tokens > self.max_sequence_length:
                raise ValueError(
                    f"prompt {i}: {len(p)} + {max_new_tokens} new tokens exceed max_sequence_length {self.max_sequence_length}"
                )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 0.0,
        seed: int = 0,
        stop_at_eod: bool = True,
        logprobs: str = "raw",
    ) -> list[Rollout]:
        """Sample continuations of ``prompts`` (token ids; mixed lengths in one batch).

        ``temperature=0`` means greedy (argmax). ``top_k`` and ``top_p`` filter the sampling
        distribution (not both). ``seed`` seeds the sampling generator: the same call gives the
        same rollouts. ``logprobs``: ``"raw"`` (log-softmax of the logits) or ``"sampled"``
        (log-softmax of ``logits / temperature``; greedy counts as temperature 1). Returns one
        :class:`Rollout` per prompt, in order.

        Raises ValueError for bad sampling parameters, empty or out-of-vocabulary prompts, or
        sequences longer than ``max_sequence_length``; RuntimeError if the model produced
        non-finite logits (fast path).
        """
        prompts = [list(map(int, p)) for p in prompts]
        self._check(prompts, max_new_tokens, temperature, top_k, top_p)
        if logprobs not in ("raw", "sampled"):
            raise ValueError(f"logprobs must be 'raw' or 'sampled', got {logprobs!r}")
        lp_temperature = float(temperature) if logprobs == "sampled" and temperature > 0 else 1.0
        out: list[Rollout] = []
        if self._fast is not None:
            tracer = active_tracer()
            with torch.no_grad():
                self._fast.sync_weights()
                self._fast.seed(seed)
                for start in range(0, len(prompts), self.max_batch_size):
                    out.extend(self._fast.generate_batch(
                        prompts[start : start + self.max_batch_size], int(max_new_tokens), float(temperature),
                        int(top_k), float(top_p), bool(stop_at_eod), lp_temperature, seq_offset=start, tracer=tracer,
                    ))
            return out
        gen = self._megatron_generator()
        gen.seed(seed)
        for start in range(0, len(prompts), self.max_batch_size):
            out.extend(gen.generate_batch(prompts[start : start + self.max_batch_size], max_new_tokens, temperature,
                                          top_k, top_p, stop_at_eod, lp_temperature, start))
        return out
