"""Rollout engine: Megatron-Core's inference engine on the learner's own model, with raw
per-token log-probs.

:class:`RolloutEngine` wraps Megatron's ``StaticInferenceEngine`` (``legacy=True``: the static
KV-cache batch loop of ``TextGenerationController``) around a ``GPTModel`` built from any spec
(Megatron's local one, miniTE's NVFP4 spec, the strict spec): the same modules, kernels and
weights as the learner. Generation is Megatron's: a prefill up to the shortest prompt, then one
decode step per position for the whole batch (longer prompts are fed their own tokens until
they start generating), a static KV cache, temperature / top-k / top-p sampling from a seeded
generator, termination on EOD.

Log-probs. Megatron's controller computes ``torch.log_softmax`` over the step's logits inline,
which is neither batch invariant nor replaceable without copying its 400-line loop. The engine
instead uses a thin subclass of ``GPTInferenceWrapper`` that sees every forward step's logits
(prefill: all prompt positions; decode: the new position) and, once the next token is known
(the next step's input, or the final tokens), scores it with
:func:`minite_megatron.rollout.logprobs.token_logprobs` -- the very function the learner's
:func:`~minite_megatron.rollout.logprobs.teacher_forced_logprobs` uses. Only one step's logits
are held at a time. By default the log-probs are *raw*: log-softmax of the model's (FP32 in
strict mode) logits before temperature, top-k or top-p. ``generate(..., logprobs="sampled")``
gives the log-probs of the distribution the tokens were drawn from at the sampling temperature,
``log_softmax(logits / temperature)`` (what RL's importance ratio compares, with the learner's
:func:`~minite_megatron.rollout.logprobs.teacher_forced_logprobs` at the same temperature); top-k
/ top-p filtering is not part of either.

The dynamic engine (``DynamicInferenceEngine``) is not used: it needs CUDA, calls flash
attention directly instead of the layer's ``core_attention`` (so strict attention cannot be
plugged in), and returns log-probs of the processed (temperature-scaled, filtered) distribution.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.engines import StaticInferenceEngine
from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.inference.utils import InferenceMode
from megatron.core.utils import get_attr_wrapped_model

from .logprobs import model_is_strict, token_logprobs


@dataclasses.dataclass
class Rollout:
    """One generated sequence.

    ``prompt_tokens`` and ``generated_tokens`` (the sampled continuation; it ends with the EOD
    token when generation stopped there, since RL needs that token's log-prob too);
    ``prompt_log_probs`` fp32 ``[len(prompt) - 1]`` (``log p(prompt[t+1] | prompt[:t+1])``) and
    ``generated_log_probs`` fp32 ``[len(generated)]``, raw (before temperature / top-k / top-p).
    """

    prompt_tokens: list[int]
    generated_tokens: list[int]
    prompt_log_probs: torch.Tensor
    generated_log_probs: torch.Tensor
    finished_by_eod: bool

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def log_probs(self) -> torch.Tensor:
        """fp32 ``[len(tokens) - 1]``: the log-prob of every token after the first."""
        return torch.cat([self.prompt_log_probs, self.generated_log_probs])


class _TokenIdTokenizer:
    """The tokenizer interface Megatron's controller needs when prompts are token ids."""

    def __init__(self, eod: int, vocab_size: int):
        self.eod = eod
        self.bos = None
        self.vocab_size = vocab_size

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, tokens, **_) -> str:
        return " ".join(str(int(t)) for t in tokens)

    def offsets(self, tokens, text):
        out, pos = [], 0
        for t in tokens:
            out.append(pos)
            pos += len(str(int(t))) + 1
        return out


class LogProbGPTInferenceWrapper(GPTInferenceWrapper):
    """``GPTInferenceWrapper`` that scores every generated and prompt token from the logits of the
    forward step that predicted it (see the module docstring).

    After a batch, :meth:`log_probs` returns fp32 ``[B, S - 1]`` for the padded token grid
    ``[B, S]`` of that batch (entry ``t``: log-prob of token ``t + 1``; positions past a row's
    end score whatever the engine wrote there), :attr:`tokens` that grid and :attr:`scored`
    which entries were scored.
    """

    def __init__(self, model, inference_context, *, strict: bool):
        super().__init__(model, inference_context)
        self.strict = strict
        self.logprob_temperature = 1.0  # set per generate() call by the engine
        self._reset()

    def _reset(self):
        self.tokens = None
        self.scored = None
        self._lp = None
        self._window = None
        self._pending = None

    def prep_model_for_inference(self):
        super().prep_model_for_inference()
        self._reset()

    def prep_inference_input(self, prompts_tokens):
        out = super().prep_inference_input(prompts_tokens)
        self.tokens = out["tokens"]  # the controller writes sampled tokens into this grid
        b, s = self.tokens.shape
        self._lp = torch.zeros((b, max(s - 1, 0)), dtype=torch.float32, device=self.tokens.device)
        self.scored = torch.zeros((b, max(s - 1, 0)), dtype=torch.bool, device=self.tokens.device)
        return out

    def get_batch_for_context_window(self, inference_input, context_start_position, context_end_position):
        self._flush()  # the token sampled from the previous step's last logits is now in the grid
        self._window = (context_start_position, context_end_position)
        return super().get_batch_for_context_window(inference_input, context_start_position, context_end_position)

    def run_one_forward_step(self, inference_input, recv_buffer_seq_len=None):
        self._declare_tokens()
        logits = super().run_one_forward_step(inference_input, recv_buffer_seq_len)
        if logits is not None:  # None on pipeline stages before the last one
            self._pending = (self._window, logits)
        return logits

    def _declare_tokens(self):
        """Tell an active diagnostics tracer which (sequence, position) each row of this step is
        (sequences numbered from ``seq_offset`` in request order), so that the rollout's trace
        aligns with the learner's (:meth:`minite_megatron.diagnostics.Tracer.set_tokens`)."""
        from ..diagnostics.capture import active_tracer

        tracer = active_tracer()
        if tracer is None or self._window is None:
            return
        start, end = self._window
        b = self.tokens.shape[0]
        seq = torch.arange(b) + self.seq_offset
        tracer.set_tokens(seq.view(1, b), torch.arange(start, end).view(-1, 1))

    seq_offset = 0

    def _flush(self):
        if self._pending is None:
            return
        (_, end), logits = self._pending
        self._pending = None
        b, length = logits.shape[0], logits.shape[1]
        first = end - length  # logits cover positions first .. end-1, predicting first+1 .. end
        stop = min(end, self.tokens.shape[1] - 1)
        if stop <= first:
            return
        targets = self.tokens[:b, first + 1 : stop + 1]
        self._lp[:b, first:stop] = token_logprobs(
            logits[:, : stop - first], targets, self.strict, self.logprob_temperature
        )
        self.scored[:b, first:stop] = True

    def log_probs(self) -> torch.Tensor:
        """Score the last step's prediction too, and return a normal (non-inference) copy."""
        with torch.inference_mode():
            self._flush()
        return self._lp.clone()


