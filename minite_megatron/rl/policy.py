"""The learner's side of a rollout batch: padded token grids, response masks, and one forward of
Megatron's ``GPTModel`` giving the log-probs (and entropy) of the sampled tokens.

Log-probs go through :func:`minite_megatron.rollout.logprobs.token_logprobs`, the function the
rollout engine scores its own tokens with (and :func:`~minite_megatron.rollout.logprobs.
teacher_forced_logprobs` uses): the same log-softmax at the same temperature on both sides, so in
strict mode the learner's log-probs equal the sampler's bit for bit.

Layout: a sequence is ``prompt + response``; the grid ``tokens`` is int64 ``[B, L]`` right padded;
per-token tensors are ``[B, L - 1]`` where entry ``t`` belongs to token ``t + 1`` (the token the
logits at position ``t`` predict). The response of sequence ``i`` occupies entries
``P_i - 1 .. P_i + R_i - 2`` (``P_i`` prompt tokens, ``R_i`` response tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..rollout.logprobs import causal_mask, model_is_strict, token_logprobs
from .losses import entropy_from_logits


def token_grid(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` int64 ``[B, L]`` (prompt + response, right padded with ``pad_id``) and the bool
    response mask ``[B, L - 1]`` (see the module docstring). Raises ValueError for an empty batch,
    an empty prompt or an empty response."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"token_grid: {len(prompts)} prompts vs {len(responses)} responses (need >= 1 each)")
    lengths = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) == 0 or len(r) == 0:
            raise ValueError(f"sequence {i}: empty {'prompt' if len(p) == 0 else 'response'}")
        lengths.append(len(p) + len(r))
    width = max(lengths)
    tokens = torch.full((len(prompts), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), width - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tokens[i, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        mask[i, len(p) - 1 : len(p) + len(r) - 1] = True
    return tokens, mask


def scatter_response_values(values: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-response 1-D tensors (e.g. the rollout engine's ``generated_log_probs``) placed at the
    True entries of ``mask`` ``[B, L - 1]``; fp32 ``[B, L - 1]``, zero elsewhere."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for i, v in enumerate(values):
        n = int(mask[i].sum())
        if v.numel() != n:
            raise ValueError(f"sequence {i}: {v.numel()} values for {n} response tokens")
        out[i, mask[i]] = v.detach().to(torch.float32).cpu()
    return out


def forward_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, L, V]`` of Megatron's ``GPTModel`` (or a DDP / Float16Module wrapper) on a causal
    right-padded grid; gathered over tensor parallelism (every TP rank gets the full vocabulary)."""
    b, length = tokens.shape
    position_ids = torch.arange(length, device=tokens.device).unsqueeze(0).expand(b, length)
    return model(tokens, position_ids, causal_mask(length, device=tokens.device), runtime_gather_output=True)


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, *, strict: bool, temperature: float = 1.0, with_entropy: bool = False,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``[B, L - 1]`` log-probs of ``tokens[:, 1:]`` under ``softmax(logits[:, :-1] / temperature)``
    and, with ``with_entropy``, that distribution's entropy per position (else None). ``check=False``:
    no host check of the token ids (a wait; a captured step cannot have it) -- for ids checked before."""
    shifted = logits[:, :-1]
    lp = token_logprobs(shifted, tokens[:, 1:], strict, temperature, check=check)
    ent = entropy_from_logits(shifted, temperature) if with_entropy else None
    return lp, ent


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, tokens: torch.Tensor, *, temperature: float, micro_batch_size: int,
    strict: bool | None = None,
) -> torch.Tensor:
    """No-grad log-probs ``[B, L - 1]`` (fp32, on the tokens' device) in micro-batches: the old
    policy's and the reference policy's log-probs, computed once per rollout batch."""
    strict = model_is_strict(model) if strict is None else strict
    out = []
    for start in range(0, tokens.shape[0], micro_batch_size):
        chunk = tokens[start : start + micro_batch_size]
        lp, _ = logprobs_from_logits(forward_logits(model, chunk), chunk, strict=strict, temperature=temperature)
        out.append(lp.float())
    return torch.cat(out)


__all__ = ["forward_logits", "logprobs_from_logits", "scatter_response_values", "sequence_logprobs", "token_grid"]
