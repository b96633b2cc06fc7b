"""The result type of the rollout engine."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Rollout:
    """One generated sequence.

    ``prompt_tokens`` and ``generated_tokens`` (the sampled continuation; it ends with the EOD
    token when generation stopped there, since RL needs that token's log-prob too);
    ``prompt_log_probs`` fp32 ``[len(prompt) - 1]`` (``log p(prompt[t+1] | prompt[:t+1])``) and
    ``generated_log_probs`` fp32 ``[len(generated)]``: raw (``logprobs="raw"``) or at the sampling
    temperature (``"sampled"``), never with top-k / top-p applied.
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
