"""Token sampling on the device, without host syncs (CUDA-graph capturable).

:func:`sample_tokens` draws the next token of every row from ``[B, V]`` logits exactly as
Megatron's static engine does (``megatron.core.inference.sampling.torch_sampling.TorchSampling``,
whose ``filter_logits`` it calls: temperature, then top-k *or* top-p filtering; ``top_k == 1``
is the argmax of the raw logits), but replaces ``torch.multinomial(probs, 1)`` by the
computation ATen's multinomial performs for one sample -- ``argmax(probs / Exp(1) noise)``
(the exponential race), the noise drawn with ``exponential_`` from the given generator -- so the
tokens equal Megatron's for the same generator state (tested on the CPU) while skipping
multinomial's host-side check of the probabilities. Non-finite logits are reported through
:func:`nonfinite_rows` instead (the engine raises after the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.inference.sampling.torch_sampling import TorchSampling


@dataclass(frozen=True)
class SamplingConfig:
    """What a decode step samples with (a CUDA graph bakes these values in).

    ``temperature == 0`` means greedy; ``logprob_temperature`` is 1 for raw log-probs or the
    sampling temperature for ``logprobs="sampled"``.
    """

    temperature: float
    top_k: int
    top_p: float
    logprob_temperature: float
    stop_at_eod: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sample_tokens(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
                  vocab_size: int) -> torch.Tensor:
    """int64 ``[B]``: one token per row of ``logits`` ``[B, V]`` (Megatron's sampler, see the
    module docstring). ``generator`` is unused for greedy sampling."""
    if cfg.greedy:
        return torch.argmax(logits, dim=-1)
    filtered = TorchSampling.filter_logits(logits, float(cfg.temperature), int(cfg.top_k), float(cfg.top_p),
                                           vocab_size=vocab_size)
    probs = filtered.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / noise, dim=-1)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: rows of ``[B, V]`` logits holding a NaN or +inf (no host sync)."""
    return torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
