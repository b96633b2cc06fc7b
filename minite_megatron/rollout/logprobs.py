"""Per-token log-probs, the same code for the learner and the rollout engine.

:func:`token_logprobs` turns logits into the log-probability of given tokens: log-softmax of
the FP32 logits divided by ``temperature`` (1: the *raw* model distribution; the sampling
temperature: the distribution the sampler actually drew from, which is what RL's importance
ratios compare; top-k / top-p filtering is never applied). In strict mode it is the
batch-invariant :func:`minite_megatron.invariant.softmax.token_log_probs`; otherwise ``torch.log_softmax``
in fp32. The division is one elementwise fp32 op, so it is batch invariant too.

:func:`teacher_forced_logprobs` is the learner side: one full forward of Megatron's
``GPTModel`` over the (padded) sequences, then :func:`token_logprobs`. The rollout engine
(:mod:`.engine`) calls :func:`token_logprobs` on the logits of its prefill and decode steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def model_is_strict(model: torch.nn.Module) -> bool:
    """True if ``model`` holds strict (batch-invariant) modules: the strict core attention, or an
    output layer flagged ``minite_strict`` (:func:`minite_megatron.model.finalize_gpt_model`)."""
    return any(getattr(m, "minite_strict", False) for m in model.modules())


def check_temperature(temperature: float) -> float:
    """The log-prob temperature as a float; raises ValueError unless finite and > 0."""
    t = float(temperature)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"log-prob temperature must be finite and > 0, got {temperature!r}")
    return t


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, strict: bool, temperature: float = 1.0, *,
                   check: bool = True, chunk_bytes: int | None = None) -> torch.Tensor:
    """fp32 ``log_softmax(fp32(logits) / temperature)[..., tokens]`` for ``logits`` ``[..., V]``
    and ``tokens`` ``[...]``.

    ``strict`` selects the batch-invariant log-softmax. ``check=False`` skips the host-side
    check of the token ids (a sync; the CUDA-graph decode step samples the ids itself): the
    same numbers. Raises ValueError for token ids outside ``[0, V)`` (with ``check``),
    mismatched shapes or a temperature that is not finite and > 0. The fp32 work runs on blocks of
    rows of at most ``chunk_bytes`` (default :data:`CHUNK_BYTES`), with the bits of one call."""
    temperature = check_temperature(temperature)
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"token_logprobs: tokens {tuple(tokens.shape)} vs logits {tuple(logits.shape)}")
    if check and tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[-1]):
        raise ValueError(f"token_logprobs: token ids must lie in [0, {logits.shape[-1]})")
    rows = max(1, chunk_bytes // (4 * max(logits.shape[-1], 1)))
    return _by_rows(lambda x, t: _row_logprobs(x, t, strict, temperature), logits, tokens, rows)


CHUNK_BYTES = 512 << 20
"""fp32 working set of one :func:`token_logprobs` chunk: a prefill's ``[B, L, V]`` logits (a
152k vocabulary) are scored a block of rows at a time, never as one ``[B, L, V]`` fp32 copy."""


def _row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, strict: bool, temperature: float) -> torch.Tensor:
    if temperature != 1.0:
        logits = logits.to(torch.float32) / temperature
    if strict:
        from ..invariant.softmax import log_softmax

        lp = log_softmax(logits, dim=-1)  # invariant.softmax.token_log_probs without its id check
        return torch.gather(lp, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return torch.gather(lp, -1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _by_rows(fn, logits: torch.Tensor, tokens: torch.Tensor, rows: int) -> torch.Tensor:
    """``fn(logits, tokens)`` over blocks of at most ``rows`` rows of ``logits`` ``[..., V]`` (views
    along the leading dimensions, no copy of the whole), concatenated: each row's log-softmax is
    its own reduction, so the bits are those of one call over the whole."""
    if logits.dim() == 1:
        return fn(logits, tokens)
    n = logits.shape[0]
    per = math.prod(logits.shape[1:-1])  # rows of one slice along dim 0
    if n * per <= rows:
        return fn(logits, tokens)
    if per <= rows:
        step = max(1, rows // max(per, 1))
        return torch.cat([fn(logits[i: i + step], tokens[i: i + step]) for i in range(0, n, step)])
    return torch.stack([_by_rows(fn, logits[i], tokens[i], rows) for i in range(n)])


def pad_sequences(sequences: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, list[int]]:
    """``[B, T]`` int64 right-padded with ``pad_id``, and the lengths. Raises ValueError for an
    empty batch or a sequence shorter than 2 tokens (no token to score)."""
    if len(sequences) == 0:
        raise ValueError("no sequences")
    lengths = [len(s) for s in sequences]
    if min(lengths) < 2:
        raise ValueError("every sequence needs at least 2 tokens (a context and a token to score)")
    tokens = torch.full((len(sequences), max(lengths)), pad_id, dtype=torch.long, device=device)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long, device=device)
    return tokens, lengths


def causal_mask(length: int, device=None) -> torch.Tensor:
    """Megatron's attention mask for one causal sequence: bool ``[1, 1, T, T]``, True = hidden."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def teacher_forced_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    strict: bool | None = None,
    pad_id: int = 0,
    device: torch.device | str | None = None,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """The learner's log-probs of ``sequences`` from one full forward of ``model``.

    Args:
        model: a Megatron ``GPTModel`` (pre- and post-process stage; any TP, logits are gathered).
        sequences: token ids, each at least 2 long; batched right-padded with ``pad_id`` (causal
            attention: padding never affects earlier positions).
        strict: batch-invariant log-softmax (default: :func:`model_is_strict`).
        device: where the tokens go (default: the model's parameters' device).
        temperature: log-probs of ``softmax(logits / temperature)`` (the sampler's distribution
            at that temperature; 1 = raw).
    Returns:
        One fp32 tensor per sequence, ``len(seq) - 1`` long: entry ``t`` is
        ``log p(seq[t + 1] | seq[: t + 1])``. Carries gradients if grad mode is on (the model's
        train/eval mode is the caller's choice).
    Raises:
        ValueError for empty batches, short sequences or token ids outside the vocabulary.
    """
    strict = model_is_strict(model) if strict is None else strict
    if device is None:
        device = next(model.parameters()).device
    tokens, lengths = pad_sequences(sequences, pad_id, device=device)
    b, t = tokens.shape
    position_ids = torch.arange(t, device=device).unsqueeze(0).expand(b, t)
    logits = model(tokens, position_ids, causal_mask(t, device=device), runtime_gather_output=True)  # [B, T, V]
    lp = token_logprobs(logits[:, :-1], tokens[:, 1:], strict, temperature)
    return [lp[i, : n - 1] for i, n in enumerate(lengths)]
