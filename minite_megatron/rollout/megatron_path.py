"""Megatron-Core's own generation loop: the rollout engine's fallback path.

:class:`MegatronGenerator` wraps Megatron's ``StaticInferenceEngine`` (``legacy=True``: the
static KV-cache batch loop of ``TextGenerationController``) around a ``GPTModel`` built from any
spec (Megatron's local one, miniTE's NVFP4 spec, the strict spec): the same modules, kernels and
weights as the learner. Generation is Megatron's: a prefill up to the shortest prompt, then one
decode step per position for the whole batch (longer prompts are fed their own tokens until
they start generating), a static KV cache, temperature / top-k / top-p sampling from a seeded
generator, termination on EOD. The rollout engine uses it where its CUDA-graph decode path
cannot run (pipeline or tensor parallelism, modules it does not know; :mod:`.support`).

Log-probs. Megatron's controller computes ``torch.log_softmax`` over the step's logits inline,
which is neither batch invariant nor replaceable without copying its 400-line loop. The engine
instead uses a thin subclass of ``GPTInferenceWrapper`` that sees every forward step's logits
(prefill: all prompt positions; decode: the new position) and, once the next token is known
(the next step's input, or the final tokens), scores it with
:func:`minite_megatron.rollout.logprobs.token_logprobs` -- the very function the learner's
:func:`~minite_megatron.rollout.logprobs.teacher_forced_logprobs` uses. Only one step's logits
are held at a time.

The dynamic engine (``DynamicInferenceEngine``) is not used: it needs CUDA, calls flash
attention directly instead of the layer's ``core_attention`` (so strict attention cannot be
plugged in), and returns log-probs of the processed (temperature-scaled, filtered) distribution.
"""

from __future__ import annotations

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

from ..ops.trace_hook import active_tracer
from .logprobs import token_logprobs
from .rollout import Rollout


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


class MegatronGenerator:
    """Batches of rollouts from Megatron's static engine (see the module docstring).

    ``generate_batch(prompts, ...)`` takes at most ``max_batch_size`` prompts; arguments are
    checked by the caller (:class:`~minite_megatron.rollout.engine.RolloutEngine`).
    """

    def __init__(self, model, *, eod_id: int, vocab_size: int, max_batch_size: int, max_sequence_length: int,
                 strict: bool):
        self.eod_id = eod_id
        context = StaticInferenceContext(max_batch_size, max_sequence_length)
        self.wrapper = LogProbGPTInferenceWrapper(model, context, strict=strict)
        self.controller = TextGenerationController(self.wrapper, _TokenIdTokenizer(eod_id, vocab_size))
        was_active = InferenceMode.is_active()
        self.engine = StaticInferenceEngine(self.controller, max_batch_size=max_batch_size, legacy=True)
        self.engine.random_seed = None  # do not reseed torch's global RNG on every generate
        if not was_active:
            InferenceMode.unset_active()  # only while generating (the learner shares the model)

    def seed(self, seed: int) -> None:
        self.controller.sampling_rng.manual_seed(int(seed))

    def generate_batch(self, prompts, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                       stop_at_eod: bool, logprob_temperature: float, seq_offset: int) -> list[Rollout]:
        self.wrapper.logprob_temperature = logprob_temperature
        self.wrapper.seq_offset = seq_offset
        if temperature == 0:
            temperature, top_k, top_p = 1.0, 1, 0.0
        params = SamplingParams(
            temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
            return_log_probs=True, num_tokens_to_generate=int(max_new_tokens),
        )
        if not stop_at_eod:
            params.add_attributes({"no_early_termination": True})
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
