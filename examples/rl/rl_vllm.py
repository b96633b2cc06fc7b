"""``--rollout-engine vllm``: the RL loop samples with an in-process ``vllm.LLM`` (minite-vllm plugin).

:class:`VllmRolloutEngine` has the interface of :class:`~minite_megatron.rollout.RolloutEngine`
that the loop uses (``generate``, ``model``, ``sync_weights``). At construction it exports the
learner (``export_modelopt``, the minite variant) and starts ``vllm.LLM`` on it, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, ``logprobs_mode="raw_logits"``: the model's logits
are the learner's log-probs (``minite_megatron.serving.vllm.model``), so the log-prob of each
sampled token that vLLM reports is the learner's. Before every ``generate`` the learner's packed
NVFP4 bytes are refitted into the running engine (``serving.refit.refit_vllm_model``: vLLM's own
``load_weights``, copied into the same storage, never re-quantized). vLLM's scheduler, KV cache and
sampler do the rest. Needs ``.venv-vllm`` (``scripts/setup_vllm_env.sh``).

Limits (each refused with one line): a BF16 learner (``--params-dtype bf16``: vLLM serves BF16
activations), TP = EP = 1, one rank, ``--temperature 1`` (vLLM's raw log-probs are at temperature 1).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile

import numpy as np

import torch

from minite_megatron.rollout.rollout import Rollout


@contextlib.contextmanager
def _caller_rng_preserved():
    """The caller's global torch / numpy / python RNG states, restored on exit. vLLM reseeds all three
    when an ``LLM`` is built (``seed=``), and importing it draws from python's; the learner's draws must
    not shift because an engine exists (``tests/serving/test_rl_vllm_rng.py``)."""
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


class VllmRolloutEngine:
    """``generate`` through ``vllm.LLM`` with a refit of the learner's weights first (module docstring)."""

    def __init__(self, model, recipe, *, eod_id: int, max_batch_size: int, max_sequence_length: int):
        with _caller_rng_preserved():  # the whole construction: vLLM's import and LLM(seed=) included
            self._build(model, recipe, eod_id, max_batch_size, max_sequence_length)

    def _build(self, model, recipe, eod_id: int, max_batch_size: int, max_sequence_length: int) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the refit reaches it
        from megatron.core.utils import get_attr_wrapped_model
        from vllm import LLM

        from minite_megatron.export import export_modelopt
        from minite_megatron.export.gather import learner_weights

        self.model, self.recipe, self.eod = model, recipe, int(eod_id)
        gpt = get_attr_wrapped_model(model, "config", return_model_obj=True)
        self.gpt, self.config = gpt, gpt.config
        if self.config.params_dtype != torch.bfloat16:
            raise ValueError(f"--rollout-engine vllm: the learner's params are {self.config.params_dtype}; vLLM serves BF16 "
                             "activations (pass --params-dtype bf16)")
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError("--rollout-engine vllm: one rank only (TP = EP = DP = 1); the in-process vLLM engine is one replica")
        self.workdir = tempfile.mkdtemp(prefix="minite-rl-vllm-")
        export_modelopt(self.workdir, learner_weights(gpt), self.config, recipe, rope_theta=float(gpt.rotary_base),
                        max_position_embeddings=max_sequence_length)
        self.llm = LLM(model=self.workdir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                       max_model_len=max_sequence_length, max_num_seqs=max_batch_size, seed=0,
                       logprobs_mode="raw_logits", kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
        self.refits = []

    def sync_weights(self) -> None:
        """Nothing to do: every :meth:`generate` refits first."""

    def refit(self):
        """The learner's current bytes into the running engine; returns the :class:`RefitStats`."""
        from minite_megatron.export.gather import learner_weights
        from minite_megatron.export.modelopt import export_tensors
        from minite_megatron.serving.refit import refit_vllm_model

        tensors = export_tensors(learner_weights(self.gpt), self.config, self.recipe)
        stats = self.llm.apply_model(lambda m: refit_vllm_model(m, tensors))[0]
        self.refits.append(stats)
        return stats

    def generate(self, prompts, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
                 seed: int = 0, stop_at_eod: bool = True, logprobs: str = "raw") -> list[Rollout]:
        """:meth:`RolloutEngine.generate`'s arguments (``top_k`` 0 / ``top_p`` 0: off); vLLM's sampler
        draws from its own generator (the LLM's seed), not from ``seed``."""
        if logprobs == "sampled" and temperature != 1.0:
            raise ValueError(f"--rollout-engine vllm: --temperature {temperature}: vLLM reports the log-probs at "
                             "temperature 1 (logprobs_mode raw_logits); use --temperature 1")
        with _caller_rng_preserved():
            return self._generate(prompts, max_new_tokens, temperature, top_k, top_p, stop_at_eod)

    def _generate(self, prompts, max_new_tokens, temperature, top_k, top_p, stop_at_eod) -> list[Rollout]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.refit()
        greedy = temperature == 0
        sp = SamplingParams(max_tokens=int(max_new_tokens), temperature=0.0 if greedy else float(temperature),
                            top_k=int(top_k or 0), top_p=float(top_p) if top_p else 1.0,
                            logprobs=0, detokenize=False, ignore_eos=True,
                            stop_token_ids=[self.eod] if stop_at_eod else None)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        rollouts = []
        for p, o in zip(prompts, outs):
            gen = list(o.outputs[0].token_ids)
            lp = torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, gen)], dtype=torch.float32)
            rollouts.append(Rollout(list(p), gen, torch.zeros(max(len(p) - 1, 0)), lp,
                                    bool(gen) and gen[-1] == self.eod and stop_at_eod))
        return rollouts


__all__ = ["VllmRolloutEngine"]