class RolloutEngine:
    """Generation with raw per-token log-probs on a Megatron ``GPTModel``.

    Args:
        model: the learner's ``GPTModel`` (any spec; strict modules give strict log-probs), or a
            wrapper of one (``Float16Module``, DDP); one pipeline stage, any TP (logits gathered).
        eod_id: end-of-document token: padding and, unless ``stop_at_eod=False``, termination.
        max_batch_size: sequences per static batch (larger requests are split).
        max_sequence_length: KV-cache length, prompt + new tokens (default: the model's).
        strict: batch-invariant log-softmax (default: :func:`model_is_strict`).
    """

    def __init__(self, model, *, eod_id: int, max_batch_size: int = 8, max_sequence_length: int | None = None,
                 strict: bool | None = None):
        self.model = model
        self.vocab_size = int(get_attr_wrapped_model(model, "vocab_size"))
        if not 0 <= eod_id < self.vocab_size:
            raise ValueError(f"eod_id {eod_id} outside the vocabulary [0, {self.vocab_size})")
        self.eod_id = eod_id
        self.max_batch_size = max_batch_size
        self.max_sequence_length = int(max_sequence_length or get_attr_wrapped_model(model, "max_sequence_length"))
        self.strict = model_is_strict(model) if strict is None else strict
        context = StaticInferenceContext(max_batch_size, self.max_sequence_length)
        self.wrapper = LogProbGPTInferenceWrapper(model, context, strict=self.strict)
        self.controller = TextGenerationController(self.wrapper, _TokenIdTokenizer(eod_id, self.vocab_size))
        was_active = InferenceMode.is_active()
        self.engine = StaticInferenceEngine(self.controller, max_batch_size=max_batch_size, legacy=True)
        self.engine.random_seed = None  # do not reseed torch's global RNG on every generate
        if not was_active:
            InferenceMode.unset_active()  # only while generating (the learner shares the model)

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
        sequences longer than ``max_sequence_length``.
        """
        prompts = [list(map(int, p)) for p in prompts]
        self._check(prompts, max_new_tokens, temperature, top_k, top_p)
        if logprobs not in ("raw", "sampled"):
            raise ValueError(f"logprobs must be 'raw' or 'sampled', got {logprobs!r}")
        self.wrapper.logprob_temperature = float(temperature) if logprobs == "sampled" and temperature > 0 else 1.0
        if temperature == 0:
            temperature, top_k, top_p = 1.0, 1, 0.0
        params = SamplingParams(
            temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
            return_log_probs=True, num_tokens_to_generate=int(max_new_tokens),
        )
        if not stop_at_eod:
            params.add_attributes({"no_early_termination": True})
        self.controller.sampling_rng.manual_seed(int(seed))
        out: list[Rollout] = []
        for start in range(0, len(prompts), self.max_batch_size):
            self.wrapper.seq_offset = start
            out.extend(self._generate_batch(prompts[start : start + self.max_batch_size], params, stop_at_eod))
        return out

    def _generate_batch(self, prompts, params, stop_at_eod):
        requests = [
            InferenceRequest(request_id=self.engine.get_new_request_id(), prompt="", prompt_tokens=list(p),
                             sampling_params=params)
            for p in prompts
        ]
        with InferenceMode.active():
            done = self.engine.generate(inference_requests=requests)
        lp = self.wrapper.log_probs()
        grid = self.wrapper.tokens
        rollouts = []
        for row, (prompt, req) in enumerate(zip(prompts, done)):
            gen = [int(t) for t in torch.as_tensor(req.generated_tokens).tolist()]
            n_prompt = len(prompt)
            eod = (
                stop_at_eod
                and len(gen) < params.num_tokens_to_generate
                and n_prompt + len(gen) < grid.shape[1]
                and int(grid[row, n_prompt + len(gen)]) == self.eod_id
            )
            if eod:
                gen = gen + [self.eod_id]
            total = n_prompt + len(gen)
            got = [int(t) for t in grid[row, :total].tolist()]
            if got != prompt + gen:
                raise RuntimeError(f"rollout {row}: the engine's token grid does not match its result")
            row_lp = lp[row, : total - 1]
            if not bool(self.wrapper.scored[row, : total - 1].all()):
                raise RuntimeError(f"rollout {row}: a position was never scored (engine step bookkeeping changed?)")
            rollouts.append(
                Rollout(prompt, gen, row_lp[: n_prompt - 1].clone(), row_lp[n_prompt - 1 :].clone(), bool(eod))
            )
        return rollouts
